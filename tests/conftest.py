"""Shared fixtures: one real local Ray cluster per test session (2 CPUs, like the CI machine)."""

from __future__ import annotations

import os

import pytest

# Actors and the test process share two cores: one intra-op thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with 2 CPUs; actors ask for fractions of a CPU."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()

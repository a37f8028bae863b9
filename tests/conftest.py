"""Shared fixtures: one real local Ray cluster per test session (2 CPUs, like the CI machine)."""

from __future__ import annotations

import os

import pytest

# Actors and the test process share two cores: one intra-op thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Float32 on every CPU (meshrl.cpu): tests compare the trainer's and the engines' numbers with float32
# references, on CPUs with and without bf16 instructions alike. Tests of the bf16 path set it themselves.
os.environ.setdefault("MESHRL_CPU_BF16", "0")


def pytest_collection_modifyitems(config, items):
    """Files with end-to-end (``slow``) tests first, in their own order, then the rest. pytest-xdist
    hands whole files to its two workers in this order (``--dist loadfile --no-loadscope-reorder``:
    its default order, most tests first, started a one-test 60-second soak last, with the other
    worker idle): the long files start early and the many short ones fill in the tail."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: each file's tests keep their order


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 1-layer model of the embedded default's architecture with the char tokenizer (read only:
    a test that changes a model directory writes its own with ``tiny.model_dir``)."""
    import tiny

    return tiny.model_dir(tmp_path_factory.mktemp("tiny") / "model", layers=1)


@pytest.fixture(scope="session")
def tiny_model_2l(tmp_path_factory) -> str:
    """The same with 2 layers (read only)."""
    import tiny

    return tiny.model_dir(tmp_path_factory.mktemp("tiny2") / "model", layers=2)

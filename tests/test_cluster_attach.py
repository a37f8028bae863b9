"""The main job on a Ray cluster that is already running (issue 26): a head and a second raylet on
this machine (Ray's own ``cluster_utils.Cluster``: real GCS and raylet processes, stopped by the
test, not a machine-wide ``ray stop``), and ``RAY_ADDRESS`` pointing at it, as after ``ray start
--head`` and ``ray start --address``. meshrl used to pass a new cluster's settings to ``ray.init``
and fail at once with Ray's "When connecting to an existing cluster, _system_config must not be
provided"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_example_smoke import TINY, run_example

pytestmark = pytest.mark.slow


@pytest.fixture
def two_raylets(monkeypatch):
    """Two raylets whose files (and the address a bare ``ray.init()`` would find) live in a temp dir
    of their own: no other test, in this process or beside it, attaches to them by accident. This
    process never connects (an earlier test may hold a Ray session of its own here)."""
    import tempfile

    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: socket paths
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def test_the_main_job_attaches_to_a_running_cluster(tmp_path, two_raylets):
    address = two_raylets.address
    proc = run_example(tmp_path, *TINY, "run.total_steps=2", "run.eval_every=0", f"run.output_dir={tmp_path / 'run'}",
                       "run.num_cpus=1", env={"RAY_ADDRESS": address})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the cluster's own CPUs (2 + 1), not run.num_cpus: an existing cluster keeps its settings
    assert f"ray: attached to {address}: 2 node(s), 3 CPUs, 0 GPUs" in proc.stdout, proc.stdout[-2000:]
    placed = next(line for line in proc.stdout.splitlines() if line.startswith("placed (node per rank): "))
    nodes = {f"{n.node_ip_address}/{n.node_id[:6]}" for n in two_raylets.list_all_nodes()}
    roles = dict(part.split(" ", 1) for part in placed.removeprefix("placed (node per rank): ").split(" | "))
    assert sorted(roles) == ["queue", "reward", "rollout", "trainer"], placed
    assert all(set(where.split()) <= nodes for where in roles.values()), (placed, nodes)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == [1, 2]
    # run.ray_address names the cluster itself (RAY_ADDRESS unset): the same connection
    code = f"from meshrl.pipeline.startup import ensure_ray; print(ensure_ray(1, {address!r}))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_TMPDIR: the cluster's
    named = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert named.returncode == 0, named.stderr[-3000:]
    assert named.stdout.strip() == f"ray: attached to {address}: 2 node(s), 3 CPUs, 0 GPUs"


def test_the_interface_and_nvlink_variables_travel_to_every_worker():
    from meshrl.pipeline.startup import WORKER_ENV, worker_env

    env = worker_env({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_NVLS_ENABLE": "0", "HOME": "/root"})
    assert env == {**WORKER_ENV, "GLOO_SOCKET_IFNAME": "eth1", "NCCL_NVLS_ENABLE": "0"}

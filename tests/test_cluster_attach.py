"""The main job on a Ray cluster that is already running (issue 26): a head and a second raylet on
this machine (Ray's own ``cluster_utils.Cluster``: real GCS, raylet and dashboard processes, stopped
by the test, not a machine-wide ``ray stop``), each with a custom resource of its own (``node_a``,
``node_b``) as ``ray start --resources`` gives them, and ``RAY_ADDRESS`` pointing at it, as after
``ray start --head`` and ``ray start --address``.

meshrl used to pass a new cluster's settings to ``ray.init`` and fail at once with Ray's "When
connecting to an existing cluster, _system_config must not be provided". Here the roles are pinned
to one node or the other by those resources, the weights are pushed from the trainer's node to the
engine's, a checkpoint written on one node is resumed with the trainer on the other, and the job is
also submitted with ``ray job submit``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
from ray.util.placement_group import placement_group

from test_example_smoke import ROOT, TINY, run_example

pytestmark = pytest.mark.slow

SHORT = [*TINY, "run.eval_every=0", "model.embedded.num_key_value_heads=2"]  # heads split over tp_size=2
LABELS = "bundle_label_selector" in inspect.signature(placement_group).parameters
"""Ray has node labels for placement groups (2.4x on): the second node carries one."""
DASHBOARD = importlib.util.find_spec("aiohttp_cors") is not None and importlib.util.find_spec("opencensus") is not None
"""ray[default] is installed: the head runs a dashboard, which `ray job submit` and `ray list` need
(not in the dev set: its agents add about 1.5 s to every Ray start of the suite)."""


def _ray_processes(tmpdir: str) -> list[str]:
    """This machine's processes started for the cluster whose files live in ``tmpdir`` (each has
    it in its environment or command line: raylets, GCS, dashboard, workers, job drivers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours
            continue
        if int(pid) != os.getpid() and (f"RAY_TMPDIR={tmpdir}".encode() in environ or tmpdir in cmdline):
            found.append(f"{pid} {cmdline[:120]}")
    return found


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets whose files (and the address a bare ``ray.init()`` would find) live in a temp dir
    of their own: no other test, in this process or beside it, attaches to them by accident. This
    process never connects (an earlier test may hold a Ray session of its own here). Afterwards no
    process of the cluster is left."""
    from ray.cluster_utils import Cluster

    tmpdir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: socket paths
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", tmpdir)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"node_a": 100}, "include_dashboard": DASHBOARD, "dashboard_port": 0})
        try:
            cluster.add_node(num_cpus=2, resources={"node_b": 100}, **({"labels": {"meshrl-role": "scorer"}} if LABELS else {}))
            cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()
    deadline = time.monotonic() + 30
    while (left := _ray_processes(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes of the test cluster still running: {left}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One warm start for the module's runs (the same tiny model)."""
    return str(tmp_path_factory.mktemp("cache"))


def _nodes(cluster) -> dict[str, str]:
    """'address/node id' (as the placement line writes it) of the node holding each custom resource."""
    head, other = cluster.list_all_nodes()
    return {"node_a": f"{head.node_ip_address}/{head.node_id[:6]}", "node_b": f"{other.node_ip_address}/{other.node_id[:6]}"}


def _placed(stdout: str) -> dict[str, list[str]]:
    line = next(line for line in stdout.splitlines() if line.startswith("placed (node per rank): "))
    roles = dict(part.split(" ", 1) for part in line.removeprefix("placed (node per rank): ").split(" | "))
    return {role: where.split() for role, where in roles.items()}


def test_roles_pinned_to_two_nodes_push_checkpoint_and_resume_across_them(tmp_path, two_nodes, cache):
    address, nodes, out = two_nodes.address, _nodes(two_nodes), tmp_path / "run"
    env = {"RAY_ADDRESS": address, "MESHRL_CACHE": cache}
    # the trainer on node_b; the engine's two tensor-parallel ranks unpacked, and each taking 1.5 of
    # a node's 2 CPUs: one rank on each node, so the TP schedule and the push cross nodes
    pin = ["cluster.trainer.resources={node_b: 0.01}", "rollout.tp_size=2", "cluster.rollout.pack=false",
           "cluster.rollout.resources={CPU: 1.5}", "reward.num_workers=1"]  # a reward worker, placed by its label
    pin += ["cluster.reward.labels={meshrl-role: scorer}"] if LABELS else []
    first = run_example(tmp_path, *SHORT, "run.total_steps=2", f"run.output_dir={out}", "run.num_cpus=1", *pin, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    # the cluster's own CPUs (2 + 2), not run.num_cpus: an existing cluster keeps its settings
    assert f"ray: attached to {address}: 2 node(s), 4 CPUs, 0 GPUs" in first.stdout, first.stdout[-2000:]
    placed = _placed(first.stdout)
    assert sorted(placed) == ["queue", "reward", "rollout", "trainer"], placed
    assert placed["trainer"] == [nodes["node_b"]] and sorted(placed["rollout"]) == sorted(nodes.values()), placed
    assert "engines: 1 replica(s) x 2 tensor-parallel ranks" in first.stdout
    assert not LABELS or placed["reward"] == [nodes["node_b"]], (placed, nodes)
    assert "storage: 2 nodes see the driver's run.output_dir" in first.stdout, first.stdout[-2000:]
    assert "actors: role/rank in Ray namespace meshrl-run-" in first.stdout
    assert (out / "checkpoints" / "step_00000002" / "trainer").is_dir() and (out / "final").is_dir()

    # resume the checkpoint the trainer wrote on node_b with the trainer on node_a and one engine
    # rank on node_b, the weights now through the object store; started as `ray job submit` starts a
    # driver (the job's config in RAY_JOB_CONFIG_JSON_ENV_VAR: Ray refuses a ray.init runtime_env
    # that sets one of the job's env_vars again, here OMP_NUM_THREADS, which meshrl sets too)
    job = json.dumps({"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "MESHRL_CACHE": cache}}, "metadata": {}})
    swapped = ["cluster.trainer.resources={node_a: 0.01}", "cluster.rollout.resources={node_b: 0.01}"]
    second = run_example(tmp_path, *SHORT, "run.total_steps=3", f"run.output_dir={out}", "run.resume=latest",
                         "reshard.transport=object_store", *swapped, env={**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": job})
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    placed = _placed(second.stdout)
    assert placed["trainer"] == [nodes["node_a"]] and placed["rollout"] == [nodes["node_b"]], (placed, nodes)
    assert "resumed from" in second.stdout and "at step 2" in second.stdout, second.stdout[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]


@pytest.mark.skipif(not DASHBOARD, reason="ray job submit needs ray[default] (pip install 'ray[default]')")
def test_the_main_job_runs_under_ray_job_submit(tmp_path, two_nodes, cache):
    """``ray job submit -- python examples/async_ppo.py ...``: the driver runs on the head node in
    the job's runtime_env (its env_vars, even one meshrl sets too, win over meshrl's); the run's
    actors are listed by Ray's state API (``ray list actors``) as role/rank in the run's namespace."""
    from ray.util.state import list_actors

    dashboard = "http://" + two_nodes.head_node.address_info["webui_url"]
    out = tmp_path / "job"
    runtime_env = json.dumps({"env_vars": {"MESHRL_CACHE": cache, "OMP_NUM_THREADS": "1"}})
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", dashboard,
           "--runtime-env-json", runtime_env, "--", sys.executable, str(ROOT / "examples" / "async_ppo.py"),
           *SHORT, "run.total_steps=2", f"run.output_dir={out}", "run.progress=false",
           "cluster.trainer.resources={node_b: 0.01}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    for _ in range(10):  # the head's agent takes a while after the node is up, longer on a loaded machine
        job = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
        if "No available agent to submit job" not in job.stderr + job.stdout:
            break
        time.sleep(3)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert f"ray: attached to {two_nodes.address}: 2 node(s), 4 CPUs" in job.stdout, job.stdout[-3000:]
    assert _placed(job.stdout)["trainer"] == [_nodes(two_nodes)["node_b"]]
    namespace = next(line for line in job.stdout.splitlines() if "actors: role/rank in Ray namespace" in line).split()[-1]
    actors = {(a.name, a.class_name) for a in list_actors(address=dashboard, filters=[("ray_namespace", "=", namespace)])}
    assert {("queue/0", "SamplerActor"), ("rollout/0", "RolloutWorker"), ("reward/0", "RewardWorker"),
            ("trainer/0", "Trainer")} <= actors, actors
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "step"] == [1, 2]


def test_run_ray_address_names_the_cluster(two_nodes):
    """``run.ray_address`` (RAY_ADDRESS unset) connects to the same cluster."""
    address = two_nodes.address
    code = f"from meshrl.pipeline.startup import ensure_ray; print(ensure_ray(1, {address!r}))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_TMPDIR: the cluster's
    named = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert named.returncode == 0, named.stderr[-3000:]
    assert named.stdout.strip() == f"ray: attached to {address}: 2 node(s), 4 CPUs, 0 GPUs"


def test_the_interface_and_nvlink_variables_travel_to_every_worker():
    from meshrl.pipeline.startup import WORKER_ENV, worker_env

    env = worker_env({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_NVLS_ENABLE": "0", "HOME": "/root"})
    assert env == {**WORKER_ENV, "GLOO_SOCKET_IFNAME": "eth1", "NCCL_NVLS_ENABLE": "0"}

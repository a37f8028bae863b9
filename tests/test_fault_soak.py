"""Soak (issue 28): each fault point of ``meshrl.faults`` kills its process once on a seeded call, and
the run completes with its ledger intact. Its own file (the helpers are test_fault_tolerance's) so
that pytest-xdist's per-file split runs it beside the rest of the fault tests, not after them.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from test_fault_tolerance import _config, _run_with_kills

pytestmark = pytest.mark.slow


def test_soak_kills_at_every_fault_point(ray_cluster, tmp_path, tiny_model, monkeypatch):
    """Soak: each fault point (meshrl.faults: mid-generate, mid-score, mid-push on either side,
    during a checkpoint write) kills its process once, on a call drawn from a seeded schedule (5
    kills of rollout, reward and trainer processes; mid-train-step and the queue's death are
    test_fault_tolerance's, whose run must equal the uninterrupted one); the run completes its
    steps and the ledger holds."""
    rng = random.Random(28)
    calls = {"rollout.generate": (4, 24), "reward.score": (4, 24), "trainer.reshard_send": (2, 12),
             "rollout.reshard_receive": (2, 12), "trainer.save_checkpoint": (1, 5)}  # each well inside a 16-step run
    plan = {name: rng.randint(*span) for name, span in calls.items()}
    monkeypatch.setenv("MESHRL_FAULTS", ",".join(f"{k}={v}" for k, v in plan.items()))
    monkeypatch.setenv("MESHRL_FAULTS_DIR", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    cfg = _config(tiny_model, tmp_path / "soak", "run.total_steps=16", "run.max_restarts=8", "run.max_worker_restarts=3")
    summary, killed, records = asyncio.run(_run_with_kills(cfg, [], seed=28))
    assert summary["steps"] == 16
    fired = {name: (tmp_path / "faults" / name).stat().st_size for name in plan}
    assert all(fired[name] >= n for name, n in plan.items()), (plan, fired)  # every point was reached and fired
    resumed = sorted(r["role"] for r in summary["restarts"] if r["role"] != "samples")
    # the trainer's two points resume the run, and so do the rollout worker's (the run's one rollout
    # worker holds its sampler); the reward worker is restarted in place (a point that fires while its
    # attempt is failing takes that attempt's end, not a record of its own)
    assert 1 <= resumed.count("trainer") <= 2 and set(resumed) <= {"trainer", "rollout"}, summary["restarts"]
    assert len(summary["restarts"]) <= 8
    assert summary["audit"]["ok"] and summary["audit"]["trained_samples"] == 16 * 8, summary["audit"]
    print({"plan": plan, "restarts": [(r["role"], r["failed_at_step"], r.get("recovery_s")) for r in summary["restarts"]],
           "worker_restarts": [r["role"] for _, r in records if r["kind"] == "worker_restart"],
           "revived": [(r["rank"], r["recovery_s"]) for _, r in records if r["kind"] == "worker_revived"], "audit": summary["audit"]})

"""Surviving the loss of a worker (issue 28): a real Ray cluster, real role processes killed with SIGKILL.

Kills come from outside, after a train step plus a delay drawn from a seeded schedule, and from
inside, at the fault points of ``meshrl.faults`` on a seeded call (mid-generate, mid-score,
mid-train-step, mid-push, during a checkpoint write); a hang is a SIGSTOP:

- a reward (or reference) worker is restarted in place by Ray (``run.max_worker_restarts``): the
  call it had in flight is sent again and the rest of the run goes on; the samples its process
  held for the queue died with it, and the step that needs them resumes from the checkpoint
  (``SamplesLost``); a hung one misses its heartbeat (``run.heartbeat_timeout_s``) and is killed;
- a rollout worker is restarted in place too: loaded with the current weights (a new transfer
  group, the version pushed again) before it takes requests, the ones it had in flight re-issued;
- the trainer or the queue: ``run.auto_resume`` tears the run down and resumes it
  from its newest checkpoint (at most ``run.max_restarts`` times); at ``max_staleness=0`` the run
  trains exactly as the uninterrupted one;
- the ledger (``run.audit``) proves every group was trained at most once and nothing the queue
  accepted was lost; a worker that keeps dying stops the run with the role's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from meshrl import Pipeline, PipelineConfig, load_config
from meshrl.mesh import Actor, ActorFailure, endpoint

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow


def _config(model_dir: str, out: Path, *extra: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={out}", "run.total_steps=8", "run.checkpoint_every=2",
        "run.keep_checkpoints=0", "run.eval_every=0", "run.progress=false", "run.audit=true", "run.auto_resume=true",
        "run.step_timeout_s=60", "task.digits=1", "task.num_test=8", "algo=grpo", "algo.samples_per_prompt=2",
        "queue.max_staleness=1", "trainer.samples_per_step=8", "rollout.prompts_per_request=2",
        "rollout.requests_in_flight=2", "rollout.max_new_tokens=4", "trainer.lr=1e-3", *extra,
    ])


async def _run_with_kills(cfg: PipelineConfig, kills: list[tuple[int, str]], seed: int = 0,
                          sig: signal.Signals = signal.SIGKILL, **kwargs):
    """Run ``cfg``, killing ``role/rank`` with ``sig`` after step ``s`` (plus a seeded delay of up
    to a step) for each ``(s, role/rank)``; the summary, each kill's (role, time), and the records.
    (SIGSTOP: a process that hangs; one left stopped at the end is let go.)"""
    rng = random.Random(seed)
    pipeline = Pipeline(cfg, **kwargs)
    run = asyncio.create_task(pipeline.run())
    pending, killed, records, pids = sorted(kills), [], [], []
    try:
        return await _watch_and_kill(pipeline, run, pending, killed, records, pids, rng, sig)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def _watch_and_kill(pipeline, run, pending, killed, records, pids, rng, sig):
    async for rec in pipeline.metrics():
        records.append((time.time(), rec))
        # a supervised worker is killed again only once its last restart was reported (Ray's restart
        # is seconds on 2 busy cores; meshrl.mesh watches each incarnation from its restart on)
        nxt = pending[0][1] if pending else None
        last = max((t for k, t in killed if k == nxt and k.startswith(("reward", "reference", "rollout"))), default=None)
        back = last is None or any(t > last and r["kind"] in ("worker_revived", "worker_restart", "restart")
                                   and (r["kind"] != "worker_restart" or r["role"] != "rollout") for t, r in records)
        if rec["kind"] == "step" and pending and rec["step"] >= pending[0][0] and back:
            _, role = pending.pop(0)
            await asyncio.sleep(rng.uniform(0.0, rec["step_time_s"]))
            pids.append(await _pid(pipeline, role))
            os.kill(pids[-1], sig)
            killed.append((role, time.time()))
    return await run, killed, records


async def _pid(pipeline: Pipeline, role: str) -> int:
    """``role``'s process id; while an attempt is failing (a role it asks is dead), the next one's."""
    last = None
    for _ in range(120):
        try:
            return (await pipeline.processes())[role]
        except (ActorFailure, RuntimeError) as exc:
            last = exc
            await asyncio.sleep(0.5)
    raise TimeoutError(f"no live {role} within 60 s: {last!r:.500}")


def _trainer_dies_in_step(monkeypatch, tmp_path: Path, step: int) -> None:
    """The trainer's process ends at its fault point in its ``step``-th train step (the batch
    fetched, not trained on); the point's count is kept under tmp_path/faults."""
    monkeypatch.setenv("MESHRL_FAULTS", f"trainer.train_step={step}")
    monkeypatch.setenv("MESHRL_FAULTS_DIR", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()


def _steps(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "step"}


def test_killed_reward_reference_and_rollout_workers_are_restarted_in_place_and_lose_nothing(ray_cluster, tmp_path, tiny_model):
    """Each worker role killed mid-run, one after the other: Ray re-creates the process in place. A
    reward or reference worker's calls are sent again; a rollout worker is loaded with the current
    weights (a new transfer group, the version pushed again) before it takes requests, its requests
    in flight re-issued while the other rollout worker keeps generating. Nothing lost."""
    cfg = _config(tiny_model, tmp_path / "workers", "run.max_worker_restarts=2", "run.total_steps=24",
                  "algo.kl_coef=0.05", "rollout.num_workers=2", "reward.num_workers=1")
    # a tiny model's steps take milliseconds: each kill leaves 6 steps that need the worker back
    kills = [(2, "reward/0"), (6, "rollout/0"), (12, "reference/0"), (18, "rollout/1")]
    summary, killed, records = asyncio.run(_run_with_kills(cfg, kills, seed=1))
    # the rest of the run went on; a resume only where the dead reward worker's process held samples
    # the queue had accepted (SamplesLost: the checkpoint's snapshot has them)
    assert summary["steps"] == 24 and {r["role"] for r in summary["restarts"]} <= {"samples"}, summary["restarts"]
    assert [role for role, _ in killed] == [role for _, role in kills]
    # each kill is answered within 30 s: a rollout worker serving the current weights again; a
    # reward or reference worker restarted (or, when the next step needed samples the dead process
    # held, the run resumed)
    for role, t_kill in killed:
        name, rank = role.split("/")
        back = [t for t, r in records if t > t_kill and (
            (r["kind"] == "worker_revived" and r["rank"] == int(rank)) if name == "rollout" else
            (r["kind"] == "worker_restart" and r["role"] == name) or (r["kind"] == "restart" and r["role"] == "samples"))]
        assert back and back[0] - t_kill < 30, (role, back[:1], t_kill)
    revived = [r for _, r in records if r["kind"] == "worker_revived"]
    assert sorted(r["rank"] for r in revived) == [0, 1], revived
    assert all(r["version"] >= 6 and r["recovery_s"] < 30 for r in revived), revived  # a trained version
    print({"revived": [(r["rank"], r["version"], r["recovery_s"]) for r in revived],
           "restarted": [(r["role"], r["step"]) for _, r in records if r["kind"] == "worker_restart"],
           "reissued_requests": max(r.get("reissued_requests", 0) for _, r in records if r["kind"] == "step"),
           "resumes": summary["restarts"], "audit": summary["audit"]})
    assert summary["audit"]["ok"] and summary["audit"]["trained_samples"] == 24 * 8, summary["audit"]


def test_a_hung_reward_worker_misses_its_heartbeat_and_is_restarted(ray_cluster, tmp_path, tiny_model):
    """A reward worker that stops answering (SIGSTOP: its calls and its heartbeat wait forever) is
    killed after run.heartbeat_timeout_s and restarted in place; the run completes, nothing lost."""
    # the restart's record comes from supervision's probe of the new process (up to 1 s after it is
    # back): a run that ends sooner waits for it (supervision.settle), so it is in the log
    cfg = _config(tiny_model, tmp_path / "hung", "run.max_worker_restarts=2", "run.total_steps=10",
                  "run.heartbeat_timeout_s=5", "reward.num_workers=1")
    summary, stopped, records = asyncio.run(_run_with_kills(cfg, [(2, "reward/0")], seed=3, sig=signal.SIGSTOP))
    assert summary["steps"] == 10 and {r["role"] for r in summary["restarts"]} <= {"samples"}, summary["restarts"]
    hung = [r for _, r in records if r["kind"] == "hung"]
    assert [(r["role"], r["rank"], r["timeout_s"]) for r in hung] == [("reward", 0, 5)], hung
    t_stop = stopped[0][1]
    t_back = min(t for t, r in records if t > t_stop and r["kind"] in ("worker_restart", "restart"))
    assert t_back - t_stop < 30, f"the hung reward worker was back after {t_back - t_stop:.1f}s"
    assert [r["role"] for _, r in records if r["kind"] == "worker_restart"] == ["reward"]
    assert summary["audit"]["ok"] and summary["audit"]["trained_samples"] == 10 * 8, summary["audit"]


def slow_reward(problem, completion: str) -> float:
    time.sleep(0.05)
    return float(completion.strip().startswith(problem.answer))


def test_trainer_and_sampler_deaths_resume_from_the_newest_checkpoint_as_if_uninterrupted(ray_cluster, tmp_path,
                                                                                         tiny_model, monkeypatch):
    """At max_staleness=0 the run with a dead trainer and a dead sampler trains every step exactly as
    the run without them (each resume redoes at most checkpoint_every steps). The trainer dies at
    its fault point mid-train-step (step 3, inside its chunk of steps: the batch fetched and not
    trained on; the soak's other trainer points each cost a resume too); the run's one rollout
    worker, which holds the sampler, is killed from outside."""
    # the rollout worker scores (reward.num_workers=0): four pipeline starts with one process fewer each
    exact = ("queue.max_staleness=0", "rollout.requests_in_flight=1", "rollout.prompts_per_request=4", "reward.num_workers=0")
    # a reward that takes a moment: the tiny model's steps would take milliseconds, and the run could
    # end before the kill after step 5 reaches its process
    plain = asyncio.run(Pipeline(_config(tiny_model, tmp_path / "plain", *exact), reward=slow_reward).run())
    _trainer_dies_in_step(monkeypatch, tmp_path, 3)
    summary, killed, records = asyncio.run(_run_with_kills(_config(tiny_model, tmp_path / "killed", *exact),
                                                           [(5, "rollout/0")], seed=2, reward=slow_reward))
    assert (tmp_path / "faults" / "trainer.train_step").stat().st_size >= 3  # the point fired
    assert summary["steps"] == plain["steps"] == 8
    assert [(r["role"], r["restart"]) for r in summary["restarts"]] == [("trainer", 1), ("rollout", 2)]
    for r in summary["restarts"]:
        assert r["failed_at_step"] - r["resumed_at_step"] <= 2 and r["recovery_s"] > 0, r
    # run.warm_resume: the live processes serve the resumed run (the trainer reloads the checkpoint,
    # the engine is pushed its weights), and it still trains exactly as the uninterrupted run (below)
    assert [sorted(r["kept"]) for r in summary["restarts"]] == [["rollout"], ["trainer"]]
    assert [r["kind"] for _, r in records].count("restart") == 2
    a, b = _steps(tmp_path / "plain"), _steps(tmp_path / "killed")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert (b[step]["loss"], b[step]["reward_mean"]) == (a[step]["loss"], a[step]["reward_mean"]), step
    assert summary["accuracy_after"] == plain["accuracy_after"]
    assert summary["audit"]["ok"] and summary["audit"]["trained_samples"] == 8 * 8, summary["audit"]


def slow_digit_reward(problem, completion: str) -> float:
    time.sleep(0.05)
    return sum(c.isdigit() for c in completion) / max(1, len(completion))  # graded: most groups have a gradient


def test_a_colocated_run_keeps_its_hybrid_worker_when_the_queue_dies(ray_cluster, tmp_path, tiny_model):
    """placement=colocated: the queue killed mid-run; the resumed run keeps the hybrid worker (trainer
    and engine in one process), which reloads the checkpoint and hands its weights to its engine. At
    max_staleness=0 it trains every step as the run without the kill."""
    exact = ("placement=colocated", "queue.max_staleness=0", "reward.num_workers=0", "run.total_steps=6",
             "rollout.requests_in_flight=1")
    plain = asyncio.run(Pipeline(_config(tiny_model, tmp_path / "plain", *exact), reward=slow_digit_reward).run())
    summary, killed, _ = asyncio.run(_run_with_kills(_config(tiny_model, tmp_path / "killed", *exact), [(3, "queue/0")],
                                                     seed=4, reward=slow_digit_reward))
    assert summary["steps"] == plain["steps"] == 6 and [role for role, _ in killed] == ["queue/0"]
    assert [(r["role"], r["kept"]) for r in summary["restarts"]] == [("queue", ["hybrid"])]
    a, b = _steps(tmp_path / "plain"), _steps(tmp_path / "killed")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert any(r["loss"] != 0 for r in a.values())  # the comparison below compares something
    for step in a:
        assert (b[step]["loss"], b[step]["reward_mean"]) == (a[step]["loss"], a[step]["reward_mean"]), step
    assert summary["accuracy_after"] == plain["accuracy_after"]
    assert summary["audit"]["ok"] and summary["audit"]["trained_samples"] == 6 * 8, summary["audit"]


def dying_reward(problem, completion: str) -> float:
    os._exit(3)  # the reward worker's process dies on every call: a real bug, not bad luck


def test_a_worker_that_keeps_dying_stops_the_run_after_its_budgets(ray_cluster, tmp_path, tiny_model):
    # run.max_restarts=0: the worker's budget spent, the run is not resumed either
    cfg = _config(tiny_model, tmp_path / "dying", "run.max_worker_restarts=1", "run.max_restarts=0")
    t0 = time.perf_counter()
    with pytest.raises(ActorFailure) as failure:
        asyncio.run(Pipeline(cfg, reward=dying_reward).run())
    text = str(failure.value) + "\n".join(getattr(failure.value, "__notes__", []))
    assert "reward/0" in text and "resumed 0 times (run.max_restarts=0)" in text, text
    assert time.perf_counter() - t0 < 240


def test_the_resume_budget_names_the_first_failure_once_spent(tmp_path):
    from meshrl.pipeline.recovery import Recovery

    cfg = _config(str(tmp_path), tmp_path / "budget", "run.max_restarts=1")
    recovery = Recovery(lambda line: None)
    first, again = ActorFailure("trainer", 0, "killed"), ActorFailure("queue", 0, "killed too")
    assert recovery.resumes(cfg, first, stop_requested=False)
    assert not recovery.resumes(cfg, ValueError("a bug"), stop_requested=False)  # not a death: it stops
    recovery.failed(cfg, first, step=3)
    assert not recovery.resumes(cfg, again, stop_requested=False)
    assert again.__notes__ == ["run.auto_resume: the run was resumed 1 times (run.max_restarts=1) and failed again; "
                               "the first failure was: killed"]


def test_a_resume_keeps_the_live_roles_it_can_use_again(tmp_path):
    """run.warm_resume: which roles a failed attempt leaves for the resumed one (meshrl.pipeline.processes).
    The runs above keep them for real: their restart records say which, and they still train as the
    uninterrupted runs."""
    from meshrl.pipeline.processes import RoleProcesses
    from meshrl.queues.parcels import SamplesLost

    def kept(failure, *extra):
        return RoleProcesses.keepable(_config(str(tmp_path), tmp_path / "warm", *extra), failure)

    every = {"trainer", "hybrid", "rollout", "reward", "reference"}  # never the queue: it restores only when fresh
    assert kept(ActorFailure("queue", 0, "killed")) == every
    assert kept(ActorFailure("trainer", 0, "killed")) == every - {"trainer"}
    assert kept(ActorFailure("rollout", 1, "killed")) == every - {"rollout"}
    assert kept(ActorFailure("hybrid", 0, "killed")) == every - {"hybrid"}
    assert kept(SamplesLost("the reward worker that held them died")) == every
    wrapped = RuntimeError("the train loop failed")
    wrapped.__cause__ = ActorFailure("trainer", 0, "killed")
    assert kept(wrapped) == every - {"trainer"}  # the death behind the error
    assert kept(ValueError("a bug")) == set() and kept(None) == set()  # no resume follows
    assert kept(ActorFailure("queue", 0, "killed"), "run.warm_resume=false") == set()
    assert kept(ActorFailure("queue", 0, "killed"), "run.auto_resume=false") == set()
    # SGLang servers are kept with their workers (the next trainer destroys the dead one's group on
    # them); a TorchEngine's TP group is set up once per start: those engines start again
    assert kept(ActorFailure("queue", 0, "killed"), "rollout.engine.backend=sglang") == every
    assert kept(ActorFailure("queue", 0, "killed"), "rollout.tp_size=2") == every - {"rollout"}
    assert kept(ActorFailure("queue", 0, "killed"), "rollout.tp_size=2", "rollout.engine.backend=sglang") == every


class Pingable(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def test_parked_meshes_that_answer_are_kept_and_the_others_stopped(ray_cluster, tmp_path):
    """Between two attempts: the meshes a resume may use are parked (the rest stopped), a parked one
    that died meanwhile is started again, a live one is the same process."""
    from meshrl.pipeline.processes import RoleProcesses

    cfg = _config(str(tmp_path), tmp_path / "parked")
    processes = RoleProcesses(tmp_path / "parked", cfg)
    meshes = {name: processes.spawn(cfg, name, Pingable) for name in ("queue", "rollout", "trainer")}
    pids = {name: mesh.pid.call_one().get(timeout=60) for name, mesh in meshes.items()}
    asyncio.run(processes.end(cfg, ActorFailure("reference", 0, "killed")))  # queue: never kept
    with pytest.raises(ActorFailure):  # stopped at once
        meshes["queue"].pid.call_one().get(timeout=30)
    os.kill(pids["rollout"], signal.SIGKILL)  # dies while parked
    said = []
    processes.new_attempt()
    asyncio.run(processes.probe(said.append))
    assert len(said) == 1 and said[0].startswith("warm resume: rollout is started again (rollout/0 "), said
    again = {name: processes.spawn(cfg, name, Pingable) for name in ("queue", "rollout", "trainer")}
    assert again["trainer"] is meshes["trainer"] and again["trainer"].pid.call_one().get(timeout=60) == pids["trainer"]
    assert processes.taken == ["trainer"]
    assert {n: m.pid.call_one().get(timeout=60) != pids[n] for n, m in again.items() if n != "trainer"} == {
        "queue": True, "rollout": True}
    assert "kept from the failed attempt (run.warm_resume), in its namespace: trainer" in processes.placement_line()
    asyncio.run(processes.end(cfg, None))  # the run ended: nothing is parked
    with pytest.raises(ActorFailure):
        again["trainer"].pid.call_one().get(timeout=30)

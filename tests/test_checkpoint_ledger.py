"""Run checkpoints without Ray: the prompt ledger and a real SampleQueue saved mid-flight and
restored (η > 0: requests in flight are re-issued with their prompts and group ids, a reservation
whose prompts were not yet taken is cancelled), ``latest`` selection and partial checkpoints."""

from __future__ import annotations

import asyncio
import shutil

from meshrl.manifest import write_manifest
from meshrl.pipeline.checkpoint import (
    PromptLedger,
    RunState,
    commit,
    later_checkpoints,
    latest_checkpoint,
    partial_dir,
    read_records,
    read_run_state,
    resolve_resume,
    write_checkpoint_files,
)
from meshrl.queues import QueueConfig, Sample, SampleQueue
from meshrl.tasks import Problem

PROBLEMS = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(10)]


def _samples(group_ids: list[int], version: int = 0) -> list[Sample]:
    return [Sample(prompt_id=g, group_id=g, group_size=1, prompt_ids=[1, 2], response_ids=[3], behavior_logprobs=[-1.0],
                   behavior_version=version) for g in group_ids]


async def _save_and_restore(tmp_path):
    queue = SampleQueue(QueueConfig(max_staleness=1), samples_per_step=4)  # room for 8 positions
    ledger = PromptLedger(PROBLEMS, seed=3)
    r1, r2, r3 = [await queue.reserve(2, timeout=1) for _ in range(3)]
    job1, _ = ledger.take(r1.id, 2)
    job2, problems2 = ledger.take(r2.id, 2)
    # r3 is granted but its reply "has not reached the controller": no prompts taken for it
    await queue.put(_samples([job1.first_group, job1.first_group + 1]), r1.id)
    ledger.done(r1.id)
    state = RunState(step=1, version=0, prompt_position=ledger.stream.position, next_group=ledger.next_group,
                     generated_tokens=7, accuracy_before=0.25, in_flight=list(ledger.in_flight.values()),
                     queue_snapshot=await queue.snapshot())
    partial = partial_dir(tmp_path, 1)
    write_checkpoint_files(partial, state, None)
    final = commit(partial, keep=2)
    restored = read_run_state(final)

    queue2 = SampleQueue(QueueConfig(max_staleness=1), samples_per_step=4)
    outstanding = await queue2.restore(restored.queue_snapshot)
    ledger2 = PromptLedger(PROBLEMS, seed=3)
    cancel = ledger2.restore(restored, [r.id for r in outstanding])
    for rid in cancel:
        await queue2.cancel(rid)
    again, again_problems = ledger2.take_reissued()
    assert ledger2.take_reissued() is None
    await queue2.put(_samples([again.first_group, again.first_group + 1]), again.reservation_id)
    batch = await queue2.get_batch(4, 0, timeout=1)
    # the next fresh request continues the stream exactly where an uninterrupted ledger would
    r4 = await queue2.reserve(2, timeout=1)
    fresh, fresh_problems = ledger2.take(r4.id, 2)
    _, uninterrupted = ledger.take(99, 2)
    return (r3, job2, problems2, cancel, again, again_problems, batch, fresh, fresh_problems, uninterrupted, restored)


def test_in_flight_requests_are_reissued_and_unknown_reservations_cancelled(tmp_path):
    r3, job2, problems2, cancel, again, again_problems, batch, fresh, fresh_problems, uninterrupted, restored = (
        asyncio.run(_save_and_restore(tmp_path)))
    assert restored.generated_tokens == 7 and restored.accuracy_before == 0.25
    assert cancel == [r3.id]
    assert again == job2 and again_problems == problems2  # same reservation, prompts, group ids
    assert sorted(s.group_id for s in batch) == [0, 1, 2, 3]  # nothing lost, nothing twice
    assert (fresh.first_group, fresh.first_position) == (4, 4)
    assert fresh_problems == uninterrupted


def test_latest_skips_partial_checkpoints_and_keep_prunes(tmp_path):
    state = RunState(step=0, version=0, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"")
    assert latest_checkpoint(tmp_path) is None and resolve_resume("latest", tmp_path) is None
    for step in (2, 4, 6):
        write_checkpoint_files(partial_dir(tmp_path, step), state, None)
        write_manifest(partial_dir(tmp_path, step))
        commit(partial_dir(tmp_path, step), keep=2)
    write_checkpoint_files(partial_dir(tmp_path, 8), state, None)  # a crash mid-write: never picked
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000006", "step_00000008.partial"]
    assert resolve_resume("latest", tmp_path).name == "step_00000006"
    assert read_records(tmp_path / "checkpoints" / "step_00000006") == []


def test_a_request_done_since_the_last_take_is_still_recorded():
    """Its put may have landed just after the queue's snapshot yet answered first (Ray orders no
    replies across calls): the checkpoint lists it, and a resume re-issues it only if the snapshot
    still holds its reservation (tests/test_review_queue_ckpt.py). Once prompts are taken again no
    checkpoint was capturing, so its put is in every later snapshot and it is dropped."""
    ledger = PromptLedger(PROBLEMS, seed=3)
    first, _ = ledger.take(0, 2)
    ledger.done(0)
    assert ledger.unfinished() == [first]
    state = RunState(step=1, version=1, prompt_position=ledger.stream.position, next_group=ledger.next_group,
                     generated_tokens=0, accuracy_before=None, in_flight=ledger.unfinished(), queue_snapshot=b"")
    assert PromptLedger(PROBLEMS, seed=3).restore(state, []) == []  # its put is in the snapshot: nothing to redo
    resumed = PromptLedger(PROBLEMS, seed=3)
    assert resumed.restore(state, [0]) == [] and resumed.take_reissued()[0] == first  # it is not
    second, _ = ledger.take(1, 2)
    assert ledger.unfinished() == [second]


def _commit_step(root, step: int, *, keep: int, generated_tokens: int):
    """A complete checkpoint of ``step``; ``generated_tokens`` tells the runs that wrote them apart."""
    state = RunState(step=step, version=step, prompt_position=0, next_group=0, generated_tokens=generated_tokens,
                     accuracy_before=None, in_flight=[], queue_snapshot=b"")
    write_checkpoint_files(partial_dir(root, step), state, None)
    trainer = partial_dir(root, step) / "trainer"  # what the trainer writes there, in miniature
    trainer.mkdir()
    (trainer / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (trainer / "rank0.pt").write_bytes(b"rng" * 10)
    write_manifest(partial_dir(root, step))  # last, as write_run_checkpoint does
    return commit(partial_dir(root, step), keep=keep)


def test_a_run_resumed_from_an_earlier_step_keeps_and_skips_the_later_checkpoints(tmp_path):
    """Resumed from step 4 while steps 6 and 8 of the first run exist: retention must not delete the
    resumed run's own checkpoint in their favour (it counts steps up to the one committed), must not
    delete them either (the user's models), and ``latest`` is the resumed run's newest."""
    for step in (4, 6, 8):
        _commit_step(tmp_path, step, keep=3, generated_tokens=1)  # the first run
    ours = _commit_step(tmp_path, 5, keep=1, generated_tokens=2)  # resumed from 4, stopped at step 5
    assert ours.is_dir() and resolve_resume("latest", tmp_path) == ours
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_00000005", "step_00000006", "step_00000008"]
    assert later_checkpoints(tmp_path, 5) == [tmp_path / "checkpoints" / n for n in ("step_00000006", "step_00000008")]
    # Reaching step 6 again replaces the first run's step 6, and step 5 goes (keep=1); step 8 stays.
    _commit_step(tmp_path, 6, keep=1, generated_tokens=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000006", "step_00000008"]
    assert read_run_state(resolve_resume("latest", tmp_path)).generated_tokens == 2


def test_latest_without_its_file_is_the_highest_complete_step(tmp_path):
    """An output directory written before ``checkpoints/latest`` existed, or whose latest was deleted."""
    for step in (2, 4):
        _commit_step(tmp_path, step, keep=0, generated_tokens=1)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_a_checkpoint_before_the_reissue_keeps_the_restored_requests():
    """Stopped (or checkpointed) again before the rollout loops re-took the restored requests: the
    second checkpoint must still list them, else the next resume cancels them and skips their prompts."""
    ledger = PromptLedger(PROBLEMS, seed=3)
    jobs = [ledger.take(r, 2)[0] for r in (0, 1)]
    state = RunState(step=1, version=1, prompt_position=ledger.stream.position, next_group=ledger.next_group,
                     generated_tokens=0, accuracy_before=None, in_flight=ledger.unfinished(), queue_snapshot=b"")
    resumed = PromptLedger(PROBLEMS, seed=3)
    assert resumed.restore(state, [0, 1]) == [] and resumed.reissue_pending == 2
    again = RunState(**{**{f: getattr(state, f) for f in state.__struct_fields__}, "in_flight": resumed.unfinished()})
    third = PromptLedger(PROBLEMS, seed=3)
    assert third.restore(again, [0, 1]) == []  # nothing cancelled
    assert [third.take_reissued()[0] for _ in range(2)] == jobs


def test_a_train_loop_failure_while_stopping_is_the_runs_failure():
    """After stop() a rollout loop's error is only logged, but the train loop's stays the run's failure:
    the run must not go on to checkpoint a trainer whose step broke halfway."""
    from meshrl.pipeline import Pipeline, PipelineConfig

    async def main():
        p = Pipeline(PipelineConfig())
        p._stopping.set()  # what stop() does first

        async def fails():
            raise RuntimeError("train_step failed on rank 0")

        await p._guard(fails())
        assert p._failure is None  # a rollout loop: logged, its request is re-issued on resume
        await p._guard(fails(), always_fails=True)
        assert isinstance(p._failure, RuntimeError)

    asyncio.run(main())


def test_resume_refuses_a_checkpoint_of_another_model_task_or_group_shape(tmp_path):
    """Resuming a PPO checkpoint with algo=grpo ran: the restored queue's one-sample groups trained
    under GRPO. The settings that shape what the checkpoint holds must match; others may change."""
    import pytest

    from meshrl.config import ConfigError, load_config
    from meshrl.pipeline import PipelineConfig
    from meshrl.pipeline.checkpoint import check_fingerprint, run_fingerprint

    ppo = load_config(PipelineConfig, None, ["algo=ppo"])
    state = RunState(step=4, version=4, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"", fingerprint=run_fingerprint(ppo))
    write_checkpoint_files(tmp_path / "ck", state, None)
    state = read_run_state(tmp_path / "ck")
    check_fingerprint(tmp_path / "ck", state, load_config(PipelineConfig, None, ["algo=ppo", "trainer.lr=1e-5",
                                                                               "run.total_steps=9", "queue.max_staleness=3"]))
    for overrides, key in ((["algo=grpo"], "algo.samples_per_prompt"), (["task.digits=3"], "task"),
                           (["model.embedded.hidden_size=64"], "model"), (["run.seed=1"], "run.seed"),
                           (["trainer.samples_per_step=8"], "trainer.samples_per_step"),
                           (["trainer.sync_interval=2"], "trainer.sync_interval"),
                           (["algo=ppo", "trainer.optimizer=sgd"], "trainer.optimizer")):
        with pytest.raises(ConfigError, match=f"`run.resume`: .* other settings \\({key}: ") as info:
            check_fingerprint(tmp_path / "ck", state, load_config(PipelineConfig, None, overrides))
        assert "\n" not in str(info.value)
    old = RunState(step=1, version=1, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                   in_flight=[], queue_snapshot=b"")  # a checkpoint from before fingerprints: nothing to compare
    check_fingerprint(tmp_path / "ck", old, load_config(PipelineConfig, None, ["algo=grpo"]))


def test_a_file_task_is_fingerprinted_by_its_problems_not_its_path(tmp_path, monkeypatch):
    """The resume check compared the task's settings: a prompt file rewritten in place (100 problems,
    then 37: the saved prompt position points into another shuffle) was accepted, and the same file
    named by an absolute path instead of a relative one, or an unused task.digits, was refused."""
    import pytest

    from meshrl.config import ConfigError, load_config
    from meshrl.pipeline import PipelineConfig
    from meshrl.pipeline.checkpoint import check_fingerprint, run_fingerprint
    from meshrl.tasks import build_task

    def write(n: int) -> None:
        (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(n)))

    def cfg(train: str, *extra: str) -> PipelineConfig:
        return load_config(PipelineConfig, None, ["task.kind=file", f"task.train_file={train}",
                                                  f"task.test_file={tmp_path / 'train.jsonl'}", *extra])

    monkeypatch.chdir(tmp_path)
    write(100)
    first = cfg("train.jsonl")
    state = RunState(step=2, version=2, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"", fingerprint=run_fingerprint(first, build_task(first.task).split("train")))
    for same in (cfg(str(tmp_path / "train.jsonl")), cfg("./train.jsonl", "task.digits=3")):
        check_fingerprint(tmp_path, state, same, build_task(same.task).split("train"))
    write(37)
    with pytest.raises(ConfigError, match=r"other settings \(the training problems: 100 there, 37 now\)"):
        check_fingerprint(tmp_path, state, first, build_task(first.task).split("train"))
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{i}+2=", "answer": "{i + 2}"}}\n' for i in range(100)))
    with pytest.raises(ConfigError, match=r"the training problems: 100 there, 100 now, other prompts or answers"):
        check_fingerprint(tmp_path, state, first, build_task(first.task).split("train"))


def test_resume_may_switch_between_advantage_estimators_without_a_critic(tmp_path):
    """grpo, rloo and reinforce_pp keep no state and read the same groups: a resume may switch among
    them; to or from gae (a critic in the checkpoint, or none) is refused. Checkpoints that recorded
    the estimator itself ("algo.advantage") are read by whether it trained a critic."""
    import pytest

    from meshrl.config import ConfigError, load_config
    from meshrl.pipeline import PipelineConfig
    from meshrl.pipeline.checkpoint import check_fingerprint, run_fingerprint

    def state(fingerprint):
        return RunState(step=2, version=2, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                        in_flight=[], queue_snapshot=b"", fingerprint=fingerprint)

    cfg = lambda *o: load_config(PipelineConfig, None, ["algo=grpo", *o])  # noqa: E731
    grpo = state(run_fingerprint(cfg()))
    check_fingerprint(tmp_path, grpo, cfg("algo.advantage=rloo"))
    check_fingerprint(tmp_path, grpo, cfg("algo.advantage=reinforce_pp", "algo.drop_uniform_groups=false"))
    with pytest.raises(ConfigError, match=r"algo.critic: False there, True now"):
        check_fingerprint(tmp_path, grpo, cfg("algo.advantage=gae", "algo.drop_uniform_groups=false"))
    older = run_fingerprint(cfg())
    del older["algo.critic"]
    older["algo.advantage"] = "grpo"
    check_fingerprint(tmp_path, state(older), cfg("algo.advantage=rloo"))
    older["algo.advantage"] = "gae"
    with pytest.raises(ConfigError, match=r"algo.critic: True there, False now"):
        check_fingerprint(tmp_path, state(older), cfg("algo.advantage=rloo"))


def test_committing_a_step_again_never_leaves_latest_without_a_complete_checkpoint(tmp_path):
    """commit deleted the step's earlier checkpoint before renaming the new one into place (a stop
    right after a periodic checkpoint writes the same step again): a crash between the two left
    ``latest`` naming nothing, and resume=latest fell back to another run's step, or to none."""
    from meshrl.pipeline.checkpoint import latest_checkpoint

    _commit_step(tmp_path, 8, keep=0, generated_tokens=1)  # an earlier run's later step
    _commit_step(tmp_path, 6, keep=1, generated_tokens=2)  # this run, resumed from an earlier step
    again = _commit_step(tmp_path, 6, keep=1, generated_tokens=3)  # the stop checkpoint of the same step
    assert latest_checkpoint(tmp_path) == again and read_run_state(again).generated_tokens == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000006", "step_00000008"]

    # the crash window of a third commit: the earlier one moved aside, the new one not yet in place
    aside = again.with_name(again.name + ".replaced")
    again.rename(aside)
    found = latest_checkpoint(tmp_path)
    assert found == aside and read_run_state(found).generated_tokens == 3
    # the next commit of that step cleans up, and so does any commit a killed run's unfinished one
    stray = partial_dir(tmp_path, 7)
    stray.mkdir()
    final = _commit_step(tmp_path, 6, keep=1, generated_tokens=4)
    assert latest_checkpoint(tmp_path) == final and not aside.exists() and not stray.exists()


def test_a_refused_resume_leaves_the_runs_config_file_alone(tmp_path):
    """run() wrote config.yaml before checking the fingerprint: a refused resume replaced the file that
    describes the run whose checkpoints sit beside it."""
    import pytest

    from meshrl.config import ConfigError, load_config, to_yaml
    from meshrl.pipeline import Pipeline, PipelineConfig
    from meshrl.pipeline.checkpoint import run_fingerprint

    out = tmp_path / "run"
    first = load_config(PipelineConfig, None, [f"run.output_dir={out}"])
    state = RunState(step=2, version=2, prompt_position=0, next_group=0, generated_tokens=0, accuracy_before=None,
                     in_flight=[], queue_snapshot=b"", fingerprint=run_fingerprint(first))
    write_checkpoint_files(partial_dir(out, 2), state, None)
    write_manifest(partial_dir(out, 2))
    commit(partial_dir(out, 2), keep=0)
    (out / "config.yaml").write_text(to_yaml(first))

    other = load_config(PipelineConfig, None, [f"run.output_dir={out}", "run.resume=latest", "task.digits=3"])
    with pytest.raises(ConfigError, match="other settings"):
        asyncio.run(Pipeline(other).run())
    assert (out / "config.yaml").read_text() == to_yaml(first)


def test_a_damaged_checkpoint_is_named_and_latest_falls_back_to_the_newest_intact_one(tmp_path):
    """Each file is checked against the manifest written at save before anything is read: a
    truncated shard, a changed run state or a missing file is named in one line, run.resume=latest
    takes the newest intact checkpoint of the run (saying so), and a path to a damaged one is
    refused, naming the newest intact one."""
    import pytest

    from meshrl.config import ConfigError

    for step in (2, 4, 6):
        _commit_step(tmp_path, step, keep=0, generated_tokens=step)
    root = tmp_path / "checkpoints"
    shard = root / "step_00000006" / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: a full disk, a copy cut short
    state = root / "step_00000004" / "run_state.msgpack"
    state.write_bytes(state.read_bytes()[:-1] + b"\x00")  # same size, other contents
    said: list[str] = []
    assert resolve_resume("latest", tmp_path, said.append) == root / "step_00000002"
    assert said == [f"run.resume=latest: step_00000006 is damaged ({shard} is 100 bytes, 1,024 when it was written); "
                    f"step_00000004 is damaged ({state} has other contents than when it was written (SHA-256 "
                    f"differs)): resuming from the newest intact checkpoint, {root / 'step_00000002'}"]
    with pytest.raises(ConfigError) as info:
        resolve_resume(str(root / "step_00000006"), tmp_path)
    assert str(info.value) == (f"`run.resume`: the checkpoint {root / 'step_00000006'} is damaged ({shard} is 100 "
                               f"bytes, 1,024 when it was written); the newest intact checkpoint there is "
                               f"{root / 'step_00000002'}")
    (root / "step_00000002" / "trainer" / "rank0.pt").unlink()
    with pytest.raises(ConfigError, match=r"no intact checkpoint under .*step_00000002 is damaged \(.*rank0.pt is "
                                          r"missing\); start over with run.overwrite=true"):
        resolve_resume("latest", tmp_path)
    # written before manifests existed: only what a resume needs is checked, and a run state that decodes
    legacy = partial_dir(tmp_path / "old", 3)
    write_checkpoint_files(legacy, RunState(step=3, version=3, prompt_position=0, next_group=0, generated_tokens=0,
                                            accuracy_before=None, in_flight=[], queue_snapshot=b""), None)
    (legacy / "trainer").mkdir()
    (legacy / "trainer" / ".metadata").write_bytes(b"m")
    (legacy / "trainer" / "rank0.pt").write_bytes(b"r")
    final = commit(legacy, keep=0)
    assert resolve_resume("latest", tmp_path / "old") == final
    (final / "run_state.msgpack").write_bytes(b"\x92")
    with pytest.raises(ConfigError, match=r"run_state.msgpack is damaged: "):
        resolve_resume("latest", tmp_path / "old")

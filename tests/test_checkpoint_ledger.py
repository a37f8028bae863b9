"""Run checkpoints without Ray: the prompt ledger and a real SampleQueue saved mid-flight and
restored (η > 0: requests in flight are re-issued with their prompts and group ids, a reservation
whose prompts were not yet taken is cancelled), ``latest`` selection and partial checkpoints."""

from __future__ import annotations

import asyncio

from meshrl.pipeline.checkpoint import (
    PromptLedger,
    RunState,
    commit,
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
                   behavior_version=version) for g in group_ids]  # fmt: skip


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
                     queue_snapshot=await queue.snapshot())  # fmt: skip
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
                     in_flight=[], queue_snapshot=b"")  # fmt: skip
    assert latest_checkpoint(tmp_path) is None and resolve_resume("latest", tmp_path) is None
    for step in (2, 4, 6):
        write_checkpoint_files(partial_dir(tmp_path, step), state, None)
        commit(partial_dir(tmp_path, step), keep=2)
    write_checkpoint_files(partial_dir(tmp_path, 8), state, None)  # a crash mid-write: never picked
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006", "step_00000008.partial"]
    assert resolve_resume("latest", tmp_path).name == "step_00000006"
    assert read_records(tmp_path / "checkpoints" / "step_00000006") == []


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

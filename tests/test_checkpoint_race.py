"""A checkpoint taken while rollout producers put: every prompt handed out is trained exactly once
after a resume from it.

At ``max_staleness > 0`` the train loop checkpoints while requests are in flight, without waiting
for their puts, so a put lands in the sampler just before or just after the checkpoint reads its
state. The sampler holds the queue and the prompt ledger in one process and reads both at one
instant (``Sampler.state``): a request's samples are in the snapshot and the request done, or its
reservation is in it unfilled and the request in flight, and a resume takes exactly those again.
(When the ledger lived in the controller and the queue in its actor, a put whose reply overtook the
snapshot's could be missed by both; a large state still travels through the object store here.)

Real sampler actor on a mesh and the train loop's ``checkpoint``; producers take and put as the
rollout workers' loops do (``meshrl.actors.rollout_loops``); the trainer role is reduced to the
directory it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from pathlib import Path
from typing import AsyncIterator

import msgspec
import ray.cloudpickle

from meshrl.config import load_config
from meshrl.mesh import Actor, endpoint, spawn_procs
from meshrl.pipeline import PipelineConfig
from meshrl.pipeline.checkpoint import InFlight, read_records, read_run_state
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import Roles, RolloutDriver, bounded
from meshrl.pipeline.training import TrainLoop, sampler_state
from meshrl.queues import QueueConfig, Sample, Sampler, decode_samples, encode_samples
from meshrl.queues.actor import SamplerActor
from meshrl.queues.snapshot import QueueSnapshot
from meshrl.tasks import Problem

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROBLEMS = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(1000)]
N, PROMPTS, STEP, ETA = 2, 2, 8, 2  # samples per prompt, prompts per request, samples per step, max_staleness
RESPONSE_TOKENS = 1500  # ~15 KB a sample: a snapshot of a few dozen goes through the object store


class CheckpointDir(Actor):
    """The trainer role's part of a checkpoint, reduced to the directory it writes."""

    @endpoint
    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


class SlowStateReply(SamplerActor):
    """The sampler actor with a state whose reply takes a while to reach the caller, as a large one's
    does through the object store: a put arriving meanwhile is applied after the state was read."""

    @endpoint
    async def state(self):
        state = await Sampler.state(self)
        await asyncio.sleep(0.5)
        return state


def _samples(job: InFlight) -> list[Sample]:
    return [Sample(prompt_id=g, group_id=g, group_size=N, prompt_ids=[1, 2], response_ids=[3] * RESPONSE_TOKENS,
                   behavior_logprobs=[-1.0] * RESPONSE_TOKENS, behavior_version=0)
            for g in range(job.first_group, job.first_group + job.count) for _ in range(N)]


async def _take(rollout: RolloutDriver) -> tuple[InFlight, list]:
    """The start of a rollout request (rollout_loops.RolloutLoops._loop)."""
    return await bounded(rollout.roles.queue.take.call_one(PROMPTS, timeout=60), 90, "the sampler to admit a request")


async def _put(rollout: RolloutDriver, job: InFlight) -> None:
    """The end of a rollout request (rollout_loop.RolloutDriver._request): the put, which also ends
    the request in the sampler's ledger."""
    blob = encode_samples(_samples(job))
    await bounded(rollout.roles.queue.put_encoded.call_one(blob, job.reservation_id), 60, "the sampler to accept samples")


def _accepted_in_lineage(path: Path) -> list[int]:
    """The group of every sample the audit records kept by the checkpoint at ``path`` say the queue took
    (its ledger, read up to the snapshot)."""
    return sorted(g for r in read_records(path) if r["kind"] == "audit" for g, n in r["accepted"] for _ in range(n))


@contextlib.asynccontextmanager
async def _controller(out: Path, queue_cls: type) -> AsyncIterator[TrainLoop]:
    """A train loop (and its rollout driver) over a real queue actor and a checkpoint-writing trainer."""
    cfg = load_config(PipelineConfig, None, [
        f"run.output_dir={out}", "run.keep_checkpoints=0", "run.step_timeout_s=60", "run.progress=false",
        f"trainer.samples_per_step={STEP}", f"algo.samples_per_prompt={N}", f"rollout.prompts_per_request={PROMPTS}",
        f"queue.max_staleness={ETA}", "queue.stale_policy=keep", "run.audit=true",
    ])
    procs = [spawn_procs({"procs": 1}, cpus_per_proc=0.01, name=name) for name in ("queue", "trainer")]
    queue = procs[0].spawn("queue", queue_cls, cfg.queue, PROBLEMS, 3, samples_per_prompt=N, samples_per_step=STEP,
                           audit=True)
    trainer = procs[1].spawn("trainer", CheckpointDir)
    log = RunLog(out, total_steps=1, progress=False)
    try:
        await asyncio.gather(queue.ready().within(60), trainer.ready().within(60))
        roles = Roles(queue=queue, rollouts=None, rewards=None, trainer=trainer, reference=None)
        rollout = RolloutDriver(cfg, roles, None, PROBLEMS, log, stopping=asyncio.Event(), environment=False)
        yield TrainLoop(cfg, roles, rollout, log, out, evaluate=None)
    finally:
        log.close()
        for p in procs:
            p.stop()


async def _resumed(path: Path, consumed: list[int]) -> tuple[list[int], list[int]]:
    """(the group of every sample a resume from ``path`` trains, counting those trained before it;
    the group of every sample handed out before it; the group of every sample the run's audit
    records say the queue took, counting the resume's puts), all sorted."""
    state = read_run_state(path)
    snap = msgspec.msgpack.decode(state.queue_snapshot, type=QueueSnapshot)
    queued = [s.group_id for g in snap.groups for s in g.samples]
    # what TrainLoop.restore does, with a sampler of this process
    fresh = Sampler(QueueConfig(max_staleness=ETA), PROBLEMS, 3, samples_per_prompt=N, samples_per_step=STEP)
    pending = await fresh.restore(sampler_state(state))
    reissued = []
    for _ in range(pending):
        job, _ = await fresh.take(PROMPTS)
        await fresh.queue.put(_samples(job), job.reservation_id)  # refused if the snapshot had them
        reissued += [s.group_id for s in _samples(job)]
    # one consumer of whole batches: the first consumed_position samples it got were taken before the snapshot
    trained = consumed[:snap.consumed_position] + queued + reissued
    return (sorted(trained), sorted(g for g in range(state.next_group) for _ in range(N)),
            sorted(_accepted_in_lineage(path) + reissued))


def test_a_put_applied_after_the_state_was_read_is_reissued(ray_cluster, tmp_path):
    """The put lands while the state's reply is still on its way: the state holds the request in flight
    and its reservation unfilled, so a resume issues its prompts again, once."""

    async def main() -> Path:
        async with _controller(tmp_path, SlowStateReply) as train:
            rollout = train.rollout
            job, _ = await asyncio.wait_for(_take(rollout), 60)
            train.step = 1
            checkpoint = asyncio.create_task(train.checkpoint())
            await asyncio.sleep(0.2)  # the state is read; its reply takes 0.5 s
            await _put(rollout, job)
            assert not checkpoint.done()  # the put's reply came first
            path = await asyncio.wait_for(checkpoint, 60)
            await train.audit.record(2, [])  # the next step's record
            return path

    path = asyncio.run(main())
    state = read_run_state(path)
    snap = msgspec.msgpack.decode(state.queue_snapshot, type=QueueSnapshot)
    assert [r.filled for r in snap.reservations] == [0] and snap.groups == []  # the put missed the state
    assert [j.reservation_id for j in state.in_flight] == [0]
    trained, handed_out, accepted = asyncio.run(_resumed(path, []))
    assert trained == handed_out == accepted == [0, 0, 1, 1]  # the resume's put is the one the audit counts
    assert _accepted_in_lineage(path) == []
    live = [(r["step"], r["accepted"]) for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "audit"]
    assert live == [(2, [[0, N], [1, N]])]  # the run that goes on took them


def test_checkpoints_taken_while_producers_put_account_for_every_sample_once(ray_cluster, tmp_path):
    """Producers and a consumer run flat out while the train loop checkpoints; no reply is slowed."""

    async def produce(rollout: RolloutDriver, rng: random.Random) -> None:
        while not rollout.stopping.is_set():
            job, _ = await _take(rollout)
            await asyncio.sleep(rng.uniform(0, 0.004))  # generating
            await _put(rollout, job)

    async def consume(queue, consumed: list[int]) -> None:
        version = 0
        while True:
            blob = await bounded(queue.get_batch_encoded.call_one(STEP, version), 60, "a batch")
            consumed += [s.group_id for s in decode_samples(blob)]
            version += 1
            await bounded(queue.set_version.call_one(version), 60, "set_version")

    async def main() -> tuple[list[Path], list[int]]:
        async with _controller(tmp_path, SamplerActor) as train:
            rollout, queue, consumed = train.rollout, train.roles.queue, []
            loops = [asyncio.create_task(produce(rollout, random.Random(i))) for i in range(4)]
            loops.append(asyncio.create_task(consume(queue, consumed)))
            rng, written = random.Random(0), []
            for _ in range(12):
                await asyncio.sleep(rng.uniform(0.02, 0.1))
                train.step += 1
                written.append(await train.checkpoint())
            rollout.stopping.set()
            await queue.close.call_one().within(60)  # wakes the loops' take, put and get_batch
            await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 60)
            return written, consumed

    written, consumed = asyncio.run(main())
    assert len(consumed) >= 4 * STEP
    in_flight = 0
    for path in written:
        trained, handed_out, accepted = asyncio.run(_resumed(path, consumed))
        assert trained == handed_out, f"{path.name}: a sample is lost or trained twice after a resume"
        assert accepted == handed_out, f"{path.name}: the audit would count a put twice, or miss one, after a resume"
        in_flight += len(read_run_state(path).in_flight)
    assert in_flight > 0  # requests were in flight at checkpoints: the race was there to lose

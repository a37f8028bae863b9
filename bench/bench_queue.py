"""SampleQueue throughput through a real Ray actor, beside the Ray transport floor and a train step.

Run: ``OMP_NUM_THREADS=1 pytest bench/bench_queue.py --benchmark-only``. Each case moves
``BATCHES`` batches of 256 samples of about 1 KB (msgpack) from a producer to a consumer, both
the driver, with calls pipelined the way a rollout worker and the trainer overlap them (every put
and get in flight; the consumer decodes each batch as it arrives); the samples/s of each case is
in ``extra_info``. Ray is started as the pipeline starts it (``ensure_ray``). Cases:

- ``queue_encoded``: ``put_encoded`` / ``get_batch_encoded`` (the pipeline's path), encoding on
  the producer and decoding on the consumer included.
- ``queue_pickle``: ``put`` / ``get_batch`` with ``list[Sample]`` pickled by Ray.
- ``floor_echo``: the same bytes through a do-nothing async actor (Ray's own cost, no queue).
- ``queue_inprocess``: the queue's own logic, no Ray.
- ``reference_train_step``: the library's own train step (``PolicyTrainer.train_step``, GRPO: the
  cheapest one) of the embedded default on 256 samples shaped like the example's, as
  ``bench_trainer.py`` times it, to put the queue's time for 256 samples in proportion (its share
  of a step). The queue's samples are larger than the example's (about 1 KB against a dozen
  tokens), so the share is an upper bound.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from meshrl.queues import QueueConfig, Sample, SampleQueue, decode_samples, encode_samples  # noqa: E402

from bench_trainer import ALGOS, model_dir  # noqa: E402,F401 (a fixture: the embedded default's checkpoint)
from bench_trainer import batch as trainer_batch  # noqa: E402

BATCH = 256
GROUP = 8
BATCHES = 40
STEP_SAMPLES = 256  # the reference step's batch (bench_trainer.SAMPLES)
ROUNDS = 5
_results: dict[str, float] = {}


def make_batch(first_group: int) -> list[Sample]:
    """256 samples, 8 per group, 32 prompt + 64 response tokens: about 1 KB each in msgpack."""
    return [
        Sample(prompt_id=first_group + i // GROUP, group_id=first_group + i // GROUP, group_size=GROUP,
               prompt_ids=list(range(100, 132)), response_ids=list(range(200 + i % 7, 264 + i % 7)),
               behavior_logprobs=[-0.1234567 - i * 1e-4] * 64, behavior_version=0, reward=float(i % 2),
               t_generated=time.time())
        for i in range(BATCH)
    ]


@pytest.fixture(scope="module")
def ray_mod():
    import ray

    started = not ray.is_initialized()
    if started:
        # Ray as the pipeline starts it (meshrl.pipeline.startup.ensure_ray: batches up to 1 MiB
        # travel inline in the call, not through the shared-memory store). MESHRL_BENCH_INLINE_BYTES
        # sets another threshold for comparison; 0 is Ray's own default (100 KB).
        inline = os.environ.get("MESHRL_BENCH_INLINE_BYTES")
        if inline is None:
            from meshrl.pipeline.startup import ensure_ray

            ensure_ray(num_cpus=2)
        else:
            ray.init(num_cpus=2, include_dashboard=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
                     _system_config={"max_direct_call_object_size": int(inline)} if int(inline) else None)
    yield ray
    if started:
        ray.shutdown()


class _Counter:
    next_group = 0

    @classmethod
    def batches(cls, k: int) -> list[list[Sample]]:
        out = [make_batch(cls.next_group + b * (BATCH // GROUP)) for b in range(k)]
        cls.next_group += k * (BATCH // GROUP)
        return out


def _report(benchmark, name: str, actor=None, cpu_before: float = 0.0) -> None:
    per_round_s = benchmark.stats.stats.median
    rate = BATCHES * BATCH / per_round_s
    _results[name] = rate
    benchmark.extra_info["samples_per_s"] = round(rate)
    benchmark.extra_info["ms_per_256_batch"] = round(per_round_s / BATCHES * 1e3, 3)
    if actor is not None:
        # The actor's own CPU (its Ray threads included) per batch: the server's cost, which
        # shared, loaded cores inflate much less than they inflate wall time.
        import ray

        rounds = len(benchmark.stats.stats.data) + 1  # + the warm-up round
        cpu_ms = (ray.get(actor.cpu_s.remote()) - cpu_before) / (rounds * BATCHES) * 1e3
        _results[name + "_actor_cpu_ms"] = cpu_ms
        benchmark.extra_info["actor_cpu_ms_per_256_batch"] = round(cpu_ms, 3)


def _timed(cls):
    """``cls`` with a ``cpu_s`` endpoint; made in a function so Ray ships it by value."""

    class Timed(cls):
        async def cpu_s(self) -> float:
            return time.process_time()

    return Timed


def _queue_actor(ray):
    actor = ray.remote(_timed(SampleQueue)).options(num_cpus=0).remote(
        QueueConfig(max_staleness=1_000_000), samples_per_step=BATCH)
    ray.get(actor.metrics.remote())
    return actor


def _move(ray, put, get, batches, encoded: bool) -> None:
    """Pipelined like the real loops: every put and get in flight at once; the consumer decodes each
    batch as it arrives (the trainer decodes batch k while the queue serves k + 1)."""
    puts = [put(encode_samples(b) if encoded else b) for b in batches]
    gets = [get() for _ in batches]
    got = [decode_samples(ray.get(g)) if encoded else ray.get(g) for g in gets]
    ray.get(puts)
    assert sum(map(len, got)) == BATCH * len(batches)


def _setup():
    return (_Counter.batches(BATCHES),), {}


def test_queue_encoded(benchmark, ray_mod):
    q = _queue_actor(ray_mod)
    cpu0 = ray_mod.get(q.cpu_s.remote())

    def move(batches):
        res = ray_mod.get(q.reserve.remote(BATCH * BATCHES, timeout=60))
        _move(ray_mod, lambda blob: q.put_encoded.remote(blob, res.id, timeout=60),
              lambda: q.get_batch_encoded.remote(BATCH, 0, timeout=60), batches, encoded=True)

    benchmark.pedantic(move, setup=_setup, rounds=ROUNDS, warmup_rounds=1)
    _report(benchmark, "queue_encoded", q, cpu0)
    m = ray_mod.get(q.metrics.remote())
    assert m["depth_samples"] == 0 and m["samples_consumed"] == m["samples_put"]
    ray_mod.kill(q)


def test_queue_pickle(benchmark, ray_mod):
    q = _queue_actor(ray_mod)
    cpu0 = ray_mod.get(q.cpu_s.remote())

    def move(batches):
        res = ray_mod.get(q.reserve.remote(BATCH * BATCHES, timeout=60))
        _move(ray_mod, lambda b: q.put.remote(b, res.id, timeout=60),
              lambda: q.get_batch.remote(BATCH, 0, timeout=60), batches, encoded=False)

    benchmark.pedantic(move, setup=_setup, rounds=ROUNDS, warmup_rounds=1)
    _report(benchmark, "queue_pickle", q, cpu0)
    ray_mod.kill(q)


def _echo_class():
    """The floor: holds each blob and hands it back, no queue logic (made here: shipped by value)."""

    class Echo:
        def __init__(self):
            self.held: asyncio.Queue[bytes] | None = None

        def _q(self) -> asyncio.Queue[bytes]:
            # Made on the actor's loop; a call may start before an earlier one whose large
            # argument is still being fetched, so give() waits rather than assumes.
            if self.held is None:
                self.held = asyncio.Queue()
            return self.held

        async def take(self, blob: bytes) -> None:
            self._q().put_nowait(blob)

        async def give(self) -> bytes:
            return await self._q().get()

        async def cpu_s(self) -> float:
            return time.process_time()

    return Echo


def test_floor_echo(benchmark, ray_mod):
    e = ray_mod.remote(_echo_class()).options(num_cpus=0).remote()
    ray_mod.get(e.take.remote(b""))
    ray_mod.get(e.give.remote())
    cpu0 = ray_mod.get(e.cpu_s.remote())

    def move(batches):
        _move(ray_mod, e.take.remote, e.give.remote, batches, encoded=True)

    benchmark.pedantic(move, setup=_setup, rounds=ROUNDS, warmup_rounds=1)
    _report(benchmark, "floor_echo", e, cpu0)
    ray_mod.kill(e)


def test_queue_inprocess(benchmark):
    q = SampleQueue(QueueConfig(max_staleness=1_000_000), samples_per_step=BATCH)

    async def amove(batches):
        res = await q.reserve(BATCH * BATCHES, timeout=1)
        for b in batches:
            await q.put(b, res.id, timeout=1)
            assert len(await q.get_batch(BATCH, 0, timeout=1)) == BATCH

    benchmark.pedantic(lambda b: asyncio.run(amove(b)), setup=_setup, rounds=ROUNDS, warmup_rounds=1)
    _report(benchmark, "queue_inprocess")


def test_reference_train_step(benchmark, model_dir):  # noqa: F811 (the imported fixture)
    import torch

    from meshrl.actors import TrainerConfig
    from meshrl.actors.data_parallel import DataParallel
    from meshrl.actors.policy_trainer import PolicyTrainer

    torch.set_num_threads(1)
    algo = ALGOS["grpo"]
    trainer = PolicyTrainer(model_dir, TrainerConfig(samples_per_step=STEP_SAMPLES), algo, dp=DataParallel(None),
                            temperature=1.0, max_new_tokens=8, total_steps=5)
    batches = iter([trainer_batch(s, algo.samples_per_prompt) for s in range(4)])
    metrics = benchmark.pedantic(lambda: trainer.train_step(next(batches), 0), rounds=3, warmup_rounds=1)
    assert metrics["skipped_updates"] == 0
    step_s = benchmark.stats.stats.median
    benchmark.extra_info["ms_per_step"] = round(step_s * 1e3, 1)
    benchmark.extra_info["samples_per_step"] = STEP_SAMPLES
    if "queue_encoded" in _results:
        queue_s = STEP_SAMPLES / _results["queue_encoded"]
        benchmark.extra_info["queue_ms_per_step_of_samples"] = round(queue_s * 1e3, 3)
        benchmark.extra_info["queue_share_of_step"] = round(queue_s / (queue_s + step_s), 4)
    _print_summary(step_s)


def _print_summary(step_s: float) -> None:
    """The ratios this file exists for, on one screen (shown with ``pytest -s``)."""
    r = _results
    if not {"queue_encoded", "floor_echo"} <= r.keys():
        return
    enc = r["queue_encoded"]
    lines = [
        f"queue_encoded   {enc:10,.0f} samples/s  "
        f"actor CPU {r['queue_encoded_actor_cpu_ms']:.2f} ms/batch",
        f"floor_echo      {r['floor_echo']:10,.0f} samples/s  "
        f"actor CPU {r['floor_echo_actor_cpu_ms']:.2f} ms/batch",
        f"queue / floor   {enc / r['floor_echo']:.2f}",
    ]
    if "queue_pickle" in r:
        lines.append(f"queue_pickle    {r['queue_pickle']:10,.0f} samples/s  actor CPU "
                     f"{r['queue_pickle_actor_cpu_ms']:.2f} ms/batch (encoded / pickle "
                     f"{enc / r['queue_pickle']:.2f})")
    if "queue_inprocess" in r:
        lines.append(f"queue_inprocess {r['queue_inprocess']:10,.0f} samples/s  (no Ray)")
    queue_s = STEP_SAMPLES / enc
    lines.append(f"{STEP_SAMPLES} samples through the queue {queue_s * 1e3:.2f} ms vs the GRPO "
                 f"train step on them {step_s * 1e3:.0f} ms: queue share of a step "
                 f"{queue_s / (queue_s + step_s):.1%}")
    print("\n" + "\n".join(lines))

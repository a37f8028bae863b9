"""The data plane: what the controller moves per step, by value (before issue 27) and by reference.

Run: ``OMP_NUM_THREADS=1 pytest bench/bench_dataplane.py --benchmark-only -s`` (sizes:
``MESHRL_DATAPLANE_SIZES=1000x1024,10000x1024,1000x32768``, samples x tokens per sample).

One step of the pipeline's sample flow through real Ray actors, the driver playing the controller:
a producer actor (the reward worker) makes the step's samples in requests of 8, the queue actor
admits them, and two consumer actors (trainer ranks, dp = 2) each decode the batch. Cases:

- ``value``: the path before issue 27. The producer returns each request's encoded blob to the
  controller, which puts it to the queue (``put_encoded``), takes the batch back
  (``get_batch_encoded``) and sends it to every rank.
- ``ref``: the pipeline's path. The producer keeps each group's blob in its object store and
  returns its ref and ``SampleMeta``s; the controller puts those (``put_ref``), takes the step's
  refs back split per rank (``get_batch_refs(shares=dp)``) and sends them to every rank, which
  fetches its own share's blobs only.

``extra_info``: ``controller_bytes`` (per step: everything the driver sent or received, as Ray
serializes it), ``rank_bytes`` (per step: the sample bytes the busiest rank decoded),
``samples_per_s`` (samples of a step over its wall time, decoding included) and ``tokens``. A sample is 256 prompt tokens and the rest response, with a float log-prob per
response token (msgpack: about 12 bytes per token).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from meshrl.queues import QueueConfig, Sample, decode_samples, encode_samples  # noqa: E402
from meshrl.queues.parcels import fetch_batch  # noqa: E402
from meshrl.queues.wire import encoded_metas  # noqa: E402

PROMPT = 256
REQUEST = 8  # samples per request: one group of 8 completions
DP = 2
SIZES = [tuple(int(x) for x in size.split("x"))
         for size in os.environ.get("MESHRL_DATAPLANE_SIZES", "1000x1024,10000x1024,1000x32768").split(",")]
_results: dict[tuple[str, int, int], dict[str, float]] = {}


def _actor_classes() -> tuple[type, type]:
    """The producer and rank actors, defined here so that Ray ships them by value (workers cannot
    import bench modules)."""

    def samples_of(first: int, tokens: int, version: int) -> list[Sample]:
        response = tokens - PROMPT
        prompt_ids, response_ids = list(range(1000, 1000 + PROMPT)), [(7 * i) % 30000 + 300 for i in range(response)]
        logprobs = [-0.1234567 - (i % 97) * 1e-3 for i in range(response)]
        return [Sample(prompt_id=(first + i) // REQUEST, group_id=(first + i) // REQUEST, group_size=REQUEST,
                       prompt_ids=prompt_ids, response_ids=response_ids, behavior_logprobs=logprobs,
                       behavior_version=version, reward=float(i % 2)) for i in range(REQUEST)]

    class Producer:
        """The reward worker's end of the flow: a request's samples, encoded."""

        def __init__(self, tokens: int) -> None:
            self.tokens = tokens

        def by_value(self, first: int, version: int) -> bytes:
            return encode_samples(samples_of(first, self.tokens, version))

        def by_ref(self, first: int, version: int) -> tuple[list, list]:
            import ray

            blob = self.by_value(first, version)
            return [ray.put(blob)], encoded_metas(blob)

    class Rank:
        """A trainer rank's end: the batch decoded (by value) or fetched and decoded (by reference)."""

        def take(self, batch, rank: int) -> tuple[int, int]:
            """Response tokens it trains and sample bytes it decoded: the whole batch by value,
            its own share by reference."""
            import ray

            if isinstance(batch, bytes):
                samples = decode_samples(batch)
                return sum(len(s.response_ids) for s in samples), len(batch)
            mine, _, count = batch.of(rank)
            samples = fetch_batch(mine, 600)[:count]
            return sum(len(s.response_ids) for s in samples), sum(len(b) for b in ray.get([p[0] for p in mine.parts]))

    return Producer, Rank


def _size(value) -> int:
    """Bytes Ray sends for ``value`` (in-band and out-of-band buffers)."""
    import ray

    return ray._private.worker.global_worker.get_serialization_context().serialize(value).total_bytes


@pytest.fixture(scope="module")
def cluster():
    import ray

    from meshrl.pipeline.startup import ensure_ray

    ensure_ray(None)
    yield ray
    ray.shutdown()
    _print_table()


@pytest.mark.parametrize(("samples", "tokens"), SIZES, ids=[f"{s}x{t}" for s, t in SIZES])
@pytest.mark.parametrize("path", ["value", "ref"])
def test_dataplane(benchmark, cluster, path, samples, tokens):
    ray = cluster
    from meshrl.queues.sample_queue import SampleQueue

    cfg = QueueConfig(max_staleness=0, capacity_tokens=samples * tokens * 2, reserve_timeout_s=600, put_timeout_s=600,
                      get_timeout_s=600)
    queue = ray.remote(SampleQueue).options(num_cpus=0).remote(cfg, samples_per_step=samples)
    Producer, Rank = _actor_classes()
    producer = ray.remote(Producer).options(num_cpus=0).remote(tokens)
    ranks = [ray.remote(Rank).options(num_cpus=0).remote() for _ in range(DP)]
    version = [0]
    moved, rank_bytes = [], []

    def step() -> None:
        v, sent = version[0], 0
        r = ray.get(queue.reserve.remote(samples, timeout=600))
        sent += _size((samples,))
        firsts = range(0, samples, REQUEST)
        if path == "value":
            puts = []
            for blob in ray.get([producer.by_value.remote(first, v) for first in firsts]):
                sent += 2 * _size(blob)  # in from the producer, out to the queue
                puts.append(queue.put_encoded.remote(blob, r.id, timeout=600))
            ray.get(puts)
            batch = ray.get(queue.get_batch_encoded.remote(samples, v, timeout=600))
        else:
            puts = []
            for ref, metas in ray.get([producer.by_ref.remote(first, v) for first in firsts]):
                sent += 2 * _size((ref, metas))
                puts.append(queue.put_ref.remote(ref, metas, r.id, timeout=600))
            ray.get(puts)
            batch = ray.get(queue.get_batch_refs.remote(samples, v, timeout=600, shares=DP))
        sent += (1 + DP) * _size(batch)  # in from the queue, out to every rank
        took = ray.get([rank.take.remote(batch, i) for i, rank in enumerate(ranks)])
        trained = sum(t for t, _ in took) if path == "ref" else took[0][0]
        assert trained == samples * (tokens - PROMPT), (path, took)
        rank_bytes.append(max(b for _, b in took))
        ray.get(queue.set_version.remote(v + 1))
        version[0] = v + 1
        moved.append(sent)

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    mean = benchmark.stats.stats.mean
    info = {"controller_bytes": float(moved[-1]), "rank_bytes": float(rank_bytes[-1]), "samples_per_s": samples / mean,
            "tokens": float(samples * tokens)}
    benchmark.extra_info.update(info)
    _results[(path, samples, tokens)] = info
    for actor in (queue, producer, *ranks):
        ray.kill(actor)


def _print_table() -> None:
    """The figures side by side, once every case ran."""
    if not _results:
        return
    print("\n| samples x tokens | path | controller bytes / step | busiest rank decodes / step | samples/s |")
    print("|---|---|---:|---:|---:|")
    for (path, samples, tokens), info in sorted(_results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "value")):
        print(f"| {samples} x {tokens} | {path} | {info['controller_bytes'] / 1e6:,.3f} MB | "
              f"{info['rank_bytes'] / 1e6:,.1f} MB | {info['samples_per_s']:,.0f} |")

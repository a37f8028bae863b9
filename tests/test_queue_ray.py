"""SampleQueue as a real async Ray actor: a producer task and a consumer task overlap through it."""

from __future__ import annotations

import pytest

from meshrl.queues import (
    QueueConfig,
    QueueTimeout,
    Sample,
    SampleQueue,
    decode_samples,
    encode_samples,
)

GROUP, STEP, STEPS, ETA = 4, 8, 12, 1  # samples per group / per train step, steps, max_staleness


def test_producer_and_consumer_overlap_through_the_actor(ray_cluster):
    ray = ray_cluster

    # Defined here so that Ray ships them by value: workers cannot import test modules.
    def producer(queue, rounds: int) -> int:
        """A rollout worker: reserve, 'generate' at the granted version, put encoded."""
        import ray

        uid = 0
        for _ in range(rounds):
            r = ray.get(queue.reserve.remote(STEP, timeout=30))
            batch = [Sample(prompt_id=uid + i, group_id=(uid + i) // GROUP, group_size=GROUP,
                            prompt_ids=[1, 2, 3], response_ids=[4, 5], behavior_logprobs=[-0.1, -0.2],
                            behavior_version=r.min_version)
                     for i in range(STEP)]
            uid += STEP
            # Two puts per reservation, one group each: a reservation may be filled piecewise.
            ray.get(queue.put_encoded.remote(encode_samples(batch[:GROUP]), r.id, timeout=30))
            ray.get(queue.put_encoded.remote(encode_samples(batch[GROUP:]), r.id, timeout=30))
        return uid

    def consumer(queue, steps: int) -> list[tuple[int, int, int]]:
        """The trainer: one batch per step, publishes every step (engines apply at once here).
        Each step takes a moment, as training does, so the producer runs into the bound."""
        import time

        import ray

        seen = []
        for step in range(steps):
            time.sleep(0.05)
            batch = decode_samples(ray.get(queue.get_batch_encoded.remote(STEP, step, timeout=30)))
            seen += [(s.prompt_id, s.group_id, step - s.behavior_version) for s in batch]
            ray.get(queue.set_version.remote(step + 1))
        return seen

    queue = ray.remote(SampleQueue).options(num_cpus=0).remote(
        QueueConfig(max_staleness=ETA), samples_per_step=STEP)
    produce = ray.remote(num_cpus=0)(producer).remote(queue, STEPS)
    consume = ray.remote(num_cpus=0)(consumer).remote(queue, STEPS)
    produced, seen = ray.get([produce, consume], timeout=120)
    assert produced == STEPS * STEP
    uids = [u for u, _, _ in seen]
    assert sorted(uids) == list(range(produced))  # each sample exactly once
    assert max(st for _, _, st in seen) <= ETA
    for i in range(0, len(seen), GROUP):  # groups arrive whole and contiguous
        assert len({g for _, g, _ in seen[i:i + GROUP]}) == 1
    m = ray.get(queue.metrics.remote())
    assert m["samples_consumed"] == produced and m["depth_samples"] == 0
    assert m["dropped_stale"] == 0 and m["reservations_outstanding"] == 0
    # The producer ran ahead until admission stopped it: the bound did its work.
    assert m["reserve_wait_s"] > 0
    ray.kill(queue)


def test_timeout_through_the_actor_names_what_it_waited_for(ray_cluster):
    ray = ray_cluster
    queue = ray.remote(SampleQueue).options(num_cpus=0).remote(
        QueueConfig(max_staleness=0), samples_per_step=STEP)
    r = ray.get(queue.reserve.remote(STEP, timeout=1))
    with pytest.raises(QueueTimeout) as e:
        ray.get(queue.get_batch.remote(STEP, 0, timeout=0.2))
    msg = str(e.value)
    assert "get_batch(n=8, current_version=0)" in msg and "8 reserved but not yet put" in msg
    assert "unblocked by put()" in msg
    with pytest.raises(QueueTimeout, match="set_version\\(1\\)"):
        ray.get(queue.reserve.remote(1, timeout=0.2))
    # A snapshot taken through the actor restores into a fresh one with the reservation intact.
    blob = ray.get(queue.snapshot.remote())
    ray.kill(queue)
    fresh = ray.remote(SampleQueue).options(num_cpus=0).remote(
        QueueConfig(max_staleness=0), samples_per_step=STEP)
    assert [o.id for o in ray.get(fresh.restore.remote(blob))] == [r.id]
    ray.kill(fresh)


def test_samples_go_by_reference_from_their_producer_to_each_consumer(ray_cluster):
    """put_ref / get_batch_refs (meshrl.queues.parcels): a producer actor keeps its blobs in its
    object store and the queue holds only their refs; every consumer fetches the batch itself, in
    the queue's order (parcels of two blobs and a group put encoded, mixed); a snapshot fetches the
    queued blobs and restores them as plain samples."""
    import ray

    from meshrl.queues.parcels import Batch, fetch_batch
    from meshrl.queues.wire import encoded_metas

    def sample(i: int, version: int) -> Sample:
        return Sample(prompt_id=i, group_id=i // GROUP, group_size=GROUP, prompt_ids=[1, 2, 3], response_ids=[4] * (i + 1),
                      behavior_logprobs=[-0.5] * (i + 1), behavior_version=version, reward=float(i))

    class Producer:
        def put(self, queue, lo: int, hi: int, rid: int, version: int):
            blob = encode_samples([sample(i, version) for i in range(lo, hi)])
            return ray.get(queue.put_ref.remote([ray.put(blob)], encoded_metas(blob), rid, timeout=30))

    queue = ray.remote(SampleQueue).options(num_cpus=0).remote(QueueConfig(max_staleness=1), samples_per_step=3 * GROUP)
    producer = ray.remote(Producer).options(num_cpus=0).remote()
    r = ray.get(queue.reserve.remote(3 * GROUP, timeout=30))
    ray.get(producer.put.remote(queue, 0, GROUP, r.id, r.min_version))
    ray.get(queue.put_encoded.remote(encode_samples([sample(i, 0) for i in range(GROUP, 2 * GROUP)]), r.id))
    ray.get(producer.put.remote(queue, 2 * GROUP, 3 * GROUP, r.id, r.min_version))
    expected = [sample(i, 0) for i in range(3 * GROUP)]

    blob = ray.get(queue.snapshot.remote())
    fresh = ray.remote(SampleQueue).options(num_cpus=0).remote(QueueConfig(max_staleness=1), samples_per_step=3 * GROUP)
    ray.get(fresh.restore.remote(blob))
    restored = decode_samples(ray.get(fresh.get_batch_encoded.remote(3 * GROUP, 0, timeout=30)))
    assert sorted(restored, key=lambda s: s.prompt_id) == expected

    batch = ray.get(queue.get_batch_refs.remote(3 * GROUP, 0, timeout=30))
    assert isinstance(batch, Batch) and len(batch) == 3 * GROUP and len(batch.parts) == 3
    assert all(isinstance(part[0], ray.ObjectRef) for part in batch.parts)

    @ray.remote(num_cpus=0)
    def consume(b: Batch) -> list[Sample]:
        return fetch_batch(b, timeout_s=30)

    ranks = ray.get([consume.remote(batch), consume.remote(batch)], timeout=60)
    assert ranks[0] == ranks[1] and sorted(ranks[0], key=lambda s: s.prompt_id) == expected
    assert sorted(fetch_batch(batch, timeout_s=30), key=lambda s: s.prompt_id) == expected
    m = ray.get(queue.metrics.remote())
    assert m["samples_consumed"] == 3 * GROUP and m["depth_samples"] == 0
    for actor in (queue, fresh, producer):
        ray.kill(actor)


def test_each_trainer_rank_gets_only_its_own_whole_groups(ray_cluster):
    """get_batch_refs(shares=dp) (meshrl.queues.parcels.Shares): with one blob per group, each dp
    rank's share holds the refs of its own groups only, disjoint from the other ranks' and covering
    the batch, and its samples are what a trainer rank given the whole batch takes as its share
    (policy_trainer.share_of); a blob of several groups (the reward worker puts one per request)
    goes to one rank whole; a rank with no group gets one padding sample. put_ref refuses a blob
    count that is neither one nor one per group."""
    import ray

    from meshrl.actors.policy_trainer import share_of
    from meshrl.queues.parcels import Shares, fetch_batch
    from meshrl.queues.wire import meta_of

    lengths = [1, 9, 2, 2, 7, 3]  # uneven groups: the split balances tokens, not groups

    def group(g: int) -> list[Sample]:
        return [Sample(prompt_id=g, group_id=g, group_size=GROUP, prompt_ids=[1, 2, 3], response_ids=[4] * (lengths[g] + i),
                       behavior_logprobs=[-0.5] * (lengths[g] + i), behavior_version=0, reward=float(i)) for i in range(GROUP)]

    class Producer:
        def put(self, queue, groups: list[int], rid: int, split: bool = True, blobs: int | None = None):
            samples = [s for g in groups for s in group(g)]
            blobs = ([ray.put(encode_samples(group(g))) for g in groups[:blobs]] if split or blobs
                     else [ray.put(encode_samples(samples))])
            return ray.get(queue.put_ref.remote(blobs, [meta_of(s) for s in samples], rid, timeout=30))

    n = len(lengths) * GROUP
    queue = ray.remote(SampleQueue).options(num_cpus=0).remote(QueueConfig(max_staleness=0), samples_per_step=n)
    producer = ray.remote(Producer).options(num_cpus=0).remote()
    r = ray.get(queue.reserve.remote(n, timeout=30))
    with pytest.raises(ValueError, match="2 blob refs for samples of 3 runs"):
        ray.get(producer.put.remote(queue, [4, 5, 0], r.id, blobs=2))
    ray.get([producer.put.remote(queue, [5, 2, 0], r.id), producer.put.remote(queue, [1, 3, 4], r.id)])
    shares = ray.get(queue.get_batch_refs.remote(n, 0, timeout=30, shares=2))
    assert isinstance(shares, Shares) and shares.total == n and sum(shares.counts) == n
    refs = [{part[0] for part in b.parts} for b in shares.batches]
    assert refs[0].isdisjoint(refs[1]) and len(refs[0] | refs[1]) == len(lengths)  # one blob per group, each once
    whole = [s for g in range(len(lengths)) for s in group(g)]
    for rank in range(2):
        mine, start, count = shares.of(rank)
        got = fetch_batch(mine, timeout_s=30)
        assert len(mine.parts) == len({s.group_id for s in got})  # no blob of another rank's group
        assert (got, (start, count, n)) == share_of(whole, rank, 2)
    tokens = [sum(s.num_tokens for s in fetch_batch(b, timeout_s=30)) for b in shares.batches]
    assert abs(tokens[0] - tokens[1]) <= max(sum(s.num_tokens for s in group(g)) for g in range(len(lengths)))

    # a blob of several groups (a request's, as the reward worker puts it) goes to one rank whole
    requests = ray.remote(SampleQueue).options(num_cpus=0).remote(QueueConfig(max_staleness=0), samples_per_step=n)
    r = ray.get(requests.reserve.remote(n, timeout=30))
    ray.get([producer.put.remote(requests, [0, 1, 2], r.id, split=False),
             producer.put.remote(requests, [3, 4, 5], r.id, split=False)])
    shares = ray.get(requests.get_batch_refs.remote(n, 0, timeout=30, shares=2))
    assert [len(b.parts) for b in shares.batches] == [1, 1] and shares.batches[0].parts != shares.batches[1].parts
    assert [s.group_id for b in shares.batches for s in fetch_batch(b, timeout_s=30)] == [g for g in range(6) for _ in range(GROUP)]

    # more ranks than groups: the last rank pads with the step's first sample and trains nothing
    small = ray.remote(SampleQueue).options(num_cpus=0).remote(QueueConfig(max_staleness=0), samples_per_step=GROUP)
    r = ray.get(small.reserve.remote(GROUP, timeout=30))
    ray.get(producer.put.remote(small, [0], r.id))
    few = ray.get(small.get_batch_refs.remote(GROUP, 0, timeout=30, shares=2))
    assert few.counts == [GROUP, 0] and fetch_batch(few.batches[1], timeout_s=30) == group(0)[:1]
    assert share_of(group(0), 1, 2) == (group(0)[:1], (GROUP, 0, GROUP))
    for actor in (queue, requests, small, producer):
        ray.kill(actor)

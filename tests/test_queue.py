"""SampleQueue unit tests, in-process: admission, groups, stale policies, capacity, waits, snapshots."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.queues import (
    QueueClosed,
    QueueConfig,
    QueueTimeout,
    Sample,
    SampleQueue,
    decode_samples,
    encode_samples,
)

_uid = itertools.count()


def group(gid: int, size: int, version: int, *, tokens: int = 4) -> list[Sample]:
    """``size`` samples of group ``gid``; prompt_id is a unique sample id."""
    return [
        Sample(prompt_id=next(_uid), group_id=gid, group_size=size, prompt_ids=[1] * (tokens // 2),
               response_ids=[2] * (tokens - tokens // 2), behavior_logprobs=[-0.5] * (tokens - tokens // 2),
               behavior_version=version)
        for _ in range(size)
    ]


def run(coro):
    return asyncio.run(coro)


def make(eta: int = 1, sps: int = 4, spv: int = 1, **kw) -> SampleQueue:
    return SampleQueue(QueueConfig(max_staleness=eta, **kw), samples_per_step=sps, steps_per_version=spv)


# -- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize("eta,sps,spv", [(0, 4, 1), (1, 4, 1), (2, 3, 1), (1, 2, 3)])
def test_admission_capacity_is_eta_plus_one_versions_of_samples(eta, sps, spv):
    async def main():
        q = make(eta, sps, spv)
        cap = (eta + 1) * sps * spv
        r = await q.reserve(cap, timeout=0)
        assert r.slots == (0, cap) and r.min_version == 0 and r.train_version == eta
        with pytest.raises(QueueTimeout):
            await q.reserve(1, timeout=0)
        # The trainer consumes one version's worth and the new weights reach every engine.
        for g in range(cap):
            await q.put(group(g, 1, 0), r.id)
        for step in range(spv):
            assert len(await q.get_batch(sps, 0, timeout=0)) == sps
        await q.set_version(1)
        r2 = await q.reserve(sps * spv, timeout=0)
        assert r2.min_version == 1 and r2.train_version == 1 + eta

    run(main())


def test_eta0_cancel_does_not_deadlock():
    """A cancelled slot is reused; with a monotonic slot counter this run would hang at eta = 0."""

    async def main():
        q = make(0, 4)
        r = await q.reserve(4, timeout=0)
        await q.put(group(0, 2, 0), r.id)
        assert await q.cancel(r.id) == 2
        r2 = await q.reserve(2, timeout=0)
        await q.put(group(1, 2, 0), r2.id)
        batch = await q.get_batch(4, 0, timeout=0)
        assert {s.group_id for s in batch} == {0, 1}
        m = await q.metrics()
        assert m["slots_cancelled"] == 2 and m["dropped_stale"] == 0

    run(main())


def test_reserve_waits_for_set_version_and_is_fifo():
    async def main():
        q = make(0, 2)
        r = await q.reserve(2, timeout=0)
        big = asyncio.create_task(q.reserve(2, timeout=5))
        await asyncio.sleep(0)
        small = asyncio.create_task(q.reserve(1, timeout=5))
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        await q.put(group(0, 2, 0), r.id)
        await q.get_batch(2, 0, timeout=0)
        await q.set_version(1)
        rb = await big
        # First in line is served first: the small one must wait for the next version.
        await asyncio.sleep(0.01)
        assert not small.done()
        await q.cancel(rb.id)
        assert (await small).n == 1
        assert (await q.metrics())["reserve_wait_s"] > 0

    run(main())


def test_trainer_version_ahead_of_queue_limits_admission():
    """A fresh queue under a resumed trainer (version 10) still admits only (eta + 1) versions."""

    async def main():
        q = make(1, 4)
        await q.set_version(10)
        r = await q.reserve(8, timeout=0)
        assert r.slots == (40, 48) and r.train_version == 11
        with pytest.raises(QueueTimeout):
            await q.reserve(1, timeout=0)

    run(main())


def test_reserve_timeout_message_names_what_unblocks_it():
    async def main():
        q = make(1, 2)
        await q.reserve(4, timeout=0)
        with pytest.raises(QueueTimeout) as e:
            await q.reserve(2, timeout=0.05)
        msg = str(e.value)
        assert "reserve(n=2)" in msg and "max_staleness=1" in msg
        assert "set_version(1)" in msg and "cancel()" in msg

    run(main())


def test_bad_arguments_are_named():
    async def main():
        q = make(1, 2)
        with pytest.raises(ValueError, match="reserve\\(n=5\\)"):
            await q.reserve(5, timeout=0)
        with pytest.raises(ValueError, match="timeout"):
            await q.reserve(1, timeout=-1)
        with pytest.raises(ValueError, match="goes backwards"):
            await q.set_version(3)
            await q.set_version(2)
        with pytest.raises(ValueError, match="was ever granted"):
            await q.cancel(99)
        with pytest.raises(ValueError, match="max_staleness"):
            QueueConfig(max_staleness=-1)
        with pytest.raises(ValueError, match="stale_policy"):
            QueueConfig(stale_policy="evict")
        with pytest.raises(ValueError, match="reserve_timeout_s must be a finite"):
            QueueConfig(reserve_timeout_s=float("inf"))  # every wait would refuse it

    run(main())


# -- put validation ---------------------------------------------------------------------------


def test_bad_puts_are_rejected_whole():
    async def main():
        q = make(3, 4)
        r = await q.reserve(4, timeout=0)
        with pytest.raises(ValueError, match="not outstanding"):
            await q.put(group(0, 2, 0), r.id + 1)
        with pytest.raises(ValueError, match="overfill"):
            await q.put(group(0, 5, 0), r.id)
        with pytest.raises(ValueError, match="unfinished"):
            await q.put(group(0, 2, 0) + group(1, 4, 0)[:2], r.id)
        with pytest.raises(ValueError, match="group_size"):
            await q.put(group(0, 2, 0)[:1] + group(0, 3, 0)[:1], r.id)
        with pytest.raises(TypeError, match="put_encoded"):
            await q.put([b"x"], r.id)
        with pytest.raises(ValueError, match="not a msgpack list of Sample"):
            await q.put_encoded(b"\x93\x01\x02\x03", r.id)
        assert (await q.metrics())["depth_samples"] == 0
        await q.put(group(0, 2, 0), r.id)
        r2 = await q.reserve(4, timeout=0)
        with pytest.raises(ValueError, match="already queued"):
            await q.put(group(0, 2, 0), r2.id)

    run(main())


def test_a_sample_with_a_field_of_the_wrong_type_is_refused_at_put():
    """A Struct built in code is not type-checked: a numpy reward, accepted, used to fail
    get_batch_encoded after the batch was taken (lost) and every snapshot while it was queued."""
    np = pytest.importorskip("numpy")

    async def main():
        q = make(1, 2)
        r = await q.reserve(2, timeout=0)
        bad = group(0, 2, 0)
        bad[1].reward = np.float32(1.0)
        with pytest.raises(ValueError, match="sample 1 .* not a valid Sample: .*numpy.float32.*nothing was put"):
            await q.put(bad, r.id)
        with pytest.raises(ValueError, match="sample 0 .* not a valid Sample"):
            await q.put([msgspec.structs.replace(group(0, 2, 0)[0], response_ids="ab")], r.id)
        assert (await q.metrics())["depth_samples"] == 0
        await q.snapshot()
        bad[1].reward = 1.0
        await q.put(bad, r.id)
        assert len(decode_samples(await q.get_batch_encoded(2, 0, timeout=0))) == 2

    run(main())


# -- groups, ordering, stale policies ---------------------------------------------------------


def test_incomplete_groups_wait_and_groups_come_whole_oldest_first():
    async def main():
        q = make(4, 4)
        await q.set_version(2)
        r = await q.reserve(12, timeout=0)
        new, old, late = group(0, 4, 2), group(1, 4, 1), group(2, 4, 0)
        await q.put(new + old + late[:2], r.id)
        first = await q.get_batch(4, 2, timeout=0)
        assert [s.group_id for s in first] == [1] * 4  # version 1 before version 2
        second = await q.get_batch(4, 2, timeout=0)
        assert [s.group_id for s in second] == [0] * 4
        with pytest.raises(QueueTimeout, match="2 in unfinished groups"):
            await q.get_batch(4, 2, timeout=0)
        await q.put(late[2:], r.id)
        assert [s.prompt_id for s in await q.get_batch(4, 2, timeout=0)] == [s.prompt_id for s in late]
        with pytest.raises(ValueError, match="multiple of group_size"):
            r2 = await q.reserve(4, timeout=0)
            await q.put(group(3, 4, 2), r2.id)
            await q.get_batch(2, 2, timeout=0)
        assert (await q.metrics())["ready_samples"] == 4  # the failed get put the group back

    run(main())


def test_drop_policy_drops_stale_groups_whole_and_frees_their_slots():
    async def main():
        q = make(1, 2)
        r = await q.reserve(2, timeout=0)
        await q.put(group(0, 2, 0), r.id)  # a slow engine: still version 0 when it arrives
        await q.set_version(2)
        r = await q.reserve(2, timeout=0)
        await q.put(group(1, 2, 2), r.id)
        # Trainer at version 2: the version-0 group is 2 versions old, one past the bound.
        batch = await q.get_batch(2, 2, timeout=0)
        assert {s.group_id for s in batch} == {1}
        m = await q.metrics()
        assert m["dropped_stale"] == 2 and m["samples_consumed"] == 2 and m["depth_samples"] == 0
        assert m["staleness/0"] == 2 and m["staleness_max"] == 0
        # Versions 0-1 and this step used 6 positions of the 8 within reach; the dropped pair's
        # positions are free again rather than lost.
        assert m["consumed_position"] == 6 and m["admission_free_slots"] == 2

    run(main())


def test_keep_policy_trains_stale_groups_and_counts_them():
    async def main():
        q = make(1, 2, stale_policy="keep")
        r = await q.reserve(2, timeout=0)
        await q.put(group(0, 2, 0), r.id)
        await q.set_version(2)
        r = await q.reserve(2, timeout=0)
        await q.put(group(1, 2, 2), r.id)
        batch = await q.get_batch(2, 2, timeout=0)
        assert {s.behavior_version for s in batch} == {0}
        m = await q.metrics()
        assert m["kept_stale"] == 2 and m["dropped_stale"] == 0 and m["staleness/2"] == 2

    run(main())


def test_cancel_drops_unfinished_groups_of_that_reservation():
    async def main():
        q = make(2, 4)
        r = await q.reserve(8, timeout=0)
        g0, g1 = group(0, 4, 0), group(1, 4, 0)
        await q.put(g0 + g1[:1], r.id)
        assert await q.cancel(r.id) == 3
        assert await q.cancel(r.id) == 0  # idempotent for a finished reservation
        m = await q.metrics()
        assert m["dropped_incomplete"] == 1 and m["depth_samples"] == 4
        assert m["samples_put"] == m["depth_samples"] + m["dropped_incomplete"]

    run(main())


def test_the_ledger_books_every_put_drop_and_cancel_in_order_up_to_a_snapshot():
    """The queue's ledger (run.audit): what a put gave it, what it dropped, read in pieces from a
    position; a snapshot's ledger_mark splits what it holds from what came after."""
    from meshrl.queues.snapshot import ledger_mark

    async def main():
        q = SampleQueue(QueueConfig(max_staleness=1), samples_per_step=4, ledger=True)
        r = await q.reserve(2, timeout=0)
        await q.put(group(0, 2, 0), r.id)  # stale by the time the trainer is at version 2
        await q.set_version(2)
        r = await q.reserve(4, timeout=0)
        await q.put(group(1, 2, 2) + group(2, 2, 2)[:1], r.id)
        assert await q.ledger(0) == ([(0, 2, False), (1, 2, False), (2, 1, False)], 3)
        mark = ledger_mark(await q.snapshot())
        assert await q.cancel(r.id) == 1  # group 2 left incomplete: dropped
        assert {s.group_id for s in await q.get_batch(2, 2, timeout=0)} == {1}  # group 0 dropped as stale
        assert mark == 3 and await q.ledger(3, mark) == ([], 3)
        assert await q.ledger(3) == ([(2, 1, True), (0, 2, True)], 5)
        with pytest.raises(ValueError, match="holds positions 3..5"):
            await q.ledger(1)  # forgotten: the caller had read past it
        with pytest.raises(ValueError, match="keeps no ledger"):
            await make().ledger(0)

    run(main())


def test_the_audit_verdict_finds_double_training_losses_and_groups_never_accepted():
    from meshrl.pipeline.audit import check

    def rec(accepted=(), trained=(), dropped=()):
        return {"kind": "audit", "accepted": [list(a) for a in accepted], "trained": [list(t) for t in trained],
                "dropped": [list(d) for d in dropped]}

    good = [rec(accepted=[(0, 2), (1, 2), (2, 2)]), rec(trained=[(0, 2)], dropped=[(1, 2)]), {"kind": "step"}]
    assert check(good, {2: 2}) == {"trained_samples": 2, "accepted_samples": 6, "dropped_samples": 2,
                                   "trained_twice": [], "lost": [], "unaccounted": [], "ok": True}
    bad = good + [rec(accepted=[(3, 2)], trained=[(0, 2), (4, 2)])]
    verdict = check(bad, {})
    assert (verdict["trained_twice"], verdict["lost"], verdict["unaccounted"], verdict["ok"]) == ([0], [2, 3], [0, 4], False)


# -- capacity, waits, close ------------------------------------------------------------------


def test_put_blocks_past_capacity_until_get_frees_tokens():
    async def main():
        q = make(4, 2, capacity_tokens=12)
        r = await q.reserve(6, timeout=0)
        await q.put(group(0, 2, 0, tokens=4), r.id)  # 8 tokens
        with pytest.raises(ValueError, match="never fit capacity_tokens=12"):
            await q.put(group(9, 2, 0, tokens=8), r.id)
        with pytest.raises(QueueTimeout, match="capacity_tokens=12") as e:
            await q.put(group(1, 2, 0, tokens=4), r.id, timeout=0.02)
        assert "get_batch()" in str(e.value)
        blocked = asyncio.create_task(q.put(group(1, 2, 0, tokens=4), r.id, timeout=5))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await q.get_batch(2, 0, timeout=0)
        await blocked
        m = await q.metrics()
        assert m["queued_tokens"] == 8 and m["put_wait_s"] > 0

    run(main())


def test_groups_put_in_pieces_complete_though_capacity_is_full():
    """Capacity full of half-put groups: get_batch cannot free it (it takes whole groups only), so
    the puts that complete them must not wait for it, or producers and trainer wait on each other."""
    async def main():
        q = make(1, 4, capacity_tokens=16)
        ra, rb = await q.reserve(2, timeout=0), await q.reserve(2, timeout=0)
        a, b = group(0, 2, 0, tokens=8), group(1, 2, 0, tokens=8)
        await q.put(a[:1], ra.id)
        await q.put(b[:1], rb.id)  # 16 of 16 tokens, no group complete
        rc = await q.reserve(2, timeout=0)
        with pytest.raises(QueueTimeout, match="capacity_tokens=16"):  # a new group still waits
            await q.put(group(2, 1, 0, tokens=8), rc.id, timeout=0.02)
        taken = asyncio.create_task(q.get_batch(4, 0, timeout=5))
        await q.put(a[1:], ra.id, timeout=0.5)
        await q.put(b[1:], rb.id, timeout=0.5)
        assert sorted(s.group_id for s in await taken) == [0, 0, 1, 1]

    run(main())


def test_mixed_group_sizes_take_a_batch_that_adds_up():
    """Sizes 2 then 4 with n = 4: the oldest-first pick takes the 2 and falls short, but the 4 alone
    is a batch; get_batch must not wait for more."""
    async def main():
        q = make(1, 4)
        r = await q.reserve(8, timeout=0)
        await q.put(group(0, 2, 0), r.id)
        await q.put(group(1, 4, 0), r.id)
        assert {s.group_id for s in await q.get_batch(4, 0, timeout=0)} == {1}
        await q.put(group(2, 2, 0), r.id)
        assert {s.group_id for s in await q.get_batch(4, 0, timeout=0)} == {0, 2}  # oldest first again
        assert (await q.metrics())["depth_samples"] == 0

    run(main())


def test_get_batch_waits_for_put_and_timeout_message():
    async def main():
        q = make(1, 4)
        r = await q.reserve(4, timeout=0)
        getter = asyncio.create_task(q.get_batch(4, 0, timeout=5))
        await asyncio.sleep(0.01)
        await q.put(group(0, 2, 0), r.id)
        await asyncio.sleep(0.01)
        assert not getter.done()
        await q.put(group(1, 2, 0), r.id)
        assert len(await getter) == 4
        with pytest.raises(QueueTimeout) as e:
            await q.get_batch(4, 0, timeout=0.02)
        msg = str(e.value)
        assert "get_batch(n=4, current_version=0)" in msg and "put()" in msg
        assert "0 reserved but not yet put" in msg

    run(main())


def test_close_wakes_every_waiter_with_queue_closed():
    async def main():
        q = make(0, 2)
        await q.reserve(2, timeout=0)
        waiters = [asyncio.create_task(q.reserve(1, timeout=5)),
                   asyncio.create_task(q.get_batch(2, 0, timeout=5))]
        await asyncio.sleep(0.01)
        await q.close()
        for w in waiters:
            with pytest.raises(QueueClosed, match="closed while waiting"):
                await w
        with pytest.raises(QueueClosed, match="not taken"):
            await q.put(group(0, 2, 0), 0)

    run(main())


# -- wire and snapshots -----------------------------------------------------------------------


def test_encoded_and_plain_paths_carry_the_same_samples():
    async def main():
        q = make(2, 4)
        r = await q.reserve(8, timeout=0)
        a, b = group(0, 4, 0), group(1, 4, 1)
        for s in a + b:
            s.token_versions = [s.behavior_version] * len(s.response_ids)
            s.reward_info = {"correct": 1.0}
        await q.put_encoded(encode_samples(a), r.id)
        await q.put(b, r.id)
        mixed = decode_samples(await q.get_batch_encoded(8, 1, timeout=0))
        assert mixed == a + b
        assert (await q.metrics())["queued_tokens"] == 0

    run(main())


def test_snapshot_restore_keeps_samples_reservations_counters_and_order():
    async def main():
        q = make(2, 2)
        await q.set_version(1)
        r = await q.reserve(6, timeout=0)
        g0, g1, g2 = group(0, 2, 1), group(1, 2, 1), group(2, 2, 1)
        await q.put_encoded(encode_samples(g1), r.id)
        await q.put(g0 + g2[:1], r.id)
        await q.get_batch(2, 1, timeout=0)  # g1 (completed first)
        blob = await q.snapshot()
        q2 = make(2, 2)
        outstanding = await q2.restore(blob)
        assert [o.id for o in outstanding] == [r.id]
        before, after = await q.metrics(), await q2.metrics()
        before.pop("throughput_samples_per_s"), after.pop("throughput_samples_per_s")
        assert before == after
        await q2.put(g2[1:], r.id)  # the restored reservation is filled under its old id
        assert [s.prompt_id for s in await q2.get_batch(4, 1, timeout=0)] == [s.prompt_id for s in g0 + g2]
        with pytest.raises(ValueError, match="fresh SampleQueue"):
            await q2.restore(blob)
        with pytest.raises(ValueError, match="not a SampleQueue snapshot"):
            await make().restore(b"nonsense")
        assert msgspec.msgpack.decode(blob)["format"] == 1

    run(main())


def test_metrics_report_waits_depth_and_throughput():
    async def main():
        q = make(1, 2)
        for v in range(3):
            r = await q.reserve(2, timeout=0)
            await q.put(group(v, 2, v), r.id)
            await q.get_batch(2, v, timeout=0)
            await q.set_version(v + 1)
        m = await q.metrics()
        assert m["samples_consumed"] == 6 and m["throughput_samples_per_s"] > 0
        assert m["staleness_mean"] == 0 and m["reservations_outstanding"] == 0
        assert all(isinstance(v, float) for v in m.values())

    run(main())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 8))
def test_shares_are_contiguous_cover_every_group_and_cut_near_equal_tokens(tokens, ranks):
    """parcels.share_groups: one contiguous run per rank, in order, covering every group once; every
    rank gets a group while there are enough (else the first ranks one each); each cut is the group
    boundary nearest its ideal share among those that leave every rank a group."""
    from meshrl.queues.parcels import share_groups

    runs = share_groups(tokens, ranks)
    assert len(runs) == ranks and runs[0].start == 0 and runs[-1].stop == len(tokens)
    assert all(a.stop == b.start for a, b in zip(runs, runs[1:]))
    if len(tokens) < ranks:
        assert [len(r) for r in runs] == [1] * len(tokens) + [0] * (ranks - len(tokens))
        return
    assert all(len(r) >= 1 for r in runs)
    total = sum(tokens)
    for k, r in enumerate(runs[1:], start=1):
        # the boundary nearest the ideal among those that leave every rank a group
        allowed = range(runs[k - 1].start + 1, len(tokens) - (ranks - k) + 1)
        ideal = total * k / ranks
        best = min(abs(sum(tokens[:j]) - ideal) for j in allowed)
        assert r.start in allowed and abs(sum(tokens[: r.start]) - ideal) == best

"""Hypothesis state machines over SampleQueue: random interleavings against a small model.

``QueueMachine`` drives reserve, put (including slow engines whose samples are already old),
get_batch, version publishes, cancel and snapshot/restore in any order, and checks after every
step: no sample lost or duplicated, no consumed sample past ``max_staleness`` unless kept and
counted, groups never split, ``capacity_tokens`` exceeded only by groups completing, eta = 0 strictly on-policy, and
the exact batch the oldest-first rule predicts. ``test_in_order_producers_never_lose_work``
checks the admission promise itself: producers that generate at the version they were granted
and fill reservations in order never have a sample dropped as stale.

Every call uses ``timeout=0`` so a wait that the model says must fail fails at once.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from meshrl.queues import QueueConfig, QueueTimeout, Sample, SampleQueue, encode_samples


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.q: SampleQueue | None = None

    def teardown(self) -> None:
        self.loop.close()

    def call(self, coro):
        return self.loop.run_until_complete(coro)

    @initialize(eta=st.integers(0, 3), policy=st.sampled_from(["drop", "keep"]),
                g=st.sampled_from([1, 2, 3]), k=st.integers(1, 3), spv=st.integers(1, 2),
                cap_groups=st.integers(1, 8))
    def setup(self, eta, policy, g, k, spv, cap_groups):
        self.eta, self.policy, self.g, self.sps, self.spv = eta, policy, g, g * k, spv
        self.spv_samples = self.sps * spv
        self.cap = cap_groups * g * 6  # room for cap_groups groups of the largest samples
        self.config = QueueConfig(max_staleness=eta, stale_policy=policy, capacity_tokens=self.cap)
        self.q = SampleQueue(self.config, samples_per_step=self.sps, steps_per_version=spv)
        self.v_pub = self.steps = self.pos = 0
        self.res: dict[int, dict] = {}  # id -> n, filled, min_version, open (gid or None)
        self.groups: dict[int, dict] = {}  # gid -> uids, versions, tokens, size, order, rid
        self.next_gid = self.next_uid = self.order = 0
        self.consumed: set[int] = set()
        self.dropped_stale = self.dropped_incomplete = self.kept_stale = self.put_count = 0

    # -- model helpers ---------------------------------------------------------------------

    @property
    def vt(self) -> int:
        """The trainer's version: it publishes every ``spv`` steps."""
        return self.steps // self.spv

    def queued(self) -> int:
        return sum(len(gr["uids"]) for gr in self.groups.values())

    def unfilled(self) -> int:
        return sum(r["n"] - r["filled"] for r in self.res.values())

    def tokens(self) -> int:
        return sum(gr["tokens"] for gr in self.groups.values())

    # -- rules -----------------------------------------------------------------------------

    @rule(n_groups=st.integers(1, 3))
    def reserve(self, n_groups):
        n = self.g * n_groups
        if n > (self.eta + 1) * self.spv_samples:
            with pytest.raises(ValueError):
                self.call(self.q.reserve(n, timeout=0))
            return
        live = self.queued() + self.unfilled()
        bound = (self.v_pub + self.eta + 1) * self.spv_samples
        if self.pos + live + n > bound:
            event("reserve refused by admission")
            with pytest.raises(QueueTimeout):
                self.call(self.q.reserve(n, timeout=0))
            return
        r = self.call(self.q.reserve(n, timeout=0))
        assert r.slots == (self.pos + live, self.pos + live + n)
        assert r.min_version == self.v_pub and r.train_version <= self.v_pub + self.eta
        self.res[r.id] = {"n": n, "filled": 0, "min_version": self.v_pub, "open": None}

    @precondition(lambda self: self.res)
    @rule(data=st.data(), encoded=st.booleans())
    def put(self, data, encoded):
        rid = data.draw(st.sampled_from(sorted(self.res)))
        r = self.res[rid]
        m = data.draw(st.integers(1, r["n"] - r["filled"]))
        # A slow engine may deliver samples made at any version since the grant.
        hi = max(r["min_version"], self.vt)
        samples, plan = [], []
        open_gid = r["open"]
        for _ in range(m):
            if open_gid is None:
                open_gid = self.next_gid
                self.next_gid += 1
                plan.append(("new", open_gid))
            tok = data.draw(st.integers(2, 6))
            ver = data.draw(st.one_of(st.just(r["min_version"]), st.integers(r["min_version"], hi)))
            samples.append(Sample(prompt_id=self.next_uid, group_id=open_gid, group_size=self.g,
                                  prompt_ids=[7] * (tok // 2), response_ids=[8] * (tok - tok // 2),
                                  behavior_logprobs=[-1.0] * (tok - tok // 2), behavior_version=ver))
            self.next_uid += 1
            have = sum(1 for s in samples if s.group_id == open_gid)
            have += len(self.groups[open_gid]["uids"]) if open_gid in self.groups else 0
            if have == self.g:
                open_gid = None
        tokens = sum(s.num_tokens for s in samples)
        put = (self.q.put_encoded(encode_samples(samples), rid, timeout=0) if encoded
               else self.q.put(samples, rid, timeout=0))
        if tokens > self.cap:
            with pytest.raises(ValueError, match="never fit"):
                self.call(put)
            return
        # a put that only adds to queued groups is never held: only their completion lets get_batch free room
        continues = all(s.group_id in self.groups for s in samples)
        if continues and self.tokens() + tokens > self.cap:
            event("put completing queued groups past capacity")
        elif self.tokens() + tokens > self.cap:
            event("put blocked by capacity")
            with pytest.raises(QueueTimeout, match="capacity_tokens"):
                self.call(put)
            return
        self.call(put)
        self.put_count += m
        event("put accepted")
        for s in samples:
            gr = self.groups.setdefault(s.group_id, {"uids": [], "versions": [], "tokens": 0,
                                                     "size": self.g, "order": None, "rid": rid})
            gr["uids"].append(s.prompt_id)
            gr["versions"].append(s.behavior_version)
            gr["tokens"] += s.num_tokens
            if len(gr["uids"]) == self.g:
                gr["order"] = self.order
                self.order += 1
        r["filled"] += m
        r["open"] = open_gid
        if r["filled"] == r["n"]:
            assert open_gid is None
            del self.res[rid]

    @rule()
    def put_to_unknown_reservation(self):
        s = Sample(prompt_id=-1, group_id=-1, group_size=1, prompt_ids=[1], response_ids=[2],
                   behavior_logprobs=[0.0], behavior_version=0)
        with pytest.raises(ValueError, match="not outstanding"):
            self.call(self.q.put([s], 10_000 + len(self.res), timeout=0))

    @rule()
    def get_batch(self):
        vt, n = self.vt, self.sps
        self.pos = max(self.pos, vt * self.spv_samples)
        complete = {gid: gr for gid, gr in self.groups.items() if gr["order"] is not None}
        stale = {gid for gid, gr in complete.items() if vt - min(gr["versions"]) > self.eta}
        if self.policy == "drop":
            for gid in stale:
                event("stale group dropped")
                self.dropped_stale += len(self.groups.pop(gid)["uids"])
                del complete[gid]
        line = sorted(complete, key=lambda gid: (min(complete[gid]["versions"]), complete[gid]["order"]))
        if len(line) * self.g < n:
            with pytest.raises(QueueTimeout, match="get_batch"):
                self.call(self.q.get_batch(n, vt, timeout=0))
            return
        expected = line[: n // self.g]
        batch = self.call(self.q.get_batch(n, vt, timeout=0))
        assert [s.prompt_id for s in batch] == [u for gid in expected for u in self.groups[gid]["uids"]]
        # Groups whole, none seen before; nothing past the bound unless kept and counted.
        for gid in expected:
            assert sum(1 for s in batch if s.group_id == gid) == self.g
        uids = {s.prompt_id for s in batch}
        assert len(uids) == n and not uids & self.consumed
        self.consumed |= uids
        for s in batch:
            assert s.behavior_version <= vt
            if self.policy == "drop":
                assert vt - s.behavior_version <= self.eta
                if self.eta == 0:
                    assert s.behavior_version == vt  # strictly on-policy
        self.kept_stale += sum(self.g for gid in expected if gid in stale)
        event(f"get_batch served ({'stale kept' if set(expected) & stale else 'fresh'})")
        for gid in expected:
            del self.groups[gid]
        self.pos += n
        self.steps += 1

    @precondition(lambda self: self.v_pub < self.vt)
    @rule(data=st.data())
    def publish(self, data):
        v = data.draw(st.integers(self.v_pub + 1, self.vt))
        self.call(self.q.set_version(v))
        self.v_pub = v
        self.pos = max(self.pos, v * self.spv_samples)

    @rule()
    def trainer_jumps_a_version(self):
        """The trainer reports a later version than its consumption implies (resumed elsewhere)."""
        self.steps += self.spv

    @precondition(lambda self: self.res)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.res)))
        r = self.res.pop(rid)
        assert self.call(self.q.cancel(rid)) == r["n"] - r["filled"]
        if r["open"] is not None:
            self.dropped_incomplete += len(self.groups.pop(r["open"])["uids"])
        assert self.call(self.q.cancel(rid)) == 0

    @rule()
    def snapshot_restore(self):
        blob = self.call(self.q.snapshot())
        snap = msgspec.msgpack.decode(blob)
        assert {s["prompt_id"] for g in snap["groups"] for s in g["samples"]} == {
            u for gr in self.groups.values() for u in gr["uids"]}
        q2 = SampleQueue(self.config, samples_per_step=self.sps, steps_per_version=self.spv)
        outstanding = self.call(q2.restore(blob))
        assert sorted(r.id for r in outstanding) == sorted(self.res)
        before, after = self.call(self.q.metrics()), self.call(q2.metrics())
        before.pop("throughput_samples_per_s"), after.pop("throughput_samples_per_s")
        assert before == after
        self.q = q2

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def accounts_balance(self):
        if self.q is None:
            return
        m = self.call(self.q.metrics())
        # capacity is exceeded only by the later samples of groups whose first samples fitted
        assert m["queued_tokens"] == self.tokens() <= self.cap + (self.g - 1) * 6 * len(self.groups)
        assert m["depth_samples"] == self.queued()
        assert m["reserved_unfilled_samples"] == self.unfilled()
        assert m["reservations_outstanding"] == len(self.res)
        assert m["consumed_position"] == self.pos
        assert m["samples_consumed"] == len(self.consumed)
        assert (m["dropped_stale"], m["dropped_incomplete"], m["kept_stale"]) == (
            self.dropped_stale, self.dropped_incomplete, self.kept_stale)
        # Nothing lost, nothing made up: every sample put is consumed, queued or counted dropped.
        assert m["samples_put"] == self.put_count == (
            m["samples_consumed"] + m["depth_samples"] + m["dropped_stale"] + m["dropped_incomplete"])
        hist = sum(v for k, v in m.items() if k.startswith("staleness/"))
        assert hist == m["samples_consumed"]
        if self.policy == "drop":
            assert m["staleness_max"] <= self.eta


QueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestQueueMachine = QueueMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 3), g=st.sampled_from([1, 2, 4]), k=st.integers(1, 3), spv=st.integers(1, 3),
       script=st.lists(st.tuples(st.sampled_from(["reserve", "fill", "cancel", "train"]),
                                 st.integers(1, 4)), min_size=10, max_size=80))
def test_in_order_producers_never_lose_work(eta, g, k, spv, script):
    """Admission's promise: work generated at (or after) the granted version and delivered in
    grant order is never dropped as stale, whatever the interleaving of steps and cancels."""
    sps = g * k

    async def main():
        q = SampleQueue(QueueConfig(max_staleness=eta), samples_per_step=sps, steps_per_version=spv)
        pending: list = []  # granted reservations, filled in grant order
        steps = gid = 0
        for action, arg in script:
            if action == "reserve":
                try:
                    pending.append(await q.reserve(g * arg, timeout=0))
                except (QueueTimeout, ValueError):
                    pass
            elif action == "fill" and pending:
                r = pending.pop(0)
                # The engine generated with the weights of the grant, or with newer ones it
                # received since (which only makes the sample fresher).
                version = r.min_version if arg % 2 else steps // spv
                batch = [Sample(prompt_id=gid * g + i, group_id=gid + i // g, group_size=g,
                                prompt_ids=[1], response_ids=[2], behavior_logprobs=[0.0],
                                behavior_version=version) for i in range(r.n)]
                gid += r.n // g
                await q.put(batch, r.id, timeout=0)
            elif action == "cancel" and pending:
                await q.cancel(pending.pop(arg % len(pending)).id)
            elif action == "train":
                try:
                    batch = await q.get_batch(sps, steps // spv, timeout=0)
                except QueueTimeout:
                    continue
                assert all(steps // spv - s.behavior_version <= eta for s in batch)
                steps += 1
                if steps % spv == 0:  # publish; the engines apply it before the next grant
                    await q.set_version(steps // spv)
        m = await q.metrics()
        assert m["dropped_stale"] == 0 and m["kept_stale"] == 0
        assert m["staleness_max"] <= eta

    asyncio.run(main())

"""TorchEngine scheduling: continuous batching, seeds, stops, pause/abort/resume, versioned weight updates.

Invariants rather than golden values: a request's tokens do not depend on what shares its batch;
a weight update shows up exactly where the per-token versions flip.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig

torch.set_num_threads(1)
V = 80


def hf_model(seed: int = 0, tied: bool = True):
    # sharper logits than HF's init: greedy ties are then impossible in practice
    return tiny.hf_model(tiny.qwen2(vocab_size=V, hidden_size=64, tied=tied), seed=seed, sharp=6.0)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def engine(hf, **kw) -> TorchEngine:
    return TorchEngine.from_hf_model(hf, config=TorchEngineConfig(**{"max_batch_size": 4, "max_seq_len": 64, **kw}))


def req(prompt, rid="", **sp) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, request_id=rid,
                           sampling=SamplingParams(**{"max_new_tokens": 8, "temperature": 0, **sp}))


PROMPTS = [[5 + i, 9, 17 + 2 * i, 4] * (1 + i % 3) for i in range(9)]


async def wait_steps(eng: TorchEngine, n: int, timeout_s: float = 20.0) -> None:
    """Yield to the engine until it has run ``n`` more decode steps."""
    target = eng.steps + n
    async with asyncio.timeout(timeout_s):
        while eng.steps < target:
            await asyncio.sleep(0)


def test_results_do_not_depend_on_batch_composition(hf):
    """9 requests of different lengths on 4 rows equal each request run alone (greedy and seeded)."""
    reqs = [req(p, max_new_tokens=3 + i % 5) for i, p in enumerate(PROMPTS)]
    reqs += [req(p, temperature=1.0, seed=100 + i, max_new_tokens=6) for i, p in enumerate(PROMPTS[:4])]
    eng = engine(hf)
    together = asyncio.run(eng.generate(reqs))
    alone = [asyncio.run(engine(hf, max_batch_size=1).generate([r]))[0] for r in reqs]
    for a, b, r in zip(together, alone, reqs):
        assert a.completions[0].output_ids == b.completions[0].output_ids
        assert len(a.completions[0].output_ids) == r.sampling.max_new_tokens
        assert torch.allclose(torch.tensor(a.completions[0].logprobs), torch.tensor(b.completions[0].logprobs),
                              atol=1e-5)
    assert eng.num_running == 0 and eng.num_waiting == 0


def test_late_request_joins_the_running_batch(hf):
    async def main():
        eng = engine(hf)
        long = asyncio.create_task(eng.generate([req(PROMPTS[0], max_new_tokens=40)]))
        await wait_steps(eng, 5)
        late = await eng.generate([req(PROMPTS[1], max_new_tokens=4)])  # finishes while `long` still runs
        assert not long.done() and eng.num_running == 1
        return (await long)[0], late[0]

    long, late = asyncio.run(main())
    solo = asyncio.run(engine(hf).generate([req(PROMPTS[1], max_new_tokens=4), req(PROMPTS[0], max_new_tokens=40)]))
    assert late.completions[0].output_ids == solo[0].completions[0].output_ids
    assert long.completions[0].output_ids == solo[1].completions[0].output_ids


def test_n_samples_share_prefill_and_seeds_are_reproducible(hf):
    eng = engine(hf, max_batch_size=8)
    r = req(PROMPTS[2], temperature=1.0, n=4, seed=7, max_new_tokens=10)
    a, b = asyncio.run(eng.generate([r]))[0], asyncio.run(eng.generate([r, req(PROMPTS[3], n=3)]))[0]
    outs = [c.output_ids for c in a.completions]
    assert outs == [c.output_ids for c in b.completions]  # same seed, other company: same samples
    assert len({tuple(o) for o in outs}) == 4  # samples of one prompt differ from each other
    unseeded = asyncio.run(eng.generate([req(PROMPTS[2], temperature=1.0, n=4, max_new_tokens=10)]))[0]
    assert [c.output_ids for c in unseeded.completions] != outs


def test_stop_tokens_and_ignore_eos(hf):
    eng = engine(hf)
    free = asyncio.run(eng.generate([req(PROMPTS[4], max_new_tokens=10)]))[0].completions[0].output_ids
    stop = free[3]
    first = free.index(stop)
    c = asyncio.run(eng.generate([req(PROMPTS[4], max_new_tokens=10, stop_token_ids=(stop,))]))[0].completions[0]
    assert c.output_ids == free[: first + 1] and c.finish_reason == "stop"
    eos_engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=2, max_seq_len=64),
                                           eos_ids=[stop])
    c = asyncio.run(eos_engine.generate([req(PROMPTS[4], max_new_tokens=10)]))[0].completions[0]
    assert c.output_ids == free[: first + 1] and c.finish_reason == "stop"
    c = asyncio.run(eos_engine.generate([req(PROMPTS[4], max_new_tokens=10, ignore_eos=True)]))[0].completions[0]
    assert c.output_ids == free and c.finish_reason == "length"


def test_pause_abort_then_resume(hf):
    async def main():
        eng = engine(hf)
        task = asyncio.create_task(eng.generate([req(p, max_new_tokens=50) for p in PROMPTS[:6]]))
        await wait_steps(eng, 3)
        await eng.pause("abort")
        first = await task  # aborted requests come back at once, with their partial outputs
        assert eng.is_paused and eng.num_running == 0
        later = asyncio.create_task(eng.generate([req(PROMPTS[0], max_new_tokens=5)]))
        await asyncio.sleep(0.05)
        assert not later.done() and eng.num_waiting == 1  # paused: new work waits
        await eng.resume()
        return first, await asyncio.wait_for(later, 20)

    first, later = asyncio.run(main())
    reasons = [r.completions[0].finish_reason for r in first]
    assert reasons == ["abort"] * 6
    assert 1 <= len(first[0].completions[0].output_ids) < 50  # running: partial
    assert first[5].completions[0].output_ids == []  # never admitted (4 rows): empty
    assert later[0].completions[0].finish_reason == "length"


def test_pause_keep_resumes_in_place(hf):
    reqs = [req(p, max_new_tokens=30) for p in PROMPTS[:3]]
    expected = asyncio.run(engine(hf).generate(reqs))

    async def main():
        eng = engine(hf)
        task = asyncio.create_task(eng.generate(reqs))
        await wait_steps(eng, 4)
        await eng.pause("keep")
        steps = eng.steps
        await asyncio.sleep(0.05)
        assert eng.steps == steps and eng.num_running == 3 and not task.done()
        await eng.resume()
        return await asyncio.wait_for(task, 20)

    got = asyncio.run(main())
    assert [r.completions[0].output_ids for r in got] == [r.completions[0].output_ids for r in expected]


def test_abort_one_request(hf):
    async def main():
        eng = engine(hf)
        task = asyncio.create_task(eng.generate([req(PROMPTS[0], "keep-me", max_new_tokens=12),
                                                 req(PROMPTS[1], "drop-me", max_new_tokens=40)]))
        await wait_steps(eng, 2)
        await eng.abort("drop-me")
        await eng.abort("no-such-request")  # unknown ids are ignored, like SGLang's abort_request
        return await asyncio.wait_for(task, 20)

    kept, dropped = asyncio.run(main())
    assert kept.completions[0].finish_reason == "length" and len(kept.completions[0].output_ids) == 12
    assert dropped.completions[0].finish_reason == "abort" and len(dropped.completions[0].output_ids) < 40
    assert dropped.request_id == "drop-me"


def test_weight_update_flips_exactly_at_version_boundary():
    """New weights whose LM head is zero make every later greedy token 0 with log-prob -log(V).

    Staged weights are invisible: generation runs on version 0 between ``begin`` and ``end``.
    """
    a = hf_model(seed=0, tied=False)
    zero_head = {"lm_head.weight": torch.zeros(V, 64)}

    async def main():
        eng = TorchEngine.from_hf_model(a, config=TorchEngineConfig(max_batch_size=4, max_seq_len=64))
        task = asyncio.create_task(eng.generate([req(PROMPTS[0], max_new_tokens=30),
                                                 req(PROMPTS[1], max_new_tokens=30, n=2)]))
        await wait_steps(eng, 4)
        await eng.begin_weight_update()
        await eng.load_weights(zero_head)
        await wait_steps(eng, 3)  # staged, not visible: these steps still run version 0
        await eng.end_weight_update(1)
        assert eng.version == 1
        return await asyncio.wait_for(task, 20)

    res = asyncio.run(main())
    ref = asyncio.run(TorchEngine.from_hf_model(a, config=TorchEngineConfig(max_batch_size=4, max_seq_len=64))
                      .generate([req(PROMPTS[0], max_new_tokens=30), req(PROMPTS[1], max_new_tokens=30)]))
    for r, expect in zip(res, [ref[0], ref[1], ref[1]]):
        for c in r.completions:
            k = c.versions.index(1)
            assert c.versions == [0] * k + [1] * (30 - k) and k >= 7
            assert c.output_ids[:k] == expect.completions[0].output_ids[:k]
            assert c.output_ids[k:] == [0] * (30 - k)
            assert torch.allclose(torch.tensor(c.logprobs[k:]), torch.full((30 - k,), -torch.log(torch.tensor(V * 1.0))))
            assert c.behavior_version == 0


def test_update_weights_before_generation_equals_fresh_engine():
    a, b = hf_model(seed=0), hf_model(seed=5)
    eng = TorchEngine.from_hf_model(a, config=TorchEngineConfig(max_batch_size=2, max_seq_len=64))
    asyncio.run(eng.update_weights(list(b.state_dict().items()), version=3))
    got = asyncio.run(eng.generate([req(PROMPTS[0])]))[0].completions[0]
    fresh = asyncio.run(TorchEngine.from_hf_model(b, config=TorchEngineConfig(max_batch_size=2, max_seq_len=64))
                        .generate([req(PROMPTS[0])]))[0].completions[0]
    assert got.output_ids == fresh.output_ids and got.versions == [3] * 8


def test_generate_timeout_aborts_and_says_why(hf):
    async def main():
        eng = engine(hf, generate_timeout_s=0.2)
        await eng.pause("keep")
        with pytest.raises(TimeoutError, match=r"1 of 1 requests unfinished after 0.2s \(paused=True"):
            await eng.generate([req(PROMPTS[0])])
        assert eng.num_waiting == 0

    asyncio.run(main())


def test_pause_mode_is_checked(hf):
    with pytest.raises(ValueError, match="'abort' or 'keep'"):
        asyncio.run(engine(hf).pause("retract"))


def test_lagged_stop_checks_equal_synchronous_ones(hf):
    """CUDA reads each step's stop hits one step late; forced on here, results are the same: same
    tokens, finish reasons and versions, with stops at many steps, rows joining late, and an abort."""
    base = engine(hf)
    free = [r.completions[0].output_ids
            for r in asyncio.run(base.generate([req(p, max_new_tokens=12) for p in PROMPTS]))]
    reqs = [req(p, f"r{i}", max_new_tokens=12, stop_token_ids=(free[i][2 + i % 6],)) for i, p in enumerate(PROMPTS)]

    async def run(lagged: bool, abort_after: int | None):
        eng = engine(hf)
        eng._batch.lagged_stops = lagged
        extra = [req(PROMPTS[0], "long", max_new_tokens=40)] if abort_after else []
        task = asyncio.create_task(eng.generate(reqs[:3] + extra if abort_after else reqs))
        if abort_after:
            await wait_steps(eng, abort_after)
            await eng.abort("long")
        return await asyncio.wait_for(task, 20), eng.steps

    (sync, sync_steps), (lagged, lagged_steps) = asyncio.run(run(False, None)), asyncio.run(run(True, None))
    assert lagged_steps > sync_steps  # stopped rows ran one discarded step each time
    assert [r.completions[0].finish_reason for r in sync].count("stop") >= 6
    (sync_a, _), (lagged_a, _) = asyncio.run(run(False, 4)), asyncio.run(run(True, 4))
    for a, b in zip(sync + sync_a, lagged + lagged_a):
        ca, cb = a.completions[0], b.completions[0]
        if a.request_id == "long":  # aborted at a step count, which the lag may shift: prefixes agree
            n = min(len(ca.output_ids), len(cb.output_ids))
            assert ca.finish_reason == cb.finish_reason == "abort" and ca.output_ids[:n] == cb.output_ids[:n]
            continue
        assert (ca.output_ids, ca.finish_reason, ca.versions) == (cb.output_ids, cb.finish_reason, cb.versions)
        assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)  # other batch sizes: other rounding


def test_bad_values_fail_their_own_request_only(hf):
    """Wrong types and out-of-range ids are refused before they reach the running batch (where they would
    fail every request in flight); the request running meanwhile finishes untouched."""
    for kw, needle in [({"top_k": 2**70}, "top_k"), ({"max_new_tokens": True}, "max_new_tokens"),
                       ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"temperature": float("nan")}, "temperature"),
                       ({"stop_token_ids": (2**70,)}, "stop_token_ids"), ({"seed": -1}, "seed"),
                       ({"ignore_eos": 1}, "ignore_eos")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)

    async def main():
        eng = engine(hf)
        alone = (await eng.generate([req(PROMPTS[1], max_new_tokens=30)]))[0].completions[0]
        long = asyncio.ensure_future(eng.generate([req(PROMPTS[1], max_new_tokens=30)]))
        await wait_steps(eng, 2)
        for bad, needle in [(req(PROMPTS[0], stop_token_ids=(V,)), r"stop_token_ids \[80\] outside \[0, 80\)"),
                            (GenerateRequest(input_ids=[1, True]), "input_ids must be integers")]:
            with pytest.raises(ValueError, match=needle):
                await eng.generate([bad])
        assert (await long)[0].completions[0] == alone
        eng.release_memory()
        with pytest.raises(RuntimeError, match="memory is released"):
            await eng.generate([req(PROMPTS[0])])

    asyncio.run(main())


def test_tiny_temperature_decodes_greedily(hf):
    """Below 1e-6 (as in SGLang) a temperature means greedy: dividing by it would overflow to NaN log-probs."""
    async def main():
        eng = engine(hf)
        g, t = await eng.generate([req(PROMPTS[2], rid="g"), req(PROMPTS[2], rid="t", temperature=1e-320)])
        return g.completions[0], t.completions[0]

    g, t = asyncio.run(main())
    assert t.output_ids == g.output_ids and t.logprobs == g.logprobs
    assert all(lp == lp for lp in t.logprobs)


def test_dropping_all_requests_resets_the_batch(hf):
    """After a failed step the engine forgets every request: the batch's counters must go with them, or a
    later lone sampled request would be run as greedy ("all greedy" from a stale count)."""
    async def main():
        eng = engine(hf)
        sampled = req(PROMPTS[3], temperature=1.0, seed=11)
        before = (await eng.generate([sampled]))[0].completions[0]
        eng.cache.release()  # the prefill below fails for real (no KV memory), halfway through admitting
        with pytest.raises(RuntimeError, match="storage"):
            eng._batch.admit([(None, req(PROMPTS[0]), 0),
                              (None, req(PROMPTS[1], temperature=1.0, top_k=3, stop_token_ids=(5,)), 1)], 0)
        assert eng._batch.sampling_flags() == (True, False, True)
        eng._drop_all()  # what the step loop does when a step raises
        eng.restore_memory()
        b = eng._batch
        assert b.size == 0 and (b.n_greedy, b.n_filtered, b.n_stoppable) == (0, 0, 0)
        after = (await eng.generate([sampled]))[0].completions[0]
        assert after == before and len(set(after.output_ids)) > 1

    asyncio.run(main())


def test_a_second_begin_weight_update_is_refused(hf):
    async def main():
        eng = engine(hf)
        await eng.begin_weight_update()
        with pytest.raises(RuntimeError, match="already staging"):
            await eng.begin_weight_update()
        await eng.abort_weight_update()
        await eng.begin_weight_update()  # after an abort a new update may start
        await eng.end_weight_update(1)
        assert eng.version == 1

    asyncio.run(main())


def test_the_uniform_draw_is_never_one_and_top_k_1_is_greedy(hf):
    """The draw is in (0, 1): at 1.0 the inverse-CDF pick ran past the kept tokens to the last one of the
    vocabulary (the least likely after sorting), whatever top-k said. Seed 805209 hit 1.0 at output
    column 4 with the old 24-bit draw; over 2**22 draws of the new one, none reaches 0 or 1, and the
    host (numpy) and device (torch) hashes agree."""
    import numpy as np

    from meshrl.engines.sampling import mix_seed, uniform, uniform_np

    seeds = np.full(2**22, mix_seed(805209, 0), dtype=np.uint64)
    cols = np.arange(2**22, dtype=np.uint64)
    u = uniform_np(seeds, cols)
    assert u.dtype == np.float32 and 0 < u.min() and u.max() < 1
    assert np.array_equal(uniform(torch.from_numpy(seeds[:4096].astype(np.int64)),
                                  torch.from_numpy(cols[:4096].astype(np.int64))).numpy(), u[:4096])

    async def main():
        eng = engine(hf)
        greedy, top1 = await eng.generate([req(PROMPTS[0], rid="g"),
                                           req(PROMPTS[0], rid="k", temperature=1.0, top_k=1, seed=805209)])
        return greedy.completions[0].output_ids, top1.completions[0].output_ids

    greedy, top1 = asyncio.run(main())
    assert top1 == greedy


def test_plain_python_values_from_numpy_and_lists(hf):
    """A numpy seed passed the checks, then overflowed the seed hash inside the step loop and failed
    every request in flight; a list of stop ids failed generate with a bare TypeError."""
    import numpy as np

    sp = SamplingParams(seed=np.int64(7), n=np.int32(2), top_p=np.float32(0.5), stop_token_ids=[np.int64(5)])
    assert type(sp.seed) is int and type(sp.n) is int and type(sp.top_p) is float and sp.stop_token_ids == (5,)
    with pytest.raises(ValueError, match="temperature must be finite"):
        SamplingParams(temperature=float("inf"))

    async def main():
        eng = engine(hf)
        seeded = GenerateRequest(input_ids=PROMPTS[0], sampling=SamplingParams(
            max_new_tokens=4, seed=np.uint32(7), stop_token_ids=[3]))
        same = GenerateRequest(input_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=4, seed=7, stop_token_ids=(3,)))
        a, b = await eng.generate([seeded, same])
        assert a.completions[0].output_ids == b.completions[0].output_ids
        for bad, needle in [(GenerateRequest(input_ids=np.array([1, 2])), "input_ids must be a list"),
                            (GenerateRequest(input_ids=[1], sampling=None), "sampling must be a SamplingParams")]:
            with pytest.raises(ValueError, match=needle):
                await eng.generate([bad])

    asyncio.run(main())


def test_automatic_ids_skip_a_callers_id_in_flight(hf):
    async def main():
        eng = engine(hf)
        mine = asyncio.ensure_future(eng.generate([req(PROMPTS[0], rid="req-0", max_new_tokens=30)]))
        await wait_steps(eng, 1)
        (auto,) = await eng.generate([req(PROMPTS[1])])
        assert auto.request_id != "req-0"
        assert (await mine)[0].request_id == "req-0"

    asyncio.run(main())


def test_a_bad_version_applies_nothing(hf):
    """update_weights raised on version=None only after the new weights were live, which then served
    as the old version: staleness and behaviour versions silently wrong."""
    other = hf_model(seed=1)

    async def main():
        eng = engine(hf)
        before = (await eng.generate([req(PROMPTS[0])]))[0].completions[0]
        for bad in (None, "v1", 1.5, True):
            with pytest.raises(ValueError, match="policy version must be an integer"):
                await eng.update_weights(other.state_dict().items(), bad)
        assert eng.version == 0 and not eng.is_updating
        after = (await eng.generate([req(PROMPTS[0])]))[0].completions[0]
        assert after.output_ids == before.output_ids and after.versions == [0] * len(after.versions)
        await eng.update_weights(other.state_dict().items(), 1)
        return (await eng.generate([req(PROMPTS[0])]))[0].completions[0]

    new = asyncio.run(main())
    fresh = asyncio.run(engine(other).generate([req(PROMPTS[0])]))[0].completions[0]
    assert new.output_ids == fresh.output_ids and new.versions == [1] * len(new.versions)


def test_from_hf_model_stops_on_the_generation_configs_eos_too(tmp_path):
    """from_pretrained read generation_config.json's EOS ids, from_hf_model ignored the model's
    generation_config: the same model stopped on different tokens depending on how it was loaded."""
    model = hf_model()
    model.config.eos_token_id = 3
    model.generation_config.eos_token_id = [3, 7]
    model.save_pretrained(tmp_path)
    assert TorchEngine.from_hf_model(model).eos_ids == TorchEngine.from_pretrained(str(tmp_path)).eos_ids == (3, 7)


# ---- generate_stream ---------------------------------------------------------------------------

async def _collect(eng: TorchEngine, r: GenerateRequest) -> tuple[list[list], list[list[int]]]:
    """Every delta of a stream, and each sample's tokens put back together."""
    deltas, ids = [], [[] for _ in range(r.sampling.n)]
    async for d in eng.generate_stream(r):
        deltas.append(d)
        ids[d.index] += d.output_ids
    return deltas, ids


@pytest.mark.parametrize("lagged", [False, True])
def test_stream_deltas_add_up_to_the_completions(hf, lagged):
    """Streamed with other requests running, stop tokens (checked a step late when ``lagged``) and a
    weight flip mid-stream: each sample's deltas add up to its ``generate`` completion, only its last
    delta has a finish reason, and no delta holds a token past a stop."""
    free = asyncio.run(engine(hf).generate([req(p, max_new_tokens=16) for p in PROMPTS[:3]]))
    stops = [(r.completions[0].output_ids[3 + 2 * i],) for i, r in enumerate(free)]
    reqs = [req(p, f"s{i}", max_new_tokens=16, temperature=0.9, seed=i, n=2, stop_token_ids=stops[i])
            for i, p in enumerate(PROMPTS[:3])]
    other = hf_model(seed=1).state_dict()

    async def run(stream: bool):
        eng = engine(hf, max_batch_size=8, stream_interval_steps=2)
        eng._batch.lagged_stops = lagged
        busy = asyncio.create_task(eng.generate([req(PROMPTS[5], "busy", max_new_tokens=30, ignore_eos=True)]))
        await wait_steps(eng, 2)
        tasks = [asyncio.create_task(_collect(eng, r) if stream else eng.generate([r])) for r in reqs]
        await wait_steps(eng, 5)
        await eng.update_weights(other.items(), version=1)
        out = [await asyncio.wait_for(t, 20) for t in tasks]
        await busy
        return out

    plain, streamed = asyncio.run(run(False)), asyncio.run(run(True))
    flipped = 0
    for [res], (deltas, ids) in zip(plain, streamed):
        assert ids == [c.output_ids for c in res.completions]
        for j, c in enumerate(res.completions):
            mine = [d for d in deltas if d.index == j]
            assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [c.finish_reason]
            assert sum((d.versions for d in mine), []) == c.versions
            assert sum((d.logprobs for d in mine), []) == pytest.approx(c.logprobs, abs=1e-5)
            if c.finish_reason == "stop":
                assert all(c.output_ids[-1] not in d.output_ids for d in mine[:-1])
            flipped += len(set(c.versions)) > 1
            if len(c.output_ids) >= 8:
                assert len(mine) > 2  # several reads, not one at the end
    assert flipped  # some sample has tokens of both versions


def test_leaving_a_stream_early_aborts_it_and_waiting_aborts_end_it(hf):
    async def main():
        eng = engine(hf)
        r = req(PROMPTS[0], "early", max_new_tokens=40, ignore_eos=True)
        async with contextlib.aclosing(eng.generate_stream(r)) as stream:
            async for _ in stream:
                break
        left_running = eng.num_running
        async with contextlib.aclosing(eng.generate_stream(req(PROMPTS[2], "unread", max_new_tokens=40))):
            pass  # closed before its first read: aborted all the same
        unread = eng.is_running("unread")
        await eng.pause("keep")
        stream = eng.generate_stream(req(PROMPTS[1], "waiting", n=2))
        await eng.abort("waiting")  # never admitted: both samples end at once, as aborts
        ended = [d async for d in stream]
        with pytest.raises(ValueError, match="outside"):
            eng.generate_stream(req([V + 5], "bad"))  # checked at the call, not at the first delta
        return left_running, eng.is_running("early") or unread, ended

    left_running, still, ended = asyncio.run(main())
    assert left_running == 0 and not still
    assert sorted((d.index, d.finish_reason, d.output_ids) for d in ended) == [(0, "abort", []), (1, "abort", [])]

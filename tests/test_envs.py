"""Environments: tool-call parsing, ToolEnv, and the episode runner on a real TorchEngine.

The runner must record exactly which tokens the policy produced: behaviour log-probs equal to the
model's own log-probs of those tokens in the full context, loss mask 0 and log-prob 0.0 on
environment text; and the trainer must ignore the masked tokens in its ratios and losses. An
environment that misbehaves fails only its own episode, and no NaN or non-number reaches a sample.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.reward import RolloutJob, score_job
from meshrl.actors.train_step import PolicyUpdater, build_step_batch
from meshrl.engines import SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.envs import EpisodeConfig, EpisodeRequest, StepResult, ToolEnv, calculator, parse_tool_call, run_episode, run_episodes
from meshrl.envs.base import as_step_result, call_env
from meshrl.modeling import pack, response_logprobs
from meshrl.queues import QueueConfig, SampleQueue, decode_samples
from meshrl.tasks import AdditionTask, Problem

torch.set_num_threads(1)
PROBLEM = Problem(id=7, prompt="12+30=", answer="42")


@pytest.fixture(scope="module")
def model_dir(tiny_model_2l):
    return tiny_model_2l


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def engine(model_dir) -> TorchEngine:
    return TorchEngine.from_pretrained(model_dir, TorchEngineConfig(max_batch_size=16))


def test_tool_calls_are_parsed_and_run():
    assert parse_tool_call("so <calc> 23*47 </calc> then", {"calc": calculator}) == msgspec.convert(
        {"name": "calc", "arguments": "23*47", "start": 3}, type=type(parse_tool_call("<calc>1</calc>", ["calc"])))
    assert parse_tool_call("<calc>1+1</search>", ["calc", "search"]) is None  # tags must match
    assert parse_tool_call("<calc>1+1", ["calc"]) is None and parse_tool_call("<x>1</x>", ["calc"]) is None
    assert parse_tool_call("<search>a</search><calc>2</calc>", ["calc", "search"]).name == "search"  # the first call
    assert [calculator(e) for e in ("23*47", "7/2", "-(3+4)*2", "2**10", "8/4")] == ["1081", "3.5", "-14", "1024", "2"]
    for bad, msg in (("__import__('os')", "unsupported"), ("1/0", "division by zero"), ("2**99999", "too large"), ("1+", "not an")):
        with pytest.raises(ValueError, match=msg):
            calculator(bad)

    env = ToolEnv.factory({"calc": calculator}, result_format="={}.", max_calls=1)(PROBLEM)
    assert env.stop == ("</calc>",) and env.reset() == "12+30="
    assert env.step("<calc>12+30</calc>") == StepResult("=42.", 0.0, False, {"tool_calls": 1.0, "tool_used": 1.0})
    assert env.step("<calc>1+1</calc>").done  # max_calls reached: the episode ends
    assert ToolEnv(PROBLEM, {"calc": calculator}).step("<calc>1/0</calc>").observation == "<result>error: calculator: division by zero</result>"
    assert ToolEnv(PROBLEM, {"calc": calculator}).step("42").done
    with pytest.raises(ValueError, match="identifiers"):
        ToolEnv(PROBLEM, {"my tool": calculator})


class Scripted:
    """Answers every turn with a fixed observation and reward; done after ``turns`` turns."""

    def __init__(self, problem: Problem, turns: int = 3, fail_at: int | None = None) -> None:
        self.problem, self.turns, self.fail_at, self.actions = problem, turns, fail_at, []

    async def reset(self) -> str:  # async and sync methods both work
        return self.problem.prompt

    def step(self, action: str):
        self.actions.append(action)
        if self.fail_at == len(self.actions):
            raise RuntimeError("the environment broke")
        return f"[obs {len(self.actions)}]", 0.25, len(self.actions) >= self.turns, {"turn": float(len(self.actions))}


def test_episode_masks_exactly_the_policy_tokens_and_their_logprobs_match_the_model(model_dir, tok):
    eng, hf = engine(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    env = Scripted(PROBLEM, turns=3)
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    ep = asyncio.run(run_episode(eng, tok, env, sampling, EpisodeConfig(), max_seq_len=64))
    obs = [tok.encode(f"[obs {i}]", add_special_tokens=False) for i in (1, 2)]
    assert ep.turns == 3 and len(env.actions) == 3 and ep.reward == pytest.approx(0.75) and ep.info == {"turn": 3.0}
    # policy turn (3 tokens, cut off) | obs 1 | policy | obs 2 | policy
    want_mask = ([1] * 3 + [0] * len(obs[0])) + ([1] * 3 + [0] * len(obs[1])) + [1] * 3
    assert ep.loss_mask == want_mask and ep.finish_reason == "length"  # the last turn was cut off
    assert ep.response_ids[3 : 3 + len(obs[0])] == obs[0] and ep.prompt_ids == tok.encode(PROBLEM.prompt)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
    assert env.actions[-1] == ep.final_text == tok.decode(ep.response_ids[-3:], skip_special_tokens=True)

    packed = pack([ep.prompt_ids], [ep.response_ids], pad_id=tok.pad_token_id, loss_masks=[ep.loss_mask])
    with torch.no_grad():
        ref = response_logprobs(hf(input_ids=packed.input_ids).logits, packed, temperature=1.0)[0]
    torch.testing.assert_close(torch.tensor(ep.logprobs), ref, atol=2e-4, rtol=0)  # policy tokens, in full context
    assert ref[torch.tensor(ep.loss_mask) == 0].abs().max() == 0

    # the same seed gives the same episode; limits end it early
    again = asyncio.run(run_episode(eng, tok, Scripted(PROBLEM, turns=3), sampling, EpisodeConfig(), max_seq_len=64))
    assert again.response_ids == ep.response_ids
    short = asyncio.run(run_episode(eng, tok, Scripted(PROBLEM, turns=9), sampling, EpisodeConfig(max_turns=2), max_seq_len=64))
    assert short.turns == 2 and short.finish_reason == "length" and sum(short.loss_mask) == 6
    cut = asyncio.run(run_episode(eng, tok, Scripted(PROBLEM, turns=9), sampling, EpisodeConfig(max_tokens=10), max_seq_len=64))
    assert len(cut.response_ids) == 10 and cut.finish_reason == "length"


def test_a_stop_string_ends_the_turn_only_when_complete(model_dir, tok):
    """Greedy decoding from a fixed prompt; the stop string is a bigram of that output whose
    last character also occurs earlier: the engine stops there first (a stop id), and the
    runner continues the turn until the whole string is at its end."""
    eng = engine(model_dir)
    free = asyncio.run(run_episode(eng, tok, Scripted(PROBLEM, turns=1), SamplingParams(max_new_tokens=24, temperature=0),
                                   EpisodeConfig(), max_seq_len=64))
    text = tok.decode(free.response_ids)
    candidates = [j for j in range(1, len(text)) if text[j] in text[:j] and text[j - 1 : j + 1] not in text[:j]]
    assert candidates, f"no usable stop string in the greedy output {text!r}"
    j = candidates[0]

    class StopEnv(Scripted):
        stop = (text[j - 1 : j + 1],)

    ep = asyncio.run(run_episode(eng, tok, StopEnv(PROBLEM, turns=1), SamplingParams(max_new_tokens=24, temperature=0),
                                 EpisodeConfig(), max_seq_len=64))
    assert tok.decode(ep.response_ids) == text[: j + 1] and ep.finish_reason == "stop"
    assert ep.logprobs == pytest.approx(free.logprobs[: j + 1], abs=1e-5)  # continuing leaves sampling unchanged


def test_environment_errors_mark_the_episode_and_groups_stay_whole(model_dir, tok):
    eng = engine(model_dir)

    class BadReset(Scripted):
        def reset(self):
            raise ValueError("no prompt today")

    def make(problem: Problem):
        return {0: BadReset(problem), 1: Scripted(problem, turns=3, fail_at=2)}.get(problem.id) or Scripted(problem, turns=1)

    problems = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(3)]
    reqs = [EpisodeRequest(problem=p, n=2, sampling=SamplingParams(max_new_tokens=3, seed=i)) for i, p in enumerate(problems)]
    groups = asyncio.run(run_episodes(eng, tok, make, reqs, EpisodeConfig(), max_seq_len=64))
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(e.failed and e.loss_mask == [0] and e.response_ids == [tok.eos_token_id] for e in groups[0])
    assert all(e.failed and e.turns == 2 and sum(e.loss_mask) == 6 for e in groups[1])  # kept what it generated
    assert not any(e.failed for e in groups[2])
    assert groups[2][0].response_ids != groups[2][1].response_ids  # each episode of a group has its own seed

    job = RolloutJob(problems=problems, prompt_ids=[g[0].prompt_ids for g in groups], results=[], group_ids=[10, 11, 12],
                     episodes=groups)
    scored = score_job(AdditionTask(1, num_test=5), tok, job)
    samples = decode_samples(scored.encoded)
    assert [s.reward_failed for s in samples] == [True] * 4 + [False] * 2 and scored.failures == 4
    assert [s.group_id for s in samples] == [10, 10, 11, 11, 12, 12] and all(s.group_size == 2 for s in samples)
    assert [(s.group_id, s.sample_index) for s in samples] == [(g, i) for g in (10, 11, 12) for i in (0, 1)]
    assert all(s.loss_mask == e.loss_mask for s, e in zip(samples, [e for g in groups for e in g]))
    assert scored.completion_tokens == sum(sum(e.loss_mask) for g in groups for e in g)  # policy tokens only


def test_trainer_ignores_masked_tokens_in_ratios_and_losses(model_dir, tok):
    """On-policy episode samples: ratios are 1 on policy tokens; whatever sits in the masked
    positions' behaviour log-probs changes nothing, and only policy tokens are counted."""
    eng = engine(model_dir)
    reqs = [EpisodeRequest(problem=Problem(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)), n=2,
                           sampling=SamplingParams(max_new_tokens=3, seed=i)) for i in range(3)]
    groups = asyncio.run(run_episodes(eng, tok, lambda p: Scripted(p, turns=2), reqs, EpisodeConfig(), max_seq_len=64))
    job = RolloutJob(problems=[r.problem for r in reqs], prompt_ids=[g[0].prompt_ids for g in groups], results=[],
                     group_ids=[0, 1, 2], episodes=groups)
    samples = decode_samples(score_job(AdditionTask(1, num_test=5), tok, job).encoded)
    for i, s in enumerate(samples):
        s.reward = float(i % 2)  # varied rewards: non-zero advantages

    def step(samples, placeholder: float) -> tuple[dict, torch.Tensor]:
        for s in samples:
            s.behavior_logprobs = [lp if m else placeholder for lp, m in zip(s.behavior_logprobs, s.loss_mask)]
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_pretrained(model_dir).train()
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        updater = PolicyUpdater(policy, None, AlgoConfig(advantage="grpo", samples_per_prompt=2), temperature=1.0,
                                max_new_tokens=64, tokens_per_microbatch=4096)
        batch = build_step_batch(samples, pad_id=tok.pad_token_id)
        assert batch.packed.num_response_tokens == sum(sum(s.loss_mask) for s in samples) == 6 * 6
        m = updater.step(batch, policy_optimizer=opt, critic_optimizer=None, max_grad_norm=1e9)
        return m, next(policy.parameters()).detach().clone()

    m0, w0 = step(samples, 0.0)
    m1, w1 = step(samples, -30.0)
    assert m0["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and m0["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert m0["clip_frac_low"] == m0["clip_frac_high"] == 0.0 and m0["grad_norm"] > 0
    for key in ("loss", "grad_norm", "ratio_mean", "mismatch_kl", "entropy"):
        assert m1[key] == m0[key], key
    torch.testing.assert_close(w1, w0, rtol=0, atol=0)


# ---- environments that misbehave: a wrong step result fails only its own episode, and never lets
# a NaN or a non-number reach the samples (it would kill the reward job or poison a group's advantages)

class Returns:
    """One policy turn answered with ``result`` (whatever it is)."""

    def __init__(self, problem: Problem, result) -> None:
        self.problem, self.result = problem, result

    def reset(self) -> str:
        return self.problem.prompt

    def step(self, action: str):
        return self.result


BAD = {
    0: StepResult(None, 0.0, False),  # no observation to append
    1: StepResult("", "1.0x", True),  # a reward that is not a number
    2: ("", 1.0, True, {"note": "fine"}),  # a metric that is not a number
    3: ("", float("nan"), True),  # NaN reward
    4: StepResult("", float("inf"), True),
}


def test_a_bad_step_result_fails_only_its_episode(model_dir, tok):
    eng = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(max_batch_size=16))
    problems = [Problem(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(6)]

    def make(problem: Problem):
        return Returns(problem, BAD.get(problem.id, ("", 0.5, True, {"ok": 1.0})))

    reqs = [EpisodeRequest(problem=p, n=2, sampling=SamplingParams(max_new_tokens=3, seed=i)) for i, p in enumerate(problems)]
    groups = asyncio.run(run_episodes(eng, tok, make, reqs, EpisodeConfig(), max_seq_len=64))
    assert [[e.failed for e in g] for g in groups] == [[True, True]] * 5 + [[False, False]]
    assert all(e.reward == 0.5 and e.info == {"ok": 1.0} for e in groups[5])

    job = RolloutJob(problems=problems, prompt_ids=[g[0].prompt_ids for g in groups], results=[],
                     group_ids=list(range(6)), episodes=groups)
    scored = score_job(AdditionTask(1, num_test=5), tok, job)
    samples = decode_samples(scored.encoded)
    assert scored.failures == 10 and [s.reward_failed for s in samples] == [True] * 10 + [False] * 2
    assert all(math.isfinite(s.reward) for s in samples) and all(math.isfinite(r) for r in scored.rewards)
    assert all(isinstance(v, float) for s in samples for v in s.reward_info.values())


def test_stop_none_means_no_stop_strings(model_dir, tok):
    eng = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(max_batch_size=4))

    class NoStops(Returns):
        stop = None

    ep = asyncio.run(run_episode(eng, tok, NoStops(Problem(0, "1+1=", "2"), ("", 1.0, True)),
                                 SamplingParams(max_new_tokens=3, seed=0), EpisodeConfig(), max_seq_len=64))
    assert not ep.failed and ep.reward == 1.0


def test_calculator_refuses_nested_powers_quickly():
    """Each exponent is small, but nested powers grow without bound; CPython computes them holding
    the GIL, so a policy's ``<calc>`` would stall the rollout worker past any env timeout."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="too large"):
        calculator("(((9**64)**64)**64)**64")
    assert time.monotonic() - t0 < 1.0
    assert calculator("(2**64)**64") == str(2**4096) and calculator("(-3)**5") == "-243"
    env = ToolEnv(Problem(0, "?", "?"), {"calc": calculator})
    assert env.step("<calc>((((9**64)**64)**64)**64)**64</calc>").observation == "<result>error: calculator: result is too large</result>"


def test_episodes_without_a_policy_token_are_accepted_by_the_queue(model_dir, tok):
    """A reset that raises (or a prompt that leaves no room) gives a failed episode with no policy
    token; its sample must still go into the queue, or the rollout loop (and the run) dies."""
    eng = TorchEngine.from_pretrained(model_dir, TorchEngineConfig(max_batch_size=4))

    class BadReset(Returns):
        def reset(self):
            raise ValueError("no prompt today")

    problems = [Problem(id=0, prompt="1+1=", answer="2"), Problem(id=1, prompt="2+2=", answer="4")]
    make = lambda p: BadReset(p, None) if p.id == 0 else Returns(p, ("", 1.0, True))  # noqa: E731
    reqs = [EpisodeRequest(problem=p, n=2, sampling=SamplingParams(max_new_tokens=3, seed=p.id)) for p in problems]
    groups = asyncio.run(run_episodes(eng, tok, make, reqs, EpisodeConfig(), max_seq_len=64))
    assert all(e.failed and e.policy_tokens == 0 for e in groups[0])
    assert all(e.behavior_version == eng.version for g in groups for e in g)
    job = RolloutJob(problems=problems, prompt_ids=[g[0].prompt_ids for g in groups], results=[], group_ids=[0, 1],
                     episodes=groups)
    scored = score_job(AdditionTask(1, num_test=5), tok, job)

    async def put() -> int:
        queue = SampleQueue(QueueConfig(max_staleness=0), samples_per_step=4, steps_per_version=1)
        reservation = await queue.reserve(4, timeout=0)
        await queue.put_encoded(scored.encoded, reservation.id, timeout=0)
        return len(await queue.get_batch(4, 0, timeout=0))

    assert asyncio.run(put()) == 4


# ---- environments that block or hang: every env call runs on a daemon thread of its own, bounded from
# its start; none holds the loop, a shared pool's thread, or the program's exit


def test_hung_sync_env_calls_hold_no_shared_thread_and_the_timeout_counts_the_call_only():
    """More hung ``step`` calls than the loop's default executor has threads: later env calls, any
    other ``asyncio.to_thread`` of that loop (the weight receive uses one) and ``asyncio.run``'s exit
    must not wait behind them. Many concurrent healthy calls, each far inside the timeout, must
    not fail for waiting for a thread."""
    release = threading.Event()
    pool = min(32, (os.cpu_count() or 1) + 4)  # the default executor's threads

    async def main() -> tuple:
        hung = await asyncio.gather(*(call_env(release.wait, timeout_s=0.3, what="step") for _ in range(pool)),
                                    return_exceptions=True)
        t0 = time.monotonic()
        healthy = await asyncio.gather(*(call_env(time.sleep, 0.3, timeout_s=1.0, what="step") for _ in range(5 * pool)),
                                       return_exceptions=True)
        healthy_s = time.monotonic() - t0
        other = await asyncio.wait_for(asyncio.to_thread(lambda: "weights received"), 2.0)
        return hung, healthy, healthy_s, other

    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(result=asyncio.run(main())), daemon=True)
    runner.start()
    try:
        runner.join(timeout=30)
        assert not runner.is_alive(), "asyncio.run did not return: it waits for the hung calls' threads"
        hung, healthy, healthy_s, other = out["result"]
    finally:
        release.set()
    assert all(isinstance(e, TimeoutError) and "env_timeout_s=0.3" in str(e) for e in hung)
    assert healthy == [None] * (5 * pool), [e for e in healthy if e is not None][:1]
    assert healthy_s < 1.0 and other == "weights received"


def test_the_factory_runs_off_the_loop_bounded_and_every_environment_is_closed_once(model_dir, tok):
    """A slow factory fails its own episode at env_timeout_s without stalling the event loop (the
    engine's); close() is called once per environment on every path: done, a raising step, a
    timed-out step (its close waits on the environment's thread behind the hung step and times out
    too: the episode still ends; it runs once the step returns), and an environment its factory
    made after its timeout (closed then, on the factory's thread)."""
    eng = engine(model_dir)
    release, closed, lock = threading.Event(), [], threading.Lock()

    class Env:
        def __init__(self, problem: Problem) -> None:
            self.problem = problem
            if problem.id == 0:
                time.sleep(2.0)  # e.g. starting a sandbox

        def reset(self) -> str:
            return self.problem.prompt

        def step(self, action: str):
            if self.problem.id == 2:
                raise RuntimeError("the environment broke")
            if self.problem.id == 3:
                release.wait()  # a sandbox that never answers
            return "", 1.0, True

        def close(self) -> None:
            with lock:
                closed.append(self.problem.id)
            if self.problem.id == 3:
                release.wait()  # and never shuts down either

    class AsyncClose(Env):
        async def close(self) -> None:
            await asyncio.sleep(0)
            closed.append(self.problem.id)

    make = lambda p: AsyncClose(p) if p.id == 1 else Env(p)  # noqa: E731
    reqs = [EpisodeRequest(problem=Problem(i, f"{i}+1=", "x"), n=1, sampling=SamplingParams(max_new_tokens=3, seed=i))
            for i in range(5)]

    async def main() -> tuple:
        stalls: list[float] = []

        async def heartbeat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                stalls.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        t0 = time.monotonic()
        groups = await asyncio.wait_for(run_episodes(eng, tok, make, reqs, EpisodeConfig(env_timeout_s=0.5), max_seq_len=64), 10)
        took = time.monotonic() - t0
        beat.cancel()
        return groups, took, max(stalls)

    try:
        groups, took, stall = asyncio.run(main())
        assert [e.failed for g in groups for e in g] == [True, False, True, True, False]
        assert took < 2.5 and stall < 0.5, (took, stall)  # 0.5 s step timeout + 0.5 s close timeout, loop free
        assert sorted(closed) == [1, 2, 4]  # the slow factory's environment does not exist yet; 3's step hangs
        release.set()  # 3's step returns: its close runs, on its thread
        deadline = time.monotonic() + 5
        while len(closed) < 5 and time.monotonic() < deadline:  # waits for: the slow factory to return
            time.sleep(0.05)
        assert sorted(closed) == [0, 1, 2, 3, 4]  # each once
    finally:
        release.set()


def test_a_prompt_or_stop_string_the_tokenizer_cannot_encode_fails_only_its_episode(model_dir, tok):
    """A stop string that encodes to no tokens has no last token, and a prompt that does has nothing
    to generate from; either fails its own episode (before: an IndexError or an empty engine request
    lost the whole batch). Characters a tokenizer lacks do that: transformers 5.2x's Qwen2Tokenizer
    drops them from the embedded character vocabulary (5.0 gave <unk>s), and so does any
    tokenizer for the empty string, which is what is sent here: the same in every version."""
    unknown = ""
    assert tok.encode(unknown, add_special_tokens=False) == [] and tok.encode(unknown) == []
    eng = engine(model_dir)

    class Good(Returns):
        def __init__(self, problem: Problem) -> None:
            super().__init__(problem, ("", 1.0, True))

    class LineEnv(Good):
        stop = (unknown,)

    class OddPrompt(Good):
        def reset(self) -> str:
            return unknown

    for bad in (LineEnv, OddPrompt):
        make = lambda p, bad=bad: bad(p) if p.id == 0 else Good(p)  # noqa: E731
        reqs = [EpisodeRequest(problem=Problem(i, f"{i}+1=", "x"), n=2, sampling=SamplingParams(max_new_tokens=3, seed=i))
                for i in range(3)]
        groups = asyncio.run(run_episodes(eng, tok, make, reqs, EpisodeConfig(), max_seq_len=64))
        assert [[e.failed for e in g] for g in groups] == [[True, True], [False, False], [False, False]], bad.__name__
        assert all(e.prompt_ids and e.policy_tokens == 0 for e in groups[0])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        from meshrl.envs.episode import _encoded

        _encoded(tok, unknown, "the stop string")


def test_done_must_be_a_bool():
    """``bool("false")`` is True: a done that is not a bool (numpy's included) is a malformed step,
    refused like a reward that is not a number, so the episode fails instead of ending by accident."""
    import numpy as np

    for done in ("false", "true", 0, 1, None, {"x": 1}, np.array([True])):
        with pytest.raises(TypeError, match="done must be a bool"):
            as_step_result(("obs", 0.0, done))
    with pytest.raises(TypeError, match="done must be a bool"):
        as_step_result(StepResult("obs", 0.0, "false"))
    assert as_step_result(("obs", 0.0, np.bool_(False))).done is False
    assert as_step_result(("obs", 0.0, np.array([1, 2]).all())).done is True
    assert as_step_result(StepResult("obs", 0.0, True)).done is True


def test_an_environment_bound_to_its_thread_works_across_its_episode(model_dir, tok):
    """An environment holding an object that only the thread which made it may use (sqlite's default
    connection; sync Playwright and GL contexts alike) ran each call on a new thread: its first step
    failed with sqlite's ProgrammingError. The factory and every sync method of one environment now
    run on that environment's own thread; other episodes run on threads of their own."""
    import sqlite3

    eng = engine(model_dir)
    threads: dict[int, set[int]] = {}

    class Ledger:
        def __init__(self, problem: Problem) -> None:
            self.problem, self.db = problem, sqlite3.connect(":memory:")
            self.db.execute("create table turns (action text)")
            self._saw()

        def _saw(self) -> None:
            threads.setdefault(self.problem.id, set()).add(threading.get_ident())

        def reset(self) -> str:
            self._saw()
            return self.problem.prompt

        def step(self, action: str):
            self._saw()
            self.db.execute("insert into turns values (?)", (action,))
            (turns,) = self.db.execute("select count(*) from turns").fetchone()
            return ("", 1.0, True) if turns == 2 else (" again:", 0.0, False)

        def close(self) -> None:
            self._saw()
            self.db.close()

    reqs = [EpisodeRequest(problem=Problem(i, f"{i}+1=", "x"), n=1, sampling=SamplingParams(max_new_tokens=3, seed=i))
            for i in range(3)]
    groups = asyncio.run(run_episodes(eng, tok, Ledger, reqs, EpisodeConfig(max_turns=3), max_seq_len=64))
    episodes = [e for g in groups for e in g]
    assert [e.failed for e in episodes] == [False] * 3 and [e.reward for e in episodes] == [1.0] * 3
    assert all(len(t) == 1 for t in threads.values()) and len(set.union(*threads.values())) == 3, threads

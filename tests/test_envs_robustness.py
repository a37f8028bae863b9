"""Environments that misbehave: a wrong step result fails only its own episode, and never lets a
NaN or a non-number reach the samples (where it would kill the reward job or poison a group's
advantages). A real TorchEngine plays the episodes."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from transformers import AutoTokenizer

from meshrl.actors.reward import RolloutJob, score_job
from meshrl.engines import SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.envs import EpisodeConfig, EpisodeRequest, StepResult, ToolEnv, calculator, run_episode, run_episodes
from meshrl.queues import QueueConfig, SampleQueue, decode_samples
from meshrl.tasks import AdditionTask, Problem

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_trainer_fsdp import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("envs_robust") / "model", layers=2, hidden=32)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


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
                     group_ids=list(range(6)), episodes=groups)  # fmt: skip
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
                                 SamplingParams(max_new_tokens=3, seed=0), EpisodeConfig(), max_seq_len=64))  # fmt: skip
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
                     episodes=groups)  # fmt: skip
    scored = score_job(AdditionTask(1, num_test=5), tok, job)

    async def put() -> int:
        queue = SampleQueue(QueueConfig(max_staleness=0), samples_per_step=4, steps_per_version=1)
        reservation = await queue.reserve(4, timeout=0)
        await queue.put_encoded(scored.encoded, reservation.id, timeout=0)
        return len(await queue.get_batch(4, 0, timeout=0))

    assert asyncio.run(put()) == 4

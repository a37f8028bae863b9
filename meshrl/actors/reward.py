"""The RewardWorker role: scores completions or episodes and builds the Samples the queue holds.

The reward is any ``meshrl.envs.Reward``: the task's own ``reward`` method, a plain function (sync
or async, per sample or batched), a remote ``HTTPReward`` or a ``MeshReward`` on a mesh. A reward
that raises, times out or returns a non-number marks its sample (``reward_failed``, reward 0) and
the run goes on; so does one too slow for its job (a job answers within its caller's timeout). An
environment episode's reward is the sum of its step rewards, plus the reward function's score of
its last policy turn when there is one; a failed episode gets 0, marked.
The worker returns the samples already encoded in the queue's wire format, so the controller only
forwards bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any, Sequence

import msgspec

from meshrl import faults
from meshrl.engines import GenerateResult
from meshrl.envs import Episode, Reward, as_reward
from meshrl.envs.reward_models import MeshReward
from meshrl.envs.rewards import FunctionReward, HTTPReward, WrongCount, to_reward_output, warn_limited
from meshrl.mesh import Actor, endpoint
from meshrl.queues import Sample, encode_samples
from meshrl.queues.wire import SampleMeta, meta_of
from meshrl.tasks import Problem, RewardOutput, Task

__all__ = ["RewardConfig", "RewardWorker", "RolloutJob", "Scored", "Scorer", "call_reward", "score_job",
           "score_job_with", "scoring_time_s"]

log = logging.getLogger(__name__)


class RewardConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_workers: int | None = None
    """Reward workers; jobs go to the least busy one. 0: each rollout worker scores its own
    generations in its own process (no reward process, no hop between the two): for rewards that
    cost little beside generation (exact match, a regex). null (the default): 0 for a reward that
    says it is quick and cannot hang (the built-in tasks' checks: ``quick_reward``,
    ``FunctionReward(inline=True)``), else 1 (a user's function, an HTTP scorer, a reward model, an
    environment's episodes: kept away from the engine, restarted on its own if it dies)."""
    timeout_s: float = 60.0
    """Longest call of a reward function: per sample, or per batch for a batched one; past it the
    samples are marked reward_failed (functions and scorers with their own timeout_s keep it). A
    whole job is bounded too: samples not scored within run.step_timeout_s (less a tenth, at most
    30 s) are marked, so a slow reward marks samples instead of ending the run."""

    inline_bytes: int = 65536
    """A request's samples whose encoded size is under this many bytes go on by value (through the
    process driving the run, as Ray sends any small message); larger ones stay in the reward
    worker's object store and go by reference, each trainer rank fetching its own. The driver then
    moves at most this much per request, however long the samples are. 0: always by reference."""

    def __post_init__(self) -> None:
        if (self.num_workers is not None and self.num_workers < 0) or not self.timeout_s > 0:
            raise ValueError(f"reward: need num_workers >= 0 and timeout_s > 0, got {self.num_workers}, {self.timeout_s}")
        if self.inline_bytes < 0:
            raise ValueError(f"reward.inline_bytes: must be >= 0, got {self.inline_bytes}")


class RolloutJob(msgspec.Struct, kw_only=True):
    """Everything needed to turn one generate call (or one batch of episodes) into samples."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    results: list[GenerateResult]
    """Single-turn generations, one per problem (empty for episodes)."""
    group_ids: list[int]
    """One per problem: the group id of its ``samples_per_prompt`` completions."""
    episodes: list[list[Episode]] = []
    """Environment episodes, one list per problem (empty for single-turn generations)."""


class Scored(msgspec.Struct, kw_only=True):
    encoded: bytes
    """The samples in the queue's wire format (empty when they went to the object store: ``ref``)."""
    rewards: list[float]
    info: dict[str, float]
    """Means of the reward functions' metrics over the job."""
    failures: int
    completion_tokens: int
    """Tokens the policy generated (environment text excluded)."""
    ref: list[Any] = []
    """``score(by_ref=True)``: ``[ObjectRef]`` of the encoded samples in Ray's object store, which
    the queue takes by reference (meshrl.queues.parcels)."""
    metas: list[SampleMeta] = []
    """What the queue schedules each sample by, in order."""
    received: float = 0.0
    """When the worker had the job's generations (``time.time()``): where generation ended, for
    a caller that passed them by reference."""

    def by_ref(self) -> "Scored":
        """The samples moved into Ray's object store as one blob (owned by this process: a worker
        that dies takes the blobs the queue holds with it, ``parcels.SamplesLost``): only its ref
        and the ``SampleMeta``s travel on with the scores. A blob holds whole groups, so the queue
        hands it to one trainer rank (``parcels.to_shares``)."""
        import ray

        return msgspec.structs.replace(self, encoded=b"", ref=[ray.put(self.encoded)])


def call_reward(task: Task, problem: Problem, completion: str) -> tuple[RewardOutput, bool]:
    """``task.reward`` guarded: a reward that raises gives 0 and ``failed=True`` (never raises)."""
    try:
        return to_reward_output(task.reward(problem, completion)), False  # a number, a RewardOutput or a dict
    except Exception as exc:  # a broken reward marks the sample; it must never stop the run
        warn_limited(task, type(exc).__name__, f"reward function failed on problem {problem.id}: "
                     f"{type(exc).__name__}: {str(exc)[:300]}", details=traceback.format_exc())
        return RewardOutput(reward=0.0), True


def _texts(tokenizer: Any, job: RolloutJob) -> tuple[list[Problem], list[str]]:
    """The problem and the text to score of every sample of ``job``, in sample order."""
    if job.episodes:
        pairs = [(p, e.final_text) for p, group in zip(job.problems, job.episodes) for e in group]
    else:
        pairs = [(p, tokenizer.decode(c.output_ids, skip_special_tokens=True))
                 for p, r in zip(job.problems, job.results) for c in r.completions]
    return [p for p, _ in pairs], [t for _, t in pairs]


def _build(job: RolloutJob, outs: Sequence[RewardOutput | None]) -> Scored:
    """Samples from ``job`` and one reward result per sample (None: the reward failed)."""
    samples, rewards, info_sums, failures, tokens = [], [], {}, 0, 0
    now, k = time.time(), 0
    for problem, prompt, group_id, i in zip(job.problems, job.prompt_ids, job.group_ids, range(len(job.problems))):
        items = job.episodes[i] if job.episodes else job.results[i].completions
        for index, item in enumerate(items):
            out = outs[k]
            k += 1
            if isinstance(item, Episode):
                failed = out is None or item.failed
                reward = 0.0 if failed else out.reward + item.reward
                info = {**item.info, **({} if out is None else out.info), "turns": float(item.turns)}
                versions, mask = item.versions, item.loss_mask
                fields = dict(prompt_ids=item.prompt_ids, response_ids=item.response_ids, behavior_logprobs=item.logprobs,
                              behavior_version=item.behavior_version, loss_mask=mask, finish_reason=item.finish_reason)
                tokens += item.policy_tokens
            else:
                failed, reward, info = out is None, 0.0 if out is None else out.reward, {} if out is None else out.info
                versions = item.versions
                fields = dict(prompt_ids=prompt, response_ids=item.output_ids, behavior_logprobs=item.logprobs,
                              behavior_version=item.behavior_version, finish_reason=item.finish_reason)
                tokens += len(item.output_ids)
            failures += failed
            samples.append(Sample(
                prompt_id=problem.id, group_id=group_id, group_size=len(items), sample_index=index, **fields,
                token_versions=versions if versions and min(versions) != max(versions) else None,
                reward=reward, reward_info=info, reward_failed=failed, t_generated=now,
            ))
            rewards.append(reward)
            for key, v in info.items():
                info_sums[key] = info_sums.get(key, 0.0) + v
    n = max(1, len(samples))
    return Scored(
        encoded=encode_samples(samples), metas=[meta_of(s) for s in samples], rewards=rewards,
        info={key: v / n for key, v in info_sums.items()},
        failures=failures, completion_tokens=tokens,
    )


def score_job(task: Task, tokenizer: Any, job: RolloutJob) -> Scored:
    """Decode every completion of ``job``, reward it with ``task.reward`` and build its ``Sample``."""
    problems, texts = _texts(tokenizer, job)
    outs = []
    for p, t in zip(problems, texts):
        out, failed = call_reward(task, p, t)
        outs.append(None if failed else out)
    return _build(job, outs)


async def _score(reward: Reward, problems: list[Problem], texts: list[str], timeout_s: float,
                 within_s: float | None = None) -> list[RewardOutput | None]:
    """``reward.score``, one result per completion (None: failed), within ``within_s`` when given.
    The library's rewards bound and mark each call themselves (a ``FunctionReward`` keeps what it
    scored within ``within_s``); a user's own ``Reward`` is bounded here by ``timeout_s`` too and,
    when it raises, times out or answers wrongly, its samples are marked: it never ends the run."""
    if isinstance(reward, FunctionReward):
        return list(await reward.score(problems, texts, within_s=within_s))
    own = isinstance(reward, (HTTPReward, MeshReward))
    name = repr(reward) if own else f"{type(reward).__name__}.score"
    limits = [s for s in (within_s, None if own else timeout_s) if s is not None]
    try:
        call = reward.score(problems, texts)
        scored = list(await (asyncio.wait_for(call, min(limits)) if limits else call))
        if len(scored) != len(texts):
            raise WrongCount(f"returned {len(scored)} results for {len(texts)} completions (one each expected)")
    except Exception as exc:  # TimeoutError included
        warn_limited(name, type(exc).__name__, f"{name} failed, so its {len(texts)} samples are marked reward_failed: "
                     f"{type(exc).__name__}: " + (str(exc)[:300] or f"no answer within {min(limits, default=0):g}s "
                                                  "(reward.timeout_s or the caller's timeout, whichever is shorter)"))
        return [None] * len(texts)
    outs: list[RewardOutput | None] = []
    for out in scored:
        try:
            outs.append(None if out is None else to_reward_output(out))
        except (TypeError, ValueError, ArithmeticError) as exc:
            warn_limited(name, "result", f"{name}: a result is marked reward_failed: {exc}")
            outs.append(None)
    return outs


def scoring_time_s(within_s: float) -> float:
    """What a reward may spend on a job whose caller waits ``within_s``: the rest (a tenth, at most
    30 s) decodes, builds and encodes the samples and carries them back before the caller gives up."""
    return within_s - min(30.0, 0.1 * within_s)


async def score_job_with(reward: Reward | None, tokenizer: Any, job: RolloutJob, timeout_s: float = 60.0, *,
                         within_s: float | None = None) -> Scored:
    """``score_job`` with any ``Reward``, or none (episodes: the environment's rewards only);
    episodes whose environment failed are not scored. ``timeout_s`` bounds a user's own ``Reward``;
    ``within_s``, the caller's timeout, bounds the whole job: samples the reward has not scored
    within ``scoring_time_s(within_s)`` are marked reward_failed (the warning names the reward)."""
    problems, texts = _texts(tokenizer, job)
    failed = [e.failed for group in job.episodes for e in group] if job.episodes else [False] * len(texts)
    todo = [i for i, f in enumerate(failed) if not f]
    outs: list[RewardOutput | None] = [None] * len(texts)
    if reward is None:
        if not job.episodes:
            raise ValueError("score_job_with: a single-turn job needs a reward")
        for i in todo:
            outs[i] = RewardOutput(reward=0.0)
    elif todo:
        budget = None if within_s is None else scoring_time_s(within_s)
        scored = await _score(reward, [problems[i] for i in todo], [texts[i] for i in todo], timeout_s, budget)
        for i, out in zip(todo, scored):
            outs[i] = out
    return _build(job, outs)


class RewardWorker(Actor):
    """Decodes completions and applies the reward (``score_job_with``); an async actor, so async
    rewards of several jobs overlap. ``reward``: what ``as_reward`` takes (a Task, a function, a
    Reward), or None for episodes scored by their environment alone."""

    def __init__(self, reward: Any, tokenizer_path: str, timeout_s: float = 60.0) -> None:
        from transformers import AutoTokenizer

        self.scorer = Scorer(reward, AutoTokenizer.from_pretrained(tokenizer_path), timeout_s)

    @endpoint
    async def score(self, job: RolloutJob, within_s: float | None = None, by_ref: bool | int = False,
                    results: list[GenerateResult] | None = None, episodes: list[list[Episode]] | None = None) -> Scored:
        """``within_s``: how long the caller waits for the scoring (its timeout); the job answers
        within it, marking the samples a slow reward has not scored by then, so a slow reward never
        ends the run. ``by_ref``: the samples stay in this node's object store (``Scored.by_ref``);
        a number: only if they encode to at least that many bytes.
        ``results`` / ``episodes``: the job's generations, when the caller passes the generate
        call's ref (``Future.ref``): Ray fetches them from the rollout worker's node for this call,
        so they never pass through the caller."""
        return await self.scorer.score(job, within_s, by_ref, results=results, episodes=episodes)


class Scorer:
    """A reward (what ``as_reward`` takes, or None for episodes scored by their environment alone)
    with the tokenizer that decodes for it: what scores a job in a reward worker, or with
    ``reward.num_workers=0`` in a rollout worker (``RolloutWorker.play_scored``)."""

    def __init__(self, reward: Any, tokenizer: Any, timeout_s: float) -> None:
        self.reward = None if reward is None else as_reward(reward, timeout_s=timeout_s)
        self.tokenizer, self.timeout_s = tokenizer, timeout_s

    async def score(self, job: RolloutJob, within_s: float | None = None, by_ref: bool | int = False, *,
                    results: list[GenerateResult] | None = None, episodes: list[list[Episode]] | None = None) -> Scored:
        """``RewardWorker.score``'s work (its docstring), in this process."""
        received = time.time()
        if results is not None:
            job.results = results
        if episodes is not None:
            job.episodes, job.prompt_ids = episodes, [group[0].prompt_ids for group in episodes]
        scored = await score_job_with(self.reward, self.tokenizer, job, self.timeout_s, within_s=within_s)
        scored.received = received
        faults.point("reward.score")
        by_ref = by_ref and len(scored.encoded) >= (by_ref if type(by_ref) is int else 0)
        return scored.by_ref() if by_ref else scored

"""The RewardWorker role: scores completions with the task's verifiable reward and builds Samples.

A reward function that raises marks its sample (``reward_failed``, reward 0) and the run goes on.
The worker returns the samples already encoded in the queue's wire format, so the controller only
forwards bytes.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Sequence

import msgspec

from meshrl.engines import GenerateResult
from meshrl.mesh import Actor, endpoint
from meshrl.queues import Sample, encode_samples
from meshrl.tasks import Problem, RewardOutput, Task

__all__ = ["RewardConfig", "RewardWorker", "RolloutJob", "Scored", "call_reward", "score_job"]

log = logging.getLogger(__name__)


class RewardConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_workers: int = 1
    """Reward workers; jobs go to the least busy one."""


class RolloutJob(msgspec.Struct, kw_only=True):
    """Everything needed to turn one generate call into samples."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    results: list[GenerateResult]
    group_ids: list[int]
    """One per problem: the group id of its ``samples_per_prompt`` completions."""


class Scored(msgspec.Struct, kw_only=True):
    encoded: bytes
    """The samples in the queue's wire format."""
    rewards: list[float]
    info: dict[str, float]
    """Means of the reward functions' metrics over the job."""
    failures: int
    completion_tokens: int


def call_reward(task: Task, problem: Problem, completion: str) -> tuple[RewardOutput, bool]:
    """``task.reward`` guarded: a reward that raises gives 0 and ``failed=True`` (never raises)."""
    try:
        out = task.reward(problem, completion)
        return RewardOutput(reward=float(out.reward), info=dict(out.info)), False
    except Exception:  # a broken reward marks the sample; it must never stop the run
        log.warning("reward function failed on problem %s:\n%s", problem.id, traceback.format_exc())
        return RewardOutput(reward=0.0), True


def score_job(task: Task, tokenizer, job: RolloutJob) -> Scored:
    """Decode every completion of ``job``, reward it and build its ``Sample``."""
    samples, rewards, info_sums, failures, tokens = [], [], {}, 0, 0
    now = time.time()
    for problem, prompt, result, group_id in zip(job.problems, job.prompt_ids, job.results, job.group_ids):
        for completion in result.completions:
            text = tokenizer.decode(completion.output_ids, skip_special_tokens=True)
            out, failed = call_reward(task, problem, text)
            failures += failed
            tokens += len(completion.output_ids)
            versions = completion.versions
            samples.append(Sample(
                prompt_id=problem.id, group_id=group_id, group_size=len(result.completions),
                prompt_ids=prompt, response_ids=completion.output_ids,
                behavior_logprobs=completion.logprobs, behavior_version=completion.behavior_version,
                token_versions=versions if versions and min(versions) != max(versions) else None,
                reward=out.reward, reward_info=out.info, reward_failed=failed,
                finish_reason=completion.finish_reason, t_generated=now,
            ))  # fmt: skip
            rewards.append(out.reward)
            for k, v in out.info.items():
                info_sums[k] = info_sums.get(k, 0.0) + v
    n = max(1, len(samples))
    return Scored(
        encoded=encode_samples(samples), rewards=rewards, info={k: v / n for k, v in info_sums.items()},
        failures=failures, completion_tokens=tokens,
    )  # fmt: skip


class RewardWorker(Actor):
    """Decodes completions and applies ``task.reward`` (``score_job``)."""

    def __init__(self, task: Task, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.task = task
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @endpoint
    def score(self, job: RolloutJob) -> Scored:
        return score_job(self.task, self.tokenizer, job)

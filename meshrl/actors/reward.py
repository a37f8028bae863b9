"""The RewardWorker role: scores completions with the task's verifiable reward and builds Samples.

A reward function that raises marks its sample (``reward_failed``, reward 0) and the run goes on.
The worker returns the samples already encoded in the queue's wire format, so the controller only
forwards bytes.
"""

from __future__ import annotations

import time
import traceback
from typing import Sequence

import msgspec

from meshrl.engines import GenerateResult
from meshrl.mesh import Actor, endpoint
from meshrl.queues import Sample, encode_samples
from meshrl.tasks import Problem, RewardOutput, Task

__all__ = ["RewardConfig", "RewardWorker", "RolloutJob", "Scored"]


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


class RewardWorker(Actor):
    """Decodes completions and applies ``task.reward``."""

    def __init__(self, task: Task, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.task = task
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.failures = 0

    def _reward(self, problem: Problem, completion: str) -> tuple[RewardOutput, bool]:
        try:
            out = self.task.reward(problem, completion)
            return RewardOutput(reward=float(out.reward), info=dict(out.info)), False
        except Exception:  # a broken reward marks the sample; it must never stop the run
            self.failures += 1
            if self.failures <= 3:
                print(f"reward function failed on problem {problem.id}:\n{traceback.format_exc()}")
            return RewardOutput(reward=0.0), True

    @endpoint
    def score(self, job: RolloutJob) -> Scored:
        samples, rewards, info_sums, failures, tokens = [], [], {}, 0, 0
        now = time.time()
        for problem, prompt, result, group_id in zip(job.problems, job.prompt_ids, job.results, job.group_ids):
            for completion in result.completions:
                text = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
                out, failed = self._reward(problem, text)
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

"""The requests of a rollout: sampling settings, seeds and tokenised prompts for a list of problems.

Built where the requests are sent from: a rollout worker's own loops (training) and the controller
(held-out evaluation). Both make the same requests for the same problems and group ids.
"""

from __future__ import annotations

from typing import Any

from meshrl.actors.reward import RolloutJob
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.envs import EpisodeRequest
from meshrl.tasks import Problem

__all__ = ["RequestMaker"]


class RequestMaker:
    """``rollout``: the run's ``RolloutConfig``; ``seed``: run.seed; ``eval_max_new_tokens``: run's."""

    def __init__(self, rollout: Any, seed: int, eval_max_new_tokens: int | None, tokenizer: Any, *,
                 environment: bool) -> None:
        self.rollout, self.seed, self.eval_max_new_tokens = rollout, seed, eval_max_new_tokens
        self.tokenizer, self.environment = tokenizer, environment

    def sampling(self, *, greedy: bool, n: int, seed: int | None, max_new_tokens: int | None = None) -> SamplingParams:
        r = self.rollout
        if max_new_tokens is None:
            max_new_tokens = (self.eval_max_new_tokens or r.max_new_tokens) if greedy else r.max_new_tokens
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k, n=n, seed=seed, ignore_eos=r.ignore_eos and not greedy,
        )

    def seed_of(self, group_ids: list[int] | None, i: int) -> int | None:
        """A sampled request is seeded by its group id, so a run's samples do not depend on how
        requests interleave in the engine."""
        return None if group_ids is None else (self.seed * 1_000_003 + group_ids[i]) % (1 << 62)

    def requests(self, problems: list[Problem], *, greedy: bool, n: int, group_ids: list[int] | None = None,
                 max_new_tokens: int | None = None) -> tuple[list[list[int]], list[GenerateRequest]]:
        """Tokenised prompts and their single-turn requests."""
        prompt_ids = [self.tokenizer.encode(p.prompt) for p in problems]
        requests = [GenerateRequest(input_ids=ids, sampling=self.sampling(greedy=greedy, n=n, seed=self.seed_of(group_ids, i),
                                                                          max_new_tokens=max_new_tokens))
                    for i, ids in enumerate(prompt_ids)]
        return prompt_ids, requests

    def job(self, problems: list[Problem], *, greedy: bool, n: int, group_ids: list[int] | None
            ) -> tuple[RolloutJob, list[GenerateRequest] | list[EpisodeRequest]]:
        """The job ``problems``' generations (or episodes) belong to, and the requests that make them."""
        job = RolloutJob(problems=problems, prompt_ids=[], results=[], group_ids=group_ids or [-1] * len(problems))
        if self.environment:
            return job, [EpisodeRequest(problem=p, n=n, sampling=self.sampling(greedy=greedy, n=1,
                                                                               seed=self.seed_of(group_ids, i)))
                         for i, p in enumerate(problems)]
        job.prompt_ids, requests = self.requests(problems, greedy=greedy, n=n, group_ids=group_ids)
        return job, requests

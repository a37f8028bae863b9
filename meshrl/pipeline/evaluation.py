"""Held-out evaluation and generation on the rollout engines, at whatever version they serve now.

``evaluate`` plays the task's held-out split greedily (single-turn, or as environment episodes),
scores it on the reward workers and writes an ``eval`` record: ``accuracy`` (the mean of the
reward's ``correct`` metric, else the share of rewards >= 1), ``reward_mean`` and every other
reward metric's mean as ``info/<key>`` (e.g. ``info/tool_used`` with ``ToolEnv``).
``generate`` completes free-form prompts for a user's own evaluation.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from meshrl.actors.rollout_loops import again
from meshrl.pipeline.metrics import RunLog
from meshrl.pipeline.rollout_loop import RolloutDriver, bounded
from meshrl.tasks import Problem, Task

__all__ = ["evaluate", "generate"]


async def evaluate(driver: RolloutDriver, task: Task, log: RunLog, *, step: int, version: int) -> dict[str, Any]:
    """Greedy held-out accuracy on the engines' current version; the ``eval`` record it wrote."""
    roles, timeout, t0 = driver.roles, driver.cfg.run.step_timeout_s, log.now()
    problems = list(task.split("test"))
    # parts of at most one engine batch, two per worker in flight: each part's run.step_timeout_s then
    # covers its own generation, not the wait behind the rest of a large held-out split
    workers = max(1, len(roles.rollouts))
    chunk = max(1, min(-(-len(problems) // workers), driver.cfg.rollout.engine.max_batch_size))
    gate = asyncio.Semaphore(2 * workers)

    async def part(problems: list[Problem]) -> Any:
        async with gate:
            if roles.rewards is None:  # reward.num_workers=0: generated and scored in one rollout worker call
                return await driver.play(problems, greedy=True, n=1, group_ids=None, scored=True,
                                         what="held-out generation and scoring")
            job = await driver.play(problems, greedy=True, n=1, group_ids=None, what="held-out generation")
        return await again(lambda: roles.rewards.score.choose(job, within_s=timeout), timeout, "held-out scoring",
                           restarts=bool(driver.cfg.run.max_worker_restarts))

    scored = await asyncio.gather(*(part(problems[i : i + chunk]) for i in range(0, len(problems), chunk)))
    rewards = [x for s in scored for x in s.rewards]
    n = max(1, len(rewards))
    means = {k: sum(s.info.get(k, 0.0) * len(s.rewards) for s in scored) / n for s in scored for k in s.info}
    accuracy = means["correct"] if "correct" in means else sum(x >= 1.0 for x in rewards) / n
    log.span("eval", "held-out", t0, log.now(), version=version)
    return log.record("eval", step=step, version=version, accuracy=accuracy, reward_mean=sum(rewards) / n,
                      problems=len(rewards), **{f"info/{k}": v for k, v in sorted(means.items()) if k != "correct"})


async def generate(driver: RolloutDriver, prompts: Sequence[str], *, max_new_tokens: int | None,
                   temperature: float) -> list[str]:
    """One completion per prompt (single-turn, special tokens removed) from the rollout engines."""
    if isinstance(prompts, str) or not all(isinstance(p, str) and p for p in prompts):
        raise TypeError("generate: prompts must be a list of non-empty strings")
    problems = [Problem(id=i, prompt=p, answer="") for i, p in enumerate(prompts)]
    _, requests = driver.maker.requests(problems, greedy=True, n=1, max_new_tokens=max_new_tokens)
    if temperature > 0:
        import msgspec

        r = driver.cfg.rollout
        requests = [msgspec.structs.replace(q, sampling=msgspec.structs.replace(q.sampling, temperature=temperature, top_p=r.top_p,
                                                                                 top_k=r.top_k)) for q in requests]
    while True:  # sent again to another worker while the one that took it is restarted
        rollouts = await driver.serving_rollouts("Pipeline.generate")
        loads = driver.revivals.loads()
        adverb = rollouts.generate.call_one if len(rollouts) == 1 else rollouts.generate.choose
        try:
            results = await bounded(adverb(requests), driver.cfg.run.step_timeout_s, "generation for Pipeline.generate")
            break
        except Exception as exc:
            if (rank := driver.revivals.restartable(exc)) is None:
                raise
            driver.revivals.died(rank, before=loads[rank])
    return [driver.tokenizer.decode(r.completions[0].output_ids, skip_special_tokens=True) for r in results]

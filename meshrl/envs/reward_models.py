"""Rewards served by an actor mesh: a learned reward model, or any scorer actor of your own.

```python
reward = RewardModel("/path/to/seq-cls-model", num_workers=2)   # AutoModelForSequenceClassification
reward = MeshReward(MyJudge, "judge-config", num_workers=4)      # your Actor with a `score` endpoint
reward = MeshReward.of(mesh)                                     # a mesh you spawned yourself
Pipeline(cfg, reward=reward)
```

The pipeline spawns the mesh (``start``) beside its other roles and stops it with them; reward
workers then call ``score`` on the least busy actor (``choose``) with a timeout. A scorer actor's
``score(problems, completions)`` returns one number (or ``RewardOutput``) per completion. A mesh the
reward spawned belongs to one run: the next ``start`` (the same object passed to a second Pipeline,
e.g. a resume in the same program) spawns a fresh one. A mesh given to ``MeshReward.of`` is the
caller's: used as it is, never stopped or replaced.

Simplification on purpose: a failed or timed-out call marks its whole chunk of samples.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from meshrl.envs.rewards import _checked, _warn
from meshrl.mesh import Actor, ActorMesh, endpoint
from meshrl.tasks import Problem, RewardOutput

__all__ = ["MeshReward", "RewardModel", "RewardModelWorker"]

log = logging.getLogger(__name__)


class MeshReward:
    """Scores on an actor mesh of ``actor(*args, **kwargs)`` (``num_workers`` actors)."""

    def __init__(self, actor: type | None = None, *args: Any, num_workers: int = 1, timeout_s: float = 120.0,
                 batch_size: int | None = None, name: str | None = None, **kwargs: Any) -> None:
        if num_workers < 1 or timeout_s <= 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"MeshReward: need num_workers >= 1, timeout_s > 0, batch_size >= 1; "
                             f"got {num_workers}, {timeout_s}, {batch_size}")
        self.actor, self.args, self.kwargs = actor, args, kwargs
        self.num_workers, self.timeout_s, self.batch_size = num_workers, timeout_s, batch_size
        self.name = name or f"reward-{getattr(actor, '__name__', 'mesh').lower()}"
        """The mesh's name (actor names are ``<name>/<rank>``: unique within a Ray cluster)."""
        self.mesh: ActorMesh | None = None
        self._spawned = False
        """``mesh`` was spawned by ``start`` (so the run that spawned it stops it), not given to ``of``."""

    @classmethod
    def of(cls, mesh: ActorMesh, *, timeout_s: float = 120.0, batch_size: int | None = None) -> "MeshReward":
        """A reward over a mesh that is already running (the caller stops it)."""
        out = cls(timeout_s=timeout_s, batch_size=batch_size)
        out.mesh = mesh
        return out

    def __repr__(self) -> str:
        return f"MeshReward({getattr(self.actor, '__name__', self.mesh)!r})"

    async def start(self, spawn: Callable[..., ActorMesh]) -> None:
        """Spawn the mesh with the pipeline's ``spawn`` (so it stops with the run); wait until ready.
        Each call spawns afresh: the mesh of a previous run was stopped with that run."""
        if self._spawned:
            self.mesh.stop()  # stopped with its run already (safe twice); frees its actors' names
            self.mesh, self._spawned = None, False
        if self.mesh is None:
            if self.actor is None:
                raise ValueError("MeshReward needs an actor class, or a running mesh through MeshReward.of(mesh)")
            self.mesh = spawn(self.name, self.actor, *self.args, procs=self.num_workers, **self.kwargs)
            self._spawned = True
        try:
            await self.mesh.ready().within(self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"gave up after {self.timeout_s:g}s waiting for the reward model mesh to start") from None

    async def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardOutput | None]:
        if self.mesh is None:
            raise RuntimeError(f"{self!r} is not started: pass it to Pipeline(reward=...) or build it with MeshReward.of(mesh)")
        size = self.batch_size or max(1, len(completions))
        spans = [(i, min(i + size, len(completions))) for i in range(0, len(completions), size)]

        async def chunk(lo: int, hi: int) -> list[RewardOutput | None]:
            try:
                values = await self.mesh.score.choose(list(problems[lo:hi]), list(completions[lo:hi])).within(self.timeout_s)
                if len(values) != hi - lo:
                    raise ValueError(f"score returned {len(values)} values for {hi - lo} completions")
            except Exception as exc:  # marks the samples; the run goes on
                _warn(self, exc)
                return [None] * (hi - lo)
            return [_checked(self, v) for v in values]

        parts = await asyncio.gather(*(chunk(lo, hi) for lo, hi in spans))
        return [x for part in parts for x in part]


class RewardModelWorker(Actor):
    """A Hugging Face sequence-classification model scoring ``prompt + completion`` (logit 0)."""

    def __init__(self, model_path: str, *, tokens_per_batch: int = 8192, threads: int = 1) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(threads)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.model.config.pad_token_id is None:
            raise ValueError(f"{model_path}: the reward model's config needs pad_token_id (to find each sequence's end)")
        self.tokens_per_batch = tokens_per_batch

    @endpoint
    def score(self, problems: list[Problem], completions: list[str]) -> list[float]:
        import torch

        texts = [p.prompt + c for p, c in zip(problems, completions)]
        ids = [self.tokenizer.encode(t) for t in texts]
        out: list[float] = []
        pad = self.model.config.pad_token_id
        i = 0
        while i < len(ids):
            longest, j = len(ids[i]), i + 1
            while j < len(ids) and max(longest, len(ids[j])) * (j + 1 - i) <= self.tokens_per_batch:
                longest, j = max(longest, len(ids[j])), j + 1
            rows = ids[i:j]
            batch = torch.full((len(rows), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(batch)
            for r, row in enumerate(rows):
                batch[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
            with torch.no_grad():
                logits = self.model(input_ids=batch, attention_mask=mask).logits  # [b, num_labels]
            out += logits[:, 0].float().tolist()
            i = j
        return out


class RewardModel(MeshReward):
    """A learned reward model on a mesh: ``RewardModelWorker(model_path)`` × ``num_workers``."""

    def __init__(self, model_path: str, *, num_workers: int = 1, timeout_s: float = 120.0, batch_size: int | None = None,
                 tokens_per_batch: int = 8192) -> None:
        super().__init__(RewardModelWorker, model_path, num_workers=num_workers, timeout_s=timeout_s,
                         batch_size=batch_size, tokens_per_batch=tokens_per_batch)

"""Choosing a policy loss from config once: ``make_policy_loss`` binds the knobs and returns a
``PolicyLoss`` with one call signature for all three losses.

The trainer reads ``algo.policy_loss`` here, once, never per micro-batch; the losses themselves
stay plain functions with no mode argument. Simplification on purpose: the knobs are fixed for
the lifetime of the object (build a new one to change them, e.g. on a schedule).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .aggregation import Aggregator
from .importance import ImportanceSampling
from .policy_losses import (
    Metrics,
    check_clip,
    decoupled_ppo_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)

POLICY_LOSSES = ("ppo", "decoupled_ppo", "gspo")


def _ppo_uniform(logprobs, old_logprobs, behavior_logprobs, advantages, mask, **knobs):
    """``ppo_policy_loss`` with behaviour log-probs moved to the shared positional order."""
    return ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, behavior_logprobs=behavior_logprobs, **knobs
    )


def _gspo_uniform(logprobs, old_logprobs, behavior_logprobs, advantages, mask, **knobs):
    """``gspo_policy_loss`` with behaviour log-probs moved to the shared positional order."""
    return gspo_policy_loss(
        logprobs, old_logprobs, advantages, mask, behavior_logprobs=behavior_logprobs, **knobs
    )


class PolicyLoss:
    """A policy loss with its knobs bound, behind one call signature (``make_policy_loss``).

    ``__call__(logprobs, old_logprobs, behavior_logprobs, advantages, mask, *, aggregate,
    entropy=None) -> (loss, metrics)``, all ``[B, T]`` as in ``ppo_policy_loss``;
    ``old_logprobs`` is the proximal policy for ``decoupled_ppo``, and ``behavior_logprobs`` may
    be None except for ``decoupled_ppo`` or when importance sampling is on.
    """

    def __init__(self, name: str, loss: Callable[..., tuple[torch.Tensor, Metrics]], knobs: dict):
        self.name, self._loss, self.knobs = name, loss, knobs

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        aggregate: Aggregator,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        return self._loss(
            logprobs, old_logprobs, behavior_logprobs, advantages, mask, aggregate=aggregate,
            entropy=entropy, **self.knobs,
        )

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.knobs.items())
        return f"PolicyLoss({self.name!r}, {knobs})"


def make_policy_loss(
    name: str,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    importance_sampling: ImportanceSampling | None = None,
    is_cap: float | None = None,
) -> PolicyLoss:
    """Bind ``algo.policy_loss = name`` and its knobs once; the trainer calls the result per step.

    Args:
        name: ``"ppo"`` | ``"decoupled_ppo"`` | ``"gspo"``.
        clip_low, clip_high: ``algo.clip_low`` / ``algo.clip_high``.
        dual_clip: ``algo.dual_clip`` (not for ``gspo``, which has none).
        importance_sampling: from ``make_importance_sampling(algo.importance_sampling, ...)``.
        is_cap: ``algo.is_cap``; used only by ``decoupled_ppo`` without ``importance_sampling``
            (AReaL's rule: drop tokens whose behaviour weight exceeds it). The truncated IS modes
            take their cap through ``make_importance_sampling``.
    """
    fn = "make_policy_loss"
    check_clip(fn, clip_low, clip_high, dual_clip)
    knobs: dict[str, object] = {
        "clip_low": clip_low,
        "clip_high": clip_high,
        "importance_sampling": importance_sampling,
    }
    if name == "ppo":
        return PolicyLoss(name, _ppo_uniform, {**knobs, "dual_clip": dual_clip})
    if name == "decoupled_ppo":
        knobs["dual_clip"] = dual_clip
        if importance_sampling is None:
            knobs["is_cap"] = is_cap
        return PolicyLoss(name, decoupled_ppo_loss, knobs)
    if name == "gspo":
        if dual_clip is not None:
            raise ValueError(f"{fn}: `dual_clip` does not apply to 'gspo'; leave it None")
        return PolicyLoss(name, _gspo_uniform, knobs)
    raise ValueError(f"{fn}: unknown policy loss {name!r}; choose one of {POLICY_LOSSES}")

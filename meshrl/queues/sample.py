"""The unit of data between rollout, reward and training: one generated sample.

A msgspec Struct so it crosses Ray and disk (queue snapshots) without pickling user objects.
Token sequences are plain int lists: a sample is small, and the trainer packs a batch into
tensors once, on its side. ``gc=False``: a sample holds only numbers, strings and containers of
them, so it can never be part of a reference cycle; untracked, the tens of thousands a trainer or
a benchmark holds cost the cyclic GC nothing (its lists are still tracked).
"""

from __future__ import annotations

import msgspec


class Sample(msgspec.Struct, kw_only=True, gc=False):
    """One completion of one prompt, with everything the trainer needs to learn from it."""

    prompt_id: int
    """Index of the prompt in its data set (its position is checkpointed, not the prompt)."""
    group_id: int
    """Samples of the same prompt drawn together share it; a GRPO group is admitted, trained and
    dropped as one."""
    group_size: int
    """How many samples the group has in all (``samples_per_prompt``)."""
    sample_index: int = 0
    """Its index in its group, 0 to ``group_size - 1``. The group id is the prompt's position in the
    run's prompt stream (``PromptLedger``), so ``(group_id, sample_index)`` names the sample across
    re-issued requests and resumes: a re-issued request makes the same pairs (the same seeds)."""
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    """Per response token: log-prob under the engine's sampling distribution (engines/types.py)."""
    behavior_version: int
    """Oldest policy version that produced a response token."""
    token_versions: list[int] | None = None
    """Per response token, only when the weights changed mid-generation."""
    loss_mask: list[int] | None = None
    """Per response token, 1 where the policy produced it (trained), 0 for tool or environment
    text; None means every response token is trained."""
    reward: float = 0.0
    reward_info: dict[str, float] = {}
    """Task metrics from the reward function, e.g. ``{"correct": 1.0}``; averaged in the logs."""
    reward_failed: bool = False
    """The reward function raised or timed out; the reward is 0 and the sample is still counted."""
    finish_reason: str = "stop"
    ref_logprobs: list[float] | None = None
    """Per response token, the reference model's log-probs (when a KL term is on)."""
    t_generated: float = 0.0
    """``time.time()`` when generation finished; queues measure age from it."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

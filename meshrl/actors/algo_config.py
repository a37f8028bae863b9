"""The RL algorithm's knobs, in one typed config, with the presets ``algo=ppo`` and ``algo=grpo``.

Each knob names what it selects in ``meshrl.algos``; formulas, papers and the bias each one fixes
are in docs/algorithms.md. The trainer reads this once and builds its functions from it
(``make_policy_loss``, ``make_importance_sampling``, ``make_aggregator``): no loss switches on a
string per step.
"""

from __future__ import annotations

import math

from typing import Any, Literal

import msgspec

__all__ = ["AlgoConfig"]


class AlgoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Advantage estimator, policy loss and regularisers (docs/algorithms.md)."""

    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"
    """gae: PPO with a critic (Schulman 2017); grpo: group-normalised, no critic (Shao 2024);
    rloo: leave-one-out baseline (Ahmadian 2024); reinforce_pp: batch-normalised (Hu 2025)."""
    samples_per_prompt: int = 1
    """Completions drawn per prompt; the group of grpo/rloo (needs >= 2)."""
    policy_loss: Literal["ppo", "decoupled_ppo", "gspo"] = "ppo"
    """ppo: clip around the behaviour policy (around the trainer's recomputed one when
    importance_sampling is on); decoupled_ppo: clip around a recomputed proximal policy with a
    behaviour→proximal importance weight (AReaL); gspo: sequence-level ratio."""
    clip_low: float = 0.2
    """PPO clip ε below 1."""
    clip_high: float = 0.2
    """PPO clip ε above 1; > clip_low is DAPO's clip-higher (keeps exploration alive)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (Ye 2020); None disables it."""
    importance_sampling: Literal["none", "truncated_token", "truncated_seq", "masked_token", "masked_seq"] = "none"
    """Extra correction for stale or mismatched behaviour log-probs (TIS / MIS); the trainer then
    recomputes π_old with a no-grad forward and weighs π_old/π_behav."""
    is_cap: float | None = 2.0
    """Truncated IS cap (required by the truncated_* modes) and decoupled PPO's drop threshold
    (None: drop nothing)."""
    is_low: float = 0.5
    """Masked IS: drop ratios below this."""
    is_high: float = 2.0
    """Masked IS: drop ratios above this."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses become one number; normalisers are global over the step."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE λ."""
    normalize_advantages: bool = True
    """Whiten GAE advantages over the step's valid tokens."""
    drop_uniform_groups: bool = False
    """grpo/rloo: leave groups whose samples all got the same reward out of the loss and its
    normaliser (they have zero advantage; DAPO's dynamic-sampling filter without the refill)."""
    grpo_scale_by_std: bool = True
    """GRPO: divide by the group's std (Dr. GRPO sets False to remove the difficulty bias)."""
    value_clip: float | None = None
    """Clip the critic's update around its old values; None disables it."""
    value_coef: float = 1.0
    """Weight of the value loss (the critic has its own optimiser; this scales its gradient)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model; > 0 starts a ReferenceWorker."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3; k3 is unbiased and low-variance)."""
    kl_in_reward: bool = False
    """Fold the KL into per-token rewards (classic RLHF PPO) instead of adding it to the loss."""

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise ValueError(f"algo.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.advantage in ("grpo", "rloo") and self.samples_per_prompt < 2:
            raise ValueError(
                f"algo.advantage={self.advantage} compares samples of one prompt: "
                f"set algo.samples_per_prompt >= 2 (got {self.samples_per_prompt})"
            )
        if self.drop_uniform_groups and self.advantage not in ("grpo", "rloo"):
            raise ValueError(f"algo.drop_uniform_groups filters groups: it needs advantage grpo or rloo, "
                             f"not {self.advantage}")
        if not 0 <= self.kl_coef < math.inf:  # NaN too: it would turn the KL term off unnoticed
            raise ValueError(f"algo.kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not 0 < self.clip_low < 1:
            raise ValueError(f"algo.clip_low must be in (0, 1), got {self.clip_low}")
        if not 0 < self.clip_high < math.inf:
            raise ValueError(f"algo.clip_high must be a finite number > 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"algo.dual_clip must be > 1 (or null), got {self.dual_clip}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algo.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.is_cap is not None and not self.is_cap > 0:
            raise ValueError(f"algo.is_cap must be > 0 (or null), got {self.is_cap}")
        if self.is_cap is None and self.importance_sampling in ("truncated_token", "truncated_seq"):
            raise ValueError(f"algo.importance_sampling={self.importance_sampling} truncates the weights at "
                             "algo.is_cap: set algo.is_cap > 0 (null only turns off decoupled PPO's drop cap)")
        if not 0 <= self.is_low < 1 < self.is_high:
            raise ValueError(f"algo.is_low must be in [0, 1) and algo.is_high > 1, got {self.is_low} and {self.is_high}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"algo.value_clip must be > 0 (or null), got {self.value_clip}")
        for name in ("value_coef", "entropy_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"algo.{name} must be a finite number >= 0, got {getattr(self, name)}")

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """Named starting points for ``algo=<name>`` on the command line."""
        return {
            "ppo": {"advantage": "gae", "samples_per_prompt": 1},
            # DAPO's recipe on top of GRPO: drop uniform groups, clip-higher. On the embedded default
            # (300 steps from the same warm start) +28.6..31.6 points without clip-higher, +36.0 with
            # it; 4 samples of 64 prompts learned faster than 8 of 32.
            "grpo": {"advantage": "grpo", "samples_per_prompt": 4, "drop_uniform_groups": True, "clip_high": 0.28},
            "dr_grpo": {"advantage": "grpo", "samples_per_prompt": 4, "grpo_scale_by_std": False,
                        "aggregation": "seq_mean_token_sum", "drop_uniform_groups": True},
            "rloo": {"advantage": "rloo", "samples_per_prompt": 4, "drop_uniform_groups": True},
            "reinforce_pp": {"advantage": "reinforce_pp", "samples_per_prompt": 1},
            "async_ppo": {"advantage": "gae", "policy_loss": "decoupled_ppo"},
        }

"""meshrl.algos: pure tensor functions for PPO, GRPO and the off-policy corrections of async RL.

Imports only torch. Every per-token argument is ``[B, T]`` over response tokens with a ``mask``;
every loss takes its normaliser from an explicit ``aggregate`` built once per step by
``make_aggregator`` and returns ``(loss, metrics)`` (combine metrics with ``reduce_metrics``).
Formulas, papers and the config names that select each piece: ``docs/algorithms.md``.
"""

from .advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    informative_groups,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .aggregation import (
    AGGREGATION_MODES,
    Aggregator,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    TokenMean,
    make_aggregator,
)
from .entropy import entropy_from_logits
from .importance import (
    IMPORTANCE_SAMPLING_MODES,
    ImportanceSampling,
    ISWeights,
    MaskedSeqIS,
    MaskedTokenIS,
    TruncatedSeqIS,
    TruncatedTokenIS,
    make_importance_sampling,
)
from .kl import KL_ESTIMATORS, kl_estimator, kl_in_reward, kl_k1, kl_k2, kl_k3, kl_loss
from .metrics import masked_mean, metric_reduction, reduce_metrics
from .policy_loss_factory import POLICY_LOSSES, PolicyLoss, make_policy_loss
from .policy_losses import decoupled_ppo_loss, gspo_policy_loss, ppo_policy_loss
from .value import value_loss

__all__ = [
    "AGGREGATION_MODES",
    "IMPORTANCE_SAMPLING_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Aggregator",
    "ISWeights",
    "ImportanceSampling",
    "MaskedSeqIS",
    "MaskedTokenIS",
    "PolicyLoss",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "TokenMean",
    "TruncatedSeqIS",
    "TruncatedTokenIS",
    "decoupled_ppo_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "informative_groups",
    "gspo_policy_loss",
    "kl_estimator",
    "kl_in_reward",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "make_aggregator",
    "make_importance_sampling",
    "make_policy_loss",
    "masked_mean",
    "metric_reduction",
    "ppo_policy_loss",
    "reduce_metrics",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
]

"""The roles of a pipeline, each an ``Actor`` spawned on a mesh: rollout, reward, reference, trainer."""

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.reference import ReferenceWorker
from meshrl.actors.reward import RewardConfig, RewardWorker, RolloutJob, Scored
from meshrl.actors.rollout import RolloutConfig, RolloutWorker
from meshrl.actors.trainer import Trainer, TrainerConfig

__all__ = [
    "AlgoConfig",
    "ReferenceWorker",
    "RewardConfig",
    "RewardWorker",
    "RolloutConfig",
    "RolloutJob",
    "RolloutWorker",
    "Scored",
    "Trainer",
    "TrainerConfig",
]

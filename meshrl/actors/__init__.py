"""The roles of a pipeline, each an ``Actor`` spawned on a mesh: rollout, reward, reference, trainer.

The names load on first use (PEP 562): a Ray worker that hosts one role imports that role's
module alone, not every role's dependencies (a reward worker needs no model code).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshrl.actors.algo_config import AlgoConfig
    from meshrl.actors.reference import ReferenceWorker
    from meshrl.actors.reward import RewardConfig, RewardWorker, RolloutJob, Scored
    from meshrl.actors.rollout import RolloutConfig, RolloutWorker
    from meshrl.actors.trainer import Trainer, TrainerConfig

_MODULES = {
    "AlgoConfig": "algo_config", "ReferenceWorker": "reference", "RewardConfig": "reward", "RewardWorker": "reward",
    "RolloutJob": "reward", "Scored": "reward", "RolloutConfig": "rollout", "RolloutWorker": "rollout",
    "Trainer": "trainer", "TrainerConfig": "trainer",
}
__all__ = ["AlgoConfig", "ReferenceWorker", "RewardConfig", "RewardWorker", "RolloutConfig", "RolloutJob", "RolloutWorker",
           "Scored", "Trainer", "TrainerConfig"]
assert sorted(__all__) == sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'meshrl.actors' has no attribute {name!r}")
    module = f"meshrl.actors.{_MODULES[name]}"
    try:
        value = getattr(importlib.import_module(module), name)
    except AttributeError as exc:  # raised inside the import, it would read as "cannot import name"
        raise ImportError(f"importing {module} failed: {exc!r}") from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

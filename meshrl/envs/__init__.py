"""What the policy interacts with and how it is scored: environments, tools and rewards.

- ``base``: the ``Environment`` interface (``reset`` → observation; ``step(action)`` →
  observation, reward, done), ``StepResult``, ``Episode`` and the per-episode limits.
- ``episode``: the runner that plays environments with an engine (loss mask 0 on environment text).
- ``tools``: tool calls written ``<name>arguments</name>``, ``ToolEnv``, a safe ``calculator``.
- ``rewards``: reward functions (sync/async, per sample/batched) and ``HTTPReward``.
- ``reward_models``: ``MeshReward`` / ``RewardModel``, rewards served by an actor mesh (loads Ray on
  first use).
"""

from __future__ import annotations

import importlib
from typing import Any

from meshrl.envs.base import Environment, EnvFactory, Episode, EpisodeConfig, StepResult
from meshrl.envs.episode import EpisodeRequest, run_episode, run_episodes
from meshrl.envs.rewards import FunctionReward, HTTPReward, Reward, as_reward, batched_reward, to_reward_output
from meshrl.envs.tools import ToolCall, ToolEnv, calculator, parse_tool_call

_LAZY = {"MeshReward": "meshrl.envs.reward_models", "RewardModel": "meshrl.envs.reward_models",
         "RewardModelWorker": "meshrl.envs.reward_models"}

__all__ = [
    "EnvFactory", "Environment", "Episode", "EpisodeConfig", "EpisodeRequest", "FunctionReward", "HTTPReward",
    "Reward", "StepResult", "ToolCall", "ToolEnv", "as_reward", "batched_reward", "calculator", "parse_tool_call",
    "run_episode", "run_episodes", "to_reward_output", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrl.envs' has no attribute {name!r}")

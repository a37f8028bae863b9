"""meshrl: asynchronous RL post-training of LLMs on Ray actor meshes.

The public API (docs/embedding.md); names load on first use, so ``import meshrl`` stays light:

```python
import meshrl

cfg = meshrl.load_config(meshrl.PipelineConfig, "run.yaml", ["run.total_steps=50"])
pipeline = meshrl.Pipeline(cfg, reward=my_reward, environment=meshrl.ToolEnv.factory({"calc": meshrl.calculator}))
summary = await pipeline.run()           # or: asyncio.create_task(pipeline.run()) beside your tasks
```
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "meshrl.pipeline", "PipelineConfig": "meshrl.pipeline", "RunConfig": "meshrl.pipeline",
    "ModelConfig": "meshrl.pipeline", "load_config": "meshrl.config", "ConfigError": "meshrl.config",
    "to_yaml": "meshrl.config",
    "Problem": "meshrl.tasks", "RewardOutput": "meshrl.tasks", "Task": "meshrl.tasks", "TaskConfig": "meshrl.tasks",
    "Environment": "meshrl.envs", "StepResult": "meshrl.envs", "Episode": "meshrl.envs", "EpisodeConfig": "meshrl.envs",
    "ToolEnv": "meshrl.envs", "ToolCall": "meshrl.envs", "calculator": "meshrl.envs", "parse_tool_call": "meshrl.envs",
    "Reward": "meshrl.envs", "FunctionReward": "meshrl.envs", "batched_reward": "meshrl.envs",
    "HTTPReward": "meshrl.envs", "MeshReward": "meshrl.envs", "RewardModel": "meshrl.envs",
    "Sample": "meshrl.queues",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])

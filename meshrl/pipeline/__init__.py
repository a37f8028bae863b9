"""The controller that runs an asynchronous RL pipeline, its root config and its outputs."""

from meshrl.pipeline.config import ModelConfig, PipelineConfig, RunConfig
from meshrl.pipeline.controller import Pipeline
from meshrl.pipeline.startup import ensure_ray
from meshrl.pipeline.plots import plot_run

__all__ = ["ModelConfig", "Pipeline", "PipelineConfig", "RunConfig", "ensure_ray", "plot_run"]

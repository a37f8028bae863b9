"""Verifiable tasks: built-in arithmetic, or prompts and answers from JSON Lines / Parquet files."""

from __future__ import annotations

from typing import Literal

import msgspec

from meshrl.tasks.arithmetic import AdditionTask
from meshrl.tasks.base import Problem, PromptStream, RewardOutput, Task, exact_match_reward
from meshrl.tasks.files import FileTask, load_problems

__all__ = [
    "AdditionTask",
    "FileTask",
    "Problem",
    "PromptStream",
    "RewardOutput",
    "Task",
    "TaskConfig",
    "build_task",
    "exact_match_reward",
    "load_problems",
]


class TaskConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which task to learn."""

    kind: Literal["addition", "file"] = "addition"
    """"addition" (built in) or "file" (train_file / test_file)."""
    digits: int = 2
    """Addition: digits per operand."""
    num_test: int = 500
    """Addition: held-out problems."""
    seed: int = 0
    """Addition: the seed that draws the splits."""
    train_file: str | None = None
    """File task: .jsonl or .parquet of training problems."""
    test_file: str | None = None
    """File task: .jsonl or .parquet of held-out problems."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"

    def __post_init__(self) -> None:
        if self.digits < 1 or self.num_test < 1:
            raise ValueError(f"task.digits and task.num_test must be >= 1, got {self.digits} and {self.num_test}")


def build_task(cfg: TaskConfig) -> Task:
    if cfg.kind == "addition":
        return AdditionTask(cfg.digits, num_test=cfg.num_test, seed=cfg.seed)
    if not cfg.train_file or not cfg.test_file:
        raise ValueError("task.kind=file needs task.train_file and task.test_file")
    return FileTask(cfg.train_file, cfg.test_file, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)

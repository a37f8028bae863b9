"""Verifiable tasks: built-in arithmetic, or prompts and answers from JSON Lines / Parquet files.

``build_task`` also renders prompts for chat models (``meshrl.tasks.chat``) and picks how answers
are checked (``meshrl.tasks.answers``); ``load_reward_function`` loads ``task.reward_function``,
a Python function named on the command line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import msgspec

from meshrl.tasks.answers import AnswerMode, answer_reward
from meshrl.tasks.arithmetic import AdditionTask
from meshrl.tasks.base import Problem, PromptStream, RewardOutput, Task, exact_match_reward
from meshrl.tasks.chat import ChatRenderer
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
    "load_reward_function",
    "NamedFunction",
    "source_split",
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
    chat_template: bool | None = None
    """Render prompts with the model tokenizer's chat template. null: prompts given as chat messages
    are rendered, strings used as they are; true: every prompt, a string as one user turn (instruct
    models); false: none (messages refused)."""
    system_prompt: str | None = None
    """With task.chat_template=true: a system turn first, unless a prompt's messages begin with
    their own."""
    reward: AnswerMode = "exact"
    """How a completion is checked against the answer: exact (the whole completion, stripped),
    last_number (its last number, compared as a number: GSM8K-style reasoning), boxed (the last
    \\boxed{...}: MATH-style). Details: meshrl/tasks/answers.py."""
    reward_function: str | None = None
    """A Python reward instead of the task's: "path/to/file.py:name" or "package.module:name", a
    function (problem, completion) -> float | RewardOutput, sync or async (what Pipeline(reward=...)
    takes)."""

    def __post_init__(self) -> None:
        if self.digits < 1 or self.num_test < 1:
            raise ValueError(f"task.digits and task.num_test must be >= 1, got {self.digits} and {self.num_test}")
        if self.system_prompt is not None and self.chat_template is not True:
            raise ValueError("task.system_prompt needs task.chat_template=true (prompts rendered as chat; with null, "
                             "string prompts are used as they are and would never see it)")
        if self.reward_function is not None:
            target, _, name = self.reward_function.rpartition(":")
            if not target or not name.isidentifier():
                raise ValueError(f"task.reward_function must be \"path/to/file.py:name\" or \"module:name\", got "
                                 f"{self.reward_function!r}")


class PreparedTask:
    """A task with its prompts rendered for a chat model and/or another answer check."""

    quick_reward = True  # its answer check: scored inline (Task.quick_reward)

    def __init__(self, task: Task, render: Callable[[str], str] | None, reward: str):
        self.name, self._task, self.reward_mode = task.name, task, reward
        self._splits = {name: [Problem(id=p.id, prompt=render(p.prompt), answer=p.answer) for p in task.split(name)]
                        if render else task.split(name) for name in ("train", "test")}

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            return self._task.split(name)  # the task's own error
        return self._splits[name]

    def source_split(self, name: str) -> Sequence[Problem]:
        """The split before chat rendering (``source_split``)."""
        return source_split(self._task, name)

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return answer_reward(self.reward_mode, problem, completion)


def source_split(task: Task, name: str) -> Sequence[Problem]:
    """``task``'s split as written, before any chat rendering: what a resume compares (a chat template
    may render today's date into every prompt)."""
    source = getattr(task, "source_split", None)
    return source(name) if callable(source) else task.split(name)


def _renderer(cfg: TaskConfig, model_path: str | None) -> Callable[[Any], str] | None:
    """What turns a prompt into the model's text; the tokenizer is loaded only if a prompt needs it."""
    if cfg.chat_template is False:
        return None
    loaded: list[ChatRenderer] = []

    def render(prompt: Any) -> str:
        if isinstance(prompt, str) and not cfg.chat_template:  # null: strings are used as they are
            return prompt
        if not loaded:
            if model_path is None:
                from meshrl.embedded.tokenizer import build_char_tokenizer

                tokenizer, source = build_char_tokenizer(), "the embedded default (it has none: use --model DIR)"
            else:
                from transformers import AutoTokenizer

                tokenizer, source = AutoTokenizer.from_pretrained(model_path), model_path
            loaded.append(ChatRenderer(tokenizer, system_prompt=cfg.system_prompt, source=source))
        return loaded[0](prompt)

    return render


def build_task(cfg: TaskConfig, model_path: str | None = None) -> Task:
    """The configured task; ``model_path``'s tokenizer renders chat prompts (the embedded one's when None)."""
    render = _renderer(cfg, model_path)
    if cfg.kind == "addition":
        task = AdditionTask(cfg.digits, num_test=cfg.num_test, seed=cfg.seed)
        if not cfg.chat_template and cfg.reward == "exact":
            return task
        return PreparedTask(task, render if cfg.chat_template else None, cfg.reward)
    if not cfg.train_file or not cfg.test_file:
        raise ValueError("task.kind=file needs task.train_file and task.test_file")
    return FileTask(cfg.train_file, cfg.test_file, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                    render=render, reward=cfg.reward)


class NamedFunction(msgspec.Struct, frozen=True):
    """A reward function by name (``task.reward_function``): what travels to the reward workers,
    which import it themselves (a module loaded from a file does not pickle with everything in it)."""

    spec: str

    def load(self) -> Callable[..., Any]:
        return load_reward_function(self.spec)


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function ``task.reward_function`` names: ``"path/to/file.py:name"`` (the file's folder goes
    on ``sys.path``, so it may import its neighbours) or ``"package.module:name"``."""
    target, _, name = spec.rpartition(":")
    key = "`task.reward_function`"
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{key}: file not found: {target}")
        module_name = "meshrl_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        module = sys.modules.get(module_name)
        if module is None:
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module  # before it runs: dataclasses and pickle look it up there
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise ValueError(f"{key}: importing {target} failed: {type(exc).__name__}: {exc}") from exc
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a module beside the run, as Ray's workers see it
            sys.path.append(str(Path.cwd()))
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ValueError(f"{key}: importing module {target!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{key}: {target} has no function {name!r} (it has {found[:8]})")
    return fn

"""Tasks from files: prompts and answers in JSON Lines or Parquet, one record per problem.

Each record has a prompt field (a string) and an answer field (a string or a number; names
configurable); the reward is exact match after stripping white space, like the built-in tasks.
Parquet needs ``pyarrow``.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path

from meshrl.tasks.base import Problem, RewardOutput, exact_match_reward

__all__ = ["FileTask", "load_problems"]


def _records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        # JSON Lines is UTF-8 and ends records at "\n" only; str.splitlines would also split inside
        # a JSON string at the line separators JSON leaves unescaped (U+2028, U+2029, U+0085)
        # (utf-8-sig: a byte-order mark, as some Windows editors write, is not part of the first record)
        for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        return records
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors (e.g. ArrowInvalid: not a Parquet file) say little of the file
            raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    raise ValueError(f"{path}: prompts must be a .jsonl or .parquet file")


def _answer_text(answer: object, path: Path, index: int, key: str) -> str:
    """The answer as a completion would write it: a whole number without ``.0`` (Parquet and JSON readers
    give ``2.0`` for a float column's 2, and ``"2.0"`` would mark a correct ``2`` wrong)."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        if isinstance(answer, numbers.Integral):
            return str(int(answer))
        value = float(answer)
        if math.isfinite(value):
            return str(int(value)) if value.is_integer() else repr(value)
    raise ValueError(f"{path}: record {index}: field {key!r} must be a string or a finite number, got {answer!r:.80}")


def load_problems(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Read problems from ``path``; every record must carry both keys."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    problems = []
    for index, record in enumerate(_records(path)):
        if not isinstance(record, dict):
            raise ValueError(f"{path}: record {index} is not an object with fields (got {type(record).__name__})")
        for key in (prompt_key, answer_key):
            if key not in record:
                raise ValueError(f"{path}: record {index} has no field {key!r}")
        prompt, answer = record[prompt_key], record[answer_key]
        # str() of a list of chat messages or of a missing (null) answer would be a silent, wrong problem
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}: record {index}: field {prompt_key!r} must be a non-empty string, got "
                             f"{prompt!r:.80} (chat messages: render them to one string first)")  # fmt: skip
        problems.append(Problem(id=index, prompt=prompt, answer=_answer_text(answer, path, index, answer_key)))
    if not problems:
        raise ValueError(f"{path}: no records")
    return problems


class FileTask:
    """Problems from a training file and a held-out file."""

    name = "file"

    def __init__(self, train_path: str | Path, test_path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer"):
        self._splits = {
            "train": load_problems(train_path, prompt_key=prompt_key, answer_key=answer_key),
            "test": load_problems(test_path, prompt_key=prompt_key, answer_key=answer_key),
        }

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise ValueError(f"unknown split {name!r}: use 'train' or 'test'")
        return self._splits[name]

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return exact_match_reward(problem, completion)

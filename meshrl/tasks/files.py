"""Tasks from files: prompts and answers in JSON Lines or Parquet, one record per problem.

Each record has a prompt field (a string, or a list of chat messages rendered by
``meshrl.tasks.chat``) and an answer field (a string or a number; names configurable). The reward
checks a completion against the answer as ``task.reward`` says (``meshrl.tasks.answers``: exact
match by default). Parquet needs ``pyarrow``.
"""

from __future__ import annotations

import decimal
import json
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path

from meshrl.tasks.answers import answer_reward
from meshrl.tasks.base import Problem, RewardOutput
from meshrl.tasks.chat import check_messages

__all__ = ["FileTask", "load_problems"]


def _records(path: Path) -> list[tuple[str, object]]:
    """``(where, record)`` for each record: where is ``path:line`` (JSON Lines) or ``path: row i``."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        try:
            # utf-8-sig: a byte-order mark, as some Windows editors write, is not part of the first record
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); JSON Lines is UTF-8: save it "
                             "as UTF-8 (PowerShell's > writes UTF-16)") from None
        # JSON Lines ends records at "\n" only; str.splitlines would also split inside a JSON string at
        # the line separators JSON leaves unescaped (U+2028, U+2029, U+0085)
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        return records
    if suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's errors (e.g. ArrowInvalid: not a Parquet file) say little of the file
            raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        rows = table.to_pylist()
        for field in table.schema:  # a float32 0.1 reads back as 0.10000000149011612: keep the value it was written as
            if pa.types.is_float32(field.type) or pa.types.is_float16(field.type):
                for row in rows:
                    if isinstance(row[field.name], float):
                        row[field.name] = _shortest(row[field.name], field.type)
        return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]
    raise ValueError(f"{path}: prompts must be a .jsonl or .parquet file")


def _shortest(value: float, type_: object) -> float:
    """The shortest decimal that reads back as the same float32 (or float16) ``value``."""
    import numpy as np

    return float(str(np.float16(value) if str(type_) in ("halffloat", "float16") else np.float32(value)))


def _answer_text(answer: object, where: str, key: str) -> str:
    """The answer as a completion would write it: a whole number without ``.0`` (Parquet and JSON readers
    give ``2.0`` for a float column's 2, and ``"2.0"`` would mark a correct ``2`` wrong)."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, decimal.Decimal) and answer.is_finite():  # Parquet's decimal columns
        return format(answer.normalize(), "f")
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        if isinstance(answer, numbers.Integral):
            return str(int(answer))
        value = float(answer)
        if math.isfinite(value):
            return str(int(value)) if value.is_integer() else repr(value)
    raise ValueError(f"{where}: field {key!r} must be a string or a finite number, got {answer!r:.80} "
                     f"({type(answer).__name__})")


def load_problems(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
                  render: Callable[[str | list[dict[str, str]]], str] | None = None) -> list[Problem]:
    """Read problems from ``path``; every record must carry both keys, neither blank.

    ``render`` turns a prompt (a string or chat messages) into the text the model sees
    (``meshrl.tasks.chat.ChatRenderer``); without it, prompts given as messages are refused.
    """
    return [rendered for rendered, _ in _load(path, prompt_key, answer_key, render)]


def _load(path: str | Path, prompt_key: str, answer_key: str,
          render: Callable[[str | list[dict[str, str]]], str] | None) -> list[tuple[Problem, Problem]]:
    """``(rendered, source)`` per record; the source's prompt is the file's (messages as JSON)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: name one .jsonl or .parquet file (a data set of several Parquet "
                         "shards: join them into one file per split first)")
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    problems = []
    for index, (where, record) in enumerate(_records(path)):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: the record is not an object with fields (got {type(record).__name__})")
        for key in (prompt_key, answer_key):
            if key not in record:
                raise ValueError(f"{where}: the record has no field {key!r} (it has {sorted(record)[:8]})")
        prompt, answer = record[prompt_key], record[answer_key]
        # str() of a list of chat messages or of a missing (null) answer would be a silent, wrong problem
        if isinstance(prompt, list) and render is not None:
            messages = check_messages(prompt, where, prompt_key)
            source, prompt = json.dumps(messages, ensure_ascii=False), render(messages)
        elif not isinstance(prompt, str) or not prompt.strip():
            hint = " (chat messages need task.chat_template null or true)" if isinstance(prompt, list) else ""
            raise ValueError(f"{where}: field {prompt_key!r} must be a non-blank string, got {prompt!r:.80}{hint}")
        else:
            source, prompt = prompt, render(prompt) if render is not None else prompt
        text = _answer_text(answer, where, answer_key)
        if not text.strip():  # exact match after stripping: an empty completion would earn the full reward
            raise ValueError(f"{where}: field {answer_key!r} is blank: an empty completion would match it")
        problems.append((Problem(id=index, prompt=prompt, answer=text), Problem(id=index, prompt=source, answer=text)))
    if not problems:
        raise ValueError(f"{path}: no records")
    return problems


class FileTask:
    """Problems from a training file and a held-out file; ``reward`` is a ``meshrl.tasks.answers`` mode."""

    name = "file"

    quick_reward = True  # its answer check: scored inline (Task.quick_reward)

    def __init__(self, train_path: str | Path, test_path: str | Path, *, prompt_key: str = "prompt",
                 answer_key: str = "answer", render: Callable[[str | list[dict[str, str]]], str] | None = None,
                 reward: str = "exact"):
        loaded = {name: _load(path, prompt_key, answer_key, render) for name, path in (("train", train_path),
                                                                                     ("test", test_path))}
        self._splits = {name: [rendered for rendered, _ in pairs] for name, pairs in loaded.items()}
        self._sources = {name: [source for _, source in pairs] for name, pairs in loaded.items()}
        self.reward_mode = reward

    def source_split(self, name: str) -> Sequence[Problem]:
        """The split as the file has it, before chat rendering (what a resume compares: a template
        may render today's date)."""
        self.split(name)  # the same error for an unknown name
        return self._sources[name]

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise ValueError(f"unknown split {name!r}: use 'train' or 'test'")
        return self._splits[name]

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return answer_reward(self.reward_mode, problem, completion)

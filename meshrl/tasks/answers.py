"""Checking a completion against a problem's answer: the whole text, the last number, or ``\\boxed{}``.

``task.reward`` picks one:

- ``exact``: the completion, stripped of surrounding white space, equals the answer (the built-in
  tasks; short answers with nothing around them).
- ``last_number``: the last number written in the completion equals the answer's number. This is
  how GSM8K-style reasoning is scored: "... so she has 18 apples. #### 18" or "The answer is $1,234."
  both give their last number. ``1,234``, ``1234.0`` and ``$1234`` all read as 1234.
- ``boxed``: the content of the last ``\\boxed{...}`` (braces nested), as MATH-style solutions
  write their final answer. It equals the answer as numbers when both read as numbers (fractions
  ``a/b`` and ``\\frac{a}{b}`` included), else as text with spaces and ``$`` removed.

A completion with nothing to extract scores 0. Every mode reports ``info["correct"]`` and, for the
extracting ones, ``info["answer_found"]`` (the share of completions that stated an answer at all:
a policy that stops writing answers shows there first).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from meshrl.tasks.base import Problem, RewardOutput

__all__ = ["AnswerMode", "ANSWER_MODES", "extract_last_number", "extract_boxed", "parse_number", "answer_reward"]

AnswerMode = Literal["exact", "last_number", "boxed"]
ANSWER_MODES: tuple[str, ...] = ("exact", "last_number", "boxed")

# a sign, digits with optional thousands commas, an optional fraction part (or a bare ".5")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"1,234.5"``), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None  # unclosed: the completion was cut off


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (``"1,234"``, ``"$5"``, ``"50%"`` → 50, ``"3/4"``, ``"\\frac{3}{4}"``,
    ``"2.50"``), or None when it is not one."""
    s = text.strip().replace(" ", "").replace("$", "").replace("\\!", "").rstrip(".")
    s = s.removesuffix("\\%").removesuffix("%")
    frac = _FRAC.match(s)
    if frac:
        a, b = parse_number(frac.group(1)), parse_number(frac.group(2))
        return a / b if a is not None and b else None
    if s.count("/") == 1:
        a, b = (parse_number(part) for part in s.split("/"))
        return a / b if a is not None and b else None
    if not _NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def _same(got: str, want: str) -> bool:
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return a == b
    squash = str.maketrans("", "", " \t\n$")
    return got.translate(squash) == want.translate(squash)


def answer_reward(mode: str, problem: Problem, completion: str) -> RewardOutput:
    """1.0 when ``completion`` answers ``problem`` under ``mode`` (module docstring), else 0.0."""
    if mode == "exact":
        correct = float(completion.strip() == problem.answer.strip())
        return RewardOutput(reward=correct, info={"correct": correct})
    if mode == "last_number":
        got = extract_last_number(completion)
    elif mode == "boxed":
        got = extract_boxed(completion)
    else:
        raise ValueError(f"task.reward: unknown mode {mode!r}; choose one of {ANSWER_MODES}")
    correct = float(got is not None and _same(got, problem.answer))
    return RewardOutput(reward=correct, info={"correct": correct, "answer_found": float(got is not None)})

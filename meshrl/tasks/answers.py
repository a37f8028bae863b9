"""Checking a completion against a problem's answer: the whole text, the last number, or ``\\boxed{}``.

``task.reward`` picks one:

- ``exact``: the completion, stripped of surrounding white space, equals the answer (the built-in
  tasks; short answers with nothing around them).
- ``last_number``: the last number written in the completion equals the answer's number. This is
  how GSM8K-style reasoning is scored: "... so she has 18 apples. #### 18" or "The answer is $1,234."
  both give their last number. ``1,234``, ``1234.0``, ``$1234``, ``1.234e3`` and ``1{,}234`` all
  read as 1234, ``-$5`` as -5. An answer field holding a worked solution ("... #### 72", as
  GSM8K's does) is read the same way: its number after ``####``, else its last number.
- ``boxed``: the content of the last ``\\boxed{...}`` (braces nested), as MATH-style solutions
  write their final answer (an answer field holding a whole solution gives its own last box). Both
  sides are normalised (``\\dfrac``/``\\tfrac`` → ``\\frac``, ``\\frac12``, ``\\text{...}``,
  ``\\left``/``\\right``, ``^\\circ``, ``\\$``, ``\\%``, ``{,}``, spaces, a lone choice in
  parentheses); then they are equal as numbers when both read as numbers (fractions included),
  else as text.

A completion with nothing to extract scores 0. Every mode reports ``info["correct"]`` and, for the
extracting ones, ``info["answer_found"]`` (the share of completions that stated an answer at all:
a policy that stops writing answers shows there first).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from meshrl.tasks.base import Problem, RewardOutput, exact_match_reward

__all__ = ["AnswerMode", "ANSWER_MODES", "extract_last_number", "extract_boxed", "parse_number", "normalize_math",
           "reference_answer", "answer_reward"]

AnswerMode = Literal["exact", "last_number", "boxed"]
ANSWER_MODES: tuple[str, ...] = ("exact", "last_number", "boxed")

# a sign (a currency sign may follow it), digits with optional thousands commas, an optional
# fraction part (or a bare ".5"), an optional exponent
# (a sign right after a word or digit is an operator or a range, "8-10", not a sign)
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"^\\frac\{([^{}]+)\}\{([^{}]+)\}$")


def _plain(text: str) -> str:
    """Typographic and LaTeX spellings of numbers made plain: ``{,}`` thousands, the Unicode minus."""
    return text.replace("{,}", ",").replace("\u2212", "-")


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"1,234.5"``, ``"-$5"``), or None."""
    found = _NUMBER.findall(_plain(text))
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


def normalize_math(text: str) -> str:
    """A final answer in a canonical spelling: the LaTeX wrappers and units that do not change its
    value removed (module docstring), no spaces."""
    s = _plain(text).strip()
    for pattern, repl in _NORMALIZE:
        s = pattern.sub(repl, s)
    s = s.replace(" ", "").rstrip(".")
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)  # "(A)" is the choice "A"
    return choice.group(1) if choice else s


_NORMALIZE = [(re.compile(p), r) for p, r in (
    (r"\\[dt]frac", r"\\frac"), (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"), (r"\\sqrt(\w)", r"\\sqrt{\1}"),
    (r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1"), (r"\\left|\\right", ""), (r"\^\{?\\circ\}?", ""),
    (r"\\[$%!,;: ]", ""), (r"\$", ""),
)]


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (``"1,234"``, ``"$5"``, ``"50%"`` → 50, ``"3/4"``, ``"-\\dfrac{3}{4}"``,
    ``"2.50"``, ``"1.5e3"``), or None when it is not one."""
    s = normalize_math(text).removesuffix("%")
    if s[:1] in "+-" and len(s) > 1 and not _NUMBER.fullmatch(s):
        rest = parse_number(s[1:])
        return None if rest is None else (-rest if s[0] == "-" else rest)
    frac = _FRAC.match(s)
    if frac:
        a, b = parse_number(frac.group(1)), parse_number(frac.group(2))
        return a / b if a is not None and b else None
    if s.count("/") == 1:
        a, b = (parse_number(part) for part in s.split("/"))
        return a / b if a is not None and b else None
    if not _NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", "").replace("$", ""))


def reference_answer(mode: str, answer: str) -> str:
    """The part of a problem's answer field that a completion's extracted answer is compared with:
    the field itself, or, when it holds a worked solution, its final answer (``####``, ``\\boxed``)."""
    if mode == "last_number" and parse_number(answer) is None:
        final = answer.rsplit("####", 1)[-1]
        return extract_last_number(final) or answer
    if mode == "boxed" and ("\\boxed{" in answer or "\\fbox{" in answer):
        return extract_boxed(answer) or answer
    return answer


def _same(got: str, want: str) -> bool:
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return a == b
    return normalize_math(got) == normalize_math(want)


def answer_reward(mode: str, problem: Problem, completion: str) -> RewardOutput:
    """1.0 when ``completion`` answers ``problem`` under ``mode`` (module docstring), else 0.0."""
    if mode == "exact":
        return exact_match_reward(problem, completion)
    if mode == "last_number":
        got = extract_last_number(completion)
    elif mode == "boxed":
        got = extract_boxed(completion)
    else:
        raise ValueError(f"task.reward: unknown mode {mode!r}; choose one of {ANSWER_MODES}")
    correct = float(got is not None and _same(got, reference_answer(mode, problem.answer)))
    return RewardOutput(reward=correct, info={"correct": correct, "answer_found": float(got is not None)})

"""Tool calls in the policy's text, and ``ToolEnv``: an environment that runs them.

A tool call is written ``<name>arguments</name>`` (``<calc>23*47</calc>``), which any tokenizer
can produce, the embedded character tokenizer included. ``ToolEnv`` ends a policy turn at a
closing tag (its ``stop`` strings), runs the tool, appends the result to the context as
``result_format`` text (loss mask 0: the policy is not trained to predict it), and ends the
episode at the first turn without a tool call: that turn is the answer a reward function scores.

Simplifications on purpose: one tool call per turn (the first); tools are plain functions of one
string; a tool that raises answers ``error: <message>`` instead of ending the episode.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from typing import Callable, Mapping

import msgspec

from meshrl.envs.base import StepResult
from meshrl.tasks import Problem

__all__ = ["ToolCall", "ToolEnv", "calculator", "parse_tool_call"]

Tool = Callable[[str], object]


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str
    start: int
    """Where the call begins in the text (the ``<`` of its opening tag)."""


def parse_tool_call(text: str, tools: Mapping[str, Tool] | list[str] | tuple[str, ...]) -> ToolCall | None:
    """The first complete ``<name>arguments</name>`` in ``text`` whose name is a known tool."""
    names = "|".join(re.escape(n) for n in tools)
    if not names:
        return None
    m = re.search(rf"<({names})>(.*?)</\1>", text, flags=re.DOTALL)
    return ToolCall(m.group(1), m.group(2).strip(), m.start()) if m else None


_MAX_POW_BITS = 14_000
"""Largest result of ``**`` on integers, in bits (~4200 digits: printable under Python's int-to-str limit)."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """Evaluate integer/decimal arithmetic (``+ - * / // % **``, parentheses); no names, no calls."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"calculator: exponent {right} is too large")
            if isinstance(node.op, ast.Pow) and isinstance(left, int) and left.bit_length() * abs(right) > _MAX_POW_BITS:
                # nested powers ((9**64)**64)**64... grow without bound, and CPython computes them
                # holding the GIL: the env timeout could not stop the thread, the engine would stall
                raise ValueError("calculator: result is too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"calculator: unsupported expression {ast.unparse(node)!r}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"calculator: not an arithmetic expression: {expression!r}") from None
    except ZeroDivisionError:
        raise ValueError("calculator: division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class ToolEnv:
    """The problem's prompt, tools called as ``<name>arguments</name>``, then an answer turn."""

    def __init__(self, problem: Problem, tools: Mapping[str, Tool], *, result_format: str = "<result>{}</result>",
                 max_calls: int = 4) -> None:
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        bad = [n for n in tools if not re.fullmatch(r"[A-Za-z_][\w.-]*", n)]
        if bad:
            raise ValueError(f"ToolEnv: tool names must be identifiers (they become tags), got {bad}")
        if "{}" not in result_format:
            raise ValueError(f"ToolEnv: result_format must contain '{{}}' for the result, got {result_format!r}")
        self.problem, self.tools, self.result_format, self.max_calls = problem, dict(tools), result_format, max_calls
        self.stop = tuple(f"</{name}>" for name in tools)
        self.calls = 0

    @classmethod
    def factory(cls, tools: Mapping[str, Tool], **kwargs) -> Callable[[Problem], "ToolEnv"]:
        """An environment factory for the pipeline: ``environment=ToolEnv.factory({"calc": calculator})``."""
        return functools.partial(cls, tools=dict(tools), **kwargs)

    def reset(self) -> str:
        self.calls = 0
        return self.problem.prompt

    def step(self, action: str) -> StepResult:
        call = parse_tool_call(action, self.tools)
        if call is None or self.calls >= self.max_calls:
            return StepResult("", 0.0, True, self._info())
        self.calls += 1
        try:
            result = str(self.tools[call.name](call.arguments))
        except Exception as exc:  # the policy sees the error and may try again
            result = f"error: {exc}"
        return StepResult(self.result_format.format(result), 0.0, False, self._info())

    def _info(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_used": float(self.calls > 0)}

"""Tasks: prompts with verifiable answers, a held-out split, and the reward that checks them.

A task is data plus a reward function; the rollout side sees only prompt token ids and the
reward side only ``(problem, completion text)``. Prompts are consumed in shuffled epochs from a
seed, and the position in that stream is a plain integer, so a checkpoint can resume it exactly.
"""

from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence

import msgspec

__all__ = ["Problem", "RewardOutput", "Task", "PromptStream", "exact_match_reward"]


class Problem(msgspec.Struct, frozen=True):
    """One prompt and the answer a correct completion must produce."""

    id: int
    prompt: str
    answer: str


class RewardOutput(msgspec.Struct):
    reward: float
    info: dict[str, float] = {}
    """Task metrics averaged in the logs, e.g. ``{"correct": 1.0}``."""


class Task(Protocol):
    """A verifiable task: a training split, a held-out split and a reward function.

    An optional class attribute ``quick_reward = True`` says ``reward`` is quick and cannot block
    or hang (a check of the completion's text): it then runs on the scoring event loop, with no
    thread hop and no timeout (``FunctionReward(inline=True)``). The built-in tasks set it."""

    name: str

    def split(self, name: str) -> Sequence[Problem]:
        """``"train"`` or ``"test"`` (held out: never trained on)."""
        ...

    def reward(self, problem: Problem, completion: str) -> RewardOutput: ...


def exact_match_reward(problem: Problem, completion: str) -> RewardOutput:
    """1.0 when the completion, stripped of surrounding white space, equals the answer."""
    correct = float(completion.strip() == problem.answer.strip())
    return RewardOutput(reward=correct, info={"correct": correct})


class PromptStream:
    """An endless stream of training problems: shuffled epochs from a seed, resumable.

    ``position`` counts the problems handed out so far; ``PromptStream(problems, seed,
    position=p)`` continues exactly where a stream at ``p`` stood.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, position: int = 0) -> None:
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        self._problems = problems
        self._seed = seed
        self.position = 0
        self._order: list[int] = []
        self._epoch = -1
        self.skip(position)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self._problems)))
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
            self._order, self._epoch = order, epoch
        return self._order

    def skip(self, n: int) -> None:
        self.position += n

    def take(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self._problems))
            out.append(self._problems[self._order_for(epoch)[index]])
            self.position += 1
        return out


RewardFn = Callable[[Problem, str], RewardOutput]

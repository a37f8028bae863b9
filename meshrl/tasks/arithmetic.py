"""Built-in verifiable arithmetic: ``a+b=`` → ``a+b``, generated from a seed, exact-match reward.

The held-out split is a fixed random set of operand pairs that the training split never
contains, so held-out accuracy measures the learned procedure, not memorised pairs.
Simplification: only addition of non-negative integers with up to ``digits`` digits each.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from meshrl.tasks.base import Problem, RewardOutput, exact_match_reward

__all__ = ["AdditionTask"]

_ENUMERATE_LIMIT = 250_000


class AdditionTask:
    """``digits``-digit addition; ``num_test`` held-out problems, the rest (or ``num_train``) to train."""

    name = "addition"

    quick_reward = True  # its answer check: scored inline (Task.quick_reward)

    def __init__(self, digits: int = 2, *, num_train: int = 100_000, num_test: int = 500, seed: int = 0):
        if digits < 1:
            raise ValueError(f"task.digits must be >= 1, got {digits}")
        space = 10 ** (2 * digits)
        if num_test >= space // 2:
            raise ValueError(f"task.num_test={num_test} leaves too few of the {space} problems to train on")
        rng = random.Random(seed)
        limit = 10**digits
        test_pairs: set[tuple[int, int]] = set()
        while len(test_pairs) < num_test:
            test_pairs.add((rng.randrange(limit), rng.randrange(limit)))
        if space <= _ENUMERATE_LIMIT:
            train_pairs = [(a, b) for a in range(limit) for b in range(limit) if (a, b) not in test_pairs]
            rng.shuffle(train_pairs)
            train_pairs = train_pairs[:num_train]
        else:
            seen, train_pairs = set(test_pairs), []
            while len(train_pairs) < num_train:
                pair = (rng.randrange(limit), rng.randrange(limit))
                if pair not in seen:
                    seen.add(pair)
                    train_pairs.append(pair)
        self.digits = digits
        self._splits = {
            "train": [self._problem(i, a, b) for i, (a, b) in enumerate(train_pairs)],
            "test": [self._problem(i, a, b) for i, (a, b) in enumerate(sorted(test_pairs))],
        }

    @staticmethod
    def _problem(index: int, a: int, b: int) -> Problem:
        return Problem(id=index, prompt=f"{a}+{b}=", answer=str(a + b))

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise ValueError(f"unknown split {name!r}: use 'train' or 'test'")
        return self._splits[name]

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return exact_match_reward(problem, completion)

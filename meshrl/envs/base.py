"""The environment interface: multi-turn episodes that the rollout side plays with its engine.

```python
class Env:                                   # any object with these two methods (sync or async)
    stop = ("</calc>",)                      # optional: strings that end a policy turn
    def reset(self) -> str: ...              # the first observation: the prompt
    def step(self, action: str) -> StepResult | tuple:   # (observation, reward, done[, info])
        ...
    def close(self) -> None: ...             # optional: release what the episode held
```

An environment is made per episode by a factory from the episode's ``Problem``
(``environment=lambda problem: Env(problem)``), so an episode's state never leaks into another.
The factory and every sync method of one episode's environment run on one daemon thread of that
episode's own (``CallThread``): one that blocks or hangs holds neither the engine's event loop nor a
thread other episodes need, and an object bound to the thread that made it (an sqlite connection, a
sync Playwright browser) works across the episode's calls. Each call is bounded by
``env_timeout_s`` from its start. ``close`` is called once per environment made, however its
episode ended (done, a limit, a failure, a timeout); an environment whose factory returned after
its timeout is closed on that thread.
The episode runner (``meshrl.envs.episode``) appends each policy turn and each observation to one
token sequence; ``Episode`` records which tokens the policy produced (trained, loss mask 1) and
which the environment did (context only, loss mask 0).

Simplification on purpose: observations are appended as plain text, tokenised on their own; a
chat model's role markers, if any, are the environment's to write into the observation.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import msgspec

from meshrl.envs.rewards import finite_info, finite_number
from meshrl.threads import CallThread, in_thread
from meshrl.tasks import Problem

__all__ = ["Environment", "EnvFactory", "Episode", "EpisodeConfig", "StepResult", "as_step_result", "call_env",
           "maybe_await", "stop_strings"]

T = TypeVar("T")


class StepResult(msgspec.Struct, frozen=True):
    """What ``Environment.step`` returns (a tuple ``(observation, reward, done[, info])`` works too)."""

    observation: str
    """Text appended to the context after the policy's turn (not trained); "" when done."""
    reward: float = 0.0
    """Reward of this step; an episode's environment reward is the sum over its steps."""
    done: bool = False
    """The episode is over: no more policy turns."""
    info: dict[str, float] = {}
    """Metrics of the episode (the last step's win), averaged in the logs as ``reward_info/<key>``."""


@runtime_checkable
class Environment(Protocol):
    """One multi-turn episode; ``reset`` and ``step`` may be plain or ``async`` methods."""

    def reset(self) -> str | Awaitable[str]:
        """The first observation: the prompt the policy continues."""
        ...

    def step(self, action: str) -> StepResult | tuple | Awaitable[StepResult | tuple]:
        """React to the policy's turn ``action`` (its text, special tokens removed)."""
        ...

    # Optional, so not a member of the protocol (isinstance would then demand it):
    # def close(self) -> None | Awaitable[None]: release what the episode held (a sandbox, a
    # connection); called once, on every path out of the episode, bounded by env_timeout_s.


EnvFactory = Callable[[Problem], Environment]
"""Makes the environment of one episode from its problem (a class taking a ``Problem`` is one)."""


class EpisodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of one environment episode (used only when the pipeline has an environment)."""

    max_turns: int = 4
    """Policy turns per episode; an episode still running after them ends as "length"."""
    max_tokens: int = 256
    """Response tokens per episode, policy and environment tokens together (each policy turn is
    also bounded by rollout.max_new_tokens)."""
    env_timeout_s: float = 60.0
    """Longest call of the environment factory, ``reset``, ``step`` or ``close``, counted from the
    call's start; past it the episode ends, marked ``reward_failed`` (a late ``close`` only warns)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(f"rollout.episode: max_turns and max_tokens must be >= 1, got {self.max_turns}, {self.max_tokens}")
        if not self.env_timeout_s > 0:
            raise ValueError(f"rollout.episode.env_timeout_s must be > 0 seconds, got {self.env_timeout_s}")


class Episode(msgspec.Struct, kw_only=True):
    """One played episode: the token sequence and who produced each token."""

    prompt_ids: list[int]
    """The first observation's tokens."""
    response_ids: list[int]
    """Every token after the prompt: policy turns and observations, in order."""
    logprobs: list[float]
    """Per response token: the engine's behaviour log-prob on policy tokens, 0.0 on observations."""
    loss_mask: list[int]
    """Per response token: 1 where the policy produced it, 0 for environment text."""
    versions: list[int]
    """Per response token: the policy version that produced it (observations: the version before)."""
    final_text: str
    """The last policy turn's text: what a reward function scores."""
    reward: float = 0.0
    """Sum of the environment's step rewards."""
    info: dict[str, float] = {}
    turns: int = 0
    """Policy turns played."""
    finish_reason: str = "stop"
    """"stop": the environment said done; "length": a turn or token limit ended it; "abort"."""
    failed: bool = False
    """The environment raised or timed out; the sample is marked ``reward_failed``."""

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def behavior_version(self) -> int:
        """The oldest version that produced a policy token; an episode without one (failed before
        the policy played) counts as played at its tokens' version, since the queue refuses a
        negative version and a refused put would end the rollout loop."""
        policy = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(policy or self.versions or [0])


async def maybe_await(value: T | Awaitable[T]) -> T:
    return await value if inspect.isawaitable(value) else value


async def call_env(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str,
                   late: Callable[[Any], None] | None = None, thread: CallThread | None = None) -> Any:
    """Call an environment method (or the factory), async, or sync off the event loop (it may
    block): on ``thread`` (the episode's ``CallThread``), else on a thread of its own
    (``in_thread``); within ``timeout_s`` of its start. ``late``: see ``in_thread``."""
    limit = f"environment {what} took longer than rollout.episode.env_timeout_s={timeout_s:g}s"
    deadline = time.monotonic() + timeout_s
    if inspect.iscoroutinefunction(fn):
        value = fn(*args)
    elif thread is not None:
        value = await thread.call(fn, *args, timeout_s=timeout_s, what=limit, late=late)
    else:
        value = await in_thread(fn, *args, timeout_s=timeout_s, what=limit, late=late)
    if not inspect.isawaitable(value):
        return value
    try:
        return await asyncio.wait_for(value, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise TimeoutError(limit) from None


def as_step_result(value: Any) -> StepResult:
    """``StepResult`` from what ``step`` returned, checked (a ``StepResult`` too: msgspec checks
    types only when decoding); a one-line error names a wrong shape or a non-finite number, so the
    runner fails this episode instead of the whole batch (or a NaN reaching the advantages)."""
    if isinstance(value, StepResult):
        obs, reward, done, info = value.observation, value.reward, value.done, value.info
    elif isinstance(value, tuple) and len(value) in (3, 4):
        obs, reward, done, *rest = value
        info = rest[0] if rest else {}
    else:
        raise TypeError(f"Environment.step must return a StepResult or (observation, reward, done[, info]), got {value!r:.80}")
    if not isinstance(obs, str):
        raise TypeError(f"Environment.step: the observation must be a str, got {type(obs).__name__}")
    if not _is_bool(done):  # bool("false") is True: a string or a number would end or go on by accident
        raise TypeError(f"Environment.step: done must be a bool, got {done!r:.40} ({type(done).__name__})")
    try:
        return StepResult(obs, finite_number(reward, "reward"), bool(done), finite_info(info))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"Environment.step: {exc}") from None


def _is_bool(value: Any) -> bool:
    """A Python bool or a numpy one (``np.bool_``, e.g. from ``array.all()``)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()
                                       and getattr(getattr(value, "dtype", None), "kind", None) == "b")


def stop_strings(env: Environment) -> Sequence[str]:
    """The environment's turn-ending strings (its optional ``stop`` attribute; None: none)."""
    stop = getattr(env, "stop", None) or ()
    if isinstance(stop, str):
        return (stop,)
    if not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"Environment.stop must be a sequence of non-empty strings, got {stop!r}")
    return tuple(stop)

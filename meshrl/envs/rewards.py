"""Rewards: plain functions (sync or async, per sample or batched) and remote scorers over HTTP.

Every reward is an object with ``async score(problems, completions) -> list[RewardOutput | None]``
(one result per completion; None marks a failed score). ``as_reward`` turns what a user passes
into one:

```python
def exact(problem, completion) -> float: ...                 # per sample, sync
async def judge(problem, completion) -> RewardOutput: ...     # per sample, async
@batched_reward
def many(problems, completions) -> list[float]: ...          # one call per batch
HTTPReward("http://127.0.0.1:8000/score", timeout_s=5, retries=2)   # a remote scorer
RewardModel("/path/to/seq-cls-model")                        # a reward model on a mesh (reward_models.py)
```

A function that raises, times out or returns something that is not a finite number marks its sample
(``reward_failed``, reward 0, the ``reward_failed_frac`` metric) and the run goes on.

Simplifications on purpose: a sync function that times out cannot be interrupted; its thread is
abandoned (and the next samples go to a fresh thread). A batched function fails or succeeds as a
whole.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from meshrl.tasks import Problem, RewardOutput

__all__ = ["FunctionReward", "HTTPReward", "Reward", "as_reward", "batched_reward", "to_reward_output"]

log = logging.getLogger(__name__)


@runtime_checkable
class Reward(Protocol):
    async def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardOutput | None]:
        """One result per completion, in order; None marks a failed score."""
        ...


def to_reward_output(value: Any) -> RewardOutput:
    """A number (numpy and 0-d torch scalars too), a ``RewardOutput`` or ``{"reward": x, "info":
    {...}}`` as a RewardOutput; NaN or infinite values raise ``ValueError`` (the sample is marked)."""
    if isinstance(value, RewardOutput):
        return RewardOutput(reward=finite_number(value.reward, "reward"), info=finite_info(value.info))
    if isinstance(value, dict) and "reward" in value:
        return RewardOutput(reward=finite_number(value["reward"], "reward"), info=finite_info(value.get("info") or {}))
    if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:
        return RewardOutput(reward=finite_number(value, "reward"))
    raise TypeError(f"a reward must be a number, a RewardOutput or {{'reward': x, 'info': {{...}}}}, got {value!r:.80}")


def finite_number(value: Any, what: str) -> float:
    """``float(value)``, refusing NaN and infinities: one of them in a group's rewards would turn
    every advantage of the group (and the step's loss) into NaN."""
    try:
        x = float(value.item() if getattr(value, "ndim", None) == 0 else value)  # numpy / torch scalars
    except OverflowError:  # a Python int or Fraction beyond float's range
        raise ValueError(f"{what} must be a finite number, got one too large for a float") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x}")
    return x


def finite_info(info: Any) -> dict[str, float]:
    """``info`` as ``{str: finite float}`` (its values are averaged into the logs)."""
    if not isinstance(info, dict):
        raise TypeError(f"reward info must be a dict of numbers, got {info!r:.80}")
    return {str(k): finite_number(v, f"reward info {k!r}") for k, v in info.items()}


def batched_reward(fn: Callable) -> "FunctionReward":
    """Mark ``fn(problems, completions) -> list`` as a batched reward function (decorator)."""
    return FunctionReward(fn, batched=True)


class FunctionReward:
    """A reward function, sync or async, per sample (``fn(problem, completion)``) or batched."""

    def __init__(self, fn: Callable, *, batched: bool = False, timeout_s: float | None = None,
                 max_concurrency: int = 64) -> None:  # fmt: skip
        if not callable(fn):
            raise TypeError(f"a reward function must be callable, got {fn!r:.80}")
        self.fn, self.batched, self.max_concurrency = fn, batched, max_concurrency
        self.timeout_s = timeout_s
        """Per sample (per batch when batched); None: the pipeline's reward.timeout_s."""
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    def __repr__(self) -> str:
        return f"FunctionReward({getattr(self.fn, '__qualname__', self.fn)!r}, batched={self.batched})"

    async def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardOutput | None]:
        timeout = self.timeout_s if self.timeout_s is not None else 60.0
        if self.batched:
            try:
                if self.is_async:
                    values = await asyncio.wait_for(self.fn(list(problems), list(completions)), timeout)
                else:
                    values = (await _in_threads(self.fn, [(list(problems), list(completions))], timeout))[0]
                    if isinstance(values, BaseException):
                        raise values
                    if inspect.isawaitable(values):  # an async function behind a plain wrapper or a lambda
                        values = await asyncio.wait_for(values, timeout)
                if len(values) != len(completions):
                    raise ValueError(f"batched reward returned {len(values)} results for {len(completions)} completions")
                return [to_reward_output(v) for v in values]
            except Exception as exc:
                _warn(self, exc)
                return [None] * len(completions)
        if self.is_async:
            gate = asyncio.Semaphore(self.max_concurrency)

            async def one(p: Problem, c: str) -> Any:
                async with gate:
                    try:
                        return await asyncio.wait_for(self.fn(p, c), timeout)
                    except BaseException as exc:  # noqa: BLE001 - a timeout or the function's error
                        if isinstance(exc, asyncio.CancelledError) and not isinstance(exc, asyncio.TimeoutError):
                            raise
                        return exc

            values = await asyncio.gather(*(one(p, c) for p, c in zip(problems, completions)))
        else:
            values = await _in_threads(self.fn, list(zip(problems, completions)), timeout)
            if any(inspect.isawaitable(v) for v in values):  # an async function behind a plain wrapper or a lambda
                values = await asyncio.gather(*(_awaited(v, timeout) for v in values))
        return [_checked(self, v) for v in values]


async def _awaited(value: Any, timeout: float) -> Any:
    """``value``, awaited (bounded) if it is awaitable; a failure is returned, as ``_in_threads`` does."""
    if not inspect.isawaitable(value):
        return value
    try:
        return await asyncio.wait_for(value, timeout)
    except Exception as exc:  # TimeoutError included
        return exc


def _checked(reward: Any, value: Any) -> RewardOutput | None:
    if isinstance(value, BaseException):
        _warn(reward, value)
        return None
    try:
        return to_reward_output(value)
    except (TypeError, ValueError, ArithmeticError) as exc:
        _warn(reward, exc)
        return None


def _warn(reward: Any, exc: BaseException) -> None:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        log.warning("%r timed out: %s", reward, exc or "no answer in time")
    else:
        log.warning("%r failed:\n%s", reward, "".join(traceback.format_exception(exc)))


async def _in_threads(fn: Callable, calls: list[tuple], timeout_s: float) -> list[Any]:
    """``fn(*args)`` for each call, in order, on one background thread; a call running longer than
    ``timeout_s`` becomes a ``TimeoutError`` and the rest continue on a fresh thread."""
    results: list[Any] = [None] * len(calls)
    start = 0
    while start < len(calls):
        # "current" is (index, start time), stored as one tuple: a reader never pairs a new index with
        # the previous call's start time (which would time out a call that just began)
        state: dict[str, Any] = {"current": (start, time.monotonic()), "abandoned": False}
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def work(lo: int = start, state: dict = state, done: asyncio.Future = done) -> None:
            for i in range(lo, len(calls)):
                state["current"] = (i, time.monotonic())
                try:
                    value: Any = fn(*calls[i])
                except Exception as exc:  # the caller marks the sample
                    value = exc
                if state["abandoned"]:
                    return
                results[i] = value
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=work, name="meshrl-reward", daemon=True).start()
        while True:
            i, since = state["current"]
            wait = since + timeout_s - time.monotonic()
            if wait > 0:
                try:
                    await asyncio.wait_for(asyncio.shield(done), wait)
                except asyncio.TimeoutError:
                    pass
            if done.done():
                return results
            i, since = state["current"]
            if time.monotonic() - since >= timeout_s:  # the current call is stuck
                state["abandoned"] = True
                results[i] = TimeoutError(f"reward call took longer than {timeout_s:g}s")
                start = i + 1
                break
    return results


def as_reward(value: Any, *, timeout_s: float) -> Reward:
    """A ``Reward`` from a Reward, a Task (its ``reward`` method) or a plain function; functions
    without their own ``timeout_s`` get ``timeout_s``."""
    if isinstance(value, FunctionReward):
        if value.timeout_s is None:
            value.timeout_s = timeout_s
        return value
    if isinstance(value, Reward) and not inspect.isfunction(value):
        return value
    if hasattr(value, "split") and callable(getattr(value, "reward", None)):  # a Task
        return FunctionReward(value.reward, timeout_s=timeout_s)
    if callable(value):
        return FunctionReward(value, timeout_s=timeout_s)
    raise TypeError(f"reward must be a function, a Reward (with async score) or a Task, got {value!r:.80}")


class HTTPReward:
    """A remote scorer: POST JSON, with a timeout per attempt and retries with back-off.

    Per sample (``batch_size=None``) it posts ``{"prompt", "completion", "answer", "problem_id"}``
    and reads a number or ``{"reward": x, "info": {...}}``; batched, it posts ``{"items": [...]}``
    and reads ``{"rewards": [...]}`` (numbers or objects). Connection errors, timeouts, 429 and
    5xx are retried; other 4xx answers fail at once. Failed samples are marked, never raised.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5,
                 batch_size: int | None = None, max_concurrency: int = 32, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HTTPReward: url must start with http:// or https://, got {url!r}")
        if retries < 0 or timeout_s <= 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"HTTPReward: need retries >= 0, timeout_s > 0, batch_size >= 1; got {retries}, {timeout_s}, {batch_size}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.batch_size, self.max_concurrency, self.headers = batch_size, max_concurrency, dict(headers or {})

    def __repr__(self) -> str:
        return f"HTTPReward({self.url!r})"

    async def _post(self, session: Any, body: Any) -> Any:
        import aiohttp

        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                    if r.status == 429 or r.status >= 500:
                        last = RuntimeError(f"{self.url} answered HTTP {r.status}: {(await r.text())[:200]}")
                        continue
                    if r.status >= 400:
                        raise ValueError(f"{self.url} answered HTTP {r.status}: {(await r.text())[:200]}")
                    return await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = TimeoutError(f"{self.url}: no answer within {self.timeout_s:g}s") \
                    if isinstance(exc, asyncio.TimeoutError) else exc  # fmt: skip
        raise RuntimeError(f"{self.url}: gave up after {self.retries + 1} attempts: {last}")

    async def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardOutput | None]:
        import aiohttp

        items = [{"prompt": p.prompt, "completion": c, "answer": p.answer, "problem_id": p.id}
                 for p, c in zip(problems, completions)]  # fmt: skip
        gate = asyncio.Semaphore(self.max_concurrency)
        async with aiohttp.ClientSession(headers=self.headers) as session:

            async def call(body: Any) -> Any:
                async with gate:
                    try:
                        return await self._post(session, body)
                    except Exception as exc:  # marks the samples; the run goes on
                        return exc

            if self.batch_size is None:
                return [_checked(self, v) for v in await asyncio.gather(*(call(x) for x in items))]
            chunks = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
            out: list[RewardOutput | None] = []
            for chunk, answer in zip(chunks, await asyncio.gather(*(call({"items": c}) for c in chunks))):
                rewards = answer.get("rewards") if isinstance(answer, dict) else answer
                if isinstance(rewards, BaseException) or not isinstance(rewards, list) or len(rewards) != len(chunk):
                    _warn(self, rewards if isinstance(rewards, BaseException) else
                          ValueError(f"expected {{'rewards': [{len(chunk)} values]}}, got {str(answer)[:120]}"))
                    out += [None] * len(chunk)
                else:
                    out += [_checked(self, v) for v in rewards]
            return out


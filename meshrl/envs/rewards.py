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

A sync per-sample function scores ``threads`` samples at once (default 8), on up to that many
daemon threads that the reward keeps between calls (``CallThread``s, which environments use too;
one thread started per sample cost 1,000 times an exact match's work): a blocking judge call overlaps with
the others, while a CPU-bound function shares the GIL, so each call (what ``timeout_s`` measures)
takes longer with more threads (``FunctionReward(fn, threads=1)`` scores one at a time). Once its
calls are timed, a fast function's samples go to a thread in chunks of about ``CHUNK_S`` of work
(a thread hop per sample cost 440 times the exact-match scores themselves). A caller that waits a
limited time passes ``within_s``: samples not scored by then are marked, the others kept, so a
slow reward marks samples instead of outlasting its caller (the reward job, and so the run).
A check that is quick and cannot hang (``inline=True``: the built-in tasks' answer checks, or a
task with ``quick_reward = True``) is scored on the caller's event loop, with no thread at all.

Simplifications on purpose: a sync function that times out cannot be interrupted; its thread is
abandoned (and the next samples go to a fresh one). A chunk gets ``timeout_s`` per sample in it,
back to back: a fast function that hangs on one sample marks the chunk's samples not scored yet
(chunks form only of calls timed well under ``CHUNK_S``). A batched function fails or succeeds as
a whole.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
import traceback
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from meshrl.tasks import Problem, RewardOutput
from meshrl.threads import CallThread, in_thread

__all__ = ["FunctionReward", "HTTPReward", "Reward", "WrongCount", "as_reward", "batched_reward", "in_thread",
           "is_task", "to_reward_output", "warn_limited"]

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
                 max_concurrency: int = 64, threads: int = 8, inline: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"a reward function must be callable, got {fn!r:.80}")
        if max_concurrency < 1 or threads < 1:
            raise ValueError(f"FunctionReward: need max_concurrency >= 1 and threads >= 1, got {max_concurrency}, {threads}")
        self.fn, self.batched = fn, batched
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        if inline and (batched or self.is_async):
            raise ValueError(f"FunctionReward: inline=True is for a sync per-sample function, not {fn!r:.80} "
                             f"({'batched' if batched else 'async'})")
        self.inline = inline
        """A sync per-sample function that is quick and cannot block (a task's answer check,
        ``Task.quick_reward``): scored on the caller's event loop, no thread. A hop to a thread
        costs more than such a check, and on a loop that also runs an engine's steps the thread
        waits for the GIL behind them (the laptop bench's 32-sample jobs: 3.2 ms from the
        generations to the scored samples on average, 8.9 ms at p90, against 0.34 and 0.4 ms
        inline). ``timeout_s`` cannot interrupt it: only for functions that cannot hang."""
        self.max_concurrency = max_concurrency
        """An async per-sample function's calls in flight at once."""
        self.threads = threads
        """A sync per-sample function's calls in flight at once, each on a thread of its own
        (module docstring: 1 for a CPU-bound function)."""
        self.timeout_s = timeout_s
        """Per sample (per batch when batched); None: the pipeline's reward.timeout_s."""
        self._idle: list[CallThread] = []  # a sync function's threads between calls
        self._call_s: float | None = None
        """A sync function's call time so far (a moving average; ``_chunk_size``)."""
        self._awaitables = False
        """A sync function returned an awaitable (awaited on the loop, one sample at a time)."""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_idle": []}  # threads stay in the process that made them

    def __repr__(self) -> str:
        return f"FunctionReward({getattr(self.fn, '__qualname__', self.fn)!r}, batched={self.batched})"

    async def score(self, problems: Sequence[Problem], completions: Sequence[str], *,
                    within_s: float | None = None) -> list[RewardOutput | None]:
        """One result per completion (None: failed). ``within_s``: the whole call's limit (its
        caller's own timeout, less its margin); samples not scored by then are marked, the others kept."""
        if self.inline:
            return [_checked(self, self._timed(problem, text)) for problem, text in zip(problems, completions)]
        timeout = self.timeout_s if self.timeout_s is not None else 60.0
        deadline = math.inf if within_s is None else time.monotonic() + within_s
        if self.batched:
            try:
                values = await self._call(list(problems), list(completions), timeout=timeout, deadline=deadline)
                if len(values) != len(completions):
                    raise WrongCount(f"returned {len(values)} scores for {len(completions)} completions (one each "
                                     f"expected): the {len(completions)} samples are marked reward_failed, reward 0")
                return [to_reward_output(v) for v in values]
            except Exception as exc:
                _warn(self, exc)
                return [None] * len(completions)
        gate = asyncio.Semaphore(self.max_concurrency if self.is_async else self.threads)
        n = len(completions)
        size = self._chunk_size(n)
        # a sync function's samples go to a thread a chunk at a time (one sample a chunk until its
        # calls are timed, or when a call takes CHUNK_S or more): one thread hop per chunk
        chunks = [list(zip(problems[a : a + size], completions[a : a + size])) for a in range(0, n, size)]

        async def one(chunk: list[tuple[Problem, str]]) -> list[Any]:
            async with gate:  # waits for: a call of this job to end (or to be abandoned at its timeout)
                try:
                    return await self._call_chunk(chunk, timeout=timeout, deadline=deadline)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a timeout or the function's error marks the samples
                    return [exc] * len(chunk)

        values = [v for part in await asyncio.gather(*(one(c) for c in chunks)) for v in part]
        late = [v for v in values if isinstance(v, _OverBudget)]
        if late:  # one line for the job, not one per sample
            log.warning("%r: %d of %d samples not scored within the caller's %gs, marked reward_failed (raise threads= "
                        "or max_concurrency=, or make the reward faster)", self, len(late), len(values), within_s)
        return [None if isinstance(v, _OverBudget) else _checked(self, v) for v in values]

    def _chunk_size(self, n: int) -> int:
        """Samples per thread hop of a sync per-sample function: as many as take ``CHUNK_S`` by its
        timed calls, at most an equal share per thread (blocking calls still overlap); 1 for an
        async function, one not timed yet, or one that returned awaitables."""
        if self.is_async or self._call_s is None or self._awaitables:
            return 1
        return max(1, min(int(CHUNK_S / max(self._call_s, 1e-7)), MAX_CHUNK, math.ceil(n / self.threads)))

    async def _call_chunk(self, chunk: list[tuple[Problem, str]], *, timeout: float, deadline: float) -> list[Any]:
        """Each ``fn(problem, completion)`` of ``chunk`` (a value, or the exception it raised), the
        chunk bounded by ``timeout`` per sample and by ``deadline``; at a chunk's timeout the samples
        it scored keep their values and the others get the timeout (``_OverBudget`` past the deadline)."""
        if len(chunk) == 1 or self.is_async:
            try:
                return [await self._call(*chunk[0], timeout=timeout, deadline=deadline)]
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001
                return [exc]
        out: list[Any] = [_UNSCORED] * len(chunk)  # filled by the thread as it goes
        try:
            await self._call(chunk, out, timeout=timeout * len(chunk), deadline=deadline, run=self._run_chunk)
        except TimeoutError as exc:
            return [exc if v is _UNSCORED else v for v in list(out)]  # (a late result of the abandoned thread: not read)
        return [await self._awaited(v, timeout, deadline) if inspect.isawaitable(v) else v for v in out]

    async def _awaited(self, value: Any, timeout: float, deadline: float) -> Any:
        """What an awaitable a sync function returned gives (or the error it raised)."""
        try:
            return await asyncio.wait_for(value, max(0.0, min(timeout, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            return TimeoutError(f"{self!r} took longer than {timeout:g}s")
        except Exception as exc:
            return exc

    def _run_chunk(self, chunk: list[tuple[Problem, str]], out: list[Any]) -> None:
        """On a thread: ``fn`` over ``chunk`` in order, each value (or exception) into ``out``."""
        for j, args in enumerate(chunk):
            out[j] = self._timed(*args)

    def _timed(self, *args: Any) -> Any:
        """On a thread (or inline): ``fn(*args)`` (or the exception it raised), its time into ``_call_s``."""
        t0 = time.perf_counter()
        try:
            value = self.fn(*args)
        except Exception as exc:
            value = exc
        took = time.perf_counter() - t0
        self._call_s = took if self._call_s is None else 0.9 * self._call_s + 0.1 * took
        self._awaitables = self._awaitables or inspect.isawaitable(value)
        return value

    async def _call(self, *args: Any, timeout: float, deadline: float, run: Callable | None = None) -> Any:
        """``fn(*args)`` (or, sync, ``run(*args)``), bounded by ``timeout`` and by ``deadline``
        (time.monotonic); cut by the deadline, it raises ``_OverBudget``."""
        try:
            limit = min(timeout, deadline - time.monotonic())
            if limit <= 0:
                raise TimeoutError
            if self.is_async:
                value = self.fn(*args)
            else:
                lane = self._idle.pop() if self._idle else CallThread("meshrl-reward")
                try:
                    value = await lane.call(run or self._timed, *args, timeout_s=limit,
                                            what=f"{self!r} took longer than {timeout:g}s")
                except TimeoutError:  # abandoned at its timeout: the thread ends if the call ever returns
                    lane.close()
                    raise
                except BaseException:  # cancelled: the call may still run
                    lane.close()
                    raise
                self._idle.append(lane)
                if isinstance(value, Exception):  # the function raised (``_timed``): its thread is free
                    raise value
            if inspect.isawaitable(value):  # async, or an async function behind a plain wrapper or a lambda
                try:
                    value = await asyncio.wait_for(value, max(0.0, min(timeout, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{self!r} took longer than {timeout:g}s") from None
            return value
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise _OverBudget(f"{self!r}: not scored within the caller's time") from None
            raise


_UNSCORED = object()
"""A sample of a chunk its thread has not scored (yet)."""

CHUNK_S = 0.002
"""A sync function's samples go to a thread in chunks that take about this long by its timed
calls: one thread hop (about 70 µs of the event loop's and the thread's time a sample, 17.7 ms for
256 exact-match scores against 0.04 ms for the scores themselves) per chunk, not per sample."""
MAX_CHUNK = 256


class _OverBudget(TimeoutError):
    """A sample that its caller's deadline left unscored (logged once per call)."""


def _checked(reward: Any, value: Any) -> RewardOutput | None:
    if isinstance(value, BaseException):
        _warn(reward, value)
        return None
    try:
        return to_reward_output(value)
    except (TypeError, ValueError, ArithmeticError) as exc:
        _warn(reward, exc)
        return None


WARN_EVERY_S = 10.0
"""A reward's failures of one kind are logged once per this many seconds per process, with a count
of those in between (a broken reward fails on every job: dozens a step)."""
_warned: dict[tuple[str, str], list[float]] = {}  # (reward, error type) -> [time logged, failures since]


def warn_limited(reward: Any, kind: str, message: str, *, details: str = "") -> None:
    """Log ``message`` about ``reward``'s failure of ``kind`` in one line, unless one of that kind was
    logged less than ``WARN_EVERY_S`` ago (then counted into the next line). ``details`` (a
    traceback) goes with the first line of each kind only."""
    now, key = time.monotonic(), (repr(reward), kind)
    last = _warned.get(key)
    if last is not None and now - last[0] < WARN_EVERY_S:
        last[1] += 1
        return
    more = f" ({last[1]:.0f} more like it in the last {now - last[0]:.0f}s)" if last is not None and last[1] else ""
    _warned[key] = [now, 0]
    log.warning("%s%s%s", message, more, f"\n{details}" if details and last is None else "")


class WrongCount(ValueError):
    """A batched reward answered with another number of results than completions it was given."""


def _warn(reward: Any, exc: BaseException) -> None:
    kind = type(exc).__name__
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        warn_limited(reward, kind, f"{reward!r} timed out: {exc or 'no answer in time'}")
    elif isinstance(exc, WrongCount):  # the reward's own answer is wrong: the line says all there is
        warn_limited(reward, kind, f"{reward!r}: {exc}")
    else:
        warn_limited(reward, kind, f"{reward!r} failed: {kind}: {str(exc)[:300]}",
                     details="".join(traceback.format_exception(exc)))


def is_task(value: Any) -> bool:
    """A Task: ``split`` and a callable ``reward``. Recognised before a ``Reward``, which is any
    object with a ``score`` attribute (a runtime-checkable protocol checks names only), so a task
    with a ``score`` helper of its own is still scored by its ``reward`` method."""
    return callable(getattr(value, "split", None)) and callable(getattr(value, "reward", None))


def as_reward(value: Any, *, timeout_s: float) -> Reward:
    """A ``Reward`` from, in this order: a ``FunctionReward``; a Task (``is_task``: its ``reward``
    method); a Reward (an object with async ``score``); a plain function. Functions without their
    own ``timeout_s`` get ``timeout_s``."""
    from meshrl.tasks import NamedFunction

    if isinstance(value, NamedFunction):  # task.reward_function: imported here, in the worker
        value = value.load()
    if isinstance(value, FunctionReward):
        if value.timeout_s is None:
            value.timeout_s = timeout_s
        return value
    if is_task(value):
        return FunctionReward(value.reward, timeout_s=timeout_s, inline=bool(getattr(value, "quick_reward", False)))
    if isinstance(value, Reward) and not inspect.isfunction(value):
        return value
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
                 batch_size: int | None = None, max_concurrency: int = 32, headers: dict[str, str] | None = None) -> None:
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
                    if isinstance(exc, asyncio.TimeoutError) else exc
        raise RuntimeError(f"{self.url}: gave up after {self.retries + 1} attempts: {last}")

    async def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardOutput | None]:
        import aiohttp

        items = [{"prompt": p.prompt, "completion": c, "answer": p.answer, "problem_id": p.id}
                 for p, c in zip(problems, completions)]
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


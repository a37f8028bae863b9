"""The episode runner: plays environments with an engine, one token sequence per episode.

```text
env = make_env(problem)            (on a thread of its own, bounded by env_timeout_s, as every env call)
prompt_ids = encode(env.reset())
repeat up to max_turns:
    policy turn: engine.generate(context) until EOS, a stop string, or max_new_tokens
                 → tokens appended with their log-probs and versions, loss mask 1
    env.step(turn text) → observation, reward, done  (a cut-off turn is stepped too)
    done → stop; else the observation's tokens are appended with loss mask 0, log-prob 0.0
env.close()                        (if it has one: once, however the episode ended)
```

Whatever the environment gets wrong (raises, times out, returns a malformed step, a prompt or
stop string the tokenizer cannot encode) fails only its own episode, marked ``failed``; engine
errors do raise.

Stop strings end a turn early: the engine stops at the *last token* of each stop string, and a
turn that stopped there without the whole string at its end (``>`` of ``<calc>`` when the stop
string is ``</calc>``) continues in a new generate call from the same context, so sampling is
unchanged. Every episode of a batch runs as its own task, so the engine batches their turns.
Sampling is seeded per episode and per generate call from the request's seed, so episodes do not
depend on how they interleave.

Simplifications on purpose: a stop string must end on a token boundary of its own encoding (true
for character tokenizers and for tags in common BPE vocabularies); the context is re-prefilled
for every call (no prefix cache).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from typing import Any, Callable, Sequence

import msgspec

from meshrl.engines.types import Engine, GenerateRequest, SamplingParams
from meshrl.envs.base import EnvFactory, Episode, EpisodeConfig, as_step_result, call_env, stop_strings
from meshrl.threads import CallThread
from meshrl.tasks import Problem

__all__ = ["EpisodeRequest", "run_episode", "run_episodes"]

log = logging.getLogger(__name__)
_SEED_MOD = 1 << 62


class EpisodeRequest(msgspec.Struct, kw_only=True):
    """``n`` episodes of one problem (a group), sampled with ``sampling`` (its ``n`` is ignored)."""

    problem: Problem
    n: int = 1
    sampling: SamplingParams


class _Trace:
    """The growing token sequence of one episode."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.versions: list[int] = []

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], policy: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(policy)] * len(ids)

    def episode(self, **fields: Any) -> Episode:
        return Episode(prompt_ids=self.prompt_ids, response_ids=self.ids, logprobs=self.logprobs,
                       loss_mask=self.mask, versions=self.versions, **fields)


def _seed(base: int | None, *salt: int) -> int | None:
    if base is None:
        return None
    for s in salt:
        base = (base * 1_000_003 + s + 1) % _SEED_MOD
    return base


async def _policy_turn(engine: Engine, tokenizer: Any, trace: _Trace, sampling: SamplingParams, stops: Sequence[str],
                       stop_ids: tuple[int, ...], budget: int, seed: int | None) -> str:
    """Generate one policy turn into ``trace``; returns why it ended: "eos", "stop" (a stop
    string), "length" (the turn's max_new_tokens), "budget" (the episode's tokens) or "abort"."""
    eos = tokenizer.eos_token_id
    start, calls = len(trace.ids), 0
    while True:
        made = len(trace.ids) - start
        if made >= budget:
            return "budget"
        if made >= sampling.max_new_tokens:
            return "length"
        room = min(sampling.max_new_tokens - made, budget - made)
        sp = msgspec.structs.replace(sampling, n=1, max_new_tokens=room, seed=_seed(seed, calls),
                                     stop_token_ids=tuple(sorted(set(sampling.stop_token_ids) | set(stop_ids))))
        request = GenerateRequest(input_ids=trace.prompt_ids + trace.ids, sampling=sp)
        (result,) = await engine.generate([request])
        c = result.completions[0]
        trace.add(c.output_ids, c.logprobs, c.versions, policy=True)
        calls += 1
        if c.finish_reason == "abort" or not c.output_ids:
            return "abort"
        if c.finish_reason == "length":
            continue  # the loop's head says which limit it was
        if c.output_ids[-1] == eos or c.output_ids[-1] not in stop_ids:
            return "eos"
        text = tokenizer.decode(trace.ids[start:], skip_special_tokens=False)
        if any(text.endswith(s) for s in stops):
            return "stop"
        # the last token of a stop string, but not the whole string: keep generating this turn


async def run_episode(engine: Engine, tokenizer: Any, env: Any, sampling: SamplingParams, limits: EpisodeConfig, *,
                      max_seq_len: int, fallback_prompt: str = "", thread: CallThread | None = None) -> Episode:
    """Play one episode of ``env`` (module docstring). An environment's error or timeout never
    raises: the episode ends there, marked ``failed`` (engine errors do raise). ``env`` stays the
    caller's to close (``run_episodes`` closes those it makes). ``thread``: where ``env``'s sync
    methods run (``run_episodes``: the thread its factory ran on); None: a thread per call."""
    timeout = limits.env_timeout_s
    try:
        prompt = await call_env(env.reset, timeout_s=timeout, what="reset", thread=thread)
        if not isinstance(prompt, str) or not prompt:
            raise TypeError(f"Environment.reset must return a non-empty str, got {prompt!r:.80}")
        stops = stop_strings(env)
        trace = _Trace(_encoded(tokenizer, prompt, "the prompt Environment.reset returned", add_special_tokens=True))
        stop_ids = tuple(sorted({_encoded(tokenizer, s, "the stop string")[-1] for s in stops}))
    except Exception:
        log.warning("environment reset failed:\n%s", traceback.format_exc())
        return _failed(_Trace(_fallback_ids(tokenizer, fallback_prompt)), engine, tokenizer)
    limit = min(limits.max_tokens, max_seq_len - len(trace.prompt_ids))
    reward, info, turns, final_text, finish = 0.0, {}, 0, "", "length"
    while turns < limits.max_turns:
        start = len(trace.ids)
        ended = await _policy_turn(engine, tokenizer, trace, sampling, stops, stop_ids, limit - start,
                                   _seed(sampling.seed, turns))
        turns += 1
        final_text = tokenizer.decode(trace.ids[start:], skip_special_tokens=True)
        if ended in ("budget", "abort"):
            finish = "length" if ended == "budget" else ended
            break
        try:
            result = as_step_result(await call_env(env.step, final_text, timeout_s=timeout, what="step", thread=thread))
            obs = [] if result.done else tokenizer.encode(result.observation, add_special_tokens=False)
        except Exception:
            log.warning("environment step failed:\n%s", traceback.format_exc())
            return trace.episode(final_text=final_text, info=info, turns=turns, finish_reason="abort", failed=True)
        reward += result.reward
        info = {**info, **result.info}
        if result.done:
            finish = "length" if ended == "length" else "stop"  # a cut-off last turn counts as truncated
            break
        obs = obs[: max(0, limit - len(trace.ids))]
        version = trace.versions[-1] if trace.versions else engine.version
        trace.add(obs, [0.0] * len(obs), [version] * len(obs), policy=False)
        if len(trace.ids) >= limit:
            break
    if not any(trace.mask):  # no room for a single policy token (a prompt as long as max_seq_len)
        return _failed(trace, engine, tokenizer)
    return trace.episode(final_text=final_text, reward=reward, info=info, turns=turns, finish_reason=finish)


def _encoded(tokenizer: Any, text: str, what: str, add_special_tokens: bool = False) -> list[int]:
    """``text``'s tokens; none (a tokenizer that drops characters it lacks, as the embedded
    character tokenizer does) is the environment's error: an empty prompt would fail the engine's
    whole batch, and a stop string needs a last token."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise ValueError(f"{what} {text!r:.40} encodes to no tokens with this tokenizer (characters it lacks?)")
    return ids


def _fallback_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt tokens of an episode that failed before it had its own: the problem's prompt,
    or one EOS when that encodes to nothing (a sample needs a prompt)."""
    ids = tokenizer.encode(prompt) if prompt else []
    return ids or [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0]


def _failed(trace: _Trace, engine: Engine, tokenizer: Any) -> Episode:
    """A failed episode with no policy token: one masked EOS, so its group stays whole."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    trace.add([eos], [0.0], [engine.version], policy=False)
    return trace.episode(final_text="", finish_reason="abort", failed=True)


async def run_episodes(engine: Engine, tokenizer: Any, make_env: EnvFactory, requests: Sequence[EpisodeRequest],
                       limits: EpisodeConfig, *, max_seq_len: int) -> list[list[Episode]]:
    """Every request's ``n`` episodes, concurrently; episode ``j`` of a request is seeded from its
    sampling seed and ``j``. Each environment is made by ``make_env`` off the event loop, bounded
    by env_timeout_s (a failure or timeout fails that episode), and closed after its episode."""
    timeout = limits.env_timeout_s

    async def one(req: EpisodeRequest, j: int) -> Episode:
        thread = CallThread(f"meshrl-env-{req.problem.id}-{j}")  # the environment's factory and methods, in order
        try:
            try:
                env = await call_env(make_env, req.problem, timeout_s=timeout, what="factory", thread=thread,
                                     late=_close_late(timeout))
            except Exception:
                log.warning("environment factory failed on problem %s:\n%s", req.problem.id, traceback.format_exc())
                return _failed(_Trace(_fallback_ids(tokenizer, req.problem.prompt)), engine, tokenizer)
            sampling = msgspec.structs.replace(req.sampling, seed=_seed(req.sampling.seed, j))
            try:
                return await run_episode(engine, tokenizer, env, sampling, limits, max_seq_len=max_seq_len,
                                         fallback_prompt=req.problem.prompt, thread=thread)
            finally:
                await _close(env, timeout, thread)
        finally:
            thread.close()  # the thread ends after the calls given to it (a hung one keeps it)

    tasks = [[asyncio.ensure_future(one(r, j)) for j in range(r.n)] for r in requests]
    try:
        return [[await t for t in group] for group in tasks]
    finally:
        for group in tasks:
            for t in group:
                t.cancel()


async def _close(env: Any, timeout_s: float, thread: CallThread | None = None) -> None:
    """``env.close()`` if it has one, bounded like every env call; a failure only warns (the
    episode is played already)."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        await call_env(close, timeout_s=timeout_s, what="close", thread=thread)
    except Exception:
        log.warning("environment close failed:\n%s", traceback.format_exc())


def _close_late(timeout_s: float) -> Callable[[Any], None]:
    """Closes an environment whose factory returned after its timeout, on the factory's thread (the
    one the environment belongs to, abandoned by the episode, where blocking harms no one); an async
    close gets an event loop of its own there, bounded by ``timeout_s``."""

    def close(env: Any) -> None:
        fn = getattr(env, "close", None)
        if not callable(fn):
            return
        if inspect.iscoroutinefunction(fn):
            asyncio.run(_close(env, timeout_s))
            return
        try:
            fn()
        except Exception:
            log.warning("environment close failed:\n%s", traceback.format_exc())

    return close

"""Streamed requests of a TorchEngine: which tokens of each sample are new, read once per interval.

``TorchEngine.generate_stream`` opens a stream for its request; after every ``interval_steps``-th
decode step the engine calls ``after_step``, which reads the new tokens of every streamed sample
that runs (one gather of their rows' output buffers: a device -> host copy, and on CUDA a sync,
made only while some stream is open) and queues them as ``StreamDelta``s. A sample's last delta
(``finished``, or ``resolved`` for requests that ended before they ran) carries the rest of its
``Completion`` and its finish reason, so the deltas of a sample always add up to its completion.

Under lagged stop checks (CUDA) a row's newest token may still turn out to follow a stop token;
it is sent one step later, once confirmed (``RunningBatch.unconfirmed_tokens``). Each read waits for
the step just launched, so while a stream is open the host no longer runs ahead of the GPU on
reading steps: raise ``stream_interval_steps`` where throughput matters more than latency.

``IncrementalText`` turns growing token ids into text a few tokens at a time (as SGLang's and
vLLM's detokenizers do), holding back a character whose bytes are not all there yet; the servers
use it so that a chunk costs what its new tokens cost, not the whole output's.

Simplifications, on purpose: deltas are cut at step boundaries (no per-token timing); text is the
server's business (``sglang_api.py``, ``openai_api.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from meshrl.engines.types import Completion, StreamDelta

_CLOSE_WAIT_S = 2.0
"""How long ``Merged.close`` waits for its readers to end once their requests are aborted."""


class _Stream:
    __slots__ = ("queue", "sent", "done")

    def __init__(self, n: int):
        self.queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self.sent = [0] * n  # tokens of each sample already queued
        self.done = [False] * n


class Streams:
    """Open streams by request (the engine's ``_Pending``)."""

    def __init__(self, interval_steps: int):
        self.interval_steps = interval_steps
        self._open: dict[Any, _Stream] = {}

    def __bool__(self) -> bool:
        return bool(self._open)

    def __contains__(self, owner: Any) -> bool:
        return owner in self._open

    def open(self, owner: Any, n: int) -> asyncio.Queue:
        stream = self._open[owner] = _Stream(n)
        return stream.queue

    def close(self, owner: Any) -> None:
        self._open.pop(owner, None)

    @torch.no_grad()
    def after_step(self, batch: Any, steps: int) -> None:
        """Queue the confirmed new tokens of every running streamed sample (every ``interval_steps``)."""
        if steps % self.interval_steps:
            return
        rows, spans = [], []
        for seq in batch.running():
            stream = self._open.get(seq.owner)
            if stream is None:
                continue
            upto = int(batch.olen[seq.row]) - batch.unconfirmed_tokens
            if upto > stream.sent[seq.index]:
                rows.append(seq.row)
                spans.append((seq, stream, stream.sent[seq.index], upto))
        if not rows:
            return
        # each row's own window [sent, upto), padded to the widest (rows differ in progress)
        dev, width, cap = batch.out_tok.device, max(b - a for _, _, a, b in spans), batch.out_tok.shape[1]
        idx = torch.tensor(rows, device=dev)[:, None]
        cols = (torch.tensor([a for _, _, a, _ in spans], device=dev)[:, None] + torch.arange(width, device=dev))
        cols = cols.clamp_(max=cap - 1)
        toks = batch.out_tok[idx, cols].tolist()  # host sync on CUDA: only while a stream is open
        lps = batch.out_lp[idx, cols].tolist()
        for (seq, stream, a, b), tk, lp in zip(spans, toks, lps):
            stream.queue.put_nowait(StreamDelta(index=seq.index, output_ids=tk[: b - a], logprobs=lp[: b - a],
                                                versions=seq.versions(b)[a:]))
            stream.sent[seq.index] = b

    def finished(self, owner: Any, index: int, completion: Completion) -> None:
        """A sample ended: queue the rest of its completion with the finish reason."""
        stream = self._open.get(owner)
        if stream is None or stream.done[index]:
            return
        a = stream.sent[index]
        stream.queue.put_nowait(StreamDelta(index=index, output_ids=completion.output_ids[a:],
                                            logprobs=completion.logprobs[a:], versions=completion.versions[a:],
                                            finish_reason=completion.finish_reason))
        stream.sent[index], stream.done[index] = len(completion.output_ids), True

    def resolved(self, owner: Any, completions: list[Completion]) -> None:
        """A request ended (an abort before it ran included): end every sample not ended yet."""
        for j, c in enumerate(completions):
            if c is not None:
                self.finished(owner, j, c)
        self._open.pop(owner, None)  # its reader holds the queue

    def clear(self) -> None:
        """Forget every stream (the engine dropped its requests; readers already got ``fail``'s error,
        or belong to an event loop that is gone)."""
        self._open.clear()

    def fail(self, exc: BaseException) -> None:
        """A step failed: every open stream raises ``exc`` to its reader."""
        for stream in self._open.values():
            stream.queue.put_nowait(exc)


class DeltaStream:
    """What ``TorchEngine.generate_stream`` returns: an async iterator of one request's deltas whose
    ``aclose`` aborts the request if it still runs, whether or not reading had started."""

    def __init__(self, deltas: Any, on_close: Any):
        self._deltas, self._on_close = deltas, on_close

    def __aiter__(self) -> "DeltaStream":
        return self

    async def __anext__(self) -> StreamDelta:
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()  # (a RuntimeError while a reader is inside __anext__)
        finally:
            self._on_close()

    def abort(self) -> None:
        """End the request now if it still runs, and queue nothing more for it, without waiting for
        its reader: ``aclose`` cannot run while a reader is suspended in ``__anext__``."""
        self._on_close()


class IncrementalText:
    """The text of a growing list of token ids, decoded over a window of the last few tokens."""

    def __init__(self, decode: Any):
        self.decode, self.ids, self.text = decode, [], ""
        self._prefix = self._read = 0  # ids[_prefix:_read] decoded to the end of ``text`` last time

    def extend(self, ids: list[int]) -> str:
        """Add ``ids``; returns the new whole characters (possibly none yet), appended to ``text``."""
        self.ids += ids
        before = self.decode(self.ids[self._prefix:self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):  # nothing new, or half a character
            return ""
        new = now[len(before):]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new


class Merged:
    """Several ``generate_stream`` iterators read as one, for servers: ``(stream index, delta)`` items
    in arrival order. ``close`` (always call it) aborts what still runs and stops the readers."""

    @classmethod
    async def open(cls, engine: Any, requests: list[Any]) -> "Merged":
        """``generate_stream`` for each request, each checked and queued at once (a server answers a
        bad one with a 400 before any header); on one that fails, those already open are closed
        (aborted) and its error is raised."""
        streams: list[Any] = []
        try:
            for r in requests:
                streams.append(engine.generate_stream(r))
        except BaseException:
            for st in streams:
                await st.aclose()
            raise
        return cls(streams)

    def __init__(self, streams: list[Any]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._streams = streams
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]
        self.left = len(streams)

    async def _pump(self, i: int, stream: Any) -> None:
        try:
            async for delta in stream:
                if self._closed:  # close() ran, and this reader's cancellation was swallowed (see close)
                    return
                self._queue.put_nowait((i, delta))
        except Exception as exc:  # an engine error: the reader raises it
            self._queue.put_nowait((i, exc))
        finally:
            self._queue.put_nowait((i, None))

    async def next(self, timeout_s: float) -> tuple[int, StreamDelta] | None:
        """The next delta; None when none came within ``timeout_s`` (the caller may check its client).
        Raises an engine error, and ``StopAsyncIteration`` once every stream has ended."""
        while self.left:
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: it can swallow a cancellation (3.11)
                    i, item = await self._queue.get()
            except TimeoutError:
                return None
            if item is None:
                self.left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return i, item
        raise StopAsyncIteration

    async def close(self) -> None:
        """Stop reading: every request that still runs is aborted at once, then the readers end.

        The requests are ended through their streams (``DeltaStream.abort``, synchronous), not by
        cancelling the readers: on Python 3.11 ``asyncio.wait_for`` (``TorchEngine._deltas``) swallows
        a cancellation that lands while a queued delta is being fetched, and the reader would go on
        to the end of the generation. Such a reader returns at its next delta (``_closed``), and none
        comes after the abort but those queued already, so the wait below is short; it is bounded
        all the same (a reader left over holds no batch row, and ends at ``generate_timeout_s``)."""
        self._closed = True
        for s in self._streams:
            s.abort()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_CLOSE_WAIT_S)
        # each ended reader's stream runs its own clean-up (one still reading cannot be closed)
        await asyncio.gather(*(s.aclose() for s, t in zip(self._streams, self._tasks) if t.done()),
                             return_exceptions=True)

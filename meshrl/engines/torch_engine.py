"""TorchEngine: the embedded, pure-PyTorch generation engine (continuous batching, one event loop).

Concurrency model. Everything runs on the asyncio event loop of the caller (a Ray async actor, the
HTTP server, or ``asyncio.run``): the first ``generate`` starts a *step task* on that loop which
repeats "admit waiting requests (prefill) -> one decode step -> ``await asyncio.sleep(0)``". A
step is synchronous and short (one forward pass), so every other coroutine — ``generate`` adding
requests, ``pause``, ``abort``, ``begin/load/end_weight_update`` — runs *between* steps. That is
what makes a weight flip atomic with no lock: ``end_weight_update`` copies the staged tensors into
the parameters in one synchronous call, so no step ever mixes versions, and every token records
the version that produced it. On CUDA the copy is queued on the same stream as the steps, so the
ordering holds on the device too.

Requests join the running batch at the next step and leave it as soon as they finish. ``pause``
with ``mode="abort"`` ends everything in flight (partial outputs, ``finish_reason="abort"``);
``mode="keep"`` freezes running sequences with their KV cache and continues them on ``resume``
(tokens after a weight update then attend to KV computed by the old weights, as SGLang's in-place
pause does). New requests wait while paused.

Weight updates live in ``engine_weights.py`` and memory release (colocated with a trainer) in
``engine_memory.py``, mixins of this class; its config in ``engine_config.py``.

Tensor parallelism (``tp.py``): either every rank gets the same calls between the same two steps
(SPMD in rounds), or, with ``TensorParallel(leader_driven=True)``, only rank 0 takes calls and the
others run ``await engine.follow()``: before each step rank 0 broadcasts what changed (``_record``),
and they apply it (``_apply``) and run the same step.

Simplifications, on purpose: one engine per process and per loop (moving to a new loop drops what
was in flight on the old one); a request's samples are admitted together; no preemption.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import numbers
import random
from typing import Any, AsyncIterator, Iterable, Sequence

import msgspec
import torch

from meshrl.cpu import native_bf16
from meshrl.engines import schedule
from meshrl.engines.batch import RunningBatch
from meshrl.engines.cuda_graphs import DecodeGraphs, default_bucket_sizes
from meshrl.engines.engine_config import _DTYPES, TorchEngineConfig
from meshrl.engines.engine_memory import MemoryRelease
from meshrl.engines.engine_weights import WeightUpdates
from meshrl.engines.kv_cache import KVCache
from meshrl.engines.layout import ModelSpec
from meshrl.engines.model import Transformer
from meshrl.engines.schedule import ScheduleChannel
from meshrl.engines.streaming import DeltaStream, Streams
from meshrl.engines.tp import TensorParallel
from meshrl.engines.types import Completion, GenerateRequest, GenerateResult, PauseMode, SamplingParams, StreamDelta
from meshrl.engines.weights import StagedWeights, eos_token_ids, iter_safetensors, load_all, load_hf_config

class _Pending:
    """A request from submission until its result is delivered."""

    __slots__ = ("request", "rid", "seed", "future", "completions", "remaining")

    def __init__(self, request: GenerateRequest, rid: str, seed: int, future: asyncio.Future):
        self.request, self.rid, self.seed, self.future = request, rid, seed, future
        self.completions: list[Completion | None] = [None] * request.sampling.n
        self.remaining = request.sampling.n


class TorchEngine(WeightUpdates, MemoryRelease):
    """Continuous-batching generation over a ``Transformer``; implements the ``Engine`` protocol."""

    def __init__(self, hf_config: Any, weights: Iterable[tuple[str, torch.Tensor]],
                 config: TorchEngineConfig = TorchEngineConfig(), *, eos_ids: Sequence[int] | None = None,
                 model_path: str | None = None, tp: TensorParallel | None = None):
        self.config, self.model_path, self.hf_config = config, model_path, hf_config
        self.spec = ModelSpec.from_hf_config(hf_config)
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
                           else config.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        dtype = _DTYPES.get(config.dtype) or (torch.bfloat16 if dev.type == "cuda" or native_bf16() else torch.float32)
        self.device, self.dtype = dev, dtype
        tp = tp or TensorParallel()
        self.tp = tp
        self._channel = ScheduleChannel(tp, dev) if tp.is_leader or tp.is_follower else None
        self._log: list[list] | None = [] if tp.is_leader else None
        """Leader-driven TP, rank 0: what changed since the last broadcast (see ``_record``)."""
        self._broken: str | None = None
        """Why a leader-driven TP engine can no longer work (its group broke), else None."""
        self._shut = False  # shutdown ran
        self._sealed: tuple[StagedWeights, int] | None = None  # a follower's ended stage, until rank 0 flips to it
        self._sealed_event = asyncio.Event()  # set when a follower's stage is ended
        self._flipped_event = asyncio.Event()  # set when it went live (or was dropped)
        self.model = Transformer(self.spec, dtype=dtype, device=dev, tp_rank=tp.rank, tp_size=tp.size,
                                 all_reduce=tp.all_reduce)
        self._weights = self._make_weights_contiguous() if config.contiguous_weights else None
        self._weights_nbytes = self._weights.nbytes() if self._weights is not None else 0
        self._weights_ptr = self._weights.data_ptr() if self._weights is not None else 0
        self.weights_released = False
        load_all(self.model, weights)
        seq = config.max_seq_len or min(self.spec.max_position_embeddings, 4096)
        per_row = KVCache.bytes_per_row(num_layers=self.spec.num_layers, num_kv_heads=self.model.num_kv_heads,
                                        max_seq_len=seq, head_dim=self.spec.head_dim, dtype=dtype)
        rows = config.max_batch_size
        if config.kv_cache_bytes:
            rows = min(rows, config.kv_cache_bytes // per_row)
            if rows < 1:
                raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no sequence: one row of "
                                 f"max_seq_len={seq} needs {per_row} bytes")
        self.cache = KVCache(num_layers=self.spec.num_layers, rows=rows, num_kv_heads=self.model.num_kv_heads,
                             max_seq_len=seq, head_dim=self.spec.head_dim, dtype=dtype, device=dev)
        self.model.rope_table(seq)  # built now: CUDA graph capture must not allocate it
        self.eos_ids = tuple(eos_ids) if eos_ids is not None else self.spec.eos_token_ids
        self._batch = RunningBatch(self.model, self.cache, eos_ids=self.eos_ids,
                                   max_stop_ids=config.max_stop_token_ids)
        core = self._batch.decode_core
        if config.compile:
            core = torch.compile(core, dynamic=True)
        self._core = core
        self._graphs = None
        self.graph_recaptures = 0
        """CUDA graph captures after ``restore_memory`` found an address moved."""
        self._capture_graphs()
        self._version = config.initial_version
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._queued_before_pause: set[str] = set()
        """The requests that were waiting when the last pause began (``flush_cache``)."""
        self._requests: dict[str, _Pending] = {}
        self._paused = False
        self._stage: StagedWeights | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.steps = 0  # decode steps run (a metric)
        self._streams = Streams(config.stream_interval_steps)

    def _capture_graphs(self) -> None:
        self._graphs = None  # the old graphs (and their memory pool) go first
        if self.config.cuda_graphs and self.device.type == "cuda":
            rows = self.cache.rows
            sizes = list(self.config.cuda_graph_batch_sizes) or default_bucket_sizes(rows)
            self._graphs = DecodeGraphs(self._batch, self._core, [min(s, rows) for s in sizes])

    # ---- constructors -----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str, config: TorchEngineConfig = TorchEngineConfig(), **kw: Any
                        ) -> "TorchEngine":
        """Load a local HF checkpoint directory (config.json + safetensors)."""
        hf_config = load_hf_config(path)
        return cls(hf_config, iter_safetensors(path), config, eos_ids=eos_token_ids(path, hf_config),
                   model_path=path, **kw)

    @classmethod
    def from_hf_model(cls, model_or_state_dict: Any, hf_config: Any = None,
                      config: TorchEngineConfig = TorchEngineConfig(), **kw: Any) -> "TorchEngine":
        """Copy weights from an in-memory HF model (config read from it) or an HF-named state dict."""
        if isinstance(model_or_state_dict, torch.nn.Module):
            hf_config = hf_config or model_or_state_dict.config
            state = model_or_state_dict.state_dict()
            if "eos_ids" not in kw:  # as from_pretrained reads generation_config.json
                generation = getattr(model_or_state_dict, "generation_config", None)
                kw["eos_ids"] = eos_token_ids(None, hf_config, getattr(generation, "eos_token_id", None))
        else:
            state = model_or_state_dict
        if hf_config is None:
            raise ValueError("from_hf_model with a state dict needs hf_config")
        return cls(hf_config, state.items(), config, **kw)

    # ---- state ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Policy version of the weights new tokens come from."""
        return self._version

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def broken(self) -> str | None:
        """Why this leader-driven TP engine can no longer serve (its group broke), else None."""
        return self._broken

    @property
    def is_updating(self) -> bool:
        """Between ``begin_weight_update`` and ``end_weight_update``."""
        return self._stage is not None

    @property
    def num_running(self) -> int:
        """Sequences (samples) in the running batch."""
        return self._batch.size

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet admitted."""
        return len(self._waiting)

    @property
    def max_batch_size(self) -> int:
        return self.cache.rows

    # ---- generation -------------------------------------------------------------------------

    def _validate(self, req: GenerateRequest) -> None:
        if not isinstance(req, GenerateRequest):
            raise TypeError(f"generate takes GenerateRequest objects, got {type(req).__name__}")
        sp, ids = req.sampling, req.input_ids
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"request {req.request_id!r}: sampling must be a SamplingParams, got {type(sp).__name__}")
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"request {req.request_id!r}: input_ids must be a list of token ids, got "
                             f"{type(ids).__name__}")
        if not ids:
            raise ValueError(f"request {req.request_id!r} has no input_ids")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {req.request_id!r}: input_ids must be integers")
        if min(ids) < 0 or max(ids) >= self.spec.vocab_size:
            raise ValueError(f"request {req.request_id!r} has token ids outside [0, {self.spec.vocab_size})")
        if len(ids) + sp.max_new_tokens > self.cache.max_seq_len:
            raise ValueError(f"request {req.request_id!r}: {len(ids)} prompt tokens + max_new_tokens="
                             f"{sp.max_new_tokens} exceed max_seq_len={self.cache.max_seq_len}")
        bad_stops = [t for t in sp.stop_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad_stops:
            raise ValueError(f"request {req.request_id!r} has stop_token_ids {bad_stops[:5]} outside "
                             f"[0, {self.spec.vocab_size})")
        if sp.n > self.cache.rows:
            raise ValueError(f"request {req.request_id!r}: n={sp.n} exceeds max_batch_size={self.cache.rows}")
        self._batch.stop_ids(req)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Complete every request (``n`` samples each); results in request order.

        Waits at most ``generate_timeout_s`` for the engine (which may be paused); on timeout or
        cancellation the unfinished requests are aborted.
        """
        pending = self._submit(requests, "generate")
        try:
            return list(await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)),
                                               self.config.generate_timeout_s))
        except asyncio.TimeoutError:
            left = [p.rid for p in pending if self._requests.get(p.rid) is p]  # (futures got cancelled)
            for rid in left:
                self._abort(rid)  # generate timed out
            raise TimeoutError(f"generate: {len(left)} of {len(pending)} requests unfinished after "
                               f"{self.config.generate_timeout_s}s ({self._state_line()}); they were aborted") from None
        except asyncio.CancelledError:
            for p in pending:
                if self._requests.get(p.rid) is p:
                    self._abort(p.rid)  # generate was cancelled
            raise

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """``generate`` for one request, as it runs: each sample's new tokens (``StreamDelta``), read
        every ``stream_interval_steps`` decode steps, then its finish reason on its last delta; the
        iteration ends when every sample has ended. Call it on the engine's event loop: the request is
        checked and queued at once (a bad one raises here, not at the first ``__anext__``).

        Waits at most ``generate_timeout_s`` in all. Closing the iterator (``aclose``; ``async with
        contextlib.aclosing(engine.generate_stream(r)) as s`` closes it after a ``break`` too) aborts
        the request if it still runs, read or not."""
        [p] = self._submit([request], "generate_stream")

        def close() -> None:
            self._streams.close(p)
            if self._requests.get(p.rid) is p:
                self._abort(p.rid)  # generate_stream was closed

        return DeltaStream(self._deltas(p, self._streams.open(p, request.sampling.n)), close)

    async def _deltas(self, p: _Pending, queue: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        deadline, left = loop.time() + self.config.generate_timeout_s, p.request.sampling.n
        try:
            while left:
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
                    # that lands as the get completes, and a cancelled reader read on to the end
                    async with asyncio.timeout_at(deadline):
                        item = await queue.get()
                except TimeoutError:
                    raise TimeoutError(f"generate_stream: request {p.rid!r} unfinished after "
                                       f"{self.config.generate_timeout_s}s ({self._state_line()}); it was aborted") from None
                if isinstance(item, BaseException):  # the step loop failed
                    raise item
                left -= item.finish_reason is not None
                yield item
        finally:
            self._streams.close(p)
            if self._requests.get(p.rid) is p:
                self._abort(p.rid)  # generate_stream was left early

    def _state_line(self) -> str:
        return f"paused={self._paused}, running={self._batch.size}, waiting={len(self._waiting)}"

    def _submit(self, requests: Sequence[GenerateRequest], what: str) -> list[_Pending]:
        """Validate ``requests``, give them ids and seeds, and queue them for the step loop."""
        self._leader_only(what)
        if self.cache.released or self.weights_released:
            raise RuntimeError(f"{what} on an engine whose memory is released (release_memory): call "
                               "restore_memory (and write a whole version if the weights were released) first")
        for r in requests:
            self._validate(r)
        self._ensure_step_task()
        loop = asyncio.get_running_loop()
        accepted, rids = [], set()
        for r in requests:
            rid = r.request_id
            while not rid or (not r.request_id and (rid in self._requests or rid in rids)):
                rid = f"req-{next(self._ids)}"  # an automatic id skips a caller's that is in flight
            if rid in self._requests or rid in rids:
                raise ValueError(f"request_id {rid!r} is already in flight")
            rids.add(rid)
            seed = r.sampling.seed if r.sampling.seed is not None else self._rng.getrandbits(32)
            accepted.append((r, rid, seed))
        pending = [self._enqueue(r, rid, seed, loop.create_future()) for r, rid, seed in accepted]
        self._wake.set()
        return pending

    def _ensure_step_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        if self._loop is not None and self._loop is not loop:
            old_task, old_loop = self._task, self._loop
            if old_task is not None and not old_task.done() and not old_loop.is_closed():
                old_loop.call_soon_threadsafe(old_task.cancel)  # it must not step (or publish) any more
            self._wake = None  # (the old loop's)
            self._drop_all()  # futures of a previous loop cannot be resolved any more
        self._loop, self._wake = loop, asyncio.Event()
        self._task = loop.create_task(self._step_loop(), name="TorchEngine.step_loop")

    async def _step_loop(self) -> None:
        me = asyncio.current_task()
        while self._task is me:  # a task left on another loop stops here
            try:
                if self._paused or not (self._waiting or self._batch.size):
                    self._publish(step=False)  # followers learn of pauses, aborts and flips now, not at the next step
                    self._wake.clear()
                    # idle: woken by generate() or resume(); an idle engine needs no timeout, but its
                    # followers' broadcasts have one: keep them fed
                    if self._channel is None:
                        await self._wake.wait()
                    else:
                        try:
                            await asyncio.wait_for(self._wake.wait(), self.tp.heartbeat_s)
                        except asyncio.TimeoutError:
                            self._publish(step=False, heartbeat=True)
                    continue
                self._publish(step=True)
                self.step()
                await asyncio.sleep(0)  # lets pause/abort/weight updates/new requests run between steps
            except Exception as exc:  # a failed step fails every caller instead of hanging them
                if self._task is not me:
                    return  # (the engine moved to another loop meanwhile: its state is not this task's)
                err = RuntimeError(f"TorchEngine step failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                for p in list(self._requests.values()):
                    if not p.future.done():
                        p.future.set_exception(err)
                        if p in self._streams:
                            p.future.exception()  # its reader gets err from the stream: nobody awaits this
                self._streams.fail(err)
                self._drop_all()
                if self._broken is not None:
                    return  # the TP group is gone: nothing more can be sent
                # the loop goes on (idle): a TP leader's followers still need its heartbeats

    def step(self) -> None:
        """Admit what fits (one prefill), then one decode step of the running batch."""
        if self._waiting and self._batch.free_rows:
            self._admit()
        b = self._batch.size
        if b:
            if self._graphs is not None and self._graphs.can_run(b):
                tok = self._graphs.replay(b)
            else:
                tok = self._core(b, self._batch.seq_len(), sampling_flags=self._batch.sampling_flags())
            self._deliver(self._batch.after_decode(tok))
            self.steps += 1
            if self._streams:
                self._streams.after_step(self._batch, self.steps)

    def _admit(self) -> None:
        chosen, rows, longest = [], 0, 0
        while self._waiting:
            p = self._waiting[0]
            n, t = p.request.sampling.n, max(longest, len(p.request.input_ids))
            if rows + n > self._batch.free_rows or (chosen and (len(chosen) + 1) * t > self.config.max_prefill_tokens):
                break
            self._waiting.popleft()
            chosen.append((p, p.request, p.seed))
            rows, longest = rows + n, t
        if chosen:
            self._deliver(self._batch.admit(chosen, self._version))

    def _deliver(self, finished: list) -> None:
        for seq, completion in finished:
            p: _Pending = seq.owner
            p.completions[seq.index] = completion
            if self._streams:
                self._streams.finished(p, seq.index, completion)
            p.remaining -= 1
            if p.remaining == 0:
                self._resolve(p)

    def _resolve(self, p: _Pending) -> None:
        self._requests.pop(p.rid, None)
        if self._streams:
            self._streams.resolved(p, p.completions)
        if not p.future.done():
            p.future.set_result(GenerateResult(request_id=p.rid, prompt_tokens=len(p.request.input_ids),
                                               completions=list(p.completions)))

    # ---- control ----------------------------------------------------------------------------

    def _abort(self, rid: str) -> bool:
        p = self._requests.get(rid)
        if p is None:
            return False
        self._record(["abort", rid])
        if p in self._waiting:
            self._waiting.remove(p)
            p.completions = [Completion(output_ids=[], logprobs=[], finish_reason="abort", versions=[])
                             for _ in p.completions]
            self._resolve(p)
        else:
            rows = {s.row: "abort" for s in self._batch.running() if s.owner is p}
            if rows:
                self._deliver(self._batch.retire(rows))
        return True

    def is_running(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight (waiting or generating)."""
        return request_id in self._requests

    def samples_of(self, request_id: str) -> int:
        """``n`` of ``request_id`` while it is in flight, else 0."""
        p = self._requests.get(request_id)
        return p.request.sampling.n if p is not None else 0

    async def abort(self, request_id: str) -> None:
        """End one request now; its result holds the tokens so far, ``finish_reason="abort"``."""
        self._leader_only("abort")
        self._abort(request_id)

    def abort_all(self) -> None:
        for rid in list(self._requests):
            self._abort(rid)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop stepping. ``"abort"`` ends all requests in flight; ``"keep"`` keeps them for resume."""
        if mode not in ("abort", "keep"):
            raise ValueError(f"pause mode must be 'abort' or 'keep', got {mode!r}")
        self._leader_only("pause")
        self._paused = True
        self._queued_before_pause = {p.rid for p in self._waiting}
        self._record(["pause"])
        if mode == "abort":
            self.abort_all()

    async def resume(self) -> None:
        """Continue stepping (kept sequences first, then waiting requests)."""
        self._leader_only("resume")
        self._paused = False
        self._record(["resume"])
        if self._wake is not None:
            self._wake.set()

    def _drop_all(self) -> None:
        """Forget every request (their futures are failed, or belong to a loop that is gone)."""
        self._record(["drop"])
        self._streams.clear()
        self._waiting.clear()
        self._requests.clear()
        self._batch.reset()  # no device reads: the step that failed may have left the batch half-updated

    def flush_cache(self) -> bool:
        """SGLang's flush: succeeds only while idle. There is no prefix cache, so nothing to drop.

        Requests that arrive while paused wait as SGLang holds them in its tokenizer manager, outside
        the scheduler whose queues a flush checks: a weight push's flush succeeds although the samples
        its pause ended were already sent again. Requests kept by a ``keep`` pause (SGLang's in-place
        one) are still in the scheduler, and a flush is refused while any is."""
        if self._batch.size:
            return False
        if self._paused:
            return not any(p.rid in self._queued_before_pause for p in self._waiting)
        return not self._waiting

    async def shutdown(self) -> None:
        """Abort everything and stop the step task (and, on a TP leader, the followers' ``follow``)."""
        if self._shut:
            return
        self._shut = True
        self.abort_all()
        if self._log is not None and self._broken is None:
            try:
                self._publish(step=False, stop=True)
            except Exception:  # the followers are gone already (e.g. they got the same Ctrl-C)
                pass
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._task = None

    # ---- leader-driven tensor parallelism (tp.py) ----------------------------------------------

    async def start(self) -> None:
        """Start the step task now rather than at the first ``generate`` (a TP leader's heartbeats keep
        its followers from the group's timeout; a server calls this at startup)."""
        self._leader_only("start")
        self._ensure_step_task()

    def _leader_only(self, what: str) -> None:
        if self._broken is not None:
            raise RuntimeError(f"{what}: {self._broken}")
        if self.tp.is_follower:
            raise RuntimeError(f"{what} on TP rank {self.tp.rank}, which follows rank 0's schedule "
                               "(leader_driven): make generation and control calls on rank 0")

    def _no_in_place(self, what: str) -> None:
        if self.tp.leader_driven and self.tp.size > 1:
            raise RuntimeError(f"{what} is refused under a leader-driven TP engine: it would act on one rank at a "
                               "step of its own (stage weights with begin/load/end_weight_update instead)")

    def _record(self, event: list) -> None:
        """Leader: remember a change of the schedule for the next broadcast (followers ``_apply`` it),
        and wake an idle step loop to send it now."""
        if self._log is not None:
            self._log.append(event)
            if self._wake is not None:
                self._wake.set()

    def _publish(self, *, step: bool, heartbeat: bool = False, stop: bool = False) -> None:
        """Leader: broadcast what changed and whether a step follows (nothing, when neither nor a heartbeat).

        A failed broadcast leaves the group out of step for good: the engine is then ``broken``."""
        if self._log is None or not (step or heartbeat or stop or self._log):
            return
        if self._broken is not None:
            raise RuntimeError(self._broken)
        try:
            self._channel.send(self._log, step=step, stop=stop)
        except Exception as exc:
            self._broken = (f"the TP group is broken (a schedule broadcast to the followers failed: "
                            f"{type(exc).__name__}: {exc}); restart every rank")
            raise
        self._log = []

    async def follow(self) -> None:
        """Leader-driven TP, ranks other than 0: run rank 0's schedule until rank 0 shuts down.

        Each message's changes are applied in rank 0's order, then its step runs; weight updates
        staged here meanwhile go live at rank 0's flip to their version (``schedule.follow``). Fails
        (and drops what runs) when a step fails or no message arrives within the group's timeout."""
        if not self.tp.is_follower:
            raise RuntimeError("follow() is for leader-driven TP ranks other than 0 "
                               f"(this is rank {self.tp.rank}, leader_driven={self.tp.leader_driven})")
        await schedule.follow(self)

    def _enqueue(self, request: GenerateRequest, rid: str, seed: int, future: asyncio.Future) -> _Pending:
        """Queue a validated request for admission (and, on a TP leader, for the followers)."""
        p = _Pending(request, rid, seed, future)
        self._requests[rid] = p
        self._waiting.append(p)
        self._record(["add", rid, [int(t) for t in request.input_ids], msgspec.to_builtins(request.sampling), int(seed)])
        return p

"""The running batch: which sequence owns which cache row, and the per-row state the hot path reads.

Running sequences occupy rows ``[0, B)`` of the KV cache and of a few device tensors (next input
token, position, sampling parameters, stop ids, output buffers). Host-side mirrors (numpy) hold what
scheduling needs (prompt and output lengths, budgets) so that sizing a step never reads the device.

Per decode step the host does O(1) Python work plus O(rows that finished); the only device -> host
reads are (a) which rows hit a stop token, made only when some row can stop on a token, and (b) the
output buffers of rows that finished. When rows finish, the last running rows move into the holes
(``_compact``), keeping the batch packed.

On CUDA, (a) is *lagged* (``lagged_stops``): step t's stop hits are copied into pinned host memory
without waiting, and read after step t+1 has been launched, so the host waits for a step the GPU has
already finished while the next one runs, instead of leaving the GPU idle for every step's Python.
A row that stopped at step t thus runs step t+1 too; that token is discarded (its output is cut at
the stop token), so results equal the synchronous check's, one step later.

When no row can stop on a token (``ignore_eos`` and no stop ids), nothing in a step reads the
device, and the host would queue decode steps without bound: a pause, an abort or a weight update
would then wait behind all of them, and the GPU would go on decoding after the engine stopped.
So the host also waits, each step, for the step launched ``RUN_AHEAD_STEPS`` earlier: it can never
be more than that many steps ahead of the GPU, which is still enough to hide its own Python.

Simplifications, on purpose: a request is admitted only when all of its ``n`` samples fit (FIFO, no
skipping ahead, so a large ``n`` is never starved); sequences are never preempted or swapped out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshrl.engines.kv_cache import KVCache
from meshrl.engines.model import PackedPrompts, Transformer
from meshrl.engines.sampling import mix_seed, sample, sample_and_record_fused, uniform, uniform_np
from meshrl.engines.types import Completion, FinishReason, GenerateRequest

RUN_AHEAD_STEPS = 4
"""CUDA: most decode steps the host may have queued on the GPU beyond the one it waits for."""

# istate columns
_TOK, _POS, _OCOL, _SEED, _TOPK, _STOP = 0, 1, 2, 3, 4, 5


class Seq:
    """One sample of one request while it runs."""

    __slots__ = ("owner", "index", "row", "marks", "filtered", "greedy", "stoppable")

    def __init__(self, owner: Any, index: int, row: int, version: int, greedy: bool, filtered: bool,
                 stoppable: bool):
        self.owner, self.index, self.row = owner, index, row
        self.marks = [(0, version)]  # (first output index, policy version) each time the version changed
        self.greedy, self.filtered, self.stoppable = greedy, filtered, stoppable

    def versions(self, n: int) -> list[int]:
        """The version of each of the first ``n`` output tokens."""
        out: list[int] = []
        for k, (_, v) in enumerate(self.marks):
            end = self.marks[k + 1][0] if k + 1 < len(self.marks) else n
            out.extend([v] * max(0, min(end, n) - len(out)))
        return out


class RunningBatch:
    """Rows ``[0, size)`` of the cache and the state tensors; admits, steps and retires sequences."""

    def __init__(self, model: Transformer, cache: KVCache, *, eos_ids: tuple[int, ...], max_stop_ids: int):
        self.model, self.cache = model, cache
        rows, cap, dev = cache.rows, cache.max_seq_len, model.device
        self.rows, self.max_stop_ids, self.eos_ids = rows, max_stop_ids, tuple(eos_ids)
        self.istate = torch.zeros(rows, _STOP + max_stop_ids, dtype=torch.int64, device=dev)
        self.fstate = torch.ones(rows, 2, dtype=torch.float32, device=dev)  # inv_temperature, top_p
        self.flags = torch.zeros(rows, 2, dtype=torch.bool, device=dev)  # greedy, filtered
        self.out_tok = torch.zeros(rows, cap, dtype=torch.int64, device=dev)
        self.out_lp = torch.zeros(rows, cap, dtype=torch.float32, device=dev)
        self._state = [self.istate, self.fstate, self.flags, self.out_tok, self.out_lp]
        self.row_ids = torch.arange(rows, device=dev)
        self.plen = np.zeros(rows, dtype=np.int64)  # prompt tokens
        self.olen = np.zeros(rows, dtype=np.int64)  # output tokens so far
        self.max_new = np.zeros(rows, dtype=np.int64)
        self.seed = np.zeros(rows, dtype=np.uint64)
        # CPU: draw the uniforms with numpy (cheaper than a dozen tiny kernels); CUDA: on the device,
        # inside the step (CUDA-graph safe, and no host->device copy racing ahead of the GPU)
        self._host_uniforms = dev.type == "cpu"
        self.seqs: list[Seq | None] = [None] * rows
        self.size = 0
        self.lagged_stops = dev.type == "cuda"
        """Read each step's stop hits after the next step is launched (see the module docstring)."""
        pin = dev.type == "cuda"
        self._hit_bufs = [torch.zeros(rows, dtype=torch.bool, pin_memory=pin) for _ in range(2)]  # alternate
        self._hit_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._pending: tuple[int, list[Seq], np.ndarray] | None = None  # (buffer, rows' Seqs, their olen)
        self._step_events = [torch.cuda.Event() for _ in range(RUN_AHEAD_STEPS)] if pin else []
        self._steps_launched = 0
        self.n_greedy = self.n_filtered = self.n_stoppable = 0

    # ---- admission (prefill) ---------------------------------------------------------------

    @property
    def free_rows(self) -> int:
        return self.rows - self.size

    def stop_ids(self, req: GenerateRequest) -> list[int]:
        """Token ids that end a sample of ``req`` (its own, plus EOS unless ``ignore_eos``)."""
        ids = list(dict.fromkeys(req.sampling.stop_token_ids + (() if req.sampling.ignore_eos else self.eos_ids)))
        if len(ids) > self.max_stop_ids:
            raise ValueError(f"request {req.request_id!r} has {len(ids)} stop token ids (EOS included); "
                             f"the engine allows max_stop_token_ids={self.max_stop_ids}")
        return ids

    @torch.no_grad()
    def admit(self, batch: list[tuple[Any, GenerateRequest, int]], version: int
              ) -> list[tuple[Seq, Completion]]:
        """Prefill ``(owner, request, seed)`` triples into free rows; returns samples already done.

        The caller checks that all samples fit (``free_rows``). Each request's ``n`` samples get rows
        next to each other and copies of the prompt's KV; their first tokens come from one logits row.
        """
        dev, lo = self.model.device, self.size
        prompts = [r.input_ids for _, r, _ in batch]
        counts = [r.sampling.n for _, r, _ in batch]
        hi = lo + sum(counts)
        irows, frows, flag_rows, first_rows = [], [], [], []
        for (owner, req, seed), n in zip(batch, counts):
            sp = req.sampling
            stops = self.stop_ids(req)
            greedy = sp.greedy
            filtered = not greedy and (sp.top_k != -1 or sp.top_p < 1)
            first_rows.append(lo + len(irows))
            for j in range(n):
                row = lo + len(irows)
                self.seqs[row] = Seq(owner, j, row, version, greedy, filtered, bool(stops))
                irows.append([0, len(req.input_ids) - 1, 0, mix_seed(seed, j),  # pos: the last prompt token
                              self.model.spec.vocab_size if sp.top_k == -1 else min(sp.top_k, self.model.spec.vocab_size)]
                             + stops + [-1] * (self.max_stop_ids - len(stops)))
                frows.append([1.0 if greedy else 1.0 / sp.temperature, sp.top_p])
                flag_rows.append([greedy, filtered])
                self.plen[row], self.olen[row], self.max_new[row] = len(req.input_ids), 0, sp.max_new_tokens
                self.seed[row] = irows[-1][_SEED]
                self.n_greedy += greedy
                self.n_filtered += filtered
                self.n_stoppable += bool(stops)
        self.istate[lo:hi].copy_(torch.tensor(irows, dtype=torch.int64), non_blocking=True)
        self.fstate[lo:hi].copy_(torch.tensor(frows, dtype=torch.float32), non_blocking=True)
        self.flags[lo:hi].copy_(torch.tensor(flag_rows, dtype=torch.bool), non_blocking=True)
        if self.cache.stale:  # restored after a release: prefill attention reads positions [0, longest prompt)
            self.cache.kv[:, :, lo:hi, :, : max(len(p) for p in prompts)].zero_()
        logits = self.model.prefill(PackedPrompts(prompts, first_rows, dev), self.cache)  # [N, V]
        if hi - lo > len(batch):  # the other samples of a prompt copy its KV and share its logits
            src = [f for f, n in zip(first_rows, counts) for _ in range(1, n)]
            dst = [f + j for f, n in zip(first_rows, counts) for j in range(1, n)]
            self.cache.move_rows(torch.tensor(src, device=dev), torch.tensor(dst, device=dev),
                                 max(len(p) for p in prompts))
            prompt_of_row = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(counts))
            logits = logits.index_select(0, prompt_of_row.to(dev))  # [M, V]
        self.size = hi
        self._sample_and_record(logits, lo, hi)
        self.olen[lo:hi] = 1
        return self._retire_finished(lo, hi)

    def reset(self) -> None:
        """Forget every running sequence without reading the device (after a failed step, whose
        admission or retirement may have stopped halfway); the next admission starts at row 0."""
        self.seqs = [None] * self.rows
        self.size = 0
        self._pending = None
        self.n_greedy = self.n_filtered = self.n_stoppable = 0

    # ---- decode ---------------------------------------------------------------------------

    def seq_len(self) -> int:
        """Cache positions the next decode step reads: max over running rows of position + 1."""
        b = self.size
        return int((self.plen[:b] + self.olen[:b]).max())

    @torch.no_grad()
    def decode_core(self, b: int, s: int, *, sampling_flags: tuple[bool, bool, bool]) -> torch.Tensor:
        """Device-only part of a decode step over rows ``[0, b)`` (no host sync: CUDA-graph safe).

        Feeds each row's next token, samples the following one, records it; returns the new tokens.
        """
        ist = self.istate
        fused = self.model.fused_kernels and not sampling_flags[2]  # top-k/top-p rows: torch's sort
        logits = self.model.decode_step(ist[:b, _TOK], ist[:b, _POS], self.cache, s, float_logits=not fused)
        if not fused:
            return self._sample_and_record(logits, 0, b, flags=sampling_flags)
        sample_and_record_fused(logits, ist[:b], self.fstate[:b], self.flags[:b], self.out_tok, self.out_lp,
                                cols=(_TOK, _POS, _OCOL, _SEED))
        return ist[:b, _TOK]  # a view: read it before the next step overwrites it

    @property
    def unconfirmed_tokens(self) -> int:
        """Newest tokens per row whose stop check is still in flight (lagged checks): 1 or 0."""
        return 1 if self._pending is not None else 0

    def sampling_flags(self) -> tuple[bool, bool, bool]:
        """(any greedy, all greedy, any top-k/top-p) over the running rows, from host counters."""
        return self.n_greedy > 0, self.n_greedy == self.size, self.n_filtered > 0

    def after_decode(self, new_tok: torch.Tensor) -> list[tuple[Seq, Completion]]:
        """Host bookkeeping after ``decode_core`` ran on rows ``[0, size)``."""
        self.olen[: self.size] += 1
        if not self.lagged_stops:
            return self._retire_finished(0, self.size, new_tok)
        self._bound_run_ahead()
        prev, self._pending = self._pending, self._launch_stop_check(new_tok)
        reasons, n_out = self._read_stops(prev) if prev else ({}, {})
        for r in np.flatnonzero(self.olen[: self.size] >= self.max_new[: self.size]).tolist():
            reasons.setdefault(r, "length")  # a stop in the previous step came first
        return self._retire(reasons, n_out) if reasons else []

    def _bound_run_ahead(self) -> None:
        """Wait until the step launched ``RUN_AHEAD_STEPS`` steps ago is done; mark this one (CUDA)."""
        if not self._step_events:
            return
        event = self._step_events[self._steps_launched % len(self._step_events)]
        event.synchronize()  # recorded RUN_AHEAD_STEPS steps ago (a never-recorded event: no wait)
        event.record()
        self._steps_launched += 1

    def _launch_stop_check(self, new_tok: torch.Tensor) -> tuple[int, list[Seq], np.ndarray] | None:
        """Start copying which rows' new token is a stop id to the host; read by ``_read_stops``."""
        if not self.n_stoppable:
            return None
        b, k = self.size, 0 if self._pending is None or self._pending[0] == 1 else 1
        hit = (new_tok[:, None] == self.istate[:b, _STOP:]).any(dim=1)  # [b]
        self._hit_bufs[k][:b].copy_(hit, non_blocking=True)
        if self._hit_events[k] is not None:
            self._hit_events[k].record()
        return k, self.seqs[:b], self.olen[:b].copy()

    def _read_stops(self, pending: tuple[int, list[Seq], np.ndarray]) -> tuple[dict[int, FinishReason], dict[int, int]]:
        """Rows (now) whose token in the pending check was a stop id, and their output length then."""
        k, seqs, olen = pending
        if self._hit_events[k] is not None:
            self._hit_events[k].synchronize()  # host sync: on the step before the one now running
        reasons: dict[int, FinishReason] = {}
        n_out: dict[int, int] = {}
        for i in np.flatnonzero(self._hit_bufs[k][: len(seqs)].numpy()).tolist():
            seq = seqs[i]
            if self.seqs[seq.row] is seq:  # still running (rows may have moved or been retired since)
                reasons[seq.row], n_out[seq.row] = "stop", int(olen[i])
        return reasons, n_out

    def _sample_and_record(self, logits: torch.Tensor, lo: int, hi: int,
                           flags: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
        """Sample rows ``[lo, hi)`` from ``logits`` ``[hi-lo, V]``, store token + log-prob, advance."""
        ist, fst, fl = self.istate[lo:hi], self.fstate[lo:hi], self.flags[lo:hi]
        if flags is None:
            seqs = self.seqs[lo:hi]
            greedy = sum(s.greedy for s in seqs)
            flags = (greedy > 0, greedy == hi - lo, any(s.filtered for s in seqs))
        any_greedy, all_greedy, any_filtered = flags
        if all_greedy:
            u = None
        elif self._host_uniforms:  # the output column of row r is olen[r] (host mirror of _OCOL)
            u = torch.from_numpy(uniform_np(self.seed[lo:hi], self.olen[lo:hi].astype(np.uint64)))
        else:
            u = uniform(ist[:, _SEED], ist[:, _OCOL])
        tok, lp = sample(logits, inv_temperature=fst[:, 0], u=u, top_k=ist[:, _TOPK], top_p=fst[:, 1],
                         greedy=fl[:, 0], filtered=fl[:, 1], any_greedy=any_greedy, all_greedy=all_greedy,
                         any_filtered=any_filtered)
        rows, col = self.row_ids[lo:hi], ist[:, _OCOL]
        self.out_tok.index_put_((rows, col), tok)
        self.out_lp.index_put_((rows, col), lp)
        ist[:, _TOK] = tok
        ist[:, _POS:_OCOL + 1] += 1  # position of the next input, and the next output column
        return tok

    # ---- retiring ------------------------------------------------------------------------------

    def _retire_finished(self, lo: int, hi: int, new_tok: torch.Tensor | None = None
                         ) -> list[tuple[Seq, Completion]]:
        """Retire rows in ``[lo, hi)`` that reached their length or sampled a stop token."""
        if new_tok is None:
            new_tok = self.istate[lo:hi, _TOK]
        if lo == hi:
            return []
        reasons: dict[int, FinishReason] = {}
        if self.n_stoppable:
            hit = (new_tok[:, None] == self.istate[lo:hi, _STOP:]).any(dim=1)  # [hi-lo]
            # host sync: which rows stopped decides the next step's batch (one copy, no nonzero)
            for r in np.flatnonzero(hit.cpu().numpy()).tolist():
                reasons[lo + r] = "stop"
        for r in np.flatnonzero(self.olen[lo:hi] >= self.max_new[lo:hi]).tolist():
            reasons[lo + r] = "length"  # SGLang checks the length first: it wins over a stop token
        return self._retire(reasons) if reasons else []

    def retire(self, reasons: dict[int, FinishReason]) -> list[tuple[Seq, Completion]]:
        """Finish the given rows (with their outputs so far), free them and repack the batch.

        Rows whose stop token is still in a pending (lagged) check finish first, as "stop", so an
        abort never returns tokens past a stop; their completions come back too.
        """
        if self._pending is None:
            return self._retire(reasons)
        by_seq = [(self.seqs[r], why) for r, why in reasons.items()]
        pending, self._pending = self._pending, None
        stopped, n_out = self._read_stops(pending)
        done = self._retire(stopped, n_out) if stopped else []
        rest = {s.row: why for s, why in by_seq if self.seqs[s.row] is s}
        return done + (self._retire(rest) if rest else [])

    def _retire(self, reasons: dict[int, FinishReason], n_out: dict[int, int] | None = None
                ) -> list[tuple[Seq, Completion]]:
        """``retire`` without the pending check; ``n_out``: rows' output lengths when not ``olen``."""
        n_out = n_out or {}
        rows = sorted(reasons)
        idx = torch.tensor(rows, device=self.model.device)
        width = int(self.olen[rows].max())
        toks = self.out_tok[idx, :width].tolist()  # host sync: the finished outputs leave the device
        lps = self.out_lp[idx, :width].tolist()
        done = []
        for r, tk, lp in zip(rows, toks, lps):
            seq, n = self.seqs[r], n_out.get(r, int(self.olen[r]))
            done.append((seq, Completion(output_ids=tk[:n], logprobs=lp[:n], finish_reason=reasons[r],
                                         versions=seq.versions(n))))
            self.n_greedy -= seq.greedy
            self.n_filtered -= seq.filtered
            self.n_stoppable -= seq.stoppable
            self.seqs[r] = None
        self._compact(set(rows))
        return done

    def _compact(self, freed: set[int]) -> None:
        """Move the last running rows into the holes below the new size."""
        new_size = self.size - len(freed)
        holes = sorted(r for r in freed if r < new_size)
        movers = [r for r in range(new_size, self.size) if r not in freed]
        if holes:
            dev = self.model.device
            src, dst = torch.tensor(movers, device=dev), torch.tensor(holes, device=dev)
            for t in self._state:
                t.index_copy_(0, dst, t.index_select(0, src))
            self.cache.move_rows(src, dst, int((self.plen[movers] + self.olen[movers]).max()))
            for arr in (self.plen, self.olen, self.max_new, self.seed):
                arr[holes] = arr[movers]
            for s_, d_ in zip(movers, holes):
                seq = self.seqs[s_]
                seq.row = d_
                self.seqs[d_], self.seqs[s_] = seq, None
        self.size = new_size

    def running(self) -> list[Seq]:
        return [s for s in self.seqs[: self.size] if s is not None]

    def mark_version(self, version: int) -> None:
        """Record that tokens from now on come from ``version`` (called between steps)."""
        for r in range(self.size):
            self.seqs[r].marks.append((int(self.olen[r]), version))

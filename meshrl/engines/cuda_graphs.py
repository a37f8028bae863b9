"""CUDA graphs of the decode step, one per batch-size bucket, replayed instead of launching kernels.

A decode step of a small model is hundreds of tiny kernels; on a GPU their launch cost, not the
math, sets the step time. ``DecodeGraphs`` captures ``RunningBatch.decode_core`` (model forward,
sampling, bookkeeping writes: everything device-side) for bucket sizes ``b`` and replays the
smallest bucket that holds the running batch. Graphs read all their inputs from the batch's state
tensors and the model's parameters, whose addresses never change (weights are updated in place).

Simplifications, on purpose: graphs attend over the whole ``max_seq_len`` (a static shape; the mask
hides unused positions), so keep ``max_seq_len`` close to what requests need; batches with top-k or
top-p rows run eagerly (the sort is not worth a second set of graphs); graphs are captured once, at
engine start, while no sequence runs (warm-up steps write into free rows only).
"""

from __future__ import annotations

from typing import Callable

import torch

from meshrl.engines.batch import RunningBatch, _OCOL, _POS

# (any greedy, all greedy, any filtered): the general variant handles greedy and sampled rows
_GRAPH_FLAGS = (True, False, False)


def default_bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every multiple of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps for a fixed set of batch sizes."""

    def __init__(self, batch: RunningBatch, core: Callable[..., torch.Tensor], sizes: list[int]):
        if batch.size:
            raise RuntimeError("CUDA graphs must be captured while no sequence runs")
        self.batch, self.sizes = batch, sorted(set(sizes))
        self.max_size = self.sizes[-1]
        s = batch.cache.max_seq_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # warm-up: cuBLAS handles, allocator, lazy module loading, and (with torch.compile) every
            # specialisation, so that nothing compiles or syncs while a graph is being captured
            for b in [self.max_size] + self.sizes:
                core(b, s, sampling_flags=_GRAPH_FLAGS)
                self._reset_rows(0, b)  # each call advanced positions: keep them in range
        torch.cuda.current_stream().wait_stream(side)
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = core(b, s, sampling_flags=_GRAPH_FLAGS)  # recorded, not run
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize()
        self._reset_rows(0, batch.rows)

    def _reset_rows(self, lo: int, hi: int) -> None:
        """Keep free rows' positions in range: a replay advances every row of its bucket."""
        self.batch.istate[lo:hi, _POS:_OCOL + 1] = 0

    def can_run(self, b: int) -> bool:
        return b <= self.max_size and self.batch.n_filtered == 0

    def replay(self, b: int) -> torch.Tensor:
        """Run one decode step for rows ``[0, b)``; returns their new tokens ``[b]``."""
        bucket = next(x for x in self.sizes if x >= b)
        if bucket > b:
            self._reset_rows(b, bucket)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:b]

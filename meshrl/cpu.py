"""What the CPU path decides from the machine it runs on: bf16 compute, and how short rows attend.

- ``native_bf16()``: the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). There, a bf16
  matmul runs 4 to 5 times faster than a float32 one (measured on the 2-core development machine,
  an AVX512-BF16 EPYC: 500 against 110 GFLOP/s at the embedded model's shapes), so the trainer's
  CPU autocast and TorchEngine's ``dtype=auto`` take bf16; elsewhere oneDNN emulates bf16, slower
  than float32, and both stay float32. ``MESHRL_CPU_BF16=0`` (or ``1``) overrides the flags.
- ``compute_process(threads)``: a process that computes with torch (trainer, engine, reference)
  sets its intra-op threads and tells glibc to keep freed memory. By default glibc hands large freed
  blocks back to the OS (an mmap per block above its threshold, a heap's top above 128 KiB, and a
  thread's own arena whole), so each step's activations are fresh pages again: 7,410 page faults a
  step, 15 ms of the embedded model's 90 ms train step on 256 samples (run on a thread, as an
  actor's method is), against 180 with the thresholds raised and one arena for every thread.
- ``attention_for(device, longest)``: on a CPU, rows of up to ``SHORT_ROWS`` tokens attend through
  SDPA's math path (matmul, softmax, matmul). torch's CPU flash kernel pays per block of each row
  and head: at the embedded model's 14-token rows its backward took 44 ms a layer for 256 rows in
  bf16 (3.7 ms in float32), against under 2 ms for the math path. Longer rows keep the flash
  kernel, whose memory does not grow with the square of the length.

Simplification on purpose: the decision is the CPU's feature flags, not a timing taken at start
(repeatable from run to run on one machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["BF16_ENV", "SHORT_ROWS", "attention_for", "compute_process", "native_bf16"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed threshold on 64-bit)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap's top that glibc keeps rather than returning it to the OS."""
ARENAS = 1
"""Every thread allocates from the main heap: a thread's own arena (64 MiB heaps) is returned
whole when it empties, which the trim threshold does not prevent."""

SHORT_ROWS = 128
"""Longest row (tokens) that attends through SDPA's math path on a CPU (its [B, H, T, T] scores
stay small next to the row's other activations up to here)."""


BF16_ENV = "MESHRL_CPU_BF16"
"""``0``: float32 on every CPU; ``1``: bf16 on every CPU (to try it where it is emulated); unset or
``auto``: by the CPU's instructions. Read once per process; runs pass it on to their workers."""


@functools.cache
def native_bf16() -> bool:
    """The CPU computes in bf16 by default: it has bf16 matmul instructions (AVX512-BF16 or AMX
    tiles), unless ``MESHRL_CPU_BF16`` says otherwise."""
    forced = os.environ.get(BF16_ENV, "auto").strip().lower()
    if forced not in ("", "auto", "0", "1"):
        raise ValueError(f"{BF16_ENV}={forced!r}: use 0 (float32), 1 (bf16) or auto (by the CPU's instructions)")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probes: stay in float32
        return False


def compute_process(threads: int) -> None:
    """Set this process up to compute with torch: ``threads`` intra-op threads, and on glibc the
    malloc thresholds that keep a step's freed activations for the next step (module docstring)."""
    torch.set_num_threads(threads)
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
              and libc.mallopt(_M_ARENA_MAX, ARENAS))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own allocator's habits
        ok = False
    if not ok:
        log.debug("mallopt is not available here: freed memory goes back to the OS as the C library decides")


def attention_for(device: torch.device, longest: int) -> contextlib.AbstractContextManager:
    """The SDPA backend for a forward of rows up to ``longest`` tokens on ``device`` (module docstring);
    a no-op off the CPU and for long rows."""
    if device.type == "cpu" and longest <= SHORT_ROWS:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()

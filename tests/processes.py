"""Run a function in ``nprocs`` spawned processes (real torch.distributed ranks), bounded in time."""

from __future__ import annotations

import time
from typing import Callable

import torch.multiprocessing as mp


def run_processes(fn: Callable, args: tuple, nprocs: int, *, timeout_s: float, what: str) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; a rank's exception fails the caller, and
    ranks still alive after ``timeout_s`` fail it naming ``what`` (and are terminated)."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            assert time.monotonic() < deadline, f"{what} did not finish within {timeout_s:g} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()

"""Run a function in ``nprocs`` spawned processes (real torch.distributed ranks), bounded in time; and
the process tree of a program (what it started, what of that still runs)."""

from __future__ import annotations

import time
from pathlib import Path
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


def descendants(pid: int) -> set[int]:
    """Every process ``pid`` started, and what those started, now."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def left_running(pids: set[int], within_s: float) -> list[str]:
    """Those of ``pids`` still running after ``within_s`` seconds, as "pid name" (zombies count as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat.rpartition(")")[2].split()[0] != "Z":
                alive.append(f"{pid} {stat.split('(')[1].split(')')[0]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.25)

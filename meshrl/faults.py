"""Fault points: a role's process kills itself (SIGKILL) at a named point of its work, once.

For fault-injection tests and drills (issue 28). A schedule in the environment names points and
the call of each on which it fires, counted over every process of the run (a resumed or restarted
role counts on)::

    MESHRL_FAULTS="reward.score=3,trainer.train_step=5"  MESHRL_FAULTS_DIR=/tmp/faults

The pipeline hands both variables to every role it spawns. ``MESHRL_FAULTS_DIR`` (one directory
all the run's processes see) holds a file per point, one byte per call, so the count survives the
processes. Points, each inside its call, before it answers:

=========================  ======================================================================
``rollout.generate``       the worker has the requests (its reservation taken); nothing returned
``reward.score``           the samples are scored, not yet handed back (nor put into the queue)
``trainer.train_step``     the rank has fetched its share of the batch, and not trained on it
``trainer.reshard_send``   the engines have posted their receives; the trainer sends nothing
``rollout.reshard_receive`` the trainer sends (or is about to); this engine takes nothing of it
``trainer.save_checkpoint`` the rank wrote its state into the partial checkpoint, not committed
=========================  ======================================================================

Without ``MESHRL_FAULTS`` a point costs a dictionary lookup.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import sys
from pathlib import Path

__all__ = ["POINTS", "check_environment", "env", "point", "schedule"]

POINTS = ("rollout.generate", "reward.score", "trainer.train_step", "trainer.reshard_send", "rollout.reshard_receive",
          "trainer.save_checkpoint")
VARIABLES = ("MESHRL_FAULTS", "MESHRL_FAULTS_DIR")


def schedule(text: str) -> dict[str, int]:
    """``"point=n,..."`` as ``{point: n}``; a point meshrl does not have, or an n below 1, is refused."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, n = item.partition("=")
        if name not in POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"MESHRL_FAULTS: {item!r} is not point=n with a point of {', '.join(POINTS)} and n >= 1")
        out[name] = int(n)
    return out


def check_environment() -> dict[str, int]:
    """The schedule of this process's ``MESHRL_FAULTS``, or ``ValueError`` in one line naming what
    is wrong with it (a pipeline checks it at start, so its roles never meet a bad one)."""
    found = schedule(os.environ.get("MESHRL_FAULTS", ""))
    if found and not os.environ.get("MESHRL_FAULTS_DIR"):
        raise ValueError("MESHRL_FAULTS is set but MESHRL_FAULTS_DIR is not: name a directory every process of "
                         "the run sees (the points count their calls there)")
    return found


@functools.cache
def _schedule() -> dict[str, int]:
    return schedule(os.environ.get("MESHRL_FAULTS", ""))  # read once, at the first point: not at import


def env() -> dict[str, str]:
    """The fault variables of this process's environment, for the processes it spawns."""
    return {k: os.environ[k] for k in VARIABLES if k in os.environ}


def point(name: str) -> None:
    """Count a call of point ``name``; kill this process if the schedule says this call."""
    n = _schedule().get(name)
    if n is None:
        return
    folder = os.environ.get("MESHRL_FAULTS_DIR")
    if not folder:
        raise RuntimeError("MESHRL_FAULTS is set but MESHRL_FAULTS_DIR is not: the points count their calls there")
    with open(Path(folder) / name, "ab+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # processes of one node; a shared directory across nodes counts per node
        f.seek(0, os.SEEK_END)
        count = f.tell() + 1
        f.write(b"x")
        f.flush()
    if count == n:
        print(f"meshrl.faults: {name} call {count}: killing process {os.getpid()} (MESHRL_FAULTS)", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

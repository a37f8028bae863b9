"""The run's output directory: one live run at a time, and nobody's files overwritten unasked.

A run writes ``RUN_FILES`` under ``run.output_dir`` (metrics, the timeline, plots, its config,
checkpoints, ``final/``). Before it writes any of them:

- ``check_fresh`` refuses a fresh run (``run.resume`` null, or a checkpoint of another directory) into a
  directory that already holds one of them — another run's records, or a user's own
  ``config.yaml`` — naming ``run.resume=latest`` (continue it) and ``run.overwrite=true`` (start
  over: those files, and only those, are deleted); ``check`` (the config's own) an empty path,
  or one that cannot be a directory.
- ``OutputLock`` holds ``.meshrl.lock`` in the directory (``flock``) while the run lives, resumes
  by ``run.auto_resume`` included; a second run there is refused, naming the holder's pid and
  host. The kernel drops the lock with its process, however it ends (SIGKILL too), so a stale
  lock file never blocks the next run.

Simplification: the lock is advisory and per directory path; two spellings of one directory (a
symlink) are one lock file, as the lock lives inside it.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import Callable

from meshrl.config import ConfigError

__all__ = ["LOCK", "RUN_FILES", "OutputLock", "check", "check_fresh", "continues_here", "overwrite"]

RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "timeline.jsonl", "config.yaml", "plots.png", "timeline.png",
             "tensorboard", "sglang")
"""What a run writes directly under its output directory (``sglang``: the logs of servers it launched)."""
LOCK = ".meshrl.lock"


def continues_here(resume: str | None, out_dir: Path) -> bool:
    """Whether ``run.resume`` continues the run of ``out_dir`` (``latest``, or one of its checkpoints)."""
    if resume is None:
        return False
    if resume == "latest":
        return True
    return Path(resume).resolve().parent.parent == out_dir.resolve()


def _unusable(out_dir: Path) -> str | None:
    """Why ``out_dir`` cannot be (made) a directory, or None: a file on its path."""
    for part in [out_dir, *out_dir.parents]:
        if part.exists():
            return None if part.is_dir() else f"{part} is a file, not a directory"
    return None


def check(output_dir: str, resume: str | None, overwrite: bool) -> None:
    """Refuse (``ConfigError``) an output directory no run can write, whatever it holds: an empty
    path, a file on its path, or run.overwrite beside a resume of the run it would delete."""
    if not output_dir.strip():
        raise ConfigError("`run.output_dir`: empty; the run would write into the current directory: name a "
                          "directory (the default is runs/async_ppo)")
    out = Path(output_dir)
    if (why := _unusable(out)) is not None:
        raise ConfigError(f"`run.output_dir`: {why}")
    if overwrite and continues_here(resume, out):
        raise ConfigError(f"`run.overwrite`: true deletes the run in {out}, and run.resume={resume} continues it: "
                          "give one of them")


def check_fresh(out: Path, resume: str | None, overwrite: bool) -> list[str]:
    """Refuse (``ConfigError``) a fresh run into a directory that holds a run's files; returns the
    names of ``RUN_FILES`` that run.overwrite deletes (empty when none, or when the run continues)."""
    if continues_here(resume, out) or not out.is_dir():
        return []
    found = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    if found and not overwrite:
        raise ConfigError(f"`run.output_dir`: {out} holds a run's files ({_describe(out, found)}): continue that "
                          "run with run.resume=latest, start over with run.overwrite=true (deletes "
                          f"{', '.join(found)}), or give another run.output_dir")
    return found


def _describe(out: Path, found: list[str]) -> str:
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*") if p.is_dir()) if "checkpoints" in found else []
    named = [f"checkpoints up to {steps[-1]}" if steps else "checkpoints/" if "checkpoints" in found else None]
    named += [f"{n}/" if (out / n).is_dir() else n for n in found if n != "checkpoints"]
    return ", ".join(n for n in named if n)


class OutputLock:
    """``run.output_dir`` held by this process while its run lives (module docstring)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._file = None

    def acquire(self) -> None:
        """Create the directory and take its lock, or raise ``ConfigError`` naming the path (it cannot
        be created) or the live run that holds it."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"`run.output_dir`: cannot create {self.out_dir} ({exc.strerror or exc}): "
                              "choose a writable directory") from None
        try:
            f = open(self.out_dir / LOCK, "a+")
        except OSError as exc:
            raise ConfigError(f"`run.output_dir`: cannot write in {self.out_dir} ({exc.strerror or exc}): "
                              "choose a writable directory") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(f"`run.output_dir`: {self.out_dir} is in use by a live run ({holder}): wait for it "
                              "to end or stop it, or give another run.output_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # drops the flock; the file stays (a lock file unlinked under a waiter is a race)
            self._file = None


def overwrite(out_dir: Path, names: list[str], echo: Callable[[str], None]) -> None:
    """``run.overwrite=true``: delete the earlier run's ``names`` (of ``RUN_FILES``), nothing else."""
    for name in names:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    if names:
        echo(f"run.overwrite=true: deleted the earlier run's {', '.join(names)} in {out_dir}")

"""A local Ray cluster's processes end with the process that started it, however that one ends.

Ray starts its head processes (GCS, raylet, monitors) with a parent-death signal, and its workers
follow the raylet; but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``)
outlive it by a minute or more, holding their ports, and when the driver is killed outright
(SIGKILL, the OOM killer) none of ``ray.shutdown`` runs. So beside a cluster it starts, meshrl
starts this watcher (``python -I .../meshrl/mesh/reaper.py PID TOKEN SESSION_DIR``: this file alone, the
standard library only, so it costs a few megabytes and no imports of meshrl or Ray):

- the cluster's processes are known two ways: ``MESHRL_RAY_CLUSTER=TOKEN`` is in the environment the
  head processes start with (``marked``), and everything they start inherits it (workers, the
  SGLang servers workers launch); and each of Ray's processes keeps its log files open under the
  cluster's session directory (the agents among them, whose environment block ``setproctitle``
  overwrites);
- the watcher waits for process ``PID`` (the driver) to end, through a pidfd (polling on kernels
  without one), in a session of its own so a terminal's Ctrl-C or hang-up does not reach it;
- then it stops every process of the cluster still running: SIGTERM, and SIGKILL for what is left
  after ``GRACE_S``; and exits.

Simplification: it sees the processes of its own node that it may read (``/proc/PID/environ`` and
``/proc/PID/fd``: the same user, or root); a cluster spans one node when meshrl starts it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Iterator

__all__ = ["MARK", "cluster_processes", "marked", "start"]

MARK = "MESHRL_RAY_CLUSTER"
GRACE_S = 3.0
"""How long the cluster's processes get to exit after SIGTERM before SIGKILL."""


@contextlib.contextmanager
def marked() -> Iterator[str]:
    """While inside, processes started from this one carry a new cluster mark; yields the token."""
    token = uuid.uuid4().hex
    before = os.environ.get(MARK)
    os.environ[MARK] = token
    try:
        yield token
    finally:  # only the cluster's processes keep it: a program's own later subprocesses are not its
        if before is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = before


def start(token: str, session_dir: str) -> subprocess.Popen:
    """Start the watcher of this process's cluster: its processes carry ``token`` or hold files
    under ``session_dir`` open."""
    env = {k: v for k, v in os.environ.items() if k != MARK}  # it must not find itself
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), token, session_dir],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def cluster_processes(token: str, session_dir: str) -> list[int]:
    """Pids of this node's processes whose environment carries ``MARK=token`` or that hold a file
    under ``session_dir`` open."""
    needle, prefix = f"{MARK}={token}".encode(), session_dir.rstrip("/") + "/"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
                    continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(prefix):
                    found.append(int(entry))
                    break
        except OSError:  # gone, a kernel thread, or another user's
            continue
    return found


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (an old kernel): poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(0.5)
    try:
        select.select([fd], [], [])  # readable once the process has ended
    finally:
        os.close(fd)


def _stop(token: str, session_dir: str) -> None:
    pids = cluster_processes(token, session_dir)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = cluster_processes(token, session_dir)
    for _ in range(3):  # what started meanwhile (a worker the raylet was spawning) is killed too
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        pids = cluster_processes(token, session_dir)
        if not pids:
            return


def main(argv: list[str]) -> None:
    driver, token, session_dir = int(argv[0]), argv[1], argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _wait_for_exit(driver)
    _stop(token, session_dir)


if __name__ == "__main__":
    main(sys.argv[1:])

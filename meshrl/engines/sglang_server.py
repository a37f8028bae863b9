"""An SGLang server's life as a rollout worker's engine: its arguments, start, health, death, stop.

``SGLangServerConfig`` is ``rollout.engine.sglang``. A rollout worker either attaches to a server
already running (``urls``: meshrl starts and stops none) or launches its own:

```text
launch:  {command} --model-path M --host H --port P --tp-size T --skip-tokenizer-init ...
         in a process group of its own (start_new_session), stdout and stderr into its log file;
         the child dies with the worker (PR_SET_PDEATHSIG), so a killed worker leaves no server
wait:    GET /health until 200, at most startup_timeout_s; a server that exits first fails the
         start at once, naming its log and quoting its last lines
run:     check() after any failed call: a server that died is the worker's failure, naming its log
stop:    SIGTERM to the whole process group (the server and every child it started), SIGKILL
         after stop_timeout_s; then the port is free and the GPU memory returned
```

``command`` is the launcher (``python -m sglang.launch_server``); meshrl's own SGLang-compatible
server, ``python -m meshrl.engines.serve``, takes the same arguments, which is how CI runs the
SGLang backend on a CPU. ``server_args`` builds the argument list from the config and the run
(the model path is the run's model, ``rollout.tp_size`` the server's TP size).

Simplification, on purpose: one server per rollout worker, one data-parallel replica each
(``dp_size = 1``: SGLang's weight-update group needs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import msgspec

__all__ = ["SGLangServerConfig", "SGLangServer", "SGLangServerError", "server_args"]

ArgValue = str | int | float | bool | None


class SGLangServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``rollout.engine.sglang``: the SGLang servers behind the rollout workers (``backend=sglang``)."""

    urls: tuple[str, ...] = ()
    """Servers already running, one per rollout worker: meshrl starts and stops none. Empty: every
    rollout worker launches its own on its GPUs."""
    command: tuple[str, ...] = ("{python}", "-m", "sglang.launch_server")
    """How a worker launches its server ({python}: the worker's interpreter); the server arguments
    follow. ["{python}", "-m", "meshrl.engines.serve"] runs meshrl's own SGLang-compatible server."""
    mem_fraction_static: float | None = None
    """GPU memory fraction for weights and KV cache (SGLang's --mem-fraction-static). null: SGLang's
    default, or with placement=colocated what the trainer's measured peak leaves."""
    attention_backend: str | None = None
    """--attention-backend (e.g. triton, flashinfer, fa3). null: SGLang's choice."""
    sampling_backend: str | None = None
    """--sampling-backend (pytorch, flashinfer). null: SGLang's choice."""
    extra_args: dict[str, ArgValue] = {}
    """More server arguments by name: {"grammar-backend": "none", "enable-memory-saver": true} gives
    --grammar-backend none --enable-memory-saver (true: the flag alone; false or null: left out)."""
    host: str = "auto"
    """Address the server listens on: auto is 127.0.0.1 when the trainer shares the node, else the
    node's routable address."""
    startup_timeout_s: float = 900.0
    """Longest wait for /health after launch (a first start JIT-compiles kernels: minutes)."""
    stop_timeout_s: float = 30.0
    """Wait after SIGTERM before the server's process group is killed."""
    request_timeout_s: float = 60.0
    """Bound on one control call (pause, flush, info, ...)."""
    generate_timeout_s: float = 3600.0
    """Bound on one /generate call."""
    bucket_bytes: int = 512 * 2**20
    """Most bytes per /update_weights_from_distributed call of a weight push."""
    group_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The weight-update group's backend: auto is nccl when the trainer and every server are on
    distinct GPUs, gloo when they share one (NCCL refuses two ranks on one device) or run on CPUs."""
    transport: Literal["auto", "group", "tensor"] = "auto"
    """How a push reaches the servers: group is /update_weights_from_distributed over SGLang's
    weight-update group (group_backend); tensor is /update_weights_from_tensor with CUDA IPC handles
    of the trainer's gathered tensors (no copy: the server loads from the trainer's memory), for a
    server on the trainer's own GPU (placement=colocated, trainer.dp=1). auto: tensor where it
    applies, else group (bench/RESULTS.md has the two measured side by side)."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How generation pauses for a push: abort ends the requests in flight, which the rollout worker
    sends again once the new weights serve (their queue reservations kept)."""

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "stop_timeout_s", "request_timeout_s", "generate_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.engine.sglang.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.bucket_bytes < 1:
            raise ValueError(f"rollout.engine.sglang.bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rollout.engine.sglang.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not self.command:
            raise ValueError("rollout.engine.sglang.command is empty: give the server's launcher, e.g. "
                             '["{python}", "-m", "sglang.launch_server"]')
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.engine.sglang.urls: {url!r} is not an http(s):// URL")
        for key in self.extra_args:
            if key.startswith("-") or not key:
                raise ValueError(f"rollout.engine.sglang.extra_args: give names without dashes, got {key!r}")


class SGLangServerError(RuntimeError):
    """The server could not start, or died; the message names its log."""


def server_args(cfg: SGLangServerConfig, *, model_path: str, host: str, port: int, tp_size: int, dtype: str,
                seed: int, context_length: int = 0, max_running_requests: int = 0, cuda_graphs: bool = True,
                mem_fraction_static: float | None = None) -> list[str]:
    """The launcher's arguments for one server: what meshrl needs, then the config's pass-through."""
    args = ["--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size),
            "--random-seed", str(seed), "--skip-tokenizer-init"]  # input ids in, output ids out: no text
    if dtype != "auto":
        args += ["--dtype", dtype]
    if context_length:
        args += ["--context-length", str(context_length)]
    if max_running_requests:
        args += ["--max-running-requests", str(max_running_requests)]
    fraction = cfg.mem_fraction_static if cfg.mem_fraction_static is not None else mem_fraction_static
    if fraction is not None:
        args += ["--mem-fraction-static", f"{fraction:.4g}"]
    if cfg.attention_backend:
        args += ["--attention-backend", cfg.attention_backend]
    if cfg.sampling_backend:
        args += ["--sampling-backend", cfg.sampling_backend]
    if not cuda_graphs:  # rollout.engine.cuda_graphs
        args.append("--disable-cuda-graph")
    for key, value in cfg.extra_args.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not None and value is not False:
            args += [f"--{key}", str(value)]
    return args


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SGLangServer:
    """One launched server process (and its children), its URL and its log."""

    def __init__(self, cfg: SGLangServerConfig, args: list[str], *, host: str, port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.cfg, self.log_path = cfg, Path(log_path)
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://{connect_host}:{port}"
        command = [sys.executable if part == "{python}" else part for part in cfg.command]
        self.command = command + args
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    @classmethod
    async def launch(cls, cfg: SGLangServerConfig, args: list[str], *, host: str, port: int, log_path: Path,
                     env: dict[str, str] | None = None) -> "SGLangServer":
        """Start the server and wait until it is healthy (``startup_timeout_s``); stopped on failure."""
        server = cls(cfg, args, host=host, port=port, log_path=log_path, env=env)
        try:
            await server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        return server

    def tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _died(self, when: str) -> SGLangServerError:
        return SGLangServerError(f"the SGLang server {self.url} exited with code {self.proc.returncode} {when}; its "
                                 f"log is {self.log_path}; last lines:\n{self.tail()}")

    async def wait_healthy(self) -> None:
        import aiohttp

        deadline = time.monotonic() + self.cfg.startup_timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc.poll() is not None:
                    raise self._died("while starting")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise SGLangServerError(f"the SGLang server {self.url} did not answer /health within "
                                            f"{self.cfg.startup_timeout_s:g} s (rollout.engine.sglang.startup_timeout_s); "
                                            f"its log is {self.log_path}; last lines:\n{self.tail()}")
                await asyncio.sleep(0.5)

    def check(self) -> None:
        """Raise ``SGLangServerError`` naming the log if the server has exited."""
        if self.proc.poll() is not None:
            raise self._died("mid-run")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_timeout_s``; its exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.cfg.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # children the server left behind (or that ignored SIGTERM) share its process group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(OSError):
            self._log.close()
        return self.proc.returncode

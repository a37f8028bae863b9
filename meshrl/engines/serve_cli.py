"""The command line of ``python -m meshrl.engines.serve``: one engine, or ``--tp N`` processes.

It also takes the names ``python -m sglang.launch_server`` knows for the same settings
(``--model-path``, ``--tp-size``, ``--random-seed``, ``--context-length``,
``--max-running-requests``, ``--disable-cuda-graph``, ``--enable-memory-saver``), so a rollout
worker launches it with the arguments it builds for SGLang (``meshrl.engines.sglang_server``);
SGLang's tuning flags that TorchEngine has no use for (``--skip-tokenizer-init``,
``--mem-fraction-static``, ``--attention-backend``, ``--sampling-backend``, ``--log-level``) are
accepted and said to be ignored.

``main`` takes the application factory (``serve.make_app``) as an argument: ``serve.py`` is the
module ``python -m`` runs, and it calls this one, so this one does not import it back.

Before anything is built, what a command can get wrong is checked from file headers alone (in
milliseconds, once imported): the port's range, the model directory (config.json, an architecture TorchEngine
runs, whole safetensors files), that ``--tp`` splits the model; then the port is bound (not yet
listened on: clients are refused until the server answers, as before). Each such problem is one
line on stderr, naming the fix, and exit code 2, as argparse's own; an error past these checks is a
bug and keeps its traceback.

With ``--tp N`` this process is TP rank 0 and serves HTTP (``make_app``); it spawns ranks 1..N-1
(``_follower_main``), which build their shards and follow its schedule (``schedule.py``), and a
thread (``_FollowerWatch``) that stops the server when one of them dies. Rank i uses ``cuda:i``
(NCCL all-reduces, the schedule over a gloo group beside them) or the CPU (gloo).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from typing import Any, Callable

from aiohttp import web

from meshrl.engines.layout import EngineLayout
from meshrl.engines.serve_http import READ_TIMEOUT_S
from meshrl.engines.sglang_api import SGLANG_COMPAT_VERSION, load_tokenizer
from meshrl.engines.torch_engine import TorchEngine, TorchEngineConfig
from meshrl.engines.weights import check_checkpoint_dir

_PROG = "meshrl.engines.serve"
"""The name in this command's messages (argparse would say ``serve.py`` under ``python -m``)."""


def main(argv: list[str] | None, make_app: Callable[..., web.Application]) -> None:
    """Parse the command line, build the engine (and its TP ranks), serve ``make_app(engine, ...)``
    until stopped."""
    p = argparse.ArgumentParser(prog=_PROG, description="Serve a local HF checkpoint with TorchEngine over SGLang's "
                                                       "(and OpenAI's) HTTP API.")
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=256)
    p.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=0)
    p.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    p.add_argument("--no-cuda-graphs", "--disable-cuda-graph", dest="no_cuda_graphs", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="keep the weights in one buffer, so /release_memory_occupation can free them too")
    p.add_argument("--compat-version", default=SGLANG_COMPAT_VERSION,
                   help="SGLang release whose HTTP surface to show (weight-update branches differ by version)")
    for flag in ("--mem-fraction-static", "--attention-backend", "--sampling-backend", "--log-level"):
        p.add_argument(flag, dest=f"ignored_{flag[2:].replace('-', '_')}", help=argparse.SUPPRESS)
    p.add_argument("--skip-tokenizer-init", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks: one process each (GPU i on CUDA); this one serves, the others "
                        "follow its schedule")
    p.add_argument("--tp-timeout-s", type=float, default=600.0,
                   help="timeout of the TP ranks' collectives (start-up rendezvous included)")
    p.add_argument("--read-timeout-s", type=float, default=READ_TIMEOUT_S,
                   help="how long a request's body may take to arrive; later: 408 and the connection closed")
    a = p.parse_args(argv)
    ignored = [f"--{k[8:].replace('_', '-')}" for k, v in vars(a).items() if k.startswith("ignored_") and v is not None]
    if a.skip_tokenizer_init:
        ignored.append("--skip-tokenizer-init")
    if ignored:  # SGLang's launcher flags: TorchEngine sizes its KV cache and picks its kernels itself
        print(f"{_PROG}: ignoring {' '.join(ignored)} (SGLang settings TorchEngine has no use for)",
              flush=True)
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    if a.tp > 1 and a.device not in ("auto", "cpu", "cuda"):
        p.error(f"--tp {a.tp} places rank i on cuda:i: give --device auto, cuda or cpu, not {a.device!r}")
    if a.tp > 1 and a.enable_memory_saver:
        p.error("--enable-memory-saver is not supported with --tp > 1")
    if not a.read_timeout_s > 0:
        p.error(f"--read-timeout-s must be > 0, got {a.read_timeout_s}")
    try:
        if not 0 <= a.port <= 65535:
            raise _StartError(f"--port {a.port} is not a TCP port: give one from 1 to 65535 (or 0: any free port)")
        _check_model(a.model, a.tp)
        sockets = _bind(a.host, a.port)
    except _StartError as exc:
        # one line (a config's own error may run to several): the user's to fix, no traceback
        print(f"{_PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    followers, watch, stopped_in_order = None, None, False
    if a.tp > 1:
        import torch.multiprocessing as mp

        from meshrl.groups import free_port

        rendezvous = free_port()
        followers = mp.start_processes(_follower_main, args=(a, rendezvous), nprocs=a.tp - 1, start_method="spawn",
                                       join=False, daemon=True)
        watch = _FollowerWatch(followers.processes)
    try:
        engine = _engine(a, rank=0, rendezvous=rendezvous) if followers is not None else _engine(a)
        port = sockets[0].getsockname()[1]  # --port 0: the one bound
        app = make_app(engine, tokenizer=load_tokenizer(a.model), compat_version=a.compat_version,
                       server_args={"host": a.host, "port": port, "model_path": a.model},
                       read_timeout_s=a.read_timeout_s)
        if watch is not None:
            watch.serving = True
        web.run_app(app, sock=sockets, print=lambda msg: print(msg, flush=True))
        stopped_in_order = True  # engine.shutdown (on_shutdown) told the followers to stop
    finally:
        for sock in sockets:  # (run_app closed those it served on; these are for an engine that failed)
            sock.close()
        if followers is not None:
            watch.stopping = True
            deadline = time.monotonic() + (30 if stopped_in_order else 0)
            while not all(p.exitcode is not None for p in followers.processes) and time.monotonic() < deadline:
                time.sleep(0.1)
            for proc in followers.processes:
                if proc.is_alive():
                    proc.terminate()
    if watch is not None and watch.failed:
        raise SystemExit(f"stopped: {watch.failed}")


class _StartError(Exception):
    """A problem with the command the user fixes (a path, a port, a flag): ``main`` prints it as one
    line naming the fix and exits with 2."""


def _check_model(path: str, tp: int) -> None:
    """What the engine needs of ``--model`` and ``--tp``, from headers alone (no weight is read): the
    model directory (``check_checkpoint_dir``), and heads and MLP width that split over ``tp``
    ranks (``EngineLayout.validate_tp``)."""
    try:
        spec = check_checkpoint_dir(path)
    except ValueError as exc:
        raise _StartError(f"--model {exc}") from None
    layout = EngineLayout(spec)
    try:
        layout.validate_tp(tp)
    except ValueError as exc:
        fits = [str(n) for n in range(1, spec.num_kv_heads + 1) if _splits(layout, n)]
        either = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]
        raise _StartError(f"--tp {tp} does not split this model: {exc}; give --tp {either}") from None


def _splits(layout: EngineLayout, tp: int) -> bool:
    try:
        layout.validate_tp(tp)
    except ValueError:
        return False
    return True


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port``, as aiohttp's ``TCPSite`` would bind
    them (``SO_REUSEADDR``, IPv6 only on IPv6), for ``run_app(sock=)``. Not listening yet: clients
    are refused until the engine is built and the server answers, as before."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _StartError(f"--host {host}: {exc.strerror}: give an address of this machine (127.0.0.1, "
                          "0.0.0.0)") from None
    sockets: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        sock = socket.socket(family, kind, proto)
        sockets.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            for s in sockets:
                s.close()
            raise _StartError(f"--port {port}: cannot listen on {address[0]}:{port} ({exc.strerror}): stop what "
                              "serves there or give another --port") from None
    return sockets


class _FollowerWatch:
    """``--tp``: watches the follower processes from a thread. One that fails stops the server (while
    it starts: at once, as rank 0 would wait for it until the group's timeout)."""

    def __init__(self, processes: list[Any]):
        import threading

        self.processes, self.serving, self.stopping, self.failed = processes, False, False, ""
        threading.Thread(target=self._run, name="tp-follower-watch", daemon=True).start()

    def _run(self) -> None:
        import signal

        while not self.stopping:
            for rank, proc in enumerate(self.processes, start=1):
                if proc.exitcode not in (None, 0) and not self.stopping:
                    self.failed = f"TP rank {rank} exited with code {proc.exitcode} (its error is above)"
                    print(f"{self.failed}: stopping the server", file=sys.stderr, flush=True)
                    if self.serving:
                        os.kill(os.getpid(), signal.SIGTERM)  # run_app's graceful exit
                    else:
                        for p in self.processes:
                            if p.is_alive():
                                p.terminate()
                        os._exit(1)
                    return
            time.sleep(0.5)


def _engine(a: argparse.Namespace, rank: int = 0, rendezvous: int = 0) -> TorchEngine:
    """The engine of TP rank ``rank`` (``a.tp`` > 1: joins the other ranks over 127.0.0.1:``rendezvous``)."""
    import datetime

    import torch

    device, tp = a.device, None
    if a.tp > 1:
        import torch.distributed as dist

        from meshrl.engines.tp import TensorParallel

        cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{rendezvous}", rank=rank,
                                world_size=a.tp, timeout=datetime.timedelta(seconds=a.tp_timeout_s))
        # schedule messages over gloo: no device sync per step for them under NCCL
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=a.tp_timeout_s)) if cuda else None
        tp = TensorParallel(rank=rank, size=a.tp, group=dist.group.WORLD, leader_driven=True, control_group=control)
    cfg = TorchEngineConfig(dtype=a.dtype, device=device, max_batch_size=a.max_batch_size,
                            max_seq_len=a.max_seq_len, seed=a.seed, cuda_graphs=not a.no_cuda_graphs,
                            contiguous_weights=a.enable_memory_saver)
    return TorchEngine.from_pretrained(a.model, cfg, tp=tp)


def _follower_main(index: int, a: argparse.Namespace, rendezvous: int) -> None:
    """TP rank ``index + 1`` of ``--tp``: build its shard, then run rank 0's schedule until it stops."""
    import signal
    import traceback

    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 stops this one in order
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        engine = _engine(a, rank=index + 1, rendezvous=rendezvous)
        asyncio.run(engine.follow())
    except BaseException:
        print(f"TP rank {index + 1} failed:", file=sys.stderr, flush=True)
        traceback.print_exc()  # (the spawn wrapper keeps it in a file nobody reads)
        raise
    finally:
        if dist.is_initialized() and dist.get_backend() != "nccl":
            # (NCCL: destroying a group whose kernels CUDA graphs captured can hang; the exit frees it)
            dist.destroy_process_group()

"""The standalone server (``python -m meshrl.engines.serve``) in a subprocess, for the tests that
talk to it over HTTP on 127.0.0.1: start it on a free port, wait for ``/health``, stop it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from meshrl.mesh.distributed import free_port


def start_server(model_dir: str | Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start serving ``model_dir`` (extra CLI ``args``); returns the process and its URL at once."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl.engines.serve", "--model", str(model_dir), "--port", str(port), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 90.0) -> None:
    """Until ``url/health`` answers 200; fails with the server's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}: {proc.stdout.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while it starts
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} did not answer /health within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def running_server(model_dir: str | Path, *args: str, env: dict[str, str] | None = None,
                   timeout_s: float = 90.0) -> Iterator[str]:
    """A healthy server's URL for the ``with`` block; stopped afterwards."""
    proc, url = start_server(model_dir, *args, env=env)
    try:
        wait_healthy(proc, url, timeout_s)
        yield url
    finally:
        stop(proc)


@contextlib.asynccontextmanager
async def app_session(app, timeout_s: float = 30.0):
    """An aiohttp ``app`` served in this process on a free port of 127.0.0.1; yields ``(session, port)``,
    a client session whose relative URLs reach it."""
    import aiohttp
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            yield session, port
    finally:
        await runner.cleanup()

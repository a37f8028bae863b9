"""bench/gpu_reshard.py runs end to end on CPU (``--tiny --cpu``: gloo, two spawned ranks) and its
built-in bit-for-bit check of the engine's tensors after each kind of push passes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_reshard_bench_smoke_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_reshard.py"), "--tiny", "--cpu", "--gpus",
                          "2", "--warmup", "0", "--iters", "2", "--bucket-mb", "1"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")}
    assert {"foreach_copy", "colocated", "colocated-staged", "raw-bcast", "raw-bcast-1g", "p2p",
            "p2p-transfer"} <= rows, out.stdout

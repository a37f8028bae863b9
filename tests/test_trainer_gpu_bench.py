"""bench/gpu_trainer.py runs end to end on CPU (``--tiny --cpu``: two gloo ranks), as the lead
runs it on the GPU machine without those flags."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_trainer_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_trainer.py"), "--tiny", "--cpu", "--steps", "2", "--algo", "ppo",
         "--activation-checkpointing", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| rank | device | step s (median) |" in proc.stdout
    assert "losses identical on every rank: True; all finite: True" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert len(r["step_s_all"]) == 2 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 3  # 1 warm-up + 2 timed

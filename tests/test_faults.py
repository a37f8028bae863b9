"""Fault points (meshrl.faults): the schedule, the count over processes, the kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from meshrl import faults


def test_the_schedule_names_points_and_calls_and_refuses_anything_else():
    assert faults.schedule(" reward.score=3, trainer.train_step=1 ,") == {"reward.score": 3, "trainer.train_step": 1}
    for bad in ("reward.scor=3", "reward.score=0", "reward.score", "trainer.train_step=x"):
        with pytest.raises(ValueError, match="MESHRL_FAULTS"):
            faults.schedule(bad)


def test_a_point_kills_the_process_that_makes_its_nth_call_counted_over_processes(tmp_path):
    env = {**os.environ, "MESHRL_FAULTS": "reward.score=3", "MESHRL_FAULTS_DIR": str(tmp_path)}
    call = [sys.executable, "-c", "from meshrl import faults; faults.point('reward.score'); faults.point('trainer.train_step')"]
    codes = [subprocess.run(call, env=env, capture_output=True, text=True, timeout=60) for _ in range(4)]
    assert [c.returncode for c in codes] == [0, 0, -signal.SIGKILL, 0]  # the 3rd call, in the 3rd process
    assert "reward.score call 3" in codes[2].stderr
    assert (tmp_path / "reward.score").stat().st_size == 4 and not (tmp_path / "trainer.train_step").exists()

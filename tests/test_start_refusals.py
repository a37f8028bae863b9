"""What a run refuses at start, in one line, before it writes or starts anything: an output directory
that holds another run or that a live run holds, one that cannot be created, a Ray address that is
not one or where nothing answers, and Pipeline arguments of the wrong kind. No Ray cluster starts
here: each case stops first."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.pipeline import Pipeline, PipelineConfig
from meshrl.pipeline.output_dir import LOCK, RUN_FILES, OutputLock
from meshrl.pipeline.startup import check_ray_address

ROOT = Path(__file__).resolve().parents[1]


def _cfg(out: Path, *overrides: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, [f"run.output_dir={out}", *overrides])


def _finished_run(out: Path) -> None:
    """What a finished run leaves (the files' contents do not matter to the checks)."""
    (out / "checkpoints" / "step_00000003").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "summary"}\n')
    (out / "config.yaml").write_text("run: {}\n")


def test_a_fresh_run_into_another_runs_directory_is_refused_and_overwrite_deletes_only_its_files(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    (out / "notes.txt").write_text("mine")  # a user's own file beside the run's
    with pytest.raises(ConfigError) as info:
        Pipeline(_cfg(out))
    assert str(info.value) == (
        f"`run.output_dir`: {out} holds a run's files (checkpoints up to step_00000003, final/, metrics.jsonl, "
        "config.yaml): continue that run with run.resume=latest, start over with run.overwrite=true (deletes "
        "checkpoints, final, metrics.jsonl, config.yaml), or give another run.output_dir")
    Pipeline(_cfg(out, "run.resume=latest"))  # continuing it is allowed
    # the check runs again under the lock (the directory may have changed since construction)
    pipeline = Pipeline(_cfg(tmp_path / "other"))
    pipeline.out_dir, pipeline._lock = out, OutputLock(out)
    with pytest.raises(ConfigError, match="holds a run's files"):
        asyncio.run(pipeline.run())
    assert (out / "metrics.jsonl").read_text() == '{"kind": "summary"}\n'

    said: list[str] = []
    started = Pipeline(_cfg(out, "run.overwrite=true"))
    started._echo = said.append
    started._claim_output_dir()  # run()'s first act: the lock, the check again, the deletion
    started._lock.release()
    assert sorted(p.name for p in out.iterdir()) == [LOCK, "notes.txt"]
    assert said == [f"run.overwrite=true: deleted the earlier run's checkpoints, final, metrics.jsonl, config.yaml in {out}"]
    assert set(RUN_FILES) >= {"checkpoints", "final", "metrics.jsonl", "timeline.jsonl", "config.yaml", "tensorboard"}


def test_a_directory_a_live_run_holds_is_refused_naming_its_process(tmp_path):
    """The lock is the kernel's (flock): it names the live holder, and a holder that died, even by
    SIGKILL, leaves nothing that blocks the next run."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from meshrl.pipeline.output_dir import OutputLock
        lock = OutputLock(Path({str(out)!r}))
        lock.acquire()
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"`run.output_dir`: {out} is in use by a live run \(pid {holder.pid} on "
                                              r"\S+, since \S+\): wait for it to end or stop it"):
            OutputLock(out).acquire()
    finally:
        holder.kill()
        holder.wait(30)
    lock = OutputLock(out)
    lock.acquire()  # the dead holder's lock went with its process
    assert f"pid {__import__('os').getpid()}" in (out / LOCK).read_text()
    with pytest.raises(ConfigError, match="in use by a live run"):  # two pipelines of one process: one each
        OutputLock(out).acquire()
    lock.release()
    OutputLock(out).acquire()


def test_an_output_dir_that_cannot_be_created_is_named(tmp_path):
    where = Path("/proc/meshrl-no-such-dir/run")  # /proc takes no new directories, even from root
    pipeline = Pipeline(_cfg(where))
    with pytest.raises(ConfigError, match=rf"^`run.output_dir`: cannot create {where} \(.+\): choose a writable "
                                          "directory$"):
        asyncio.run(pipeline.run())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_that_is_not_one_or_where_nothing_answers_fails_in_seconds(tmp_path, monkeypatch):
    """ray.init waited 180 s and more for a port where nothing listens, and said `Invalid address
    format` for a malformed one: each is now one line naming the address, before the warm start."""
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        Pipeline(_cfg(tmp_path / "run"))
    assert time.monotonic() - t0 < 30
    assert str(info.value) == (f"`RAY_ADDRESS`: nothing answers at 127.0.0.1:{port} (Connection refused): start "
                               "the cluster there (ray start --head), or unset RAY_ADDRESS to start a local one")
    for bad in ("not-an-address", "127.0.0.1:99999", "http://127.0.0.1:8265", ":6379"):
        monkeypatch.setenv("RAY_ADDRESS", bad)
        with pytest.raises(ConfigError, match=rf"^`RAY_ADDRESS`: {bad!r} is not a Ray cluster address: give its "
                                              r"head's host:port"):
            check_ray_address(None)
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConfigError, match=rf"^`run.ray_address`: nothing answers at ray://127.0.0.1:{port}"):
        check_ray_address(f"ray://127.0.0.1:{port}")
    check_ray_address(None)  # none named: Ray's own rules (a local cluster)
    # as a user runs the main job: one line, exit status 2, nothing written
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "async_ppo.py"), f"run.output_dir={tmp_path / 'cli'}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"config error: `RAY_ADDRESS`: nothing answers at 127.0.0.1:{port} (Connection refused): start the cluster "
        "there (ray start --head), or unset RAY_ADDRESS to start a local one"], out.stderr[-2000:]
    assert not (tmp_path / "cli").exists()


def test_pipeline_arguments_of_the_wrong_kind_are_refused_at_construction(tmp_path):
    """They failed inside a worker once it started ("waiting for its restart")."""
    cfg = _cfg(tmp_path / "run")
    with pytest.raises(TypeError, match=r"^reward must be a function, a Reward \(with async score\) or a Task, got 42"):
        Pipeline(cfg, reward=42)

    class NoReward:
        def split(self, name):
            return []

    with pytest.raises(TypeError, match=r"^task must have split\(\) and reward\(\) .*; NoReward lacks reward$"):
        Pipeline(cfg, task=NoReward())
    with pytest.raises(TypeError, match=r"object lacks split and reward$"):
        Pipeline(cfg, task=object())
    Pipeline(cfg, task=NoReward(), reward=lambda problem, completion: 1.0)  # the reward= scores instead

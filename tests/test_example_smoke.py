"""Smoke runs of examples/async_ppo.py at tiny size, through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import descendants, left_running

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.embedded.hidden_size=32", "model.embedded.num_hidden_layers=1", "model.embedded.intermediate_size=64",
    "model.embedded.num_attention_heads=2", "model.embedded.num_key_value_heads=1",
    "warmstart.max_steps=20", "warmstart.target_accuracy=null", "warmstart.batch_size=32",
    "task.digits=1", "task.num_test=16", "trainer.samples_per_step=16", "rollout.prompts_per_request=4",
    "rollout.requests_in_flight=2", "run.total_steps=3", "run.eval_every=2",
]


def run_example(tmp_path: Path, *args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    extra = env or {}
    env = {**os.environ, "MESHRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return subprocess.run([sys.executable, str(ROOT / "examples" / "async_ppo.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo_kl"])
def test_example_runs_end_to_end_and_writes_its_outputs(request, tmp_path, algo):
    """ppo through a subprocess, as a user runs it; grpo with a KL term (a reference worker) through
    the example's main() in this process, on the session's Ray cluster (the same code after start-up)."""
    # ppo pushes every 2 steps: after the 3rd and last step one more push (off the cadence the queue
    # counts on), so the final evaluation is of the exported weights
    sync = 2 if algo == "ppo" else 1
    extra = ["algo=grpo", "algo.samples_per_prompt=4", "algo.kl_coef=0.01"] if algo == "grpo_kl" else []
    extra.append(f"trainer.sync_interval={sync}")
    args = [*TINY, *extra, f"run.output_dir={tmp_path / 'run'}"]
    if algo == "ppo":
        out = run_example(tmp_path, *args, env={"MESHRL_CPU_BF16": "auto"})  # a user's CPU: bf16 where it has bf16 instructions
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        stdout = out.stdout
    else:
        request.getfixturevalue("ray_cluster")
        code, stdout, err = _main_in_process(tmp_path, request.getfixturevalue("monkeypatch"),
                                             request.getfixturevalue("capsys"), *args)
        assert code == 0, stdout[-3000:] + err[-3000:]
    assert "held-out accuracy:" in stdout
    assert "held-out accuracy at step 2 (v" in stdout  # the periodic evaluation (run.eval_every=2) is printed

    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("reward_mean", "staleness_mean", "staleness_max", "tokens_per_s", "step_time_s", "loss", "reward_info/correct"):
        assert all(key in r for r in steps), key
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3]
    # the cadence's pushes in the step records (3 // sync), one more off it before the final evaluation
    assert steps[-1]["version"] == 3 // sync and evals[-1]["version"] == -(-3 // sync), (steps[-1], evals[-1])
    # max_staleness=1: pushes went through receives armed during the step (meshrl.reshard.push)
    pushed = [r for r in steps if "sync/recv_signal_wait_s" in r]
    assert pushed and all(r["sync/armed_s"] >= 0 and r["sync/send_s"] > 0 for r in pushed)
    # admission: nothing generated past the bound (the queue hears of a version only once every engine serves it)
    assert steps[-1]["queue/dropped_stale"] == 0 and steps[-1]["queue/kept_stale"] == 0, steps[-1]
    assert records[-1]["kind"] == "summary"
    if algo == "grpo_kl":
        assert "kl" in steps[-1]  # the reference worker's log-probs reached the loss
    assert (run / "plots.png").stat().st_size > 10_000
    assert (run / "config.yaml").is_file() and (run / "timeline.jsonl").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = torch.tensor([tok.encode("1+2=")])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tok))


def _main_in_process(tmp_path: Path, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``examples/async_ppo.py``'s ``main(argv)`` in this process: each case below stops before Ray
    and the warm start, so an interpreter per case would only add its start-up."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from async_ppo import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bad_config_stops_at_start_with_one_line(tmp_path):
    """As a user runs it: an unknown key is one line on stderr and exit status 2."""
    out = run_example(tmp_path, "queue.max_stalenes=2", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: unknown config key `queue.max_stalenes` (known: capacity_tokens, get_timeout_s, "
        "max_staleness, put_timeout_s, reserve_timeout_s, stale_policy)"
    ]


def test_bad_paths_prompts_and_files_stop_at_start_with_one_line(tmp_path, monkeypatch, capsys):
    def run(*args: str) -> tuple[int, str, str]:
        return _main_in_process(tmp_path, monkeypatch, capsys, *args)

    code, _, err = run("--model", str(tmp_path / "nowhere"))
    assert code == 2 and "`model.path`" in err and "does not exist" in err
    # a prompt with no room for its completion is found before the warm start and any actor
    code, out, err = run("rollout.max_new_tokens=60", f"run.output_dir={tmp_path / 'long'}")
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("config error: `rollout.max_new_tokens`: ")
    assert "train prompt(s) leave no room for 60 new tokens in the engine's max_seq_len=64" in err
    assert "warm start" not in out
    # characters the embedded default's tokenizer lacks would be <unk>: such an answer could never match
    (tmp_path / "accents.jsonl").write_text('{"prompt": "caf", "answer": "\u00e9"}\n', encoding="utf-8")
    code, _, err = run("task.kind=file", f"task.train_file={tmp_path / 'accents.jsonl'}",
                       f"task.test_file={tmp_path / 'accents.jsonl'}", f"run.output_dir={tmp_path / 'acc'}")
    assert code == 2 and "characters the embedded default's tokenizer does not have" in err, err[-2000:]
    # a broken prompts file is read before any actor starts, and named in one line too; overrides may
    # come before and after --model
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    code, _, err = run("run.total_steps=2", "task.kind=file", "--config", str(ROOT / "examples" / "async_ppo.yaml"),
                       f"task.train_file={tmp_path / 'bad.jsonl'}", f"task.test_file={tmp_path / 'ok.jsonl'}")
    assert code == 2
    assert err.strip().splitlines() == [f"config error: {tmp_path / 'bad.jsonl'}:2: not valid JSON (Expecting value)"], err[-2000:]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))


class _Run:
    """``examples/async_ppo.py`` in a subprocess whose output lines a thread collects."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        import threading

        env = {**os.environ, "MESHRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
               "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        # a session of its own, as a terminal's job: a signal to its process group reaches every process it started
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "async_ppo.py"), *TINY, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for_step(self, step: int, timeout: float = 240) -> set[int]:
        """Wait for train step ``step``'s line; every process the run has started (descendants)."""
        import time

        deadline = time.monotonic() + timeout
        while not any(line.startswith(f"step {step:>4}/") for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.out[-3000:]
            time.sleep(0.1)
        return descendants(self.proc.pid)

    def stopped_by(self, signum: int, timeout: float = 180, *, group: bool = False) -> int:
        """Send ``signum`` to the driver (``group``: to its process group, as a closed terminal does); its exit status."""
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return code


@pytest.mark.slow
def test_signals_stop_cleanly_resume_past_a_damaged_checkpoint_and_leave_nothing_running(tmp_path):
    """SIGTERM (Slurm, Kubernetes, `ray job stop`, kill) and SIGHUP stop a run as Ctrl-C does (the
    same handler): the steps in flight finish, a checkpoint and final/ are written, whatever
    run.checkpoint_every, and the exit status says which signal. SIGTERM used to kill the run (exit
    143, everything since the last periodic checkpoint lost), and Ray's own handler aborted the
    process 3 s into a clean stop. After each signal no process of the run's local Ray cluster is
    left (its agents outlived it, holding ports). The resume in between
    meets a damaged newest checkpoint and falls back to the one before, saying so. (A SIGKILL of the
    driver: test_ray_start.py.)"""
    import signal

    run_dir = tmp_path / "run"
    args = ["run.total_steps=500", "run.progress=false", "run.checkpoint_every=2", f"run.output_dir={run_dir}"]
    first = _Run(tmp_path, *args)
    processes = first.wait_for_step(3)
    assert first.stopped_by(signal.SIGTERM) == 128 + signal.SIGTERM, first.out[-3000:]
    assert "stopping (SIGTERM): the steps in flight finish" in first.out and "stopped after" in first.out, first.out[-3000:]
    assert "SIGTERM received" not in first.out  # Ray's abort handler did not run
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["stopped"] and 3 <= summary["steps"] < 500
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert newest.name == f"step_{summary['steps']:08d}" and (run_dir / "final" / "config.json").is_file()
    assert not left_running(processes, 15)

    shard = next((newest / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    intact = sorted(p for p in checkpoints.glob("step_*") if p != newest)[-1]
    second = _Run(tmp_path, *args, "run.resume=latest")
    processes = second.wait_for_step(int(intact.name[5:]) + 1)
    assert (f"run.resume=latest: {newest.name} is damaged ({shard} is 100 bytes" in second.out
            and f"resuming from the newest intact checkpoint, {intact}" in second.out), second.out[-3000:]
    # a closed terminal: the hang-up reaches the whole job, Ray's processes too, which leave it to the driver
    assert second.stopped_by(signal.SIGHUP, group=True) == 128 + signal.SIGHUP, second.out[-3000:]
    assert "stopping (SIGHUP)" in second.out and "stopped after" in second.out
    assert not left_running(processes, 15)


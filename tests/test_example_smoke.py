"""Smoke runs of examples/async_ppo.py at tiny size, through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_with_a_checkpoint_to_resume(tmp_path):
    """The first Ctrl-C drains, checkpoints and exports (it used to exit with a traceback and save
    nothing: with checkpoint_every=0, run.resume=latest then started over)."""
    import signal
    import threading

    env = {**os.environ, "MESHRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "async_ppo.py"), *TINY, "run.total_steps=500",
                             "run.progress=false", f"run.output_dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    lines: list[str] = []
    stepped = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step ") and "/500" in line:
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stepped.wait(240), "".join(lines[-40:])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(180) == 0, "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    out = "".join(lines)
    assert "stopping: the steps in flight finish" in out and "stopped after" in out and "run.resume=latest" in out, out[-3000:]
    run = tmp_path / "run"
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "run_state.msgpack").is_file()
    assert (run / "final" / "config.json").is_file()
    summary = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["stopped"] and 1 <= summary["steps"] < 500

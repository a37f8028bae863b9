"""``rollout.engine.backend=sglang`` end to end on a CPU: the pipeline launches one server per rollout
worker through the production lifecycle (``meshrl.engines.sglang_server``), pushes weights into
them over SGLang's weight-update group (gloo), re-issues the samples a push's abort-mode pause
ends, and stops every server when the run ends or fails.

The server is meshrl's own SGLang-compatible one (``rollout.engine.sglang.command`` =
``{python} -m meshrl.engines.serve``, which takes SGLang's launcher arguments), showing SGLang
0.5.17's surface (``--compat-version``): no begin/end_weight_update, a ``weight_version`` per
completion and no per-token spans. Real SGLang on a GPU: bench/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import ray.cloudpickle

from bounds import ON_POLICY_KL_MAX, ON_POLICY_RATIO_ATOL
from meshrl.config import ConfigError, load_config
from meshrl.pipeline import Pipeline, PipelineConfig
from meshrl.tasks import Problem, RewardOutput, TaskConfig, build_task

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

OWN_SERVER = '["{python}", "-m", "meshrl.engines.serve"]'


class DigitShareTask:
    """1-digit addition prompts rewarded by the share of digits in the completion: varied rewards
    (non-zero advantages) for a random model."""

    name = "digit-share"

    def __init__(self) -> None:
        self._base = build_task(TaskConfig(digits=1, num_test=4))

    def split(self, name: str):
        return self._base.split(name)

    def reward(self, problem: Problem, completion: str) -> RewardOutput:
        return RewardOutput(reward=sum(c.isdigit() for c in completion) / max(1, len(completion)))


def _config(model_dir: str, out: Path, *extra: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, [
        f"model.path={model_dir}", f"run.output_dir={out}", "run.total_steps=3", "run.eval_every=0",
        "run.progress=false", "algo=grpo", "algo.samples_per_prompt=2", "trainer.samples_per_step=8",
        "rollout.prompts_per_request=2", "rollout.requests_in_flight=2", "rollout.max_new_tokens=4",
        "rollout.engine.backend=sglang", f"rollout.engine.sglang.command={OWN_SERVER}",
        "rollout.engine.sglang.extra_args={compat-version: 0.5.17}", "rollout.engine.device=cpu",
        "rollout.engine.max_batch_size=16", "rollout.engine.sglang.startup_timeout_s=120",
        "rollout.engine.sglang.stop_timeout_s=10", "run.step_timeout_s=120", *extra,
    ])


def _steps(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


def _servers(model_dir: str) -> list[int]:
    """Pids of meshrl servers (launched by a rollout worker: --model-path) still serving ``model_dir``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"meshrl.engines.serve" in cmd and b"--model-path" in cmd and model_dir.encode() in cmd:
                pids.append(int(entry.name))
    return pids


def _wait_gone(model_dir: str, seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _servers(model_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_launched_servers_take_every_push_and_re_issue_what_a_push_aborts(ray_cluster, tmp_path, tiny_model, capsys):
    """Two rollout workers, each launching its server (logs under the run's output). At
    max_staleness=1 generation runs while the trainer trains; each push pauses the servers in abort
    mode, ending the samples in flight, which the workers send again on the new weights: every step
    still trains exactly samples_per_step whole samples within the bound. No server outlives the
    run."""
    out = tmp_path / "run"
    cfg = _config(tiny_model, out, "queue.max_staleness=1", "run.total_steps=5", "rollout.max_new_tokens=16",
                  "rollout.ignore_eos=true", "rollout.num_workers=2",
                  "reward.num_workers=0")  # the rollout workers score what their servers made: one process fewer
    summary = asyncio.run(Pipeline(cfg, task=DigitShareTask()).run())
    assert summary["steps"] == 5 and summary["version"] == 5
    started = capsys.readouterr().out
    assert "sglang: 2 server(s) (launched, logs in" in started and "weights over a gloo group" in started
    assert sorted(p.name for p in (out / "sglang").iterdir()) == ["server0.log", "server1.log"]
    assert "--model-path" in (out / "sglang" / "server0.log").read_text()
    steps = _steps(out)
    assert all(r["sync/bytes"] > 0 for r in steps)  # every push went through SGLang's group
    assert all(r["samples"] == 8 and r["staleness_max"] <= 1 for r in steps)
    assert all(r["response_tokens_mean"] == 16 for r in steps)  # whole samples, not cut short by an abort
    last = steps[-1]
    # how many a push's pause ended and the worker sent again; a group waiting for its re-issued
    # sample may finish past the bound while the trainer takes newer groups: the queue drops it
    # (and its positions are generated again), so drops come only from groups with a re-issue
    reissued = last["sync/reissued_samples"]
    assert last["queue/kept_stale"] == 0 and last["queue/dropped_stale"] <= 2 * reissued, last
    assert _wait_gone(tiny_model) == []


def test_a_resume_keeps_the_launched_server_and_the_new_trainer_rejoins_it(ray_cluster, tmp_path, tiny_model,
                                                                           monkeypatch):
    """run.warm_resume with SGLang: the trainer dies mid-step (its fault point) and the run resumes with
    the rollout worker and its server kept (the same server process all along: none launched again).
    The new trainer destroys the dead one's weight-update group on it and joins its own; the server
    then serves the checkpoint's weights and every later push: on-policy at max_staleness=0."""
    monkeypatch.setenv("MESHRL_FAULTS", "trainer.train_step=3")
    monkeypatch.setenv("MESHRL_FAULTS_DIR", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    out = tmp_path / "run"
    cfg = _config(tiny_model, out, "queue.max_staleness=0", "run.total_steps=5", "run.checkpoint_every=2",
                  "run.auto_resume=true", "reward.num_workers=0")

    async def run() -> tuple[dict, set[int]]:
        pipeline = Pipeline(cfg, task=DigitShareTask())
        running, servers = asyncio.create_task(pipeline.run()), set()
        async for rec in pipeline.metrics():
            if rec["kind"] == "step":
                servers.update(_servers(tiny_model))
        return await running, servers

    summary, servers = asyncio.run(run())
    assert (tmp_path / "faults" / "trainer.train_step").exists()  # the point fired
    assert summary["steps"] == 5
    assert [(r["role"], r["kept"]) for r in summary["restarts"]] == [("trainer", ["rollout"])]
    assert len(servers) == 1, servers  # one server process served both attempts
    steps = {r["step"]: r for r in _steps(out)}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for r in steps.values():  # the kept server served each step's weights, the resumed ones too
        assert r["sync/bytes"] > 0 and r["staleness_max"] == 0.0, r
        assert abs(r["ratio_mean"] - 1) <= ON_POLICY_RATIO_ATOL and 0 <= r["mismatch_kl"] <= ON_POLICY_KL_MAX, r
    assert _wait_gone(tiny_model) == []


def test_a_server_killed_mid_run_fails_the_run_naming_its_log(ray_cluster, tmp_path, tiny_model):
    """Colocated (the server beside the trainer rank, as on one GPU): the run starts and trains; a
    server killed mid-run fails it within seconds, naming the server's log."""
    out = tmp_path / "run"
    cfg = _config(tiny_model, out, "placement=colocated", "queue.max_staleness=1", "run.total_steps=200",
                  "reward.num_workers=0")  # the hybrid worker scores: one process fewer
    pipeline = Pipeline(cfg, task=DigitShareTask())

    async def main() -> BaseException:
        run = asyncio.ensure_future(pipeline.run())
        async for record in pipeline.metrics():
            if record.get("kind") == "step":
                break
        pids = _servers(tiny_model)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception) as info:
            await asyncio.wait_for(run, 60)
        return info.value, time.monotonic() - killed

    error, took = asyncio.run(main())
    text = "".join(str(e) for e in _chain(error))
    assert "exited with code" in text and str(out / "sglang" / "server0.log") in text, text[-2000:]
    assert took < 30, took
    assert _wait_gone(tiny_model) == []


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def test_attached_servers_train_on_policy_at_staleness_zero_and_are_left_running(ray_cluster, tmp_path, tiny_model):
    """A server the user started: used, not stopped. At max_staleness=0 every sample comes from the
    version it trains: importance ratios 1 and mismatch KL 0 at every step up to float32 rounding
    (bounds.py), as with TorchEngine."""
    from meshrl.mesh.distributed import free_port
    from serving import wait_healthy

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "meshrl.engines.serve", "--model", tiny_model, "--port",
                               str(port), "--device", "cpu", "--compat-version", "0.5.17"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", 120.0)
        out = tmp_path / "run"
        # the rollout worker scores what its server generated (reward.num_workers=0): no reward worker
        cfg = _config(tiny_model, out, "queue.max_staleness=0", "run.total_steps=2", "reward.num_workers=0",
                      f'rollout.engine.sglang.urls=["http://127.0.0.1:{port}"]')
        summary = asyncio.run(Pipeline(cfg, task=DigitShareTask()).run())
        assert summary["steps"] == 2
        assert not (out / "sglang").exists()  # nothing launched
        steps = _steps(out)
        assert [r["step"] for r in steps] == [1, 2] and all(r["samples"] == 8 for r in steps)
        for r in steps:
            assert r["staleness_max"] == 0.0 and r["reward_failed_frac"] == 0.0
            assert abs(r["ratio_mean"] - 1) <= ON_POLICY_RATIO_ATOL and abs(r["ratio_max"] - 1) <= ON_POLICY_RATIO_ATOL, r
            assert 0 <= r["mismatch_kl"] <= ON_POLICY_KL_MAX, r
        assert server.poll() is None  # and nothing stopped: it is the user's
        import urllib.request

        info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/get_model_info", timeout=10).read())
        assert info["weight_version"] == "2"  # the run's pushes landed on it
    finally:
        server.terminate()
        server.wait(30)


def test_a_colocated_server_takes_what_the_trainer_peak_leaves():
    from transformers import Qwen2Config

    from meshrl.pipeline.startup import colocated_mem_fraction

    cfg = load_config(PipelineConfig, None, ["placement=colocated", "rollout.engine.backend=sglang"])
    model = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24)
    gib = 2**30
    h200 = colocated_mem_fraction(cfg, 494_000_000, 140 * gib, model)
    # 0.5B, micro-batches of up to 16k tokens: the trainer (chunked LM head) peaked at 31.3 GiB on
    # an H200 (bench/RESULTS.md); the server's share leaves that and 12 GiB of working memory
    assert 0.3 <= h200 <= 1 - (31.3 + 12) / 140
    small = Qwen2Config(vocab_size=64, hidden_size=512, num_hidden_layers=8)  # the GPU main job's 30M model
    assert colocated_mem_fraction(cfg, 30_000_000, 140 * gib, small) == 0.85  # a ceiling
    more_tokens = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, tokens_per_microbatch=4 * cfg.trainer.tokens_per_microbatch))
    assert colocated_mem_fraction(more_tokens, 494_000_000, 141 * gib, model) < h200
    assert colocated_mem_fraction(cfg, 7_600_000_000, 141 * gib, model) < h200
    assert colocated_mem_fraction(cfg, 70_000_000_000, 141 * gib, model) == 0.05  # a floor, never below


def test_launched_servers_are_sent_weights_in_their_own_dtype():
    """fp32 master weights go out as the 16-bit dtype a launched server holds (half the bytes); an
    fp32 checkpoint's or an attached server's dtype is not meshrl's to know, so those go as they are."""
    from transformers import Qwen2Config

    from meshrl.pipeline.startup import sglang_weight_dtype

    def chosen(*overrides, dtype="bfloat16"):
        cfg = load_config(PipelineConfig, None, ["rollout.engine.backend=sglang", *overrides])
        return sglang_weight_dtype(cfg, Qwen2Config(vocab_size=64, dtype=dtype))

    assert chosen() == "bfloat16" and chosen(dtype="float16") == "float16"
    assert chosen(dtype="float32") == "" and chosen(dtype=None) == ""
    assert chosen("rollout.engine.dtype=float16") == "float16"  # the --dtype meshrl passes
    assert chosen('rollout.engine.sglang.urls=["http://127.0.0.1:1"]') == ""


@pytest.mark.parametrize("overrides, key", [
    (["rollout.engine.sglang.urls=[\"http://127.0.0.1:1\"]", "rollout.num_workers=2"], "rollout.engine.sglang.urls"),
    (["placement=colocated", "colocated.release_weights=true"], "colocated.release_weights"),
    (["rollout.engine.sglang.transport=tensor"], "rollout.engine.sglang.transport"),  # needs the trainer's GPU
    (["rollout.engine.kv_cache_bytes=1000000"], "rollout.engine.kv_cache_bytes"),
    (["rollout.engine.compile=true"], "rollout.engine.compile"),
])
def test_combinations_that_cannot_work_fail_at_start_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        load_config(PipelineConfig, None, ["rollout.engine.backend=sglang", *overrides]).validate()
    with pytest.raises((ValueError, ConfigError), match="rollout.engine.sglang.urls"):
        load_config(PipelineConfig, None, ["rollout.engine.backend=sglang", "rollout.engine.sglang.urls=[\"localhost:1\"]"])

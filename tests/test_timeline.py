"""The timeline math (meshrl.pipeline.timeline) on synthetic spans whose answers are known by hand,
the timeline PNG, and (slow) the end-to-end bench's CPU mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from meshrl.pipeline.timeline import merge, overlap_s, run_summary, steady_window, subtract, timeline_summary

ROOT = Path(__file__).resolve().parents[1]


def span(role: str, what: str, start: float, end: float, **extra) -> dict:
    return {"role": role, "what": what, "start": start, "end": end, **extra}


def sync_run(steps: int, t_gen: float, t_score: float, t_train: float, t_push: float) -> list[dict]:
    """Strict alternation, as max_staleness=0 runs: generate → score → train → push, repeated."""
    spans, t = [], 0.0
    for _ in range(steps):
        spans.append(span("rollout", "generate", t, t + t_gen, worker=0))
        spans.append(span("reward", "score", t + t_gen, t + t_gen + t_score, worker=0))
        t += t_gen + t_score
        spans.append(span("trainer", "train_step", t, t + t_train))
        spans.append(span("sync", "push_weights", t + t_train, t + t_train + t_push, version=1))
        t += t_train + t_push
    return spans


def test_interval_algebra():
    assert merge([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert overlap_s([(0, 10)], [(2, 3), (2.5, 4), (9, 12)]) == pytest.approx(3.0)
    assert overlap_s([(0, 1), (5, 6)], [(0.5, 5.5)]) == pytest.approx(1.0)
    assert subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]
    assert subtract([(0, 1), (4, 6)], [(0, 5)]) == [(5, 6)]


def test_synchronous_run_idles_each_role_for_the_others_phase():
    spans = sync_run(steps=6, t_gen=2.0, t_score=0.5, t_train=3.0, t_push=0.5)
    s = timeline_summary(spans, warmup_steps=1)
    cycle = 2.0 + 0.5 + 3.0 + 0.5
    # the window opens at the end of step 1's train step and closes at the end of step 6's
    assert s["steps"] == 5 and s["window_s"] == pytest.approx(5 * cycle)
    assert s["t_gen_s"] == pytest.approx(2.5) and s["t_train_s"] == pytest.approx(3.0)
    assert s["t_sync_s"] == pytest.approx(0.5) and s["pushes"] == 5  # step 1's push lies in the window, step 6's after it
    assert s["ideal_speedup"] == pytest.approx((2.5 + 3.0) / 3.0)
    assert s["idle"]["rollout/0"] == pytest.approx(1 - 2.0 / cycle)
    assert s["idle"]["reward"] == pytest.approx(1 - 0.5 / cycle)
    assert s["idle"]["trainer"] == pytest.approx(1 - 3.5 / cycle)  # pushes are the trainer's work too


def test_overlapped_run_keeps_the_trainer_busy_and_concurrent_requests_count_once():
    spans = []
    for k in range(8):  # train 2.8 s, push 0.1 s, wait 0.1 s; two requests generate at once, ahead of the trainer
        spans.append(span("trainer", "train_step", 3.0 * k, 3.0 * k + 2.8))
        spans.append(span("sync", "push_weights", 3.0 * k + 2.8, 3.0 * k + 2.9))
        for _ in range(2):
            spans.append(span("rollout", "generate", 3.0 * k, 3.0 * k + 1.5, worker=0))
    s = timeline_summary(spans, warmup_steps=2)
    assert s["steps"] == 6 and s["window_s"] == pytest.approx(23.8 - 5.8)
    assert s["idle"]["trainer"] == pytest.approx(6 * 0.1 / 18.0)  # the waits after steps 2..7's pushes
    assert s["t_gen_s"] == pytest.approx(1.5) and s["t_train_s"] == pytest.approx(2.8)
    assert s["idle"]["rollout/0"] == pytest.approx(1 - 6 * 1.5 / 18.0)
    assert s["t_step_s"] == pytest.approx(3.0) and s["pushes"] == 6


def test_evaluations_are_cut_out_of_the_window_and_warmup_is_capped():
    spans = sync_run(steps=3, t_gen=1.0, t_score=0.0, t_train=1.0, t_push=0.0)
    spans.append(span("eval", "held-out", 3.0, 4.0))  # inside the window (it opens at 2.0, closes at 6.0)
    window, steps = steady_window(spans, warmup_steps=1)
    assert window == [(2.0, 3.0), (4.0, 6.0)] and steps == 2
    s = timeline_summary(spans, warmup_steps=1)
    assert s["window_s"] == pytest.approx(3.0)
    assert s["idle"]["trainer"] == pytest.approx(1 - 1.0 / 3.0)  # step 3's train step (5-6); step 2's (3-4) was cut
    _, steps = steady_window(spans, warmup_steps=10)
    assert steps == 1
    assert timeline_summary([], warmup_steps=1)["steps"] == 0


def test_run_summary_reads_throughput_and_staleness_of_the_measured_steps(tmp_path):
    spans = sync_run(steps=4, t_gen=1.0, t_score=0.0, t_train=1.0, t_push=0.0)
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    steps = [{"kind": "step", "step": i + 1, "samples": 16.0, "response_tokens_mean": 10.0, "staleness_mean": i * 0.5,
              "staleness_max": float(i)} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    s = run_summary(tmp_path, warmup_steps=1)
    assert s["steps"] == 3 and s["window_s"] == pytest.approx(6.0)
    assert s["samples_per_s"] == pytest.approx(48 / 6.0) and s["tokens_per_s"] == pytest.approx(480 / 6.0)
    assert s["staleness_mean"] == pytest.approx((0.5 + 1.0 + 1.5) / 3) and s["staleness_max"] == 3.0

    from meshrl.pipeline.plots import plot_timeline

    png = plot_timeline(tmp_path, warmup_steps=1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_run_leaves_the_callers_matplotlib_alone(tmp_path):
    """The run's plots are drawn off the event loop in a thread, and in a program that may have its own
    figures (a notebook): no pyplot figure is opened and the backend is not switched (it was set to Agg)."""
    import matplotlib
    import matplotlib.pyplot as plt

    from meshrl.pipeline.plots import plot_run

    spans = sync_run(steps=3, t_gen=1.0, t_score=0.1, t_train=1.0, t_push=0.1)
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    records = [{"kind": "step", "step": i + 1, "reward_mean": 0.1 * i, "tokens_per_s": 100.0, "step_time_s": 1.0,
                "staleness_mean": 0.5, "staleness_max": 1.0} for i in range(3)]
    records.append({"kind": "eval", "step": 3, "accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")
        mine = plt.figure()
        png = plot_run(tmp_path)
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [mine.number]
        plt.close(mine)
    finally:
        matplotlib.use(before)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "timeline.png").stat().st_size > 10_000


@pytest.mark.slow
def test_e2e_bench_tiny_cpu_mode(ray_cluster, tmp_path, monkeypatch, capsys):
    """The GPU bench's own code path at tiny size on CPU: sync and one async run, table and files
    (its main() in this process, on the session's Ray cluster: a subprocess would only add an
    interpreter and a cluster start)."""
    import ray

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_gpu

    ray.cloudpickle.register_pickle_by_value(e2e_gpu)  # its task reaches the rollout workers that score (not on their path)

    # an override reaches every run (here: the rollout worker scores, one process fewer a run)
    assert e2e_gpu.main(["--tiny", "--etas", "0,1", "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "e2e"),
                         "reward.num_workers=0"]) == 0
    stdout = capsys.readouterr().out
    result = json.loads((tmp_path / "e2e" / "e2e.json").read_text())
    runs = {r["eta"]: r for r in result["models"][0]["runs"]}
    assert set(runs) == {0, 1}
    for r in runs.values():
        assert r["steps"] == 5 and r["measured_steps"] == 4 and r["samples_per_s"] > 0 and r["t_train_s"] > 0 and r["t_gen_s"] > 0
        assert 0 <= r["idle"]["trainer"] < 1 and r["pushes"] >= 3
        assert r["response_tokens_mean"] == result["models"][0]["config"]["response_len"]  # fixed lengths (ignore_eos)
    assert runs[0]["staleness_mean"] == 0.0
    assert yaml.safe_load((tmp_path / "e2e" / "tiny" / "eta1" / "config.yaml").read_text())["reward"]["num_workers"] == 0
    assert (tmp_path / "e2e" / "tiny" / "timelines.png").stat().st_size > 10_000
    assert any(line.startswith("| η |") for line in stdout.splitlines()[-8:])  # the table prints last

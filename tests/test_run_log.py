"""The run's log: metrics.jsonl, its async stream, and TensorBoard scalars (also across a resume)."""

from __future__ import annotations

import json
import time

import pytest

from meshrl.pipeline.metrics import RunLog

pytest.importorskip("tensorboard")  # the dev extra installs it; without it the run writes no scalars


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``run_dir/tensorboard``, as (step, value), purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step(n: int, reward: float) -> dict:
    return {"step": n, "version": n, "reward_mean": reward, "queue/dropped_stale": 0, "reward_info/correct": reward / 2,
            "note": "text is not a scalar", "is_last": n == 3}


def test_step_and_eval_records_become_scalars_at_their_step(tmp_path):
    log = RunLog(tmp_path, 3, progress=False, tensorboard=True)
    log.record("eval", step=0, version=0, accuracy=0.25, problems=8)
    for n in (1, 2, 3):
        log.record("step", **step(n, 0.1 * n))
    log.record("eval", step=3, version=3, accuracy=0.5, problems=8)
    log.close()
    s = scalars(tmp_path)
    assert s["reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert [v for _, v in s["reward_info/correct"]] == pytest.approx([0.05, 0.1, 0.15])
    assert s["eval/accuracy"] == [(0, 0.25), (3, 0.5)] and s["eval/problems"] == [(0, 8.0), (3, 8.0)]
    assert "note" not in s and "is_last" not in s and "step" not in s and "time_s" not in s
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["eval", "step", "step", "step", "eval"]


def test_a_resumed_run_replaces_what_the_earlier_run_logged_past_its_checkpoint(tmp_path):
    """The earlier run logged steps 1-4 and checkpointed at 2; the resumed run replays 1-2 into
    metrics.jsonl and writes its own 3-4: TensorBoard shows one value per step, the resumed run's
    from step 2 on (the replayed step 2 is written again, as its eval re-runs there)."""
    first = RunLog(tmp_path, 4, progress=False, tensorboard=True)
    for n in (1, 2, 3, 4):
        first.record("step", **step(n, 0.1 * n))
    first.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][:2]
    # TensorBoard reads a run's event files in name order, and a name holds its writer's start in
    # whole seconds: a real resume starts seconds later; this one must not start in the same second
    time.sleep(1.05)

    resumed = RunLog(tmp_path, 4, progress=False, tensorboard=True, resumed_step=2)
    for rec in records:
        resumed.replay(rec)
    resumed.record("eval", step=2, version=2, accuracy=0.75)
    for n in (3, 4):
        resumed.record("step", **step(n, 1.0 + n))
    resumed.close()
    s = scalars(tmp_path)
    assert s["reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 4.0), (4, 5.0)]
    assert s["eval/accuracy"] == [(2, 0.75)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4)]
    assert lines[0] == records[0]  # replayed as written, time_s included


def test_tensorboard_off_writes_no_folder(tmp_path):
    log = RunLog(tmp_path, 1, progress=False, tensorboard=False)
    log.record("step", **step(1, 0.5))
    log.close()
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").stat().st_size > 0

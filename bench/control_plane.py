"""The control plane's cost: actor calls the controller sends, and its CPU, per train step, with 1, 4
and 16 rollout workers.

    python bench/control_plane.py                        # 1, 4 and 16 workers, 200 steps after 20
    python bench/control_plane.py --workers 1,4 --steps 400

Each run is the main job at tiny size in this process (the controller is this process): the
embedded default's architecture shrunk to 32 wide, GRPO with 4 samples per prompt,
``rollout.prompts_per_request=2`` and ``rollout.requests_in_flight=2`` (small requests: a controller
that made calls per request would make several per step, more with more workers),
``reward.num_workers=0``, ``queue.max_staleness=1``, 32 samples a step. Counted from the first step
record after the warm-up steps to the last step's record (the trainer runs the steps in chunks and
its records come a chunk at a time, so the steps counted are those between the two records seen):
the actor calls this process sent (``meshrl.mesh.actor_mesh.SENT``, by method), this process's CPU
seconds (``time.process_time``: every thread, Ray's included), and the steps' wall time. Prints a
table and writes ``control_plane.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.embedded.hidden_size=32", "model.embedded.num_hidden_layers=1", "model.embedded.intermediate_size=64",
    "model.embedded.num_attention_heads=2", "model.embedded.num_key_value_heads=1",
    "warmstart.max_steps=10", "warmstart.target_accuracy=null", "warmstart.batch_size=32",
    "task.digits=1", "task.num_test=8",
]


async def one(workers: int, steps: int, warmup: int, out: Path) -> dict:
    """One run with ``workers`` rollout workers; its calls and CPU per step after ``warmup`` steps."""
    from meshrl.config import load_config
    from meshrl.mesh.actor_mesh import SENT
    from meshrl.pipeline import Pipeline, PipelineConfig

    cfg = load_config(PipelineConfig, ROOT / "examples" / "async_ppo.yaml", [
        *TINY, "algo=grpo", "algo.samples_per_prompt=4", "trainer.samples_per_step=32", f"rollout.num_workers={workers}",
        "rollout.prompts_per_request=2", "rollout.requests_in_flight=2", "reward.num_workers=0", "queue.max_staleness=1",
        f"run.total_steps={warmup + steps}", f"run.eval_every={warmup + steps}", "run.progress=false",
        "run.checkpoint_at_end=false", f"run.output_dir={out / f'workers{workers}'}", "run.overwrite=true",
    ])
    pipeline = Pipeline(cfg)
    run = asyncio.create_task(pipeline.run())
    marks: list[tuple[int, collections.Counter, float, float]] = []
    async for rec in pipeline.metrics():
        if rec["kind"] == "step" and (rec["step"] >= warmup and not marks or rec["step"] == warmup + steps):
            marks.append((rec["step"], collections.Counter(SENT), time.process_time(), time.perf_counter()))
    await run
    (s0, calls0, cpu0, t0), (s1, calls1, cpu1, t1) = marks[0], marks[-1]
    steps = s1 - s0
    if steps < 1:
        raise RuntimeError(f"every step after the warm-up came in one record batch (steps {s0}..{s1}): give more --steps")
    calls = calls1 - calls0
    return {"workers": workers, "steps": steps, "calls_per_step": sum(calls.values()) / steps,
            "by_method": {k: v / steps for k, v in calls.most_common()}, "cpu_ms_per_step": 1e3 * (cpu1 - cpu0) / steps,
            "steps_per_s": steps / (t1 - t0)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,4,16", help="rollout worker counts, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="train steps after the warm-up ones (those counted: see above)")
    p.add_argument("--warmup", type=int, default=20, help="train steps first, not counted")
    p.add_argument("--out", default="runs/control_plane", help="output directory")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MESHRL_CACHE", str(out / "cache"))
    rows = [asyncio.run(one(int(n), a.steps, a.warmup, out)) for n in a.workers.split(",")]
    (out / "control_plane.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'workers':>7} | {'calls/step':>10} | {'CPU ms/step':>11} | {'steps/s':>7} | calls per step by method")
    for r in rows:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["by_method"].items())[:6])
        print(f"{r['workers']:>7} | {r['calls_per_step']:>10.2f} | {r['cpu_ms_per_step']:>11.1f} | {r['steps_per_s']:>7.2f} | {top}")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

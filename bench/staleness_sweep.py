"""Measure what max_staleness buys: the embedded default at several η, side by side in one process.

    python bench/staleness_sweep.py                       # η ∈ {0, 1, 2, 4, 8}, 200 steps each
    python bench/staleness_sweep.py --etas 0,2 --steps 50 --out runs/sweep-small
    python bench/staleness_sweep.py --steps 150 --corrections ppo,async_ppo,tis   # each correction's sweep, one sitting

``--corrections`` runs the whole η sweep once per off-policy correction (CORRECTIONS: plain PPO,
decoupled PPO, truncated importance sampling), one after the other on the same cluster, and adds
a table of each correction's held-out accuracy at η = max against its own η = 0.

Each η runs the same config (examples/async_ppo.yaml plus any overrides given after ``--``) on the
same local Ray cluster, one after the other, from the same cached warm start. Writes under
``--out``: one run directory per η, ``staleness.png`` (reward against steps and against wall time,
held-out accuracy, throughput) and ``staleness.md`` (the table that docs/staleness.md shows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshrl.config import load_config  # noqa: E402
from meshrl.pipeline import Pipeline, PipelineConfig  # noqa: E402


CORRECTIONS = {
    "ppo": [],  # plain PPO: the clipped ratio against the behaviour log-probs
    "async_ppo": ["algo=async_ppo"],  # decoupled PPO (AReaL): clip around recomputed proximal log-probs
    "tis": ["algo.importance_sampling=truncated_token"],  # PPO with truncated per-token importance weights
}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(eta: int, run_dir: Path, target: float = 0.6) -> dict:
    records = _records(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    summary = next(r for r in records if r["kind"] == "summary")
    train_s = steps[-1]["time_s"] - steps[0]["time_s"] + steps[0]["step_time_s"]
    samples = sum(r["samples"] for r in steps)
    t0 = steps[0]["time_s"] - steps[0]["step_time_s"]
    reached = [e["time_s"] - t0 for e in evals if e["accuracy"] >= target and e["step"] > 0]
    return {
        "eta": eta,
        "steps": len(steps),
        "rl_seconds": train_s,
        "samples_per_s": samples / train_s,
        "tokens_per_s": steps[-1]["generated_tokens"] / train_s,
        "staleness_mean": sum(r["staleness_mean"] for r in steps) / len(steps),
        "staleness_max": max(r["staleness_max"] for r in steps),
        "trainer_wait_frac": sum(r["batch_wait_s"] for r in steps) / train_s,
        "ratio_max": max(r.get("ratio_max", 1.0) for r in steps),  # π / π_old (π_old: behaviour, or the recomputed proximal)
        "is_weight_max": max((r["is_weight_max"] for r in steps if "is_weight_max" in r), default=None),  # π_prox / π_behav, capped
        "clip_frac": sum(r.get("clip_frac_low", 0) + r.get("clip_frac_high", 0) for r in steps) / len(steps),
        "mismatch_kl": sum(r.get("mismatch_kl", 0.0) for r in steps) / len(steps),
        "acc_before": summary["accuracy_before"],
        "acc_after": summary["accuracy_after"],
        "evals": [(e["step"], e["time_s"], e["accuracy"]) for e in evals],
        "target": target,
        "time_to_target": reached[0] if reached else None,  # RL seconds to the first eval at >= target
    }


def plot(rows: list[dict], run_dirs: dict[int, Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for eta, run_dir in run_dirs.items():
        steps = [r for r in _records(run_dir) if r["kind"] == "step"]
        t0 = steps[0]["time_s"] - steps[0]["step_time_s"]
        smooth = [sum(r["reward_mean"] for r in steps[max(0, i - 9) : i + 1]) / len(steps[max(0, i - 9) : i + 1]) for i in range(len(steps))]
        axes[0].plot([r["step"] for r in steps], smooth, label=f"η={eta}")
        axes[1].plot([r["time_s"] - t0 for r in steps], smooth, label=f"η={eta}")
    for row in rows:
        axes[2].plot([e[0] for e in row["evals"]], [e[2] for e in row["evals"]], "o-", label=f"η={row['eta']}")
    axes[3].bar([str(r["eta"]) for r in rows], [r["samples_per_s"] for r in rows])
    axes[0].set(xlabel="train step", ylabel="train reward (10-step mean)", title="Reward vs steps")
    axes[1].set(xlabel="seconds of RL", ylabel="train reward (10-step mean)", title="Reward vs wall time")
    axes[2].set(xlabel="train step", ylabel="held-out accuracy (greedy)", title="Held-out accuracy")
    axes[3].set(xlabel="max_staleness η", ylabel="samples / s", title="Throughput")
    for ax in axes[:3]:
        ax.legend()
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _weight(w: float | None) -> str:
    return "-" if w is None else f"{w:.2f}"


def table(rows: list[dict]) -> str:
    target = rows[0]["target"] if rows else 0.6
    head = (f"| η | RL time (s) | samples/s | mean / max staleness | trainer waiting | max ratio | clip frac | mismatch KL | max IS weight | "
            f"held-out before → after | s to {target:.0%} |\n")
    head += "|---|---|---|---|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['eta']} | {r['rl_seconds']:.0f} | {r['samples_per_s']:.0f} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | "
        f"{r['trainer_wait_frac']:.0%} | {r['ratio_max']:.2f} | {r['clip_frac']:.4f} | {r['mismatch_kl']:.4f} | "
        f"{_weight(r['is_weight_max'])} | "
        f"{r['acc_before']:.1%} → {r['acc_after']:.1%} | "
        f"{'not reached' if r['time_to_target'] is None else round(r['time_to_target'])} |\n"
        for r in rows
    )


def kept(by_correction: dict[str, list[dict]]) -> str:
    """Each correction's held-out accuracy at its largest η as a share of its own η = 0."""
    lines = ["| correction | η = 0 after | largest η | after | kept of η = 0 |", "|---|---|---|---|---|"]
    for name, rows in by_correction.items():
        base = next((r for r in rows if r["eta"] == 0), None)
        top = max(rows, key=lambda r: r["eta"])
        share = f"{top['acc_after'] / base['acc_after']:.1%}" if base and base["acc_after"] > 0 else "-"
        lines.append(f"| {name} | {base['acc_after']:.1%} | {top['eta']} | {top['acc_after']:.1%} | {share} |" if base
                     else f"| {name} | - | {top['eta']} | {top['acc_after']:.1%} | - |")
    return "\n".join(lines) + "\n"


async def sweep(etas: list[int], steps: int, out: Path, overrides: list[str], target: float = 0.6) -> list[dict]:
    rows, run_dirs = [], {}
    for eta in etas:
        run_dir = out / f"eta{eta}"
        cfg = load_config(
            PipelineConfig, ROOT / "examples" / "async_ppo.yaml",
            [*overrides, f"queue.max_staleness={eta}", f"run.total_steps={steps}", f"run.output_dir={run_dir}", "run.progress=false",
             "run.overwrite=true"],  # a rerun replaces the cell
        )
        print(f"== max_staleness={eta} ==", flush=True)
        await Pipeline(cfg).run()
        run_dirs[eta] = run_dir
        rows.append(summarise(eta, run_dir, target))
    (out / "staleness.md").write_text(table(rows))
    plot(rows, run_dirs, out)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--etas", default="0,1,2,4,8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/staleness")
    p.add_argument("--corrections", help=f"comma-separated, of {', '.join(CORRECTIONS)}: one sweep each, under --out/NAME")
    p.add_argument("--target", type=float, default=0.6, help="held-out accuracy whose first reaching is timed")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    etas = [int(x) for x in args.etas.split(",")]
    if not args.corrections:
        rows = asyncio.run(sweep(etas, args.steps, out, args.overrides, args.target))
        print(table(rows))
        print(f"plot: {out / 'staleness.png'}")
        return
    names = args.corrections.split(",")
    unknown = [n for n in names if n not in CORRECTIONS]
    if unknown:
        p.error(f"--corrections: unknown {', '.join(unknown)} (known: {', '.join(CORRECTIONS)})")
    by_correction = {}
    for name in names:
        print(f"==== correction {name} ====", flush=True)
        by_correction[name] = asyncio.run(sweep(etas, args.steps, out / name, [*args.overrides, *CORRECTIONS[name]], args.target))
    report = "".join(f"### {name}\n\n{table(rows)}\n" for name, rows in by_correction.items()) + kept(by_correction)
    (out / "corrections.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()

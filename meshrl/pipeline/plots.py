"""PNG plots of a run: learning (reward, accuracy), throughput, staleness and the role timeline.

Reads only ``metrics.jsonl`` and ``timeline.jsonl``, so ``python -m meshrl.pipeline.plots DIR``
redraws any finished (or running) run: ``plots.png`` (four panels) and ``timeline.png`` (one lane
per rollout worker, reward, trainer and eval, coloured by activity, weight pushes marked, the
warm-up shaded, each lane's idle fraction over the steady-state window in its label).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from meshrl.pipeline.timeline import lane_of, merge, steady_window, timeline_summary

__all__ = ["plot_run", "draw_timeline", "plot_timeline"]

_ACTIVITY_COLORS = {"restart": "black", "revived": "black", "hung": "tab:olive", "generate": "tab:blue", "score": "tab:orange", "train_step": "tab:green", "push_weights": "tab:red",
                    "checkpoint": "tab:brown", "held-out": "tab:purple", "switch_to_train": "tab:gray"}


def _lane_order(lane: str) -> tuple[int, int]:
    head, _, tail = lane.partition("/")
    rank = {"rollout": 0, "reward": 1, "trainer": 2, "eval": 3}.get(head, 4)
    return rank, int(tail) if tail.isdigit() else 0


def draw_timeline(ax: Any, spans: Sequence[dict[str, Any]], *, warmup_steps: int = 1, xlim: tuple[float, float] | None = None,
                  title: str = "What each role was doing", legend_outside: bool = True) -> dict[str, Any]:
    """Draw the lanes of ``spans`` on ``ax``; returns their ``timeline_summary``."""
    summary = timeline_summary(spans, warmup_steps)
    lanes = sorted({lane_of(s) for s in spans}, key=_lane_order)
    seen: set[str] = set()
    for row, lane in enumerate(lanes):
        mine = [s for s in spans if lane_of(s) == lane]
        # the long activities first, what happens inside or between them on top
        for what in sorted({s["what"] for s in mine}, key=lambda w: (w not in ("train_step", "generate"), w == "push_weights", w)):
            bars = merge((s["start"], s["end"]) for s in mine if s["what"] == what)
            height = 0.8 if what != "push_weights" else 1.0
            ax.broken_barh([(a, b - a) for a, b in bars], (row - height / 2, height), color=_ACTIVITY_COLORS.get(what, "tab:gray"),
                           label=None if what in seen else what, linewidth=0)
            seen.add(what)
        for s in mine:  # an instant (a worker's restart, a hang taken): a marker on the lane
            if s["end"] - s["start"] < 1e-6 and s["what"] in ("restart", "hung"):
                ax.plot([s["end"]], [row], marker="v", color=_ACTIVITY_COLORS[s["what"]], markersize=7,
                        label=None if s["what"] in seen else s["what"], linestyle="none")
                seen.add(s["what"])
    for s in spans:  # a weight push stops everything that depends on it: mark it across every lane
        if s["role"] == "sync":
            ax.axvline(s["end"], color="tab:red", linewidth=0.6, alpha=0.5)
    window, _ = steady_window(spans, warmup_steps)
    if window and summary["steps"]:
        ax.axvspan(min(s["start"] for s in spans), window[0][0], color="0.85", zorder=0, label="warm-up (not measured)")
    idle = summary.get("idle", {})
    labels = [f"{lane}\nidle {idle[lane]:.0%}" if lane in idle else lane for lane in lanes]
    ax.set(yticks=range(len(lanes)), yticklabels=labels, xlabel="seconds since start", title=title, ylim=(-0.7, len(lanes) - 0.3))
    if xlim is not None:
        ax.set_xlim(*xlim)
    if legend_outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        ax.legend(loc="upper right", fontsize="x-small", ncol=2)
    return summary


def plot_timeline(run_dir: str | Path, *, warmup_steps: int = 1, out: str | Path | None = None,
                  xlim: tuple[float, float] | None = None) -> Path:
    """Write the role timeline of ``run_dir`` as a PNG (default ``run_dir/timeline.png``)."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend and figures stay as they are

    run_dir = Path(run_dir)
    spans = _load(run_dir / "timeline.jsonl")
    lanes = {lane_of(s) for s in spans}
    fig = Figure(figsize=(14, 1.2 + 0.7 * max(1, len(lanes))))
    ax = fig.subplots()
    s = draw_timeline(ax, spans, warmup_steps=warmup_steps, xlim=xlim)
    if s["steps"]:
        ax.set_title(f"What each role was doing — steady state: {s['steps']} steps in {s['window_s']:.1f}s; per step "
                     f"generate {s['t_gen_s']:.2f}s, train {s['t_train_s']:.2f}s, push {s['t_sync_s'] * 1e3:.0f} ms")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "timeline.png"
    fig.savefig(out, dpi=100)
    return out


def _load(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> Path:
    """Write ``run_dir/plots.png`` (and ``timeline.png``); return the first's path."""
    from matplotlib.figure import Figure  # no pyplot: thread-safe, and a notebook's backend stays its own

    run_dir = Path(run_dir)
    records = _load(run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    spans = _load(run_dir / "timeline.jsonl")

    fig = Figure(figsize=(13, 8))
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    x = [r["step"] for r in steps]
    ax.plot(x, [r["reward_mean"] for r in steps], label="train reward (sampled)", alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)")
    ax.set(xlabel="train step", ylabel="reward / accuracy", title="Learning", ylim=(-0.02, 1.02))
    ax.legend(loc="lower right")

    ax = axes[0][1]
    ax.plot(x, [r["tokens_per_s"] for r in steps], label="generated tokens/s")
    ax.set(xlabel="train step", ylabel="tokens/s", title="Throughput")
    ax2 = ax.twinx()
    ax2.plot(x, [r["step_time_s"] for r in steps], color="tab:gray", alpha=0.5, label="step time (s)")
    ax2.set_ylabel("step time (s)")
    ax.legend(loc="upper left")

    ax = axes[1][0]
    ax.plot(x, [r["staleness_mean"] for r in steps], label="mean")
    ax.plot(x, [r["staleness_max"] for r in steps], label="max", alpha=0.6)
    ax.set(xlabel="train step", ylabel="versions behind", title="Staleness of trained samples")
    ax.legend()

    draw_timeline(axes[1][1], spans, legend_outside=False)
    fig.tight_layout()
    out = run_dir / "plots.png"
    fig.savefig(out, dpi=90)
    plot_timeline(run_dir)
    return out


if __name__ == "__main__":
    print(plot_run(sys.argv[1] if len(sys.argv) > 1 else "."))

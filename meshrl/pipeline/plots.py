"""PNG plots of a run: learning (reward, accuracy), throughput, staleness and the role timeline.

Reads only ``metrics.jsonl`` and ``timeline.jsonl``, so ``python -m meshrl.pipeline.plots DIR``
redraws any finished (or running) run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["plot_run"]

_ROLE_COLORS = {"rollout": "tab:blue", "reward": "tab:orange", "trainer": "tab:green", "sync": "tab:red", "eval": "tab:purple"}


def _load(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> Path:
    """Write ``run_dir/plots.png`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = _load(run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    spans = _load(run_dir / "timeline.jsonl")

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
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

    ax = axes[1][1]
    roles = sorted({s["role"] for s in spans}, key=lambda r: list(_ROLE_COLORS).index(r) if r in _ROLE_COLORS else 99)
    for row, role in enumerate(roles):
        bars = [(s["start"], s["end"] - s["start"]) for s in spans if s["role"] == role]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=_ROLE_COLORS.get(role, "tab:gray"))
    ax.set(yticks=range(len(roles)), yticklabels=roles, xlabel="seconds since start", title="What each role was doing")
    fig.tight_layout()
    out = run_dir / "plots.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot_run(sys.argv[1] if len(sys.argv) > 1 else "."))

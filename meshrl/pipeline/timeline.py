"""The role timeline of a run: busy intervals per lane, idle fractions and phase times.

``timeline.jsonl`` (``RunLog.span``) holds one span per piece of work: role, what, start, end
(seconds since the run began) and, for rollout and reward spans, the rollout worker's index. This
module turns the spans into what the overlap claim is judged by:

- **lanes**, one per thing that can wait: ``rollout/<i>`` (rollout worker i's engine, busy while
  any of its generate calls is in flight), ``reward`` (scoring), ``trainer`` (train steps, weight
  pushes and checkpoints: the trainer ranks do all three) and ``eval``;
- the **steady-state window**: from the end of the ``warmup_steps``-th train step to the end of the
  last one, minus every held-out evaluation (it runs on the engines and would hide their idling);
- per lane, the **idle fraction** 1 − |busy ∩ window| / |window|, busy being the union of the
  lane's spans (requests in flight at once count once);
- **phase times** per train step in the window: ``t_gen_s`` (the union of every rollout and reward
  span: the wall time the rollout side worked), ``t_train_s`` (train steps), ``t_sync_s`` (one
  weight push), and the ideal overlap speedup ``(t_gen + t_train) / max(t_gen, t_train)`` that a
  synchronous run's phase times promise: the overlap of the two phases alone, not an upper bound
  (a synchronous step also holds its push and the gaps between phases, which overlap can hide too,
  so a run may reach slightly more; ``t_step_s / max(t_gen, t_train)`` of the synchronous run is
  the bound).

Simplification on purpose: a span is busy for its whole length, even while an engine waits on a
paused batch or runs a batch too small to fill the device; the timeline says who waits, not how
well the time waited for was used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "Interval", "lane_of", "load_spans", "merge", "overlap_s", "subtract", "steady_window", "timeline_summary",
    "run_summary",
]

Interval = tuple[float, float]

NOT_WORK = ("restart", "revived", "hung")
"""Spans that mark a fault on a lane (a role's death and its time away), not work done."""


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def overlap_s(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two unions of intervals (each merged first)."""
    a, b = merge(a), merge(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(intervals: Sequence[Interval], holes: Sequence[Interval]) -> list[Interval]:
    """``intervals`` minus ``holes`` (both unions of intervals), merged."""
    out: list[Interval] = []
    holes = merge(holes)
    for start, end in merge(intervals):
        cur = start
        for h0, h1 in holes:
            if h1 <= cur or h0 >= end:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return out


def lane_of(span: dict[str, Any]) -> str:
    """The lane a span occupies (module docstring): weight pushes (and the colocated mode's switch
    to training) belong to the trainer's lane."""
    role = span["role"]
    if role == "rollout":
        return f"rollout/{span.get('worker', 0)}"
    if role in ("trainer", "sync", "colocated"):  # colocated: the switch to training, inside a train step
        return "trainer"
    return role


def load_spans(run_dir: str | Path) -> list[dict[str, Any]]:
    """The spans of ``run_dir/timeline.jsonl`` (empty if there is none)."""
    path = Path(run_dir) / "timeline.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_steps(spans: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["role"] == "trainer" and s["what"] == "train_step"), key=lambda s: s["end"])


def steady_window(spans: Sequence[dict[str, Any]], warmup_steps: int) -> tuple[list[Interval], int]:
    """The steady-state window (module docstring) as disjoint intervals, and the train steps that
    end in it. ``warmup_steps`` is capped so at least one step remains; with 0 the window opens
    at the first span that is not an evaluation."""
    steps = _train_steps(spans)
    if not steps:
        return [], 0
    warmup = max(0, min(warmup_steps, len(steps) - 1))
    if warmup:
        start = steps[warmup - 1]["end"]
    else:
        start = min(s["start"] for s in spans if s["role"] != "eval")
    evals = [(s["start"], s["end"]) for s in spans if s["role"] == "eval"]
    return subtract([(start, steps[-1]["end"])], evals), len(steps) - warmup


def timeline_summary(spans: Sequence[dict[str, Any]], warmup_steps: int = 1) -> dict[str, Any]:
    """Idle fraction per lane and phase times per train step over the steady-state window.

    Returns ``window_s`` (its length), ``window`` (its first start and last end), ``steps`` (train
    steps ending in it), ``idle`` ({lane: fraction}), ``t_gen_s``, ``t_train_s``, ``t_sync_s``
    (mean push; 0 without pushes), ``pushes``, ``t_step_s`` (window / steps) and
    ``ideal_speedup`` ((t_gen + t_train) / max(t_gen, t_train): what overlapping the two phases
    of this run would give; not an upper bound, see the module docstring) and ``max_speedup``
    (``t_step_s / max(t_gen, t_train)``: the bound, with push and gaps hidden too). Empty
    (``steps`` 0) when no train step finished.
    """
    window, steps = steady_window(spans, warmup_steps)
    window_s = length(window)
    if steps == 0 or window_s <= 0:
        return {"steps": 0, "window_s": 0.0, "idle": {}}
    by_lane: dict[str, list[Interval]] = {}
    spans = [s for s in spans if s["what"] not in NOT_WORK]
    for s in spans:
        if s["role"] != "eval":
            by_lane.setdefault(lane_of(s), []).append((s["start"], s["end"]))
    idle = {lane: 1.0 - overlap_s(iv, window) / window_s for lane, iv in sorted(by_lane.items())}

    def per_step(pred) -> float:
        return overlap_s([(s["start"], s["end"]) for s in spans if pred(s)], window) / steps

    t_gen = per_step(lambda s: s["role"] in ("rollout", "reward"))
    t_train = per_step(lambda s: s["role"] == "trainer" and s["what"] == "train_step")
    pushes = [s["end"] - s["start"] for s in spans
              if s["role"] == "sync" and overlap_s([(s["start"], s["end"])], window) > 0]
    busiest = max(t_gen, t_train)
    return {
        "window_s": window_s, "window": (window[0][0], window[-1][1]), "steps": steps, "idle": idle,
        "t_gen_s": t_gen, "t_train_s": t_train, "t_sync_s": sum(pushes) / len(pushes) if pushes else 0.0,
        "pushes": len(pushes), "t_step_s": window_s / steps,
        "ideal_speedup": (t_gen + t_train) / busiest if busiest > 0 else 1.0,
        "max_speedup": window_s / steps / busiest if busiest > 0 else 1.0,
    }


def run_summary(run_dir: str | Path, warmup_steps: int = 1) -> dict[str, Any]:
    """``timeline_summary`` of a run directory plus its throughput over the same window, from
    ``metrics.jsonl``: ``samples_per_s`` and ``tokens_per_s`` (trained samples and their response
    tokens, steps after the warm-up), ``staleness_mean`` (mean over those steps), and how steady
    those steps were: ``step_s_median``, ``step_s_p90`` and ``step_p90_over_median`` (each step's
    ``step_time_s``), and the same for its train part (``train_s_median``, ``train_s_p90``)."""
    run_dir = Path(run_dir)
    out = timeline_summary(load_spans(run_dir), warmup_steps)
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["step"])
    measured = steps[len(steps) - out["steps"] :] if out["steps"] else []
    if measured and out["window_s"] > 0:
        samples = sum(r["samples"] for r in measured)
        tokens = sum(r["samples"] * r["response_tokens_mean"] for r in measured)
        out.update(samples_per_s=samples / out["window_s"], tokens_per_s=tokens / out["window_s"],
                   staleness_mean=sum(r["staleness_mean"] for r in measured) / len(measured),
                   staleness_max=max(r["staleness_max"] for r in measured))
        for name, key in (("step", "step_time_s"), ("train", "train_time_s")):
            times = sorted(r[key] for r in measured if key in r)
            if times:
                out[f"{name}_s_median"], out[f"{name}_s_p90"] = _quantile(times, 0.5), _quantile(times, 0.9)
        if out.get("step_s_median"):
            out["step_p90_over_median"] = out["step_s_p90"] / out["step_s_median"]
    return out


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between the two nearest ranks."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

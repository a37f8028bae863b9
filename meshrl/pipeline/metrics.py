"""What a run shows and writes: a progress bar, one line per step, metrics.jsonl, a role timeline,
and TensorBoard scalars when the ``tensorboard`` package is installed (``run.tensorboard``).

Every record in ``metrics.jsonl`` is one JSON object with a ``kind`` ("step", "eval", "summary"),
the train ``step`` and the policy ``version``; step records carry everything the trainer, the
queue and the controller measured. The timeline (``timeline.jsonl``) holds one span per piece of
work a role did (role, what, start, end, in seconds since the run began) — the picture of overlap.
TensorBoard (``output_dir/tensorboard``) gets every number of the step records under their own
names (``reward_mean``, ``queue/...``, ``reward_info/...``) and of the eval records under
``eval/...``, at the train step; a resumed run hides what the earlier run logged past its checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

__all__ = ["RunLog", "format_step", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write (it needs the ``tensorboard`` package)."""
    return importlib.util.find_spec("tensorboard") is not None


def format_step(m: dict[str, Any], total_steps: int) -> str:
    """The one-line summary of a train step."""
    acc = m.get("reward_info/correct")
    parts = [
        f"step {m['step']:>4}/{total_steps} v{m['version']}",
        f"reward {m['reward_mean']:.3f}" + (f" acc {acc:.3f}" if acc is not None else ""),
        f"stale {m['staleness_mean']:.2f}/{m['staleness_max']:.0f}",
        f"{m['tokens_per_s']:,.0f} tok/s",
        f"step {m['step_time_s']:.2f}s (train {m['train_time_s']:.2f} wait {m['batch_wait_s']:.2f} sync {m['sync_time_s']:.2f})",
    ]
    if m.get("restarts") or m.get("reissued_calls") or m.get("revived_workers"):
        # run.auto_resume's resumes; workers restarted in place, and the calls and requests sent again
        parts.append(f"{m.get('restarts', 0)} resumed, {m.get('revived_workers', 0)} revived, "
                     f"{m.get('reissued_calls', 0) + m.get('reissued_requests', 0)} re-sent")
    return " | ".join(parts)


class RunLog:
    """Writes metrics.jsonl and timeline.jsonl under ``out_dir`` and prints progress."""

    def __init__(self, out_dir: Path, total_steps: int, *, progress: bool = True, tensorboard: bool | None = False,
                 resumed_step: int = 0) -> None:
        """``tensorboard``: write scalars under ``out_dir/tensorboard`` (None: when the package is
        installed). ``resumed_step``: the checkpoint's step a resumed run continues from; TensorBoard
        hides what the earlier run wrote from that step on (its records are replayed, ``replay``)."""
        self._resumed_step = resumed_step
        self.out_dir = out_dir
        self.total_steps = total_steps
        out_dir.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard or (tensorboard is None and tensorboard_available()):
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (run.tensorboard)

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resumed_step or None, flush_secs=10)
        self._metrics = (out_dir / "metrics.jsonl").open("w")
        self._timeline = (out_dir / "timeline.jsonl").open("w")
        self.t0 = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        self.replayed = 0
        """Records replayed from the checkpoint this run resumed from (the first ones of ``records``)."""
        self._subscribers: list[asyncio.Queue] = []
        self._closed = False
        self._bar = None
        if progress:
            from tqdm import tqdm

            # disable=None: a bar on a terminal; plain lines in logs and pipes.
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr, leave=True, disable=None)

    def now(self) -> float:
        """Seconds since the run began (the timeline's clock)."""
        return time.perf_counter() - self.t0

    def span(self, role: str, what: str, start: float, end: float, **extra: Any) -> None:
        self._timeline.write(json.dumps({"role": role, "what": what, "start": round(start, 4), "end": round(end, 4), **extra}) + "\n")

    def echo(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"kind": kind, "time_s": round(self.now(), 3), **fields}
        self._write(rec)
        self._scalars(rec)
        return rec

    def replay(self, rec: dict[str, Any]) -> None:
        """A record of the checkpointed run this one continues, as written then: into metrics.jsonl
        and the streams, and into TensorBoard from the resumed step on (the purged ones)."""
        rec = dict(rec)
        self.replayed += 1
        self._write(rec)
        if rec.get("step", -1) >= self._resumed_step:
            self._scalars(rec)

    def _scalars(self, rec: dict[str, Any]) -> None:
        if self._tb is None or rec["kind"] not in ("step", "eval") or not isinstance(rec.get("step"), int):
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        prefix = "" if rec["kind"] == "step" else "eval/"
        # one event per record, every scalar in it: an event per scalar (add_scalar) filled the
        # writer's queue and blocked the train loop for a millisecond or more a step
        summary = Summary(value=[Summary.Value(tag=prefix + key, simple_value=float(value)) for key, value in rec.items()
                                 if key not in ("step", "time_s") and isinstance(value, (int, float))
                                 and not isinstance(value, bool)])
        self._tb.file_writer.add_summary(summary, rec["step"])

    def _write(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        self._metrics.write(json.dumps(rec) + "\n")
        self._metrics.flush()
        for q in self._subscribers:
            q.put_nowait(rec)

    def step(self, metrics: dict[str, Any]) -> None:
        self.record("step", **metrics)
        self.echo(format_step(metrics, self.total_steps))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", v=metrics["version"])

    async def stream(self, *, replay: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Every record from now on (``replay``: from the first), as the run writes it; ends when
        the log closes."""
        q: asyncio.Queue = asyncio.Queue()
        for rec in self.records if replay else []:
            q.put_nowait(rec)
        if self._closed:
            q.put_nowait(None)
        self._subscribers.append(q)
        try:
            while (rec := await q.get()) is not None:
                yield rec
        finally:
            self._subscribers.remove(q)

    def close(self) -> None:
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for q in self._subscribers:
            q.put_nowait(None)
        self._metrics.close()
        self._timeline.close()
        if self._tb is not None:
            self._tb.close()

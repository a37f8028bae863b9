"""Run checkpoints: their layout, the controller's state saved beside the trainer's, and which one
``run.resume`` picks.

```text
<output_dir>/checkpoints/step_00000004/
    trainer/            the trainer mesh's state (meshrl.actors.trainer_checkpoint): DCP shards of
                        models and optimisers, per-rank RNG, schedule and counters
    run_state.msgpack   RunState: step, policy version, prompt-stream position, group counter,
                        requests in flight, the queue snapshot, held-out accuracy before RL
    metrics.jsonl       the run's records up to this step (a resumed run's log starts from them)
```

A checkpoint is written under ``step_XXXXXXXX.partial`` and renamed when complete, so ``latest``
never picks a half-written one; older complete ones beyond ``keep`` are deleted afterwards.

Exactness: the controller writes a checkpoint after a weight push and *before* the queue learns
the new version, so at ``max_staleness = 0`` no rollout is in flight and the queue is empty; the
resumed run then repeats the uninterrupted one (sampling is seeded by group id). With
``max_staleness > 0`` the requests in flight are recorded (``InFlight``) and re-issued on resume
under their restored reservations, with their original prompts and group ids.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Sequence

import msgspec

from meshrl.tasks import Problem, PromptStream

__all__ = ["InFlight", "PromptLedger", "RunState", "write_checkpoint_files", "read_run_state", "read_records",
           "commit", "latest_checkpoint", "resolve_resume", "partial_dir"]  # fmt: skip

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class InFlight(msgspec.Struct, frozen=True):
    """A generate request under a queue reservation: enough to issue it again after a resume."""

    reservation_id: int
    first_group: int
    """Group id of its first prompt (the next ones follow)."""
    first_position: int
    """Prompt-stream position of its first prompt."""
    count: int
    """Prompts in the request."""


class RunState(msgspec.Struct, kw_only=True):
    """What the controller needs, beside the trainer's state, to continue a run exactly."""

    format: int = FORMAT
    step: int
    """Train steps done."""
    version: int
    """Policy version published to the engines."""
    prompt_position: int
    """``PromptStream.position``: training prompts handed out so far."""
    next_group: int
    """The next group id (sampling seeds are derived from group ids)."""
    generated_tokens: int
    accuracy_before: float | None
    """Held-out accuracy before RL (a resumed run does not measure it again)."""
    in_flight: list[InFlight]
    queue_snapshot: bytes
    """``SampleQueue.snapshot()``."""


class PromptLedger:
    """The rollout side's data position: prompts and group ids handed out, requests in flight.

    Fresh requests take the next prompts of the stream; after ``restore``, the requests that were
    in flight at the checkpoint are handed out again first (same reservation, prompts, group ids).
    """

    def __init__(self, problems: Sequence[Problem], seed: int) -> None:
        self._problems, self._seed = problems, seed
        self.stream = PromptStream(problems, seed)
        self.next_group = 0
        self.in_flight: dict[int, InFlight] = {}  # by reservation id
        self._reissue: list[InFlight] = []

    def take(self, reservation_id: int, count: int) -> tuple[InFlight, list[Problem]]:
        """The next ``count`` prompts for a new reservation."""
        job = InFlight(reservation_id, self.next_group, self.stream.position, count)
        problems = self.stream.take(count)
        self.next_group += count
        self.in_flight[reservation_id] = job
        return job, problems

    def take_reissued(self) -> tuple[InFlight, list[Problem]] | None:
        """A request restored from a checkpoint to generate again, if any is left."""
        if not self._reissue:
            return None
        job = self._reissue.pop(0)
        self.in_flight[job.reservation_id] = job
        return job, PromptStream(self._problems, self._seed, position=job.first_position).take(job.count)

    def done(self, reservation_id: int) -> None:
        self.in_flight.pop(reservation_id, None)

    def restore(self, state: RunState, outstanding: Sequence[int]) -> list[int]:
        """Continue from ``state``; ``outstanding``: reservation ids the restored queue still
        waits on. Returns those to cancel: granted, but their prompts were not yet taken."""
        self.stream = PromptStream(self._problems, self._seed, position=state.prompt_position)
        self.next_group = state.next_group
        known = {job.reservation_id: job for job in state.in_flight}
        self._reissue = [known[r] for r in outstanding if r in known]
        return [r for r in outstanding if r not in known]

    @property
    def reissue_pending(self) -> int:
        return len(self._reissue)

    def unfinished(self) -> list[InFlight]:
        """What a checkpoint must record: requests in flight and restored ones not yet re-issued (their
        reservations are still in the queue's snapshot; left out, the next resume would cancel them
        and skip their prompts for good)."""
        return list(self.in_flight.values()) + list(self._reissue)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def partial_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before ``commit`` renames it."""
    return checkpoints_root(output_dir) / f"step_{step:08d}.partial"


def write_checkpoint_files(partial: Path, state: RunState, metrics_file: Path | None) -> None:
    """The controller's part of a checkpoint (the trainer writes ``partial/trainer`` itself)."""
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "run_state.msgpack").write_bytes(msgspec.msgpack.encode(state))
    if metrics_file is not None and metrics_file.is_file():
        shutil.copyfile(metrics_file, partial / "metrics.jsonl")


def read_run_state(path: Path) -> RunState:
    file = Path(path) / "run_state.msgpack"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a run checkpoint (no run_state.msgpack); pass a "
                                "<output_dir>/checkpoints/step_XXXXXXXX directory or run.resume=latest")
    state = msgspec.msgpack.decode(file.read_bytes(), type=RunState)
    if state.format != FORMAT:
        raise ValueError(f"{file}: checkpoint format {state.format}, this meshrl reads {FORMAT}")
    return state


def read_records(path: Path) -> list[dict]:
    """The step and eval records of the run up to the checkpoint at ``path`` (oldest first)."""
    file = Path(path) / "metrics.jsonl"
    if not file.is_file():
        return []
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") in ("step", "eval")]


def _complete(output_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def commit(partial: Path, *, keep: int) -> Path:
    """Rename a finished ``.partial`` checkpoint to its final name; keep the newest ``keep`` (0: all)."""
    final = partial.with_name(partial.name.removesuffix(".partial"))
    if final.exists():  # a run resumed from an earlier step writes this step again
        shutil.rmtree(final)
    partial.rename(final)
    if keep > 0:
        for _, old in _complete(final.parent.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints``, or None."""
    found = _complete(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``run.resume`` → a checkpoint directory: None starts fresh, so does ``latest`` with none yet."""
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    read_run_state(path)  # fails now, naming the path, if it is not a checkpoint
    return path

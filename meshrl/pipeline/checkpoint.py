"""Run checkpoints: their layout, the controller's state saved beside the trainer's, and which one
``run.resume`` picks.

```text
<output_dir>/checkpoints/step_00000004/
    trainer/            the trainer mesh's state (meshrl.actors.trainer_checkpoint): DCP shards of
                        models and optimisers, per-rank RNG, schedule and counters
    run_state.msgpack   RunState: step, policy version, prompt-stream position, group counter,
                        requests in flight, the queue snapshot, held-out accuracy before RL
    metrics.jsonl       the run's records up to this step (a resumed run's log starts from them)
    manifest.json       the size and SHA-256 of every file above (meshrl.manifest)
```

A checkpoint is written under ``step_XXXXXXXX.partial``, its manifest last, and renamed when
complete, then named in ``checkpoints/latest``: ``run.resume=latest`` takes the checkpoint committed
last, never a half-written one. Before a resume reads anything of a checkpoint, its files are
checked against the manifest (``damage``): a damaged one is refused in one line naming the file,
and ``run.resume=latest`` falls back to the newest intact checkpoint of the run, saying so.

Retention (``keep``) counts the steps up to the one just committed: checkpoints of later steps are
left by a run this one was resumed back from (an earlier step). They are kept, not counted and not
``latest``, until this run writes their steps again; deleting a checkpoint the user did not ask to
replace would lose their model.

Exactness: the controller writes a checkpoint after a weight push and *before* the queue learns
the new version, so at ``max_staleness = 0`` no rollout is in flight and the queue is empty; the
resumed run then repeats the uninterrupted one (sampling is seeded by group id). With
``max_staleness > 0`` the requests in flight are recorded (``InFlight``), with those just done whose
put may have missed the snapshot; a resume re-issues those whose reservation the snapshot still
holds, under it, with their original prompts and group ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec

from meshrl import manifest
from meshrl.tasks import Problem
from meshrl.queues.ledger import InFlight, PromptLedger

__all__ = ["InFlight", "PromptLedger", "RunState", "write_checkpoint_files", "read_run_state", "read_records",
           "commit", "damage", "latest_checkpoint", "later_checkpoints", "resolve_resume", "partial_dir"]

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_REPLACED = ".replaced"  # a step's earlier checkpoint while commit swaps in the new one
LATEST = "latest"
"""File in ``checkpoints/`` naming the checkpoint committed last."""


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
    """``PromptLedger.unfinished()``: requests that a resume re-issues if ``queue_snapshot`` still
    holds their reservation (a request just done may be listed, its samples in the snapshot)."""
    queue_snapshot: bytes
    """``SampleQueue.snapshot()``."""
    fingerprint: dict[str, Any] = {}
    """``run_fingerprint`` of the config that wrote it (empty in checkpoints from before it existed)."""


def run_fingerprint(cfg: Any, train: Sequence[Problem] | None = None) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues: the model, the task and the
    seed (the prompt position counts into that seed's shuffle of the task's training split), the
    algorithm's shape (the group size, and whether a critic is trained: its weights and optimiser are
    in the checkpoint, or not), and the queue's arithmetic (its consumed position counts batches of
    ``trainer.samples_per_step``, ``trainer.sync_interval`` to a version: other sizes would read it
    wrongly and wait forever for admission), and the LoRA adapters' shape (``trainer.lora``: the
    checkpoint holds adapters of that rank, and alpha scales what they add). Everything else may change: learning rate, steps,
    staleness, and the advantage estimator among those without a critic (grpo, rloo, reinforce_pp
    read the same groups and keep no state).

    ``train``, the training split, makes the task's entry its content: the number of problems and a
    hash of their prompts and answers ("data"), with the model's path resolved. A prompt file
    rewritten in place is then told apart, and the same file named another way, or a file task's
    unused ``task.digits``, is not. Without it: the settings alone, as checkpoints before it hold."""
    fp = {
        "model": msgspec.to_builtins(cfg.model), "task": msgspec.to_builtins(cfg.task), "run.seed": cfg.run.seed,
        "algo.samples_per_prompt": cfg.algo.samples_per_prompt, "algo.critic": cfg.algo.uses_critic,
        "trainer.samples_per_step": cfg.trainer.samples_per_step, "trainer.sync_interval": cfg.trainer.sync_interval,
        "trainer.lora": _lora_shape(cfg.trainer.lora),
    }
    if cfg.trainer.optimizer != "adamw":  # the optimiser's state is in the checkpoint; listed when not
        fp["trainer.optimizer"] = cfg.trainer.optimizer  # the default, so older fingerprints compare equal
    for key in ("reward", "reward_function"):  # the answer check and the reward may change on resume
        fp["task"].pop(key, None)
    for key in ("chat_template", "system_prompt"):  # how prompts are rendered may not; listed when set,
        if fp["task"].get(key) is None:  # so fingerprints from before these keys existed compare equal
            fp["task"].pop(key, None)
    if train is not None:
        if fp["model"].get("path"):
            fp["model"]["path"] = str(Path(fp["model"]["path"]).resolve())
        task = fp["task"]
        kept = (("kind", "prompt_key", "answer_key", "chat_template", "system_prompt") if task.get("kind") == "file"
                else task.keys() - {"train_file", "test_file"})
        fp["task"] = {k: task[k] for k in task if k in kept}
        digest = hashlib.sha256(msgspec.msgpack.encode([(p.prompt, p.answer) for p in train])).hexdigest()
        fp["data"] = {"train_problems": len(train), "train_sha256": digest}
    return fp


def _lora_shape(lora: Any) -> dict[str, Any] | None:
    """What a checkpoint's adapters depend on (None: no LoRA), in the form it reads back as."""
    if not lora.enabled:
        return None
    return {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": sorted(lora.target_modules)}


def check_fingerprint(path: Path, state: RunState, cfg: Any, train: Sequence[Problem] | None = None) -> None:
    """Raise ``ConfigError`` naming every setting that differs from the checkpoint's run (``train``:
    see ``run_fingerprint``; a checkpoint written without it is compared by settings alone)."""
    from meshrl.config import ConfigError

    then = dict(state.fingerprint)
    if not then:  # written before fingerprints existed: nothing to compare
        return
    now = run_fingerprint(cfg, train if "data" in then else None)
    if "algo.advantage" in then:  # written before "algo.critic" replaced it: only gae trains a critic
        then["algo.critic"] = then.pop("algo.advantage") == "gae"
    # a key missing on one side is its default (None): keys listed only when set, or newer than the checkpoint
    differ = [k for k in {**then, **now} if then.get(k) != now.get(k)]
    if differ:
        def show(key: str) -> str:
            if key != "data":
                return f"{key}: {then.get(key)!r} there, {now.get(key)!r} now"
            a, b = then[key]["train_problems"], now[key]["train_problems"]
            return f"the training problems: {a} there, {b} now" + (", other prompts or answers" if a == b else "")

        shown = "; ".join(show(k) for k in differ)
        raise ConfigError(f"`run.resume`: {path} was written by a run with other settings ({shown}); resume with "
                          "the same ones, or start fresh in another run.output_dir")


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
    try:
        state = msgspec.msgpack.decode(file.read_bytes(), type=RunState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{file} is damaged: {str(exc)[:200]}") from None
    if state.format != FORMAT:
        raise ValueError(f"{file}: checkpoint format {state.format}, this meshrl reads {FORMAT}")
    return state


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint at ``path`` (naming the file), or None if it is whole. With a
    manifest every file is checked (``meshrl.manifest``); a checkpoint written before manifests
    existed only for the files a resume needs, and a run state that decodes."""
    path = Path(path)
    if manifest.has_manifest(path):
        return manifest.damage(path)
    for name in ("run_state.msgpack", "trainer/.metadata", "trainer/rank0.pt"):
        if not (path / name).is_file():
            return f"{path / name} is missing"
    try:
        read_run_state(path)
    except ValueError as exc:
        return str(exc)
    return None


def read_records(path: Path) -> list[dict]:
    """The records of the run up to the checkpoint at ``path`` that a resumed run carries on
    (oldest first): steps, evaluations, the audit ledger and earlier resumes."""
    file = Path(path) / "metrics.jsonl"
    if not file.is_file():
        return []
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") in ("step", "eval", "audit", "restart", "worker_restart", "hung")]


def _complete(output_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def commit(partial: Path, *, keep: int) -> Path:
    """Rename a finished ``.partial`` checkpoint to its final name, make it ``latest``, and keep the
    newest ``keep`` (0: all) of the steps up to it (later steps: module docstring)."""
    final = partial.with_name(partial.name.removesuffix(".partial"))
    if (m := _STEP_DIR.match(final.name)) is None:
        raise ValueError(f"commit: {partial} is not a partial checkpoint directory; write it at "
                         "partial_dir(output_dir, step)")
    replaced = final.with_name(final.name + _REPLACED)
    if final.exists():  # this step again: a stop right after a periodic checkpoint, or a resumed run
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)  # kept until the new one is in place: a crash now leaves it (latest_checkpoint)
    partial.rename(final)
    pointer = final.parent / LATEST
    tmp = pointer.with_name(LATEST + ".tmp")
    tmp.write_text(final.name + "\n")
    os.replace(tmp, pointer)  # atomic: a crash leaves the previous latest, which is still complete
    shutil.rmtree(replaced, ignore_errors=True)
    for stray in final.parent.glob("step_*.partial"):  # a checkpoint a killed run never finished: never read
        shutil.rmtree(stray, ignore_errors=True)
    if keep > 0:
        step = int(m.group(1))
        ours = [p for s, p in _complete(final.parent.parent) if s <= step]
        for old in ours[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint committed last under ``output_dir/checkpoints`` (else the highest complete
    step: a directory written before ``latest`` existed, or whose latest was deleted), or None."""
    root = checkpoints_root(output_dir)
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if _STEP_DIR.match(path.name):
            for candidate in (path, path.with_name(path.name + _REPLACED)):  # a crash inside commit's swap
                if (candidate / "run_state.msgpack").is_file():
                    return candidate
    found = _complete(output_dir)
    return found[-1][1] if found else None


def later_checkpoints(output_dir: str | Path, step: int) -> list[Path]:
    """Complete checkpoints of steps after ``step``: a run resumed at ``step`` leaves them be."""
    return [p for s, p in _complete(output_dir) if s > step]


def _lineage(output_dir: str | Path) -> list[Path]:
    """The checkpoints ``run.resume=latest`` may take, newest first: the one committed last, then the
    run's earlier steps (a later step's checkpoint is an earlier run's: ``later_checkpoints``)."""
    newest = latest_checkpoint(output_dir)
    if newest is None:
        return []
    step = int(newest.name[len("step_"):].removesuffix(_REPLACED))
    return [newest] + [p for s, p in reversed(_complete(output_dir)) if s < step]


def resolve_resume(resume: str | None, output_dir: str | Path, echo: Callable[[str], None] = print) -> Path | None:
    """``run.resume`` → a whole checkpoint directory: None starts fresh, so does ``latest`` with none yet.

    Each candidate is checked against its manifest before anything of it is read (``damage``).
    ``latest`` falls back to the newest intact checkpoint of the run, saying so through ``echo``; a
    damaged one named by path, or no intact one at all, raises ``ConfigError`` naming the damaged
    file (and the newest intact checkpoint, if there is one)."""
    from meshrl.config import ConfigError

    if resume is None:
        return None
    if resume == "latest":
        damaged: list[str] = []
        for candidate in _lineage(output_dir):
            problem = damage(candidate)
            if problem is None:
                if damaged:
                    echo(f"run.resume=latest: {'; '.join(damaged)}: resuming from the newest intact checkpoint, "
                         f"{candidate}")
                return candidate
            damaged.append(f"{candidate.name} is damaged ({problem})")
        if damaged:
            raise ConfigError(f"`run.resume`: no intact checkpoint under {checkpoints_root(output_dir)}: "
                              f"{'; '.join(damaged)}; start over with run.overwrite=true or in another run.output_dir")
        return None
    path = Path(resume)
    problem = damage(path)
    if problem is not None:
        intact = next((c for c in _lineage(path.parent.parent) if c != path and damage(c) is None), None)
        where = (f"the newest intact checkpoint there is {intact}" if intact is not None
                 else "there is no intact checkpoint beside it")
        raise ConfigError(f"`run.resume`: the checkpoint {path} is damaged ({problem}); {where}")
    return path

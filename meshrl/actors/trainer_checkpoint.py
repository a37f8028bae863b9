"""Save and load a ``PolicyTrainer``'s full training state, sharded, for exact resume.

Layout of a trainer checkpoint directory::

    <path>/            torch.distributed.checkpoint (DCP) files: policy and critic parameters and
                       their AdamW states, each rank writing its own shards (``__0_0.distcp``, ...)
    <path>/rank<r>.pt  per rank: CPU/CUDA/Python RNG states, the mini-batch shuffling generator,
                       LR scheduler state, step and skip counters (small; plain ``torch.save``)

DCP stores tensors under their fully-qualified names with global shapes, so a checkpoint written
at one dp size loads at another (DCP reshards on load); the per-rank RNG file of a rank that did
not exist falls back to rank 0's (then dropout-like randomness is not bit-identical, which the
embedded models do not use). Every rank must call ``save``/``load`` (they are collectives when
sharded). Simplification: a single shared file system (all ranks write under one path).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

if TYPE_CHECKING:
    from meshrl.actors.policy_trainer import PolicyTrainer

__all__ = ["save_trainer_state", "load_trainer_state", "init_optimizer_state"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW state now, exactly as the first ``step`` would (zeros, step 0).

    The colocated worker (``hybrid``) calls it so the state is allocated before the engine's KV
    cache and never lands in the memory the cache gives back; a save calls it so a checkpoint taken
    before the first update holds that same state instead of DCP's dummy step's.
    """
    from torch.optim.optimizer import _get_scalar_dtype

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return  # plain SGD keeps no state
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            on_device = group.get("capturable", False) or group.get("fused", False)
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused", False)), device=p.device)
                             if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _models(t: PolicyTrainer) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    out = [("policy", t.policy, t.optimizer)]
    if t.critic is not None and t.critic_optimizer is not None:
        out.append(("critic", t.critic, t.critic_optimizer))
    return out


def _frozen_base(t: PolicyTrainer, name: str) -> bool:
    """With LoRA the policy's frozen base is left out of checkpoints (it is the model path's,
    unchanged): a checkpoint holds the adapters, not another copy of the model."""
    return name == "policy" and t.lora is not None


def _sharded_state(t: PolicyTrainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    for name, model, optim in _models(t):
        # Before the first update an optimiser has no state, and get_state_dict would create it by
        # running a dummy step (lr 0): Adam's step count would then be one ahead from there on.
        init_optimizer_state(optim)
        model_sd, optim_sd = get_state_dict(model, optim)
        if _frozen_base(t, name):  # every name of a frozen tensor, tied ones included (lm_head.weight)
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        state[name], state[f"{name}_optim"] = model_sd, optim_sd
    return state


def _small_state(t: PolicyTrainer) -> dict[str, Any]:
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if t.dp.device.type == "cuda" else None,
        "python_rng": random.getstate(),
        "generator": t.generator.get_state(),
        "scheduler": t.scheduler.state_dict(),
        "steps": t.steps,
        "skipped_in_a_row": t.skipped_in_a_row,
        "dp": t.dp.size,
    }


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # dp = 1 on CPU has no process group on purpose; DCP warns about exactly that on every call
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_trainer_state(t: PolicyTrainer, path: str | Path) -> None:
    """Write ``t``'s training state under ``path`` (module docstring); a collective."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        with _quiet_single_process():
            dcp.save(_sharded_state(t), checkpoint_id=str(path), process_group=t.dp.group, no_dist=not t.dp.sharded)
    except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
        exc.add_note(f"dp rank {t.dp.rank}/{t.dp.size} saving the trainer state to {path} (every rank must call "
                     f"it){_why(exc)}")
        raise
    torch.save(_small_state(t), path / f"rank{t.dp.rank}.pt")


def _why(exc: BaseException) -> str:
    """DCP's CheckpointException names only the failing ranks: add the first rank's own error."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in failures.items():
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f": rank {rank}: {type(inner).__name__}: {str(inner)[:300]}"
    return ""


def _flat_keys(d: dict[str, Any], prefix: str) -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        out |= _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def _check_same_models(path: Path, state: dict[str, Any], names: list[str]) -> None:
    """Refuse a checkpoint of other models: DCP fills the template's keys and ignores the rest, so a
    deeper model's checkpoint, or one with a critic, would load into this trainer without a word."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    problems = []
    for name in ("policy", "critic"):
        want = _flat_keys(state[name], f"{name}.") if name in names else set()
        have = {k for k in saved if k.startswith(f"{name}.")}
        if have - want or want - have:
            extra, missing = sorted(have - want), sorted(want - have)
            problems.append(f"{name}: {len(missing)} parameters missing (e.g. {missing[:2]}), {len(extra)} not in this "
                            f"trainer (e.g. {extra[:2]})")
    if problems:
        raise ValueError(f"{path} holds other models than this trainer's ({'; '.join(problems)}): resume with the "
                         "model, algorithm (critic or not) and trainer.lora that wrote it")


def load_trainer_state(t: PolicyTrainer, path: str | Path) -> int:
    """Restore ``t`` from ``path`` (written by ``save_trainer_state``); returns its step count."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    if not (path / "rank0.pt").is_file():
        raise FileNotFoundError(f"{path} is not a trainer checkpoint (no rank0.pt): pass the directory "
                                "save_trainer_state wrote (a run checkpoint's trainer/ folder)")
    state = _sharded_state(t)  # templates with this run's sharding; DCP reshards into them
    _check_same_models(path, state, [name for name, _, _ in _models(t)])
    # this run's optimiser settings (lr, betas, weight decay): the loaded param groups carry the old
    # run's, and a resume may change them (README); the moments and step counts are what is restored
    settings = [[{k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in optim.param_groups]
                for _, _, optim in _models(t)]
    base_lrs = list(t.scheduler.base_lrs)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), process_group=t.dp.group, no_dist=not t.dp.sharded)
    except (Exception, CheckpointException) as exc:
        exc.add_note(f"dp rank {t.dp.rank}/{t.dp.size} loading the trainer state from {path}{_why(exc)}")
        raise
    for name, model, optim in _models(t):
        set_state_dict(model, optim, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"],
                       options=StateDictOptions(strict=not _frozen_base(t, name)))  # the base is not in it
    own = path / f"rank{t.dp.rank}.pt"
    small = torch.load(own if own.is_file() else path / "rank0.pt", weights_only=False)
    torch.set_rng_state(small["torch_rng"])
    if small["cuda_rng"] is not None and t.dp.device.type == "cuda":
        torch.cuda.set_rng_state(small["cuda_rng"])
    random.setstate(small["python_rng"])
    t.generator.set_state(small["generator"])
    t.scheduler.load_state_dict(small["scheduler"])
    for (_, _, optim), groups in zip(_models(t), settings):
        for group, own in zip(optim.param_groups, groups):
            group.update(own)
    # the schedule continues from the checkpoint's step over this run's lr (and total_steps: the
    # lambda is this run's; LambdaLR does not save plain functions)
    t.scheduler.base_lrs = base_lrs
    at = t.scheduler.last_epoch
    for group, base, factor in zip(t.optimizer.param_groups, base_lrs, t.scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * factor(at)
    t.scheduler._last_lr = [group["lr"] for group in t.optimizer.param_groups]  # what get_last_lr() reports
    t.steps, t.skipped_in_a_row = small["steps"], small["skipped_in_a_row"]
    return t.steps

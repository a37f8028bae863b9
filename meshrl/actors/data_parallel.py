"""Data parallelism for the trainer: FSDP2 wrapping, reductions over the ``dp`` axis, row splits.

The trainer's model code never sees a mesh: ``shard_model`` applies FSDP2 ``fully_shard`` from
outside, one unit per decoder layer plus the root (embeddings, final norm, LM or value head, so
tied input/output embeddings stay in one unit), on the ``dp`` axis of a torch ``DeviceMesh``.

Gradient reduction is a plain SUM (``set_gradient_divide_factor(1.0)`` with sum-only
collectives; gloo has no PREMUL_SUM): every loss is already divided by the *global* valid-token
(or sequence) count of its mini-batch, so the sum over ranks is exactly the dp = 1 gradient. FSDP2
averages by default, which would scale the gradient by 1/dp.

Every rank holds only its share of the step's batch (whole groups: ``train_step``), and the
statistics that span shares (normalisers, micro-batch counts, batch metrics) are reduced here;
FSDP2 runs one all-gather per layer per forward, so every rank runs the same number of forwards
and backwards, short ranks padding with empty micro-batches (a real row whose loss mask is all
zero: zero loss, zero gradient).

Simplifications on purpose: one ``dp`` axis (no tensor or context parallelism); dp = 1 on CPU uses
plain modules (FSDP2 over a single rank would only add hooks and copies to every layer's forward).
Every collective is bounded by the process group's timeout (``init_torch_distributed(timeout=)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from meshrl.algos import metric_reduction

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DataParallel", "decoder_layers", "shard_model", "full_state_dict", "clip_grad_norm"]


class DataParallel:
    """This process's place on the trainer's ``dp`` axis and the reductions over it.

    ``mesh`` is None for a single rank (no process group); then every reduction is the identity.
    """

    def __init__(self, mesh: DeviceMesh | None, device: torch.device | str = "cpu", axis: str = "dp") -> None:
        self.mesh, self.device, self.axis = mesh, torch.device(device), axis
        if mesh is None:
            self.rank, self.size, self.group = 0, 1, None
        else:
            # the dp axis's size: on a 2-D mesh mesh.size() is every rank of it, not this axis's
            self.rank, self.size, self.group = mesh.get_local_rank(axis), mesh[axis].size(), mesh.get_group(axis)

    @property
    def sharded(self) -> bool:
        """Whether models are wrapped with FSDP2 (dp > 1, or a 1-rank mesh on GPU)."""
        return self.mesh is not None

    def all_reduce(self, t: torch.Tensor, *, op: str = "sum", what: str) -> torch.Tensor:
        """In-place SUM/MAX of ``t`` over the dp ranks; ``what`` names it if a rank never arrives."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            exc.add_note(f"dp rank {self.rank}/{self.size} waiting for every rank to all-reduce {what} "
                         "(a rank that failed or ran a different number of steps never arrives)")
            raise
        return t

    def gather_objects(self, obj: Any, *, what: str) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (``[obj]`` for a single rank)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:
            exc.add_note(f"dp rank {self.rank}/{self.size} waiting for every rank to all-gather {what} "
                         "(a rank that failed or ran a different number of steps never arrives)")
            raise
        return out

    def reduce_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Combine per-rank loss metrics (``meshrl.algos.metrics`` rules) into the global ones."""
        keys = sorted(metrics)
        if self.size == 1:
            return {k: float(metrics[k]) for k in keys}
        tokens = metrics["num_tokens"].double()
        summed = [k for k in keys if metric_reduction(k) != "max"]
        maxed = [k for k in keys if metric_reduction(k) == "max"]
        # mean metrics travel as value × tokens, so their SUM over ranks re-weights correctly
        s = torch.stack([metrics[k].double() * (tokens if metric_reduction(k) == "mean" else 1.0) for k in summed])
        self.all_reduce(s, what="loss metrics (sum)")
        m = torch.stack([metrics[k].double() for k in maxed]) if maxed else torch.zeros(0, dtype=torch.float64)
        if maxed:
            self.all_reduce(m, op="max", what="loss metrics (max)")
        total = float(s[summed.index("num_tokens")])
        out = {k: float(v) / max(total, 1.0) if metric_reduction(k) == "mean" else float(v) for k, v in zip(summed, s)}
        out.update({k: float(v) for k, v in zip(maxed, m)})
        return out


def decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The repeated transformer blocks of an HF causal LM, its base model, or a ``ValueModel``."""
    for path in ("model.layers", "backbone.layers", "backbone.model.layers", "layers"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"{type(model).__name__} has no decoder layers at model.layers / backbone.layers / layers: "
                     "FSDP2 wraps one unit per layer, so the trainer needs to find them")


def shard_model(
    model: nn.Module, dp: DataParallel, *, mixed_precision: bool, cpu_offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, on the dp mesh (in place; returns it).

    ``mixed_precision``: bf16 parameters in forward/backward, fp32 gradient reduction, fp32 master
    weights and optimiser state. ``cpu_offload``: parameters live on the CPU between uses (the
    frozen reference model, so it costs no GPU memory at rest).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if dp.mesh is None:
        raise ValueError("shard_model needs a DeviceMesh: DataParallel(mesh=None) trains plain modules")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    mesh = dp.mesh[dp.axis] if dp.mesh.ndim > 1 else dp.mesh
    # One rank, a trained model: a layer's "all-gather" is only a cast of its own weights, so keep
    # the bf16 copy from forward to backward (1 GB at 0.5B) instead of making it twice a step
    # (a frozen model has no backward to free it in: it reshards as usual).
    reshard = dp.size > 1 or cpu_offload or not any(p.requires_grad for p in model.parameters())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # losses carry the global normaliser: SUM, not mean
            module.set_force_sum_reduction_for_comms(True)
    return model


def full_state_dict(model: nn.Module, dp: DataParallel) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model`` under its own names: on rank 0; ``{}`` elsewhere.

    A collective when sharded: every rank must call it.
    """
    if not dp.sharded:
        return {name: t.detach().cpu() for name, t in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    try:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    except Exception as exc:
        exc.add_note(f"dp rank {dp.rank}/{dp.size} gathering the full state dict: every rank must call it")
        raise


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """Clip to ``max_norm`` by the *global* norm (over every rank's shards); returns that norm.

    With FSDP2 the gradients are DTensors and the norm is reduced over the mesh by DTensor; the
    ``float`` is a host sync, once per optimiser update.
    """
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)

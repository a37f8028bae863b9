"""The trainer's state and work on one rank of its ``dp`` axis, outside any actor.

``PolicyTrainer`` owns the policy (and for PPO the critic, and optionally a frozen reference),
their optimisers and LR schedule, runs one RL step (``PolicyUpdater``), gathers full weights for
export, and saves/loads checkpoints (``trainer_checkpoint``). The ``Trainer`` actor is a thin
adapter over it; tests and ``bench/gpu_trainer.py`` drive it in ``torch.multiprocessing`` workers.

Placement (``DataParallel``):

- dp = 1 on CPU: plain modules, no process group — the embedded default's path, kept as cheap as
  a single-process trainer can be.
- dp > 1, or any CUDA run: FSDP2 ``fully_shard`` per decoder layer on the dp ``DeviceMesh``; on
  CUDA with ``mixed_precision``: bf16 parameters in compute, fp32 gradient reduction, fp32
  master weights and AdamW state.

Every rank must make the same calls in the same order (each may run collectives).
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from pathlib import Path
from typing import Iterator, Literal, Sequence

import msgspec
import torch

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.data_parallel import DataParallel, full_state_dict, shard_model
from meshrl.actors.lora import BaseModel, LoRAConfig, apply_lora, merge_state_dict, named_weights, save_adapter
from meshrl.actors.train_step import PolicyUpdater, build_step_batch
from meshrl.cpu import attention_for, native_bf16
from meshrl.modeling import ValueModel, disable_dropout, load_causal_lm, no_progress_bars
from meshrl.queues import Sample
from meshrl.queues.parcels import share_groups

__all__ = ["TrainerConfig", "PolicyTrainer", "NonFiniteStepsError", "batch_stats", "lr_lambda", "make_optimizer"]


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Optimisation of the policy and critic, and the trainer's data-parallel layout."""

    samples_per_step: int = 256
    """Samples (completions, not prompts) per train step; a multiple of algo.samples_per_prompt."""
    lr: float = 1e-4
    critic_lr: float = 1e-3
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw: AdamW (betas, decoupled weight decay). sgd: plain SGD, no momentum (weight_decay as an
    L2 term), an update linear in the gradient; the pipeline's invariant tests use it, since AdamW's
    division by sqrt(v) turns a rounding-level gradient difference in a coordinate whose gradient is
    near zero into an lr-sized step."""
    weight_decay: float = 0.0
    """Weight decay, for the policy and the critic alike (decoupled with AdamW)."""
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0
    """Linear LR warm-up, in train steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR after warm-up: constant, or cosine decay to min_lr_ratio × lr at the last step."""
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (over every dp rank's shards) to this."""
    tokens_per_microbatch: int = 16384
    """Padded tokens (rows × longest row) per forward/backward on one rank; bounds activation memory."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    minibatches_per_step: int = 1
    """Optimiser updates per pass (the batch is split into this many mini-batches)."""
    sync_interval: int = 1
    """Train steps between weight publishes; each publish is one policy version. A run whose last
    step falls between publishes pushes once more before its final evaluation (of the exported weights)."""
    threads: int = 1
    """torch intra-op threads in each trainer process."""
    seed: int = 0
    dp: int = 1
    """Data-parallel ranks (one process each); > 1 shards policy and critic with FSDP2."""
    device: Literal["cpu", "cuda"] = "cpu"
    """cuda: one GPU per dp rank, NCCL, and FSDP2 even at dp = 1 (for its mixed precision)."""
    mixed_precision: bool = True
    """On cuda: bf16 parameters and activations, fp32 gradient reduction and master weights."""
    cpu_bf16_autocast: bool | None = None
    """On cpu: forward and backward under bf16 autocast, fp32 master weights and optimiser
    (4-5x faster matmuls on CPUs with AMX or AVX512-BF16; log-probs then differ from an fp32
    engine's by ~1e-2, which the importance ratio absorbs). The in-trainer reference runs under
    the same autocast; a separate reference worker computes in fp32, so the KL to it starts at
    ~1e-4, not 0. None (the default): on where the CPU has bf16 instructions (``meshrl.cpu``),
    as TorchEngine's ``dtype=auto`` is bf16 there; never for float64 master weights."""
    share_prompts: bool | None = None
    """Rows of one prompt in a micro-batch (a GRPO group) run the prompt's forward once: its keys and
    values serve every completion, and the backward sums their gradients into it. The same numbers
    as running each row whole, with a prompt's tokens computed once instead of once per sample
    (37% fewer tokens for the embedded model's GRPO groups of 8). Off under activation
    checkpointing (its layers keep no cache). None (the default): on the CPU only. On CUDA it
    loses: the compiled 0.5B trainer took 0.336 s a step with it against 0.217 s without on one
    H100 (bench/RESULTS.md; ``bench/one_gpu.sh trainer [--compile]``); true turns it on there."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~1/3 more compute)."""
    compile: bool = False
    """``torch.compile`` each decoder layer's forward (dynamic shapes), the LM head's chunked
    log-prob math (``modeling.compile_head``) and, for a Llama-family decoder, both shared-prompt
    passes as one graph (``shared_prompts.compile_passes``): fused elementwise kernels instead of
    one launch (on the CPU, one dispatch) per op. The first steps pay the compile: tens of seconds,
    up to a minute on a 2-core CPU, where inductor builds C++ kernels with g++ (without one the
    trainer refuses at start). The laptop model's 256-sample GRPO step, in one process: 58 -> 48 ms
    (bench/RESULTS.md)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend with ``compile``: inductor (fused kernels); aot_eager or eager trace the
    same graphs and run them with eager ops, building nothing (to tell a compiled run's numbers from
    the kernels' without a compiler, or quickly)."""
    reference_in_trainer: bool = False
    """With algo.kl_coef > 0: a frozen copy of the initial policy in the trainer computes the
    reference log-probs (sharded like the policy) instead of a ReferenceWorker. With LoRA the
    reference is the policy with its adapters off: no copy at all."""
    reference_cpu_offload: bool = False
    """On cuda: keep the in-trainer reference model's parameters on the CPU between uses."""
    max_skipped_steps: int = 3
    """Consecutive train steps whose update was skipped for a NaN/inf loss or gradient before
    the run stops (0: never stop)."""
    collective_timeout_s: float = 600.0
    """Bound on every collective of the dp group (and its rendezvous)."""
    lora: LoRAConfig = LoRAConfig()
    """Low-rank adapters on the policy (rank 0: full fine-tuning); engines get merged weights."""

    def __post_init__(self) -> None:
        for name in ("samples_per_step", "tokens_per_microbatch", "ppo_epochs", "minibatches_per_step",
                     "sync_interval", "threads", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_step % self.minibatches_per_step:
            raise ValueError(
                f"trainer.samples_per_step={self.samples_per_step} is not divisible by "
                f"trainer.minibatches_per_step={self.minibatches_per_step}"
            )
        if self.max_skipped_steps < 0:
            raise ValueError(f"trainer.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        for name in ("lr", "critic_lr"):  # 0 is allowed: a run that only measures (no update)
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"trainer.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not self.max_grad_norm > 0:  # .inf: no clipping
            raise ValueError(f"trainer.max_grad_norm must be > 0 (.inf: no clipping), got {self.max_grad_norm}")
        if not 0 < self.collective_timeout_s < math.inf:
            raise ValueError(f"trainer.collective_timeout_s must be a finite number > 0, got {self.collective_timeout_s}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"trainer.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must both be in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive train steps had a NaN/inf loss or gradient; the run stops."""


def lr_lambda(cfg: TrainerConfig, total_steps: int):
    """The LR multiplier per step: linear warm-up, then constant or cosine."""

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - 1 - cfg.warmup_steps)  # steps run 0..total_steps-1: the last one gets min
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def make_optimizer(cfg: TrainerConfig, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``params`` (every weight decay explicit: not AdamW's hidden 0.01).
    AdamW is torch's fused kernel on CUDA and on the CPU (one call per dtype group, DTensor shards
    included; on the CPU torch's default is a Python loop of six ops per parameter)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
    fused = bool(params) and all(p.device.type in ("cuda", "cpu") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)


def batch_stats(samples: Sequence[Sample], version: int) -> dict[str, float]:
    """What the trained batch looked like: rewards, task metrics, staleness, lengths."""
    return stats_of(_batch_sums(samples, version))


def _batch_sums(samples: Sequence[Sample], version: int) -> dict[str, float]:
    """``batch_stats``'s sums (and ``staleness_max``) over ``samples``: shares' add up."""
    staleness = [version - s.behavior_version for s in samples]
    out = {
        "samples": float(len(samples)),
        "reward": sum(s.reward for s in samples),
        "reward_failed": float(sum(s.reward_failed for s in samples)),
        "staleness": float(sum(staleness)),
        "staleness_max": float(max(staleness, default=-math.inf)),
        "response_tokens": float(sum(len(s.response_ids) for s in samples)),
        "truncated": float(sum(s.finish_reason == "length" for s in samples)),
        "trained_tokens": float(sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.response_ids) for s in samples)),
    }
    for key in {k for s in samples for k in s.reward_info}:
        out[f"reward_info/{key}"] = sum(s.reward_info.get(key, 0.0) for s in samples)
    return out


def stats_of(sums: dict[str, float], *more: dict[str, float]) -> dict[str, float]:
    """``batch_stats`` from the ``_batch_sums`` of one or more shares of the batch."""
    total: dict[str, float] = {}
    for part in (sums, *more):
        for k, v in part.items():
            total[k] = max(total.get(k, -math.inf), v) if k == "staleness_max" else total.get(k, 0.0) + v
    n = max(total["samples"], 1.0)
    out = {
        "reward_mean": total["reward"] / n,
        "reward_failed_frac": total["reward_failed"] / n,
        "staleness_mean": total["staleness"] / n,
        "staleness_max": total["staleness_max"],
        "response_tokens_mean": total["response_tokens"] / n,
        "truncated_frac": total["truncated"] / n,
        "samples": total["samples"],
        "trained_tokens": total["trained_tokens"],
    }
    out.update({k: v / n for k, v in total.items() if k.startswith("reward_info/")})
    return out


def share_of(samples: Sequence[Sample], rank: int, ranks: int) -> tuple[list[Sample], tuple[int, int, int]]:
    """Rank ``rank``'s share of a whole batch as the queue hands it out (``parcels.to_shares``):
    its samples (one padding sample when it gets no group) and ``(start, count, total)``."""
    # Queue order depends on how rollouts interleaved; group order does not (stable sort keeps
    # a group's samples in completion order), so the same samples always train the same way.
    ordered = sorted(samples, key=lambda s: s.group_id)
    firsts = [i for i, s in enumerate(ordered) if i == 0 or s.group_id != ordered[i - 1].group_id] + [len(ordered)]
    tokens = [sum(s.num_tokens for s in ordered[a:b]) for a, b in zip(firsts, firsts[1:])]
    run = share_groups(tokens, ranks)[rank]
    a, b = firsts[run.start], firsts[run.stop]
    return (ordered[a:b] if b > a else ordered[:1]), (a, b - a, len(ordered))


class GcClock:
    """Seconds this process spent in the garbage collector, and collections of the oldest
    generation, since it was made (``gc.callbacks``): what a step's time lost to the collector.
    One per process (``gc_clock``): every trainer of the process reads the same one."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2


_GC_CLOCK: GcClock | None = None


def gc_clock() -> GcClock:
    global _GC_CLOCK
    if _GC_CLOCK is None:
        _GC_CLOCK = GcClock()
    return _GC_CLOCK


def _need_cpp_compiler() -> None:
    """trainer.compile on the CPU: inductor builds C++ kernels, so say at start when it cannot."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:
        raise RuntimeError(f"trainer.compile=true on the CPU needs a C++ compiler for torch.compile's kernels, "
                           f"and none was found ({exc}): install g++ or set "
                           "trainer.compile=false") from exc


def _allocator_counts(device: torch.device) -> dict[str, float]:
    """The CUDA caching allocator's cumulative counts that make a step slow when they move:
    retries (a failed cudaMalloc: every cached block freed, then again) and device mallocs/frees."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "device_mallocs": float(stats.get("num_device_alloc", 0)),
            "device_frees": float(stats.get("num_device_free", 0))}


class PolicyTrainer:
    """Policy, critic, optimisers and schedule of one dp rank (module docstring)."""

    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        *,
        dp: DataParallel,
        temperature: float,
        max_new_tokens: int,
        total_steps: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype`` is the master weights' (and, on cpu, the compute's): float64 only for the
        invariant tests, whose rounding differences then sit far below what AdamW amplifies."""
        torch.manual_seed(cfg.seed)
        self.cfg, self.algo, self.dp, self.model_path = cfg, algo, dp, model_path
        policy = disable_dropout(load_causal_lm(model_path, dtype).train())
        self.lora = cfg.lora if cfg.lora.enabled else None
        if self.lora is not None:
            apply_lora(policy, self.lora)
        self.policy = self._place(policy)
        self.pad_id = self.policy.config.pad_token_id if self.policy.config.pad_token_id is not None else 0
        critic = disable_dropout(ValueModel.from_pretrained(model_path, dtype).train()) if algo.uses_critic else None
        self.critic = self._place(critic) if critic is not None else None
        self.reference = None
        if cfg.reference_in_trainer and algo.kl_coef > 0:
            if self.lora is not None:
                self.reference = BaseModel(self.policy)
            else:
                frozen = load_causal_lm(model_path, dtype).eval().requires_grad_(False)
                self.reference = self._place(frozen, frozen=True, offload=cfg.reference_cpu_offload)
        self.optimizer = make_optimizer(cfg, [p for p in self.policy.parameters() if p.requires_grad], cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))
        self.critic_optimizer = None if self.critic is None else make_optimizer(cfg, list(self.critic.parameters()), cfg.critic_lr)
        self.updater = PolicyUpdater(
            self.policy, self.critic, algo, temperature=temperature, max_new_tokens=max_new_tokens,
            tokens_per_microbatch=cfg.tokens_per_microbatch, ppo_epochs=cfg.ppo_epochs,
            minibatches=cfg.minibatches_per_step, dp=dp, reference=self.reference,
            share_prompts=self._shares_prompts(cfg, dp),
        )
        # Seeded alike on every rank: each rank computes every rank's mini-batch split.
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.steps = 0
        self.skipped_in_a_row = 0
        self.gc_clock = gc_clock()
        auto = cfg.cpu_bf16_autocast is None and dtype == torch.float32 and native_bf16()
        self.cpu_autocast = self.dp.device.type == "cpu" and (bool(cfg.cpu_bf16_autocast) or auto)
        """Forward and backward under CPU bf16 autocast (``cpu_bf16_autocast``)."""

    @staticmethod
    def _shares_prompts(cfg: TrainerConfig, dp: DataParallel) -> bool:
        """``cfg.share_prompts`` resolved: checkpointed layers keep no cache; the default is the CPU's
        (on CUDA a prompt's cache cost more than its recomputation saved)."""
        if cfg.activation_checkpointing:
            return False
        return cfg.share_prompts if cfg.share_prompts is not None else dp.device.type == "cpu"

    def _place(self, model: torch.nn.Module, *, frozen: bool = False, offload: bool = False) -> torch.nn.Module:
        """Activation checkpointing (trained models), then FSDP2 or a plain move to the device."""
        if self.cfg.activation_checkpointing and not frozen:
            target = model.backbone if isinstance(model, ValueModel) else model
            if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
                target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.compile:  # cuda or cpu
            from meshrl.actors.data_parallel import decoder_layers
            from meshrl.modeling import compile_head
            from meshrl.shared_prompts import compile_passes

            backend = self.cfg.compile_backend
            if self.dp.device.type == "cpu" and backend == "inductor":
                _need_cpp_compiler()
            compile_head(backend)
            compile_passes(backend)
            for layer in decoder_layers(model):
                # the bound forward, not the module: FSDP2's hooks stay eager, names stay the same
                layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
        if self.dp.sharded:
            cuda = self.dp.device.type == "cuda"
            return shard_model(model, self.dp, mixed_precision=self.cfg.mixed_precision and cuda, cpu_offload=offload and cuda)
        return model.to(self.dp.device)

    def train_step(self, samples: Sequence[Sample], version: int, *, share: tuple[int, int, int] | None = None
                   ) -> dict[str, float]:
        """One optimisation step at policy ``version``: on every rank, with the whole batch (each
        rank takes its share) or with this rank's share, ``share = (start, count, total)``
        (``meshrl.queues.parcels.Shares.of``: the step's samples ``start : start + count`` of
        ``total``, in the step's order; ``count == 0``: one padding sample).

        Returns the step's metrics (global: the same on every rank): the losses' (meshrl.algos),
        the batch's rewards and staleness, LR, gradient norm, skipped updates and timings. Raises
        ``NonFiniteStepsError`` after ``max_skipped_steps`` skipped steps in a row.
        """
        began = time.perf_counter()
        gc_s, gc_full, alloc = self.gc_clock.seconds, self.gc_clock.full, _allocator_counts(self.dp.device)
        if share is None:
            samples, share = share_of(samples, self.dp.rank, self.dp.size)
        start, count, total = share
        mine = list(samples[:count]) if count else list(samples[:1])
        if count != len(samples) and not (count == 0 and len(samples) == 1):
            raise ValueError(f"train_step: a share of {count} samples (from {start} of {total}) came with "
                             f"{len(samples)} samples")
        batch = build_step_batch(mine, pad_id=self.pad_id)
        parts = self.dp.gather_objects(_batch_sums(mine[:count], version), what="the batch's statistics")
        stats = stats_of(*parts)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_autocast), \
                    attention_for(self.dp.device, max(batch.lengths)):
                metrics = self.updater.step(
                    batch, policy_optimizer=self.optimizer, critic_optimizer=self.critic_optimizer,
                    max_grad_norm=self.cfg.max_grad_norm, generator=self.generator,
                    rows=range(start, start + count), total=total,
                )
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(self._out_of_memory(exc, max(batch.lengths))) from exc
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # the schedule counts steps, also those whose updates were all skipped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.steps += 1
        skipped = metrics["skipped_updates"] + metrics["critic_skipped_updates"] > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        metrics["skipped_steps_in_a_row"] = float(self.skipped_in_a_row)
        limit = self.cfg.max_skipped_steps
        if limit and self.skipped_in_a_row >= limit:
            raise NonFiniteStepsError(
                f"stopping: {self.skipped_in_a_row} train steps in a row (trainer.max_skipped_steps={limit}, "
                f"last at step {self.steps}) skipped their update because the loss or the gradient norm was "
                f"NaN/inf (last loss {metrics['loss']}, grad_norm {metrics['grad_norm']}); lower trainer.lr, "
                "check the rewards for NaN/inf, or raise trainer.max_skipped_steps"
            )
        metrics["train_time_s"] = time.perf_counter() - began
        # where a slow step's time went: the garbage collector, the allocator going back to the driver
        metrics["trainer/gc_s"] = self.gc_clock.seconds - gc_s
        metrics["trainer/gc_full"] = float(self.gc_clock.full - gc_full)
        metrics.update({f"trainer/{k}": v - alloc[k] for k, v in _allocator_counts(self.dp.device).items()})
        return {**stats, **metrics}

    def _out_of_memory(self, exc: torch.OutOfMemoryError, longest: int) -> str:
        """torch's out-of-memory message, with what the step held and the settings that lower it."""
        device, used = self.dp.device, ""
        if device.type == "cuda":
            used = (f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB held by torch of "
                    f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB, ")
        return (f"the train step ran out of memory on {device} ({used}micro-batches of up to "
                f"trainer.tokens_per_microbatch={self.cfg.tokens_per_microbatch} padded tokens, rows of up to "
                f"{longest} tokens): lower trainer.tokens_per_microbatch, set trainer.activation_checkpointing=true "
                f"or add trainer.dp ranks; with placement=colocated the engine shares the device, so also a smaller "
                f"KV cache (rollout.engine.max_batch_size, rollout.engine.kv_cache_bytes) or colocated.overlap=false "
                f"(its cache is then freed while the step trains). torch said: {exc}")

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full tensors under HF names (LoRA merged): on rank 0 (``{}`` elsewhere); a collective."""
        state = self._full_state()
        return merge_state_dict(state, self.lora.scale) if self.lora is not None and state else state

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The policy's own full state dict (adapters unmerged) on rank 0; a collective when sharded."""
        if not self.dp.sharded:
            return {name: t.detach() for name, t in self.policy.state_dict().items()}
        return full_state_dict(self.policy, self.dp)

    def export_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's policy parameters under HF names, as engines load them (DTensors under FSDP2):
        the live tensors, or with LoRA the merged weights, made as they are iterated (then a
        collective under FSDP2: every rank iterates it whole)."""
        if self.lora is None:
            return self.policy.named_parameters()
        return named_weights(self.policy, merged=True)

    def layout_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors with the shapes, dtypes and shards of ``export_parameters``, without its compute or
        collective (what a transfer plan is read from)."""
        if self.lora is None:
            return list(self.policy.named_parameters())
        return list(named_weights(self.policy, merged=False))

    def save_hf(self, path: str | Path) -> str:
        """An HF-loadable safetensors checkpoint (config, generation config, tokenizer) at ``path``,
        written by rank 0 from the gathered full state dict; a collective. With LoRA the weights
        are merged, and ``path/adapter`` holds the adapters alone in PEFT's format."""
        out = Path(path)
        with no_progress_bars():
            self._save_hf(out)
        return str(out)

    def _save_hf(self, out: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not self.dp.sharded and self.lora is None:
            self.policy.save_pretrained(out, safe_serialization=True)
        else:
            full = state = self._full_state()
            if self.lora is not None and self.dp.rank == 0:  # a plain model of the base architecture
                full = merge_state_dict(state, self.lora.scale)
                save_adapter(state, self.lora, self.model_path, out / "adapter")
            if self.dp.rank == 0:
                # A parameter-less twin with the gathered tensors assigned: no second copy, no
                # random init, and save_pretrained handles tied embeddings and file sharding.
                with torch.device("meta"):
                    twin = AutoModelForCausalLM.from_config(self.policy.config)
                twin.load_state_dict(full, assign=True, strict=True)
                twin.tie_weights()
                twin.generation_config = self.policy.generation_config  # from_config made a default one
                twin.save_pretrained(out, safe_serialization=True)
        if self.dp.rank == 0:
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out)

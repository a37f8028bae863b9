"""The Trainer role: a mesh of ``trainer.dp`` actors, one ``PolicyTrainer`` rank each.

Spawn it on ``spawn_procs({"dp": N}, ...)``; each actor joins the mesh's process group
(``init_torch_distributed``: gloo on CPU, NCCL on GPU) when ``dp > 1`` or on CUDA, and shards the
models with FSDP2 over the ``dp`` axis (``policy_trainer``, ``data_parallel``). At dp = 1 on CPU
no process group is made and the models are plain modules.

Endpoints and who calls them:

- ``train_step(shares, version)``: on **every** rank; each fetches only its own share of the step
  (whole groups, ``meshrl.queues.parcels.Shares``), or takes it from a whole batch; returns the
  global metrics (same on every rank).
- ``gather_weights()``: on every rank (a collective) before ``export_weights`` when dp > 1:
  rank 0 keeps the full tensors for the next export. At dp = 1 it is a no-op.
- ``export_weights()``: on rank 0 only (``meshrl.reshard.push_weights`` does this) — the policy's
  full tensors under Hugging Face names.
- ``reshard_layout()`` (rank 0), ``reshard_join(...)`` and ``reshard_send(version)`` (every
  rank): the source side of ``meshrl.reshard.meshes`` — each rank sends its own FSDP2 shards
  straight into the engines' tensor-parallel layout, no gather (the default weight transport).
- ``gather_weights()`` + ``export_weights()``: the ``object_store`` transport instead.
- ``sglang_connect(urls, ...)`` (every rank; rank 0 joins SGLang's weight-update group) and
  ``sglang_push(version)`` (every rank: the gathers; rank 0 sends): ``rollout.engine.backend=sglang``
  (``meshrl.actors.sglang_sync``).
- ``train_connect(sampler, engines, plan)``, ``place(step, version)``, ``run_steps(until, ...)``,
  ``push_version(version)``, ``settle_push()``: on every rank: the train loop, run here in chunks
  the controller hands out (``meshrl.actors.train_loop``).
- ``save_hf(path)``, ``save_checkpoint(path)``, ``load_checkpoint(path)``: on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshrl import faults
from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.data_parallel import DataParallel
from meshrl.actors.policy_trainer import NonFiniteStepsError, PolicyTrainer, TrainerConfig, batch_stats, lr_lambda
from meshrl.actors.sglang_sync import SGLangSource
from meshrl.actors.train_loop import ChunkRunner, ControlLoop, LoopPlan
from meshrl.actors.trainer_checkpoint import load_trainer_state, save_trainer_state
from meshrl.cpu import compute_process
from meshrl.mesh import Actor, current_rank, current_size, endpoint, init_torch_distributed
from meshrl.queues.parcels import Batch, Shares, fetch_batch
from meshrl.reshard import DestLayout, GroupRanks, PushStats, ReshardConfig, SourceLayout
from meshrl.reshard.meshes import SourceSide

__all__ = ["TrainerConfig", "Trainer", "NonFiniteStepsError", "batch_stats", "lr_lambda"]


class Trainer(Actor):
    """One dp rank of the trainer mesh (module docstring)."""

    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        *,
        temperature: float,
        max_new_tokens: int,
        total_steps: int,
    ) -> None:
        compute_process(cfg.threads)
        world = math.prod(current_size().values())
        if world != cfg.dp:
            raise ValueError(f"trainer.dp={cfg.dp} but the trainer mesh has {world} actors: spawn it on "
                             f'spawn_procs({{"dp": {cfg.dp}}}, ...)')
        if cfg.dp > 1 or cfg.device == "cuda":
            mesh = init_torch_distributed(timeout=cfg.collective_timeout_s)
            device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
            dp = DataParallel(mesh, device, axis=mesh.mesh_dim_names[-1])
        else:
            dp = DataParallel(None, "cpu")
        self.core = PolicyTrainer(model_path, cfg, algo, dp=dp, temperature=temperature,
                                  max_new_tokens=max_new_tokens, total_steps=total_steps)
        self._staged: dict[str, torch.Tensor] | None = None
        self.reshard = SourceSide(self.core.export_parameters, dp.device, layout_parameters=self.core.layout_parameters)
        self.sglang = SGLangSource(self.core.export_parameters, dp.rank)
        self.train_loop: ChunkRunner | None = None
        """The train loop (``train_connect``)."""

    # -- the train loop (meshrl.actors.train_loop) ------------------------------------------------

    @property
    def rank(self) -> int:
        return self.core.dp.rank

    def train(self, shares: Any, version: int) -> dict[str, float]:
        return self.train_step(shares, version)

    def send(self, version: int) -> PushStats:
        faults.point("trainer.reshard_send")
        return self.reshard.send(version)

    def gather(self) -> None:
        self.gather_weights()

    def export(self) -> dict[str, torch.Tensor]:
        return self.export_weights()

    def agree(self, failed: bool) -> bool:
        """Whether any dp rank failed (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([1.0 if failed else 0.0], device=self.core.dp.device)
        return bool(self.core.dp.all_reduce(flag, op="max", what="whether a rank's push failed").item())

    @endpoint
    def train_connect(self, sampler: Any, engines: Any, plan: LoopPlan) -> None:
        """Take batches from ``sampler`` and push to ``engines`` as ``plan`` says (before ``run_steps``)."""
        control = self.train_loop.control if self.train_loop is not None else ControlLoop()
        self.train_loop = ChunkRunner(self, plan, sampler, engines, control)

    def _runner(self) -> ChunkRunner:
        if self.train_loop is None:
            raise RuntimeError("the trainer's loop before train_connect")
        return self.train_loop

    @endpoint
    def place(self, step: int, version: int) -> None:
        """The run's position: where the next ``run_steps`` goes on from."""
        self._runner().place(step, version)

    @endpoint
    def run_steps(self, until: int, *, prefetch: bool = True, settle: bool = False,
                  publish_last: bool = True) -> dict[str, Any]:
        """Train steps up to ``until`` (``ChunkRunner.run``): their records, the step and version
        reached, and a push's failure that ended the chunk (None)."""
        self._staged = None
        return self._runner().run(until, prefetch=prefetch, settle=settle, publish_last=publish_last)

    @endpoint
    def push_version(self, version: int, publish: bool = False) -> dict[str, float]:
        """The current weights to every engine as ``version`` (every rank), then until they serve
        it; ``publish``: the sampler learns it then. The push's parts (rank 0)."""
        runner = self._runner()
        runner.push(version, publish=publish)
        runner.settle()
        runner.version = version
        return runner.phases()

    @endpoint
    def settle_push(self) -> None:
        """Until every engine serves the newest version pushed (a detached push's second half)."""
        self._runner().settle()

    @endpoint
    def forget_push(self) -> None:
        """A rollout worker was re-created: a push that failed with it is forgotten (pushed again)."""
        self._runner().forget()

    @endpoint
    def train_step(self, batch: Shares | Batch | bytes, version: int) -> dict[str, float]:
        """One optimisation step at policy ``version``: on ``Shares`` (the queue's
        ``get_batch_refs(shares=dp)``: this rank fetches its own share's blobs, nothing else), or on
        the whole batch by reference or in the queue's wire format (this rank takes its share)."""
        self._staged = None  # staged weights are stale once the policy changes
        timeout = self.core.cfg.collective_timeout_s
        if isinstance(batch, Shares):
            mine, start, count = batch.of(self.core.dp.rank)
            samples, share = fetch_batch(mine, timeout), (start, count, batch.total)
        else:
            samples, share = fetch_batch(batch, timeout), None
        faults.point("trainer.train_step")
        return self.core.train_step(samples, version, share=share)

    @endpoint
    def gather_weights(self) -> int:
        """Collective: gather the full policy onto rank 0 for the next ``export_weights``.

        Returns the number of tensors staged on this rank (0 on ranks > 0 and at dp = 1).
        """
        if not self.core.dp.sharded:
            return 0
        self._staged = self.core.policy_state()
        return len(self._staged)

    @endpoint
    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full tensors under Hugging Face names (what engines load); rank 0."""
        if not self.core.dp.sharded:
            return self.core.policy_state()
        if self.core.dp.rank != 0 or self._staged is None:
            raise RuntimeError(f"export_weights on dp rank {self.core.dp.rank} of a sharded trainer without staged "
                               "weights: call gather_weights on every rank first, then export_weights on rank 0")
        staged, self._staged = self._staged, None
        return staged

    @endpoint
    def reshard_layout(self) -> SourceLayout:
        """Where each policy parameter's shards live (read from its DTensors)."""
        return self.reshard.layout()

    @endpoint
    def reshard_join(self, dest: DestLayout, ranks: GroupRanks, addr: str, port: int, config: ReshardConfig) -> None:
        """Join the transfer group with the engines (blocks until every member joined)."""
        self.reshard.join(dest, ranks, current_rank().rank, addr, port, config)

    @endpoint
    def reshard_send(self, version: int) -> PushStats:
        """Send this rank's shards of the current policy as ``version``."""
        faults.point("trainer.reshard_send")
        return self.reshard.send(version)

    @endpoint
    def sglang_connect(self, urls: list[str], bucket_bytes: int, backend: str, pause_mode: str, timeout_s: float,
                       request_timeout_s: float, dtype: str = "", reset: bool = False) -> None:
        """Rank 0 joins SGLang's weight-update group with every server at ``urls`` (once); ``dtype``: the
        servers' weight dtype, what floating-point tensors go out in; ``reset``: the servers outlived
        a trainer (run.warm_resume), whose group they may still hold."""
        self.sglang.connect(urls, bucket_bytes=bucket_bytes, backend=backend, pause_mode=pause_mode,
                            timeout_s=timeout_s, request_timeout_s=request_timeout_s, dtype=dtype, reset=reset)

    @endpoint
    def device_memory(self) -> tuple[int, int]:
        """(parameters of the policy and critic, this rank's device memory in bytes; 0 on a CPU)."""
        models = [self.core.policy] + ([self.core.critic] if self.core.critic is not None else [])
        count = sum(p.numel() for m in models for p in m.parameters())
        device = self.core.dp.device
        return count, (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0)

    @endpoint
    def sglang_push(self, version: int) -> PushStats:
        """The current policy into every SGLang server as ``version`` (every rank: a collective)."""
        return self.sglang.push(version)

    @endpoint
    def sglang_close(self) -> None:
        """Leave SGLang's weight-update group (best effort)."""
        self.sglang.close()

    @endpoint
    def save_hf(self, path: str) -> str:
        """Write an HF-loadable safetensors checkpoint of the policy, with config and tokenizer."""
        return self.core.save_hf(path)

    @endpoint
    def save_checkpoint(self, path: str) -> str:
        """Sharded training state (models, optimisers, schedule, RNG, counters) under ``path``."""
        save_trainer_state(self.core, path)
        faults.point("trainer.save_checkpoint")
        return path

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Restore what ``save_checkpoint`` wrote; returns the trainer's step count."""
        self._staged = None
        return load_trainer_state(self.core, path)

"""The RolloutWorker role: one generation engine, driven by the controller's rollout loops.

An async actor: several ``generate`` calls are in flight at once and the engine batches them
continuously; ``update_weights`` lands between two decode steps, so a sample's per-token versions
show exactly where the weights changed. The ``reshard_*`` endpoints are the engine side of
``meshrl.reshard.meshes`` (the trainer's shards arrive straight into this engine's TP layout and
flip atomically); the engine keeps generating on the old version while they arrive.
With an environment (``meshrl.envs``), ``run_episodes`` plays multi-turn episodes on the same
engine: every policy turn is a generate call, so turns of all episodes batch together.

With ``rollout.tp_size = T > 1`` the rollout mesh has dims ``{procs: num_workers, tp: T}``: each
replica is T actors (one GPU each on CUDA) joined in one process group (``init_torch_distributed``)
whose DeviceMesh's ``tp`` axis shards the engine (``engines/tp.py``), leader-driven: the controller
sends generation calls to ``tp = 0`` only (``start_tp``: the others follow its schedule), while
weight pushes reach every rank, each receiving its own shard and going live at rank 0's flip.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import msgspec

from meshrl.engines import GenerateRequest, GenerateResult
from meshrl.engines.types import GREEDY_TEMPERATURE
from meshrl.engines.torch_engine import TorchEngine, TorchEngineConfig
from meshrl.envs import EnvFactory, Episode, EpisodeConfig, EpisodeRequest, run_episodes
from meshrl.mesh import Actor, current_rank, endpoint
from meshrl.reshard import DestLayout, GroupRanks, PushStats, ReshardConfig, SourceLayout
from meshrl.reshard.meshes import DestSide

__all__ = ["RolloutConfig", "RolloutWorker"]


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Generation: engines, sampling, and how much work is in flight."""

    num_workers: int = 1
    """Rollout workers, one engine replica each."""
    tp_size: int = 1
    """Tensor-parallel ranks per engine replica, one process (and GPU) each, for models larger than one
    device: num_workers x tp_size processes in all."""
    max_new_tokens: int = 8
    """Completion length limit, in tokens (EOS included)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    """Sampled (training) completions run to exactly max_new_tokens (fixed lengths for throughput runs)."""
    prompts_per_request: int = 32
    """Prompts per generate call (one queue reservation of prompts × samples_per_prompt)."""
    requests_in_flight: int = 2
    """Concurrent generate calls per worker, so the engine batches across them."""
    threads: int = 1
    """torch intra-op threads per worker."""
    engine: TorchEngineConfig = TorchEngineConfig()
    episode: EpisodeConfig = EpisodeConfig()
    """Limits of environment episodes (only with an environment); max_new_tokens bounds each turn."""

    def __post_init__(self) -> None:
        for name in ("num_workers", "tp_size", "max_new_tokens", "prompts_per_request", "requests_in_flight", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature == 0 or self.temperature >= GREEDY_TEMPERATURE):
            # between them the engine decodes greedily (log-probs of the unscaled logits) while the
            # trainer would divide its logits by the temperature: the importance ratios would be garbage
            raise ValueError(f"rollout.temperature must be 0 (greedy) or >= {GREEDY_TEMPERATURE}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")


class RolloutWorker(Actor):
    """Owns a ``TorchEngine`` loaded from a Hugging Face checkpoint directory (and, to play
    episodes, an environment factory and the checkpoint's tokenizer)."""

    def __init__(self, model_path: str, engine: TorchEngineConfig, threads: int = 1, *, tp_size: int = 1,
                 tp_timeout_s: float = 600.0, environment: EnvFactory | None = None,
                 episode: EpisodeConfig = EpisodeConfig()) -> None:  # fmt: skip
        import torch

        torch.set_num_threads(threads)
        tp = _join_tp(tp_size, tp_timeout_s) if tp_size > 1 else None
        self.engine = TorchEngine.from_pretrained(model_path, engine, tp=tp)
        self._follow: Any = None
        self.reshard = DestSide(self.engine)
        self.environment, self.episode = environment, episode
        self.tokenizer = None
        if environment is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    @endpoint
    async def start_tp(self) -> tuple[int, int]:
        """Tensor parallel: rank 0 starts its step loop (and heartbeats); the others follow its schedule
        from now on, in a task of this actor's event loop. Returns this engine's (tp rank, tp size).

        A follower whose ``follow`` ends for any reason but rank 0's stop prints why and ends its
        process: its peers then see the connection close at once (a silent follower would leave
        rank 0 waiting in its next collective for the group's whole timeout)."""
        if self.engine.tp.is_follower:
            if self._follow is None or self._follow.done():
                self._follow = asyncio.ensure_future(self.engine.follow())
                self._follow.add_done_callback(_exit_unless_stopped)
        else:
            await self.engine.start()
        return self.engine.tp.rank, self.engine.tp.size

    @endpoint
    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return await self.engine.generate(requests)

    @endpoint
    async def run_episodes(self, requests: Sequence[EpisodeRequest]) -> list[list[Episode]]:
        """Every request's ``n`` episodes of the environment, played concurrently on the engine."""
        if self.environment is None:
            raise RuntimeError("run_episodes: this rollout worker has no environment (Pipeline(environment=...))")
        return await run_episodes(self.engine, self.tokenizer, self.environment, requests, self.episode,
                                  max_seq_len=self.engine.cache.max_seq_len)  # fmt: skip

    @endpoint
    async def update_weights(self, named_tensors: dict[str, Any], version: int) -> int:
        """Apply a whole new version atomically (between decode steps); returns the version."""
        await self.engine.update_weights(named_tensors.items(), version)
        return self.engine.version

    @endpoint
    async def version(self) -> int:
        return self.engine.version

    @endpoint
    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause(mode)

    @endpoint
    async def resume(self) -> None:
        await self.engine.resume()

    @endpoint
    async def reshard_dest_layout(self, num_ranks: int) -> DestLayout:
        """The layout of ``num_ranks`` engine ranks like this one (its declared TP plan and dtype)."""
        return self.reshard.layout(num_ranks)

    @endpoint
    async def reshard_join(self, source: SourceLayout, dest: DestLayout, ranks: GroupRanks, addr: str, port: int,
                           config: ReshardConfig) -> None:
        """Join the trainer-to-engines transfer group as destination rank = this actor's flat rank."""
        await self.reshard.join(source, dest, ranks, current_rank().rank, addr, port, config)

    @endpoint
    async def reshard_receive(self, version: int) -> PushStats:
        """Receive a whole version from the trainer ranks and serve it from the next step on."""
        return await self.reshard.receive(version)

    @endpoint
    async def reshard_arm(self, version: int, timeout_s: float) -> None:
        """Post the receive of ``version`` now, before the trainer sends it (``Resharder.arm``)."""
        await self.reshard.arm(version, timeout_s)

    @endpoint
    async def reshard_disarm(self) -> None:
        await self.reshard.disarm()


def _exit_unless_stopped(task: asyncio.Task) -> None:
    if task.cancelled() or task.exception() is None:
        return  # rank 0 stopped it (or the actor is going away)
    import os
    import sys
    import traceback

    print(f"TP follower {current_rank()}: following rank 0 failed; ending this process:", file=sys.stderr, flush=True)
    traceback.print_exception(task.exception())
    sys.stderr.flush()
    os._exit(1)


def _join_tp(tp_size: int, timeout_s: float) -> Any:
    """This actor's place in its replica's TP group: the mesh-wide process group's ``tp`` axis, led by
    ``tp = 0``; schedule messages go over gloo even when the all-reduces use NCCL."""
    import datetime

    import torch.distributed as dist

    from meshrl.engines.tp import TensorParallel
    from meshrl.mesh import current_size, init_torch_distributed

    sizes = current_size()
    if sizes.get("tp") != tp_size:
        raise ValueError(f"rollout.tp_size={tp_size} needs a rollout mesh with a 'tp' dim of that size, got {sizes}")
    mesh = init_torch_distributed(timeout=timeout_s)
    control = None
    if dist.get_backend() == "nccl":  # every rank makes every replica's gloo group, in the same order
        replicas, mine = mesh.mesh.reshape(-1, tp_size).tolist(), dist.get_rank()
        for ranks in replicas:
            group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            if mine in ranks:
                control = group
    # a follower may take up to most of the group's timeout to end its part of a push
    return TensorParallel.from_device_mesh(mesh, "tp", leader_driven=True, control_group=control,
                                           flip_timeout_s=0.9 * timeout_s)

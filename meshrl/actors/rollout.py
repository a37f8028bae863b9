"""The RolloutWorker role: one generation engine, and the rollout loops that feed it.

An async actor: its rollout loops (``run_loops``, ``meshrl.actors.rollout_loops``) take requests
from the run's sampler, several at once, and the engine batches them
continuously; ``update_weights`` lands between two decode steps, so a sample's per-token versions
show exactly where the weights changed. The ``reshard_*`` endpoints are the engine side of
``meshrl.reshard.meshes`` (the trainer's shards arrive straight into this engine's TP layout and
flip atomically); the engine keeps generating on the old version while they arrive.
With an environment (``meshrl.envs``), ``run_episodes`` plays multi-turn episodes on the same
engine: every policy turn is a generate call, so turns of all episodes batch together.
With ``reward.num_workers=0`` a worker also holds the reward and scores what it generated
(``play_scored``): the samples leave it built and encoded, as a reward worker's would.

With ``rollout.tp_size = T > 1`` the rollout mesh has dims ``{procs: num_workers, tp: T}``: each
replica is T actors (one GPU each on CUDA) joined in one process group (``init_torch_distributed``)
whose DeviceMesh's ``tp`` axis shards the engine (``engines/tp.py``), leader-driven: the controller
sends generation calls to ``tp = 0`` only (``start_tp``: the others follow its schedule), while
weight pushes reach every rank, each receiving its own shard and going live at rank 0's flip.

With ``rollout.engine.backend=sglang`` a worker holds an ``SGLangEngine`` instead: ``start_sglang``
launches its SGLang server on the worker's GPUs (all ``tp_size`` of them: the server does its own
TP) or attaches to the URL the config gives it (``meshrl.engines.sglang_server``). Weights then go
from the trainer straight into the servers (``meshrl.actors.sglang_sync``); a push's abort-mode
pause ends the samples in flight, which the engine sends again (``reissue_aborted``), so a generate
call always returns whole samples. A server that dies fails the worker's next call, naming its log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal, Sequence

import msgspec

from meshrl import faults
from meshrl.actors.requests import RequestMaker
from meshrl.actors.reward import RolloutJob, Scored, Scorer
from meshrl.actors.rollout_loops import LoopHost, LoopSettings, RolloutLoops
from meshrl.cpu import compute_process
from meshrl.engines import GenerateRequest, GenerateResult
from meshrl.engines.engine_config import TorchEngineConfig
from meshrl.engines.sglang_server import SGLangServerConfig
from meshrl.engines.types import GREEDY_TEMPERATURE
from meshrl.envs import EnvFactory, Episode, EpisodeConfig, EpisodeRequest, run_episodes
from meshrl.mesh import Actor, ActorFailure, current_rank, endpoint
from meshrl.mesh.actor import mesh_context
from meshrl.queues.actor import SAMPLER_ENDPOINTS
from meshrl.queues.sampler import Sampler
from meshrl.reshard import DestLayout, GroupRanks, PushStats, ReshardConfig, SourceLayout
from meshrl.reshard.meshes import DestSide

__all__ = ["RolloutConfig", "RolloutEngineConfig", "RolloutWorker"]

REISSUE_ABORTED = 8
"""Times a sample aborted by its SGLang server's pause is sent again before it counts as aborted."""


class RolloutEngineConfig(TorchEngineConfig, frozen=True, kw_only=True):
    """``rollout.engine``: which engine backs the rollout workers; TorchEngine's settings, and SGLang's."""

    backend: Literal["torch", "sglang"] = "torch"
    """torch: a TorchEngine in every worker (the embedded default); sglang: an SGLang server per
    worker (rollout.engine.sglang: launched on the worker's GPUs, or attached by URL). With sglang,
    dtype, device, max_batch_size (--max-running-requests), max_seq_len (--context-length),
    cuda_graphs (--disable-cuda-graph), seed and initial_version apply to the server; TorchEngine's
    other settings do not (kv_cache_bytes and compile are refused: the server sizes its cache by
    rollout.engine.sglang.mem_fraction_static)."""
    sglang: SGLangServerConfig = SGLangServerConfig()


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
    engine: RolloutEngineConfig = RolloutEngineConfig()
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
    """Owns a ``TorchEngine`` loaded from a Hugging Face checkpoint directory, or with
    ``backend=sglang`` an SGLang server and its ``SGLangEngine`` (and, to play episodes, an
    environment factory and the checkpoint's tokenizer)."""

    def __init__(self, model_path: str, engine: TorchEngineConfig, threads: int = 1, *, tp_size: int = 1,
                 tp_timeout_s: float = 600.0, environment: EnvFactory | None = None,
                 episode: EpisodeConfig = EpisodeConfig(), scorer: tuple[Any, float] | None = None,
                 sampler: dict[str, Any] | None = None) -> None:
        """``scorer``: ``(reward, timeout_s)`` as a ``RewardWorker`` takes them, with reward.num_workers=0:
        this worker then scores its own generations (``play_scored``). ``sampler``: ``Sampler``'s
        arguments, by name: this worker holds the run's sampler (the run's one rollout worker), its
        loops take and put in this process, and the sampler's endpoints are this worker's."""
        compute_process(threads)
        self.model_path, self.config, self.tp_size = model_path, engine, tp_size
        self.server: Any = None
        """The SGLang server this worker launched (None: TorchEngine, or a server attached by URL)."""
        self._follow: Any = None
        if getattr(engine, "backend", "torch") == "sglang":
            self.engine: Any = None  # start_sglang, once the server is up
            self.reshard = None
        else:
            from meshrl.engines.torch_engine import TorchEngine

            tp = _join_tp(tp_size, tp_timeout_s) if tp_size > 1 else None
            self.engine = TorchEngine.from_pretrained(model_path, engine, tp=tp)
            self.reshard = DestSide(self.engine)
        self.environment, self.episode = environment, episode
        self.tokenizer = None
        if environment is not None or scorer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.scorer = None if scorer is None else Scorer(scorer[0], self.tokenizer, scorer[1])
        self.loop_host = LoopHost()
        """The rollout loops this worker runs (``run_loops``)."""
        self._sampler_args = sampler
        self.sampler = None if sampler is None else Sampler(**sampler)

    @endpoint
    async def start_sglang(self, log_dir: str, trainer_ip: str, mem_fraction: float | None = None) -> str:
        """``backend=sglang``: launch this worker's server on its GPUs (or attach to its URL in
        ``rollout.engine.sglang.urls``) and wait until it is healthy; returns the server's URL.
        Its log is ``log_dir/server<rank>.log``; ``mem_fraction`` is its --mem-fraction-static unless
        rollout.engine.sglang sets one (a server sharing a trainer's GPU)."""
        from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
        from meshrl.engines.sglang_server import SGLangServer, server_args
        from meshrl.groups import free_port, routable_ip

        cfg, engine, rank = self.config.sglang, self.config, current_rank().rank
        if self.engine is not None:  # kept from a failed attempt (run.warm_resume): its server serves on
            await self._calling(self.engine.server_version())
            return self.engine.url
        if cfg.urls:
            url = cfg.urls[rank].rstrip("/")
        else:
            node = routable_ip()
            host = cfg.host if cfg.host != "auto" else "127.0.0.1" if trainer_ip in (node, "127.0.0.1") else node
            port = free_port()
            args = server_args(cfg, model_path=self.model_path, host=host, port=port, tp_size=self.tp_size,
                               dtype=engine.dtype, seed=engine.seed, context_length=engine.max_seq_len,
                               max_running_requests=engine.max_batch_size, cuda_graphs=engine.cuda_graphs,
                               mem_fraction_static=mem_fraction)
            if engine.device != "auto":
                args += ["--device", "cuda" if engine.device.startswith("cuda") else engine.device]
            self.server = await SGLangServer.launch(cfg, args, host=host, port=port,
                                                    log_path=Path(log_dir) / f"server{rank}.log")
            url = self.server.url
        self.engine = SGLangEngine(url, config=SGLangEngineConfig(
            request_timeout_s=cfg.request_timeout_s, generate_timeout_s=cfg.generate_timeout_s,
            initial_version=engine.initial_version, reissue_aborted=REISSUE_ABORTED))
        await self._calling(self.engine.server_version())  # an attached URL that does not answer fails here
        return url

    async def _calling(self, call: Any) -> Any:
        """``await call``; when it fails and this worker's server has exited, that is the error (its log named)."""
        try:
            return await call
        except Exception:
            if self.server is not None:
                self.server.check()
            raise

    @endpoint
    async def check_engine(self, answers: bool = False) -> None:
        """Raise if this worker's SGLang server has exited (naming its log); ``answers``: or if it does not
        answer a request (within rollout.engine.sglang.request_timeout_s). A no-op for TorchEngine."""
        if self.server is not None:
            self.server.check()
        if answers and hasattr(self.engine, "server_version"):
            await self._calling(self.engine.server_version())

    @endpoint
    async def close_engine(self) -> None:
        """Stop this worker's SGLang server and every process it started (TorchEngine: nothing)."""
        server, self.server = self.server, None
        try:
            if self.engine is not None and hasattr(self.engine, "close"):
                await self.engine.close()
        finally:
            if server is not None:
                await asyncio.to_thread(server.stop)

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
        faults.point("rollout.generate")
        return await self._calling(self.engine.generate(requests))

    @endpoint
    async def run_episodes(self, requests: Sequence[EpisodeRequest]) -> list[list[Episode]]:
        """Every request's ``n`` episodes of the environment, played concurrently on the engine."""
        if self.environment is None:
            raise RuntimeError("run_episodes: this rollout worker has no environment (Pipeline(environment=...))")
        seq = self.engine.cache.max_seq_len if self.reshard is not None else self._max_seq_len()
        return await self._calling(run_episodes(self.engine, self.tokenizer, self.environment, requests, self.episode,
                                                max_seq_len=seq))

    @endpoint
    async def play_scored(self, job: RolloutJob, requests: Sequence[GenerateRequest] | Sequence[EpisodeRequest], *,
                          within_s: float | None = None, by_ref: bool | int = False) -> Scored:
        """``generate`` (or ``run_episodes``, for ``EpisodeRequest``s) and ``score`` in one call, in this
        process: reward.num_workers=0, no reward worker and no second hop for the generations."""
        return await self.score(job, within_s, by_ref, **await self.play(requests))

    async def play(self, requests: Sequence[GenerateRequest] | Sequence[EpisodeRequest]) -> dict[str, Any]:
        """``generate``, or ``run_episodes`` for ``EpisodeRequest``s: their answer as ``score``'s keyword."""
        if requests and isinstance(requests[0], EpisodeRequest):
            return {"episodes": await self.run_episodes(requests)}
        return {"results": await self.generate(requests)}

    @endpoint
    async def run_loops(self, sampler: Any, rewards: Any, reference: Any, settings: LoopSettings, rollout: Any,
                        seed: int) -> None:
        """This worker's rollout loops (``meshrl.actors.rollout_loops``): requests from ``sampler``,
        generated here, scored here or on ``rewards``, annotated by ``reference``, put back; until the
        sampler closes. A loop's failure is raised (the others end). ``rollout``: the run's
        ``RolloutConfig``; ``seed``: run.seed (the requests' seeds come from it and the group ids)."""
        loops = RolloutLoops(self.play, self.play_scored, self.request_maker(rollout, seed), self.sampler_for(sampler),
                             rewards, reference, settings)
        await self.loop_host.run(loops)

    def sampler_for(self, sampler: Any) -> Any:
        """The sampler the loops call: ``sampler`` (a mesh), or with None this worker's own, in process."""
        if sampler is not None:
            return sampler
        if self.sampler is None:
            raise RuntimeError("run_loops(sampler=None) on a rollout worker that holds no sampler")
        return InProcess(self.sampler)

    @endpoint
    async def pause_loops(self, timeout_s: float) -> int:
        """No new requests; wait (at most ``timeout_s``) for those being generated to put their
        samples; how many still were (``RolloutLoops.pause``)."""
        return await self.loop_host.pause(timeout_s)

    def request_maker(self, rollout: Any, seed: int) -> RequestMaker:
        """The ``RequestMaker`` of this worker's loops: the same requests, seeds and tokenised prompts
        wherever they are made."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return RequestMaker(rollout, seed, None, self.tokenizer, environment=self.environment is not None)

    async def score(self, job: RolloutJob, within_s: float | None = None, by_ref: bool | int = False,
                    results: list[GenerateResult] | None = None, episodes: list[list[Episode]] | None = None) -> Scored:
        """``RewardWorker.score``, in this worker (reward.num_workers=0)."""
        if self.scorer is None:
            raise RuntimeError("score: this rollout worker holds no reward (reward.num_workers=0 gives it one)")
        return await self.scorer.score(job, within_s, by_ref, results=results, episodes=episodes)

    def _max_seq_len(self) -> int:
        """An SGLang server's context: rollout.engine.max_seq_len, or the model's positions (capped as TorchEngine's)."""
        if self.config.max_seq_len:
            return self.config.max_seq_len
        from meshrl.engines.weights import load_hf_config

        return min(int(getattr(load_hf_config(self.model_path), "max_position_embeddings", 4096)), 4096)

    @endpoint
    async def update_weights(self, named_tensors: dict[str, Any], version: int) -> int:
        """Apply a whole new version atomically (between decode steps); returns the version."""
        await self.engine.update_weights(named_tensors.items(), version)
        return self.engine.version

    @endpoint
    async def version(self) -> int:
        if self.reshard is None:  # an SGLang server: the version it serves (stamped by the last push)
            return await self._calling(self.engine.refresh_version())
        return self.engine.version

    @endpoint
    async def reissued(self) -> int:
        """Samples an SGLang server aborted for a push and this worker sent again (0 with TorchEngine)."""
        return getattr(self.engine, "reissued", 0)

    def _torch(self, what: str) -> DestSide:
        if self.reshard is None:
            raise RuntimeError(f"{what}: this rollout worker's engine is an SGLang server, which takes weights "
                               "from the trainer over SGLang's own group (Trainer.sglang_push), not reshard")
        return self.reshard

    def _joined(self, what: str) -> DestSide:
        """The transfer side of a worker in the trainer's group; a process Ray re-created in place
        (run.max_worker_restarts) is not in it until the controller connects it again: its failure
        says so as a restart, which the train loop answers by that connect and the push again."""
        side = self._torch(what)
        if side.resharder is None:
            import ray

            if ray.get_runtime_context().was_current_actor_reconstructed:
                ctx = mesh_context()
                raise ActorFailure(ctx.mesh, ctx.rank, f"{what}: this process was restarting (re-created by Ray) "
                                   "and has not joined the trainer's transfer group yet")
        return side

    @endpoint
    async def reshard_dest_layout(self, num_ranks: int) -> DestLayout:
        """The layout of ``num_ranks`` engine ranks like this one (its declared TP plan and dtype)."""
        return self._torch("reshard_dest_layout").layout(num_ranks)

    @endpoint
    async def reshard_join(self, source: SourceLayout, dest: DestLayout, ranks: GroupRanks, addr: str, port: int,
                           config: ReshardConfig) -> None:
        """Join the trainer-to-engines transfer group as destination rank = this actor's flat rank."""
        await self._torch("reshard_join").join(source, dest, ranks, current_rank().rank, addr, port, config)

    @endpoint
    async def reshard_receive(self, version: int) -> PushStats:
        """Receive a whole version from the trainer ranks and serve it from the next step on."""
        faults.point("rollout.reshard_receive")
        return await self._joined("reshard_receive").receive(version)

    @endpoint
    async def reshard_arm(self, version: int, timeout_s: float) -> None:
        """Post the receive of ``version`` now, before the trainer sends it (``Resharder.arm``)."""
        await self._joined("reshard_arm").arm(version, timeout_s)

    @endpoint
    async def reshard_disarm(self) -> None:
        await self._joined("reshard_disarm").disarm()


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


class InProcess:
    """An object of this process called as a one-actor mesh is: ``x.method.call_one(...)`` is the
    coroutine of ``x.method(...)`` (``bounded`` awaits either)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return _Call(getattr(self._target, name))


class _Call:
    def __init__(self, fn: Any) -> None:
        self.call_one = fn


def _sampler_endpoint(name: str) -> Any:
    async def call(self: RolloutWorker, *args: Any, **kwargs: Any) -> Any:
        if self.sampler is None:
            raise RuntimeError(f"`{name}`: this rollout worker holds no sampler (the run's sampler is its own actor)")
        return await getattr(self.sampler, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``Sampler.{name}`` of the sampler this worker holds (the run's ``queue`` role)."
    return endpoint(call)


async def _restore(self: RolloutWorker, state: Any) -> int:
    """``Sampler.restore``, into a fresh sampler: a resume's (this process may be kept from a failed
    attempt, whose sampler went on after the checkpoint)."""
    if self._sampler_args is None:
        raise RuntimeError("`restore`: this rollout worker holds no sampler (the run's sampler is its own actor)")
    self.sampler = Sampler(**self._sampler_args)
    return await self.sampler.restore(state)


for _name in SAMPLER_ENDPOINTS:
    setattr(RolloutWorker, _name, _sampler_endpoint(_name))
RolloutWorker.restore = endpoint(_restore)

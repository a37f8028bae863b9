"""The root config of a pipeline: it only composes the components' own configs.

Defaults live in each component's Struct; ``examples/async_ppo.yaml`` and command-line overrides
(``algo=grpo queue.max_staleness=2``) change them. ``validate`` checks what no single component
can: that the parts agree with each other, and that paths exist.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec

from meshrl.actors import AlgoConfig, RewardConfig, RolloutConfig, TrainerConfig
from meshrl.actors.hybrid import ColocatedConfig
from meshrl import faults
from meshrl.config import ConfigError
from meshrl.embedded import EmbeddedModelConfig, WarmStartConfig
from meshrl.engines.layout import ModelSpec
from meshrl.engines.weights import check_checkpoint_dir, load_hf_config
from meshrl.queues import QueueConfig
from meshrl.reshard import ReshardConfig
from meshrl.pipeline import output_dir
from meshrl.tasks import TaskConfig

__all__ = ["ClusterConfig", "ModelConfig", "RolePlacement", "RunConfig", "PipelineConfig"]

MIN_STEP_TIMEOUT_S = 10.0


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str | None = None
    """A local Hugging Face causal LM directory; None builds the embedded default."""
    embedded: EmbeddedModelConfig = EmbeddedModelConfig()


class RunConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What to run and where the output goes."""

    total_steps: int = 200
    """Train steps."""
    output_dir: str = "runs/async_ppo"
    """metrics.jsonl, plots, config.yaml, checkpoints/ and the final HF checkpoint go here. A fresh
    run refuses a directory that holds another run's files (run.resume=latest continues that run,
    run.overwrite=true starts over), and one that a live run holds (meshrl.pipeline.output_dir)."""
    overwrite: bool = False
    """Start fresh in an output_dir that holds an earlier run: its checkpoints, final/, records,
    plots and config.yaml are deleted first (nothing else in the directory is touched)."""
    eval_every: int = 25
    """Train steps between held-out evaluations (0: only before and after)."""
    eval_max_new_tokens: int | None = None
    """Held-out generation length; None: rollout.max_new_tokens."""
    seed: int = 0
    progress: bool = True
    """Show a progress bar (the per-step metrics lines print either way)."""
    tensorboard: bool | None = None
    """TensorBoard scalars under output_dir/tensorboard: null writes them when the ``tensorboard``
    package is installed, true requires it (the run fails at start without it), false never."""
    step_timeout_s: float = 600.0
    """Longest wait for one train step, one batch or one weight push before the run stops (at
    least 10: the roles' start-up and the first checkpoint wait as long)."""
    num_cpus: int | None = None
    """CPUs of the local Ray cluster started when none is running; None: all of this machine's."""
    ray_address: str | None = None
    """The Ray cluster to run on (``ray start``'s head address, host:port). None follows Ray's own
    rules: ``RAY_ADDRESS``, else a cluster ``ray start`` left on this machine, else a new local one."""
    checkpoint_every: int = 0
    """Train steps between checkpoints under output_dir/checkpoints (0: only at the end); a
    multiple of trainer.sync_interval, so a checkpoint always follows a weight push."""
    checkpoint_at_end: bool = True
    """Checkpoint after the last step (benchmarks turn it off: a large model's save takes long)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (older ones are deleted); 0 keeps all. Checkpoints of steps
    after the one a run resumed from are neither counted nor deleted (until it writes those steps)."""
    stop_drain_timeout_s: float = 60.0
    """Pipeline.stop: longest wait for the requests in flight to put their samples before the
    checkpoint (requests still generating then are recorded and generated again on resume)."""
    resume: str | None = None
    """latest: continue from the newest checkpoint under output_dir/checkpoints (a fresh start
    if there is none); a path: that checkpoint directory; null: start fresh."""
    auto_resume: bool = False
    """When a role's process dies (the trainer, the queue, a rollout worker past its restarts: any
    ``ActorFailure``), tear the run down and resume it from its newest checkpoint by itself, redoing
    at most checkpoint_every steps; a bug (an exception a role raised) still stops the run."""
    warm_resume: bool = True
    """auto_resume: the resumed run takes over the failed one's live processes (the trainer reloads the
    checkpoint, the engines are pushed its weights) and starts only the dead role and the queue
    again; false starts every role again (meshrl.pipeline.processes)."""
    max_restarts: int = 3
    """auto_resume: the most resumes of one run; the next death stops it with the first failure."""
    max_worker_restarts: int = 3
    """Reward and reference workers are restarted in place (Ray re-creates the process) up to this
    many times each, the calls they had in flight sent again, while the rest of the run goes on."""
    heartbeat_timeout_s: float = 60.0
    """A role's process that answers no heartbeat within this many seconds is hung (stopped, stuck
    holding the GIL, on a node cut off): it is killed, then restarted in place (reward, reference) or
    the run resumed (run.auto_resume) or stopped, naming it. Answered from a thread of its own, so a
    long step does not count. 0: no heartbeat."""
    chunk_s: float = 2.0
    """The trainer runs the train loop itself, in chunks the controller hands out (up to the next
    checkpoint, evaluation or the end); a chunk also ends after about this many seconds, at a step
    that pushed, so the step records (written once a chunk) and a restart in place come at least
    this often. One controller call a chunk, none a step."""
    audit: bool = False
    """Keep the ledger of samples (meshrl.pipeline.audit): the groups the queue accepted and each
    step trained, as ``audit`` records in metrics.jsonl; the summary says whether any group was
    trained twice or accepted and lost."""


class RolePlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one role's processes go on a Ray cluster (their GPUs come from the device settings)."""

    resources: dict[str, float] = {}
    """Ray resources each process reserves besides its GPUs: a custom resource that ``ray start
    --resources='{"trainer_node": 8}'`` gave some nodes pins the role to them ({trainer_node: 0.01});
    {"node:10.0.0.2": 0.01} pins it to one node by address; {CPU: 1} reserves a core per process
    (unset: a token, as processes share cores anyway)."""
    labels: dict[str, str] = {}
    """Node labels the role's nodes must carry (``ray start --labels``; Ray's label selectors)."""
    pack: bool = True
    """trainer: its dp ranks (one FSDP group) on one node; rollout: each tensor-parallel group on one
    node (the replicas go wherever they fit); queue, reward, reference: all their processes on one
    node. False lets Ray spread them."""


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the roles are placed on the Ray cluster's nodes."""

    placement_timeout_s: float = 60.0
    """Longest wait for a role's processes to be placed; then the run fails, naming the role and
    what the cluster lacks (an autoscaling cluster may need minutes to add a node)."""
    queue: RolePlacement = RolePlacement()
    rollout: RolePlacement = RolePlacement()
    reward: RolePlacement = RolePlacement(pack=False)
    """Reward workers (and a MeshReward's mesh): spread where they fit."""
    trainer: RolePlacement = RolePlacement()
    """The trainer's dp ranks; with placement=colocated, the workers that hold trainer and engine."""
    reference: RolePlacement = RolePlacement()

    def role(self, name: str) -> RolePlacement:
        """The placement of the mesh called ``name`` (hybrid: the trainer's; another: a reward mesh)."""
        name = {"hybrid": "trainer"}.get(name, name)
        return getattr(self, name) if name in ("queue", "rollout", "trainer", "reference") else self.reward

    def validate(self) -> None:
        if not 0 < self.placement_timeout_s < math.inf:
            raise ConfigError(f"`cluster.placement_timeout_s`: must be a finite number of seconds > 0, got "
                              f"{self.placement_timeout_s}")
        for role in ("queue", "rollout", "reward", "trainer", "reference"):
            bad = {k: v for k, v in getattr(self, role).resources.items() if k == "GPU" or not k or not v > 0}
            if bad:
                raise ConfigError(f"`cluster.{role}.resources`: {bad}: give Ray resource names and amounts > 0 "
                                  "(a role's GPUs come from its device settings, not from here)")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_model_dir(path: Path) -> None:
    """What the trainer and TorchEngine need of ``model.path``, checked before anything starts: the
    directory, the engine's own reading of its config and whole weight files
    (``check_checkpoint_dir``), and a tokenizer."""
    try:
        check_checkpoint_dir(str(path))
    except ValueError as exc:
        raise ConfigError(f"`model.path`: {exc}") from None
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the config alone: every prompt would be no tokens
        raise ConfigError(f"`model.path`: {path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): "
                          "save it there with tokenizer.save_pretrained")


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    algo: AlgoConfig = AlgoConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    queue: QueueConfig = QueueConfig()
    trainer: TrainerConfig = TrainerConfig()
    reshard: ReshardConfig = ReshardConfig()
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: rollout workers and trainer ranks are separate processes (and devices);
    colocated: one process per trainer rank holds the trainer and a full engine replica, which take
    turns on its device (meshrl.actors.hybrid: the KV cache is freed while training, weights are
    handed over by in-place copies)."""
    colocated: ColocatedConfig = ColocatedConfig()
    """The switch between the two modes (placement=colocated only)."""
    cluster: ClusterConfig = ClusterConfig()
    """Where the roles go on the Ray cluster's nodes: pins, packing, how long placement may take."""

    def model_positions(self) -> int:
        """The longest sequence the engine serves by default: the model's positions, at most 4096
        (TorchEngine's own default when rollout.engine.max_seq_len is 0)."""
        if self.model.path is None:
            return self.model.embedded.max_position_embeddings
        return min(ModelSpec.from_hf_config(load_hf_config(str(self.model.path))).max_position_embeddings, 4096)

    @property
    def sampler_in_rollout(self) -> bool:
        """The sampler (queue and prompt ledger) lives in the run's one rollout worker's process: its
        loops take and put there, and no queue process runs. With several workers, tensor
        parallelism or colocated workers it is an actor of its own."""
        return self.rollout.num_workers == 1 and self.rollout.tp_size == 1 and self.placement != "colocated"

    def validate(self) -> "PipelineConfig":
        """Cross-component checks; raise ConfigError naming the key."""
        if self.model.path is not None:
            _check_model_dir(Path(self.model.path))
        group = self.algo.samples_per_prompt
        if self.trainer.samples_per_step % group:
            raise ConfigError(
                f"`trainer.samples_per_step`: {self.trainer.samples_per_step} is not a multiple of "
                f"algo.samples_per_prompt={group} (groups are trained whole)"
            )
        self._validate_queue_fill()
        self._validate_run()
        every, sync = self.run.checkpoint_every, self.trainer.sync_interval
        if every < 0 or every % sync:
            raise ConfigError(f"`run.checkpoint_every`: {every} must be >= 0 and a multiple of "
                              f"trainer.sync_interval={sync} (a checkpoint follows a weight push)")
        if not self.run.stop_drain_timeout_s >= 0:
            raise ConfigError(f"`run.stop_drain_timeout_s`: must be >= 0 seconds, got {self.run.stop_drain_timeout_s}")
        if self.run.tensorboard:
            from meshrl.pipeline.metrics import tensorboard_available

            if not tensorboard_available():
                raise ConfigError("`run.tensorboard`: true, but the tensorboard package is not installed "
                                  "(pip install tensorboard), or set it to null to write scalars only when it is")
        try:
            faults.check_environment()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for key in ("max_restarts", "max_worker_restarts"):
            if not 0 <= getattr(self.run, key) <= 100:
                raise ConfigError(f"`run.{key}`: must be 0 to 100, got {getattr(self.run, key)}")
        if not (self.run.heartbeat_timeout_s == 0 or self.run.heartbeat_timeout_s >= 1):
            raise ConfigError(f"`run.heartbeat_timeout_s`: 0 (off) or at least 1 second, got {self.run.heartbeat_timeout_s:g}")
        if self.run.keep_checkpoints < 0:
            raise ConfigError(f"`run.keep_checkpoints`: must be >= 0, got {self.run.keep_checkpoints}")
        resume = self.run.resume
        if resume is not None and resume != "latest" and not (Path(resume) / "run_state.msgpack").is_file():
            raise ConfigError(f"`run.resume`: {resume} is not a run checkpoint (no run_state.msgpack); "
                              "use latest or an <output_dir>/checkpoints/step_XXXXXXXX directory")
        if self.trainer.reference_in_trainer and self.algo.kl_coef == 0:
            raise ConfigError("`trainer.reference_in_trainer`: needs algo.kl_coef > 0 (no KL term, no reference)")
        self._validate_placement()
        self.cluster.validate()
        if self.task.kind == "file" and not (self.task.train_file and self.task.test_file):
            raise ConfigError("`task.train_file`: task.kind=file needs task.train_file and task.test_file")
        if self.task.kind != "file" and (self.task.train_file or self.task.test_file):
            raise ConfigError(f"`task.kind`: task.train_file/test_file are set, but task.kind={self.task.kind} does not "
                              "read them: set task.kind=file")
        n, rows = self.algo.samples_per_prompt, self.rollout.engine.max_batch_size
        if n > rows:
            raise ConfigError(f"`rollout.engine.max_batch_size`: {rows} rows cannot hold one prompt's "
                              f"algo.samples_per_prompt={n} samples (they share its prefill): raise it")
        for key in ("train_file", "test_file"):
            path = getattr(self.task, key)
            if self.task.kind == "file" and path and not Path(path).is_file():
                raise ConfigError(f"`task.{key}`: file not found: {path}")
        return self

    def _validate_run(self) -> None:
        run = self.run
        if run.total_steps < 1:
            raise ConfigError(f"`run.total_steps`: must be >= 1, got {run.total_steps}")
        if run.eval_every < 0:
            raise ConfigError(f"`run.eval_every`: must be >= 0 (0: only before and after), got {run.eval_every}")
        if run.eval_max_new_tokens is not None and run.eval_max_new_tokens < 1:
            raise ConfigError(f"`run.eval_max_new_tokens`: must be >= 1 (or null), got {run.eval_max_new_tokens}")
        if not MIN_STEP_TIMEOUT_S <= run.step_timeout_s < math.inf:
            raise ConfigError(f"`run.step_timeout_s`: must be a finite number of seconds >= {MIN_STEP_TIMEOUT_S:g} "
                              f"(a role's start-up waits that long), got {run.step_timeout_s:g}")
        if run.num_cpus is not None and run.num_cpus < 1:
            raise ConfigError(f"`run.num_cpus`: must be >= 1 (or null: all of this machine's), got {run.num_cpus}")
        output_dir.check(run.output_dir, run.resume, run.overwrite)

    def _validate_queue_fill(self) -> None:
        """Sizes with which the queue could never fill a train batch: the run would wait out its
        timeouts and die, so they are refused here, naming the keys to change."""
        r = self.rollout.prompts_per_request * self.algo.samples_per_prompt  # one request's reservation
        spv = self.trainer.samples_per_step * self.trainer.sync_interval  # positions per policy version
        eta = self.queue.max_staleness
        sizes = (f"a request reserves rollout.prompts_per_request x algo.samples_per_prompt = {r} samples; a "
                 f"version trains trainer.samples_per_step x trainer.sync_interval = {spv}")
        if r > (eta + 1) * spv:
            raise ConfigError(f"`rollout.prompts_per_request`: {sizes}, and queue.max_staleness={eta} admits at most "
                              f"{(eta + 1) * spv} samples ahead: lower prompts_per_request or raise max_staleness")
        if spv % r and eta * spv < r - 1:
            # reservations are granted whole: with none of the slack η·spv, the ones that fit under the
            # bound stop short of the version's last samples, and the bound only moves once they are trained
            raise ConfigError(f"`rollout.prompts_per_request`: {sizes}, not a multiple of {r}, so with "
                              f"queue.max_staleness={eta} requests can never cover a whole version (the run would "
                              "wait forever): make it a multiple, or raise max_staleness")
        seq = self.rollout.engine.max_seq_len or self.model_positions()
        # a batch short of its last group, and one more request's put: less, and the put waits for room
        # that only a train step frees while the train step waits for that put
        sps, group = self.trainer.samples_per_step, self.algo.samples_per_prompt
        need = (sps - group + r) * seq
        if seq and self.queue.capacity_tokens < need:
            raise ConfigError(f"`queue.capacity_tokens`: {self.queue.capacity_tokens} cannot hold a train batch short "
                              f"of its last group (trainer.samples_per_step={sps} - algo.samples_per_prompt={group}) "
                              f"plus one request's {r} samples, of up to {seq} tokens each ({need}): a put would wait "
                              "for room only a train step frees, and the step for that put; raise it")

    def _validate_chunks(self) -> None:
        if not 0 < self.run.chunk_s < float("inf"):
            raise ConfigError(f"`run.chunk_s`: must be a positive number of seconds, got {self.run.chunk_s}")

    def _validate_sglang(self) -> None:
        engine = self.rollout.engine
        if engine.backend != "sglang":
            return
        urls, n = engine.sglang.urls, self.rollout.num_workers
        if urls and len(urls) != n:
            raise ConfigError(f"`rollout.engine.sglang.urls`: {len(urls)} server URL(s) for rollout.num_workers={n}: "
                              "give one per rollout worker")
        if engine.sglang.transport == "tensor" and (self.placement != "colocated" or self.trainer.dp != 1
                                                    or self.trainer.device != "cuda"):
            raise ConfigError("`rollout.engine.sglang.transport`: tensor hands the server CUDA IPC handles of the "
                              "trainer's memory, so the server must share the trainer's one GPU: placement=colocated, "
                              f"trainer.dp=1, trainer.device=cuda (got {self.placement}, dp={self.trainer.dp}, "
                              f"{self.trainer.device}); use transport=group")
        if self.placement == "colocated" and self.colocated.release_weights:
            raise ConfigError("`colocated.release_weights`: TorchEngine's hand-over; an SGLang server sharing the "
                              "trainer's GPU keeps its memory (size it with rollout.engine.sglang.mem_fraction_static)")
        if self.placement == "colocated" and self.colocated.overlap:
            raise ConfigError("`colocated.overlap`: TorchEngine's (one process, two CUDA streams); an SGLang server "
                              "sharing the trainer's GPU takes turns with it (release and resume its memory)")
        if engine.kv_cache_bytes:
            raise ConfigError("`rollout.engine.kv_cache_bytes`: an SGLang server sizes its KV cache itself: set "
                              "rollout.engine.sglang.mem_fraction_static instead")
        if engine.compile:
            raise ConfigError("`rollout.engine.compile`: TorchEngine's torch.compile; an SGLang server captures CUDA "
                              "graphs (rollout.engine.cuda_graphs) and takes its own flags in "
                              "rollout.engine.sglang.extra_args")

    def _validate_placement(self) -> None:
        self._validate_sglang()
        self._validate_chunks()
        tp = self.rollout.tp_size
        if tp > 1 and self.placement == "colocated":
            raise ConfigError(f"`rollout.tp_size`: placement=colocated holds one whole engine replica per trainer "
                              f"rank; use placement=disaggregated for tp_size={tp}")
        if tp > 1:
            if self.model.path is not None:
                spec = ModelSpec.from_hf_config(load_hf_config(str(self.model.path)))
                sizes = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                         "intermediate_size": spec.intermediate_size}
            else:
                e = self.model.embedded
                sizes = {k: getattr(e, k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
            bad = {k: v for k, v in sizes.items() if v % tp}
            if bad:
                raise ConfigError(f"`rollout.tp_size`: the model's {bad} do not split over tp_size={tp} ranks")
        if tp > 1 and self.reshard.apply != "staged" and self.rollout.engine.backend != "sglang":
            raise ConfigError(f"`reshard.apply`: tensor-parallel engines (rollout.tp_size={tp}) take staged updates "
                              f"only (each rank goes live at rank 0's flip), got {self.reshard.apply}")
        if self.placement != "colocated":
            for key in ("release_weights", "overlap"):
                if getattr(self.colocated, key):
                    raise ConfigError(f"`colocated.{key}`: only applies with placement=colocated")
            return
        dp, engine_device = self.trainer.dp, self.rollout.engine.device
        if self.rollout.num_workers != dp:
            raise ConfigError(f"`rollout.num_workers`: placement=colocated runs one engine per trainer rank; "
                              f"set it to trainer.dp={dp} (got {self.rollout.num_workers})")
        if self.reshard.transport != "distributed" and self.rollout.engine.backend != "sglang":
            raise ConfigError("`reshard.transport`: placement=colocated hands weights over in place; "
                              "use reshard.transport=distributed (the default)")
        if engine_device != "auto" and engine_device.startswith("cuda") != (self.trainer.device == "cuda"):
            raise ConfigError(f"`rollout.engine.device`: placement=colocated puts the engine on the trainer's device "
                              f"(trainer.device={self.trainer.device}); use auto, got {engine_device}")
        if self.colocated.release_weights and self.trainer.sync_interval != 1:
            raise ConfigError(f"`colocated.release_weights`: needs trainer.sync_interval=1 (released weights come back "
                              f"only with a push), got {self.trainer.sync_interval}")

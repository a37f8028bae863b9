"""What a run settles before its roles start: Ray, the devices and weight transport, the prompts.

``ensure_ray`` connects to a Ray cluster or starts a local one (off the caller's event loop, on a
thread that lives as long as the process); ``settle_devices`` turns ``rollout.engine.device=auto`` into a device for this
cluster and picks a weight transport both sides can use; ``check_prompts`` refuses prompts and
answers that could never fit, before the warm start and any actor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec
import ray

from meshrl.config import ConfigError
from meshrl.mesh import reaper
from meshrl.pipeline.config import PipelineConfig
from meshrl.tasks import Task
from meshrl.tasks.answers import reference_answer

__all__ = ["WORKER_ENV", "check_prompts", "check_ray_address", "ensure_ray", "reclaim_sigterm", "settle_devices", "sglang_transport"]

WORKER_ENV = {
    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


_ray_init_lock = threading.Lock()
_reaper: list[Any] = []  # the watcher of the local cluster this process started (meshrl.mesh.reaper)

PROBE_TIMEOUT_S = 10.0
"""How long the TCP probe of a named cluster's address may take before the run stops at start."""
ATTACH_TIMEOUT_S = 60.0
"""Longest wait for ``ray.init`` to attach to a cluster whose address answers."""


def check_ray_address(address: str | None) -> None:
    """Refuse, in one line naming it, the cluster address a run would attach to (``address``: run.ray_address,
    else ``RAY_ADDRESS``) if it is not one, or if nothing answers there within ``PROBE_TIMEOUT_S``
    (``ray.init`` would wait minutes for it); ``auto``, ``local`` and none pass (Ray's own rules)."""
    named = address or os.environ.get("RAY_ADDRESS", "").strip()
    key = "run.ray_address" if address else "RAY_ADDRESS"
    if not named or named in ("auto", "local"):
        return
    host, sep, port = named.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"`{key}`: {named!r} is not a Ray cluster address: give its head's host:port (e.g. "
                          "10.0.0.1:6379, what `ray start --head` printed), ray://host:10001 for Ray Client, or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        why = exc.strerror or ("no answer within %gs" % PROBE_TIMEOUT_S if isinstance(exc, TimeoutError) else type(exc).__name__)
        raise ConfigError(f"`{key}`: nothing answers at {named} ({why}): start the cluster there (ray start --head), "
                          f"or unset {key} to start a local one") from None


def ensure_ray(num_cpus: int | None, address: str | None = None) -> str:
    """Connect to a Ray cluster, or start a local one; returns a line saying which (its address,
    nodes, CPUs and GPUs).

    ``address`` (``run.ray_address``) names a cluster; without it Ray's rules decide: ``RAY_ADDRESS``,
    else a cluster ``ray start`` left on this machine, else a new local cluster of ``num_cpus``.
    An existing cluster takes none of a new one's settings (CPUs, system config); what every worker
    needs travels in the job's runtime_env: meshrl's worker variables, and the directory meshrl is
    imported from on ``PYTHONPATH`` (for raylets whose environment lacks it).

    Thread-safe: the pipeline calls it off its event loop (``ray.init`` takes seconds), and two
    pipelines may at once. Off the main thread, Ray is started on a thread that lives as long as the
    process: Ray's GCS and raylet die with the *thread* that started them (Linux's parent-death
    signal), and an executor's thread ends with its ``asyncio.run``, which killed the cluster under
    the next run of the program."""
    with _ray_init_lock:
        if ray.is_initialized():
            return _cluster_line("connected to")
        check_ray_address(address)
        attaching = bool(address or os.environ.get("RAY_ADDRESS"))
        if threading.current_thread() is threading.main_thread() and not attaching:
            return _cluster_line(_ray_init(num_cpus, address))
        started: list[Any] = []
        ready = threading.Event()

        def owner() -> None:
            try:
                started.append(_ray_init(num_cpus, address))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                started.append(exc)
            ready.set()
            if not isinstance(started[0], BaseException):
                threading.Event().wait()  # the cluster's processes live while this thread does

        threading.Thread(target=owner, name="meshrl-ray", daemon=True).start()
        # waits for: ray.init; unblocked by: the cluster (an attach whose address answered is bounded)
        if not ready.wait(ATTACH_TIMEOUT_S if attaching else None):
            named = address or os.environ.get("RAY_ADDRESS")
            raise TimeoutError(f"ray.init did not attach to the Ray cluster at {named} within {ATTACH_TIMEOUT_S:g}s "
                               "(its port answers; is it a Ray head's GCS port?)")
        if isinstance(started[0], BaseException):
            raise started[0]
        return _cluster_line(started[0])


def reclaim_sigterm() -> None:
    """Give SIGTERM back to this program's own Python handler, if it has one (call on the main thread,
    after ``ensure_ray``).

    A driver's Ray core worker installs abseil's failure handler for SIGTERM over the program's: it
    prints a stack trace, calls the program's handler, and aborts the process 3 seconds later
    whatever that handler started (a clean stop takes longer: the steps in flight, a checkpoint,
    the export). A program without a handler of its own keeps Ray's."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)


def _cluster_line(how: str) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    address = ray.get_runtime_context().gcs_address
    return (f"ray: {how} {address}: {len(nodes)} node(s), {int(res.get('CPU', 0))} CPUs, "
            f"{int(res.get('GPU', 0))} GPUs")


def _ray_init(num_cpus: int | None, address: str | None) -> str:
    os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
    env = worker_env()
    for key in _job_env_vars():  # `ray job submit --runtime-env-json`: the job's own settings win
        env.pop(key, None)
    common: dict[str, Any] = {"logging_level": logging.WARNING, "runtime_env": {"env_vars": env}}
    with _quiet_sigterm_warning():  # off the main thread Ray leaves SIGTERM alone and says so
        if address is None:
            try:
                # the processes of a cluster started here carry its mark, and ignore a terminal's hang-up
                # (Ray blocks SIGINT in them, not SIGHUP: a closed terminal killed the cluster under the
                # run's clean stop); a thread's blocked signals are its children's
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
                try:
                    with reaper.marked() as token:
                        ray.init(
                            num_cpus=num_cpus, include_dashboard=False, **common,
                            # Batches of small samples stay out of the shared-memory store (about +30% queue speed).
                            _system_config={"max_direct_call_object_size": 1 << 20},
                        )
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                if _started_here():  # they end with this process, however it ends
                    session = ray._private.worker._global_node.get_session_dir_path()
                    _reaper.append(reaper.start(token, session))
                return "started"
            except ValueError as exc:  # RAY_ADDRESS or a `ray start` cluster: Ray connects to it
                if "existing cluster" not in str(exc):
                    raise
        if "PYTHONPATH" not in _job_env_vars():
            env["PYTHONPATH"] = _worker_pythonpath()
        ray.init(address=address, **common)
        return "attached to"


def _started_here() -> bool:
    """Whether the cluster ``ray.init`` just joined is one it started (its head processes are this
    process's), not one it found."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "head", False))  # a driver that attached holds a connect-only, non-head node


def _job_env_vars() -> dict[str, str]:
    """The env_vars of the runtime_env a job was submitted with (``ray job submit`` puts the job's
    config in the driver's environment; Ray refuses a ``ray.init`` runtime_env that sets one of
    the same variables)."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


PASSED_THROUGH = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                  "NVSHMEM_DISABLE_NVLS", "NCCL_CUMEM_ENABLE", "MESHRL_CPU_BF16")
"""Driver variables every worker gets as they are (a raylet started by ``ray start`` elsewhere has
an environment of its own): the network interfaces of the process groups, the NVLink switches, and
whether CPUs compute in bf16 (``meshrl.cpu``)."""


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The job's ``env_vars``: meshrl's worker variables and the driver's PASSED_THROUGH ones."""
    environ = os.environ if environ is None else environ
    return {**WORKER_ENV, **{k: environ[k] for k in PASSED_THROUGH if k in environ}}


def _worker_pythonpath() -> str:
    """The directory meshrl is imported from, then the driver's PYTHONPATH."""
    import meshrl

    root = os.path.dirname(os.path.dirname(os.path.abspath(meshrl.__file__)))
    return os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


@contextlib.contextmanager
def _quiet_sigterm_warning():
    def drop(record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()

    worker_log = logging.getLogger("ray._private.worker")
    worker_log.addFilter(drop)
    try:
        yield
    finally:
        worker_log.removeFilter(drop)


def check_prompts(cfg: PipelineConfig, task: Task, *, reward: Any = None, environment: Any = None,
                  echo: Callable[[str], None] = print) -> None:
    """Prompts that leave no room for their completion in the engine's max_seq_len (or encode to
    nothing) fail the run at start, naming the keys, not as an engine error after the roles start;
    every prompt is tokenized (a prompt short in characters may be long in tokens). Answers longer
    than the completions may be (the task's own reward matches them whole) are reported: all of
    them fail the run, some print a warning."""
    if environment is not None:  # episodes grow turn by turn: rollout.episode bounds them
        return
    if cfg.model.path is None:
        from meshrl.embedded.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    if cfg.model.path is None:
        from meshrl.embedded.tokenizer import CHARACTERS

        known, unknown = set(CHARACTERS), set()
        for split in ("train", "test"):
            for p in task.split(split):
                unknown.update(set(p.prompt) - known, set(p.answer) - known)
        if unknown:  # they would be <unk>: an answer holding one could never be matched
            raise ConfigError(f"`model.path`: the task uses characters the embedded default's tokenizer does not "
                              f"have ({''.join(sorted(unknown))[:20]!r}; it has printable ASCII): use --model DIR "
                              "with a tokenizer that covers them")
    seq = cfg.rollout.engine.max_seq_len or cfg.model_positions()  # TorchEngine's own default
    eval_key = "run.eval_max_new_tokens" if cfg.run.eval_max_new_tokens else "rollout.max_new_tokens"
    for split, new_key, new in (("train", "rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                                ("test", eval_key, cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens)):
        problems = task.split(split)
        if not problems:
            continue
        lengths = _token_counts(tokenizer, [p.prompt for p in problems], special=True)
        if reward is None:  # the task's reward: an answer longer than a completion is never matched
            mode = getattr(task, "reward_mode", "exact")  # only its final answer, for an answer field with a solution
            finals = [reference_answer(mode, p.answer) for p in problems]
            answers = _token_counts(tokenizer, finals, special=False)
            long = [i for i, k in enumerate(answers) if k > new]
            if long:
                a = finals[long[0]]
                what = (f"{len(long)} of the {len(problems)} {split} answers are longer than {new_key}={new} tokens "
                        f"(e.g. {a[:40]!r}: {answers[long[0]]} tokens), so the task's reward can never match them")
                if len(long) == len(problems):
                    raise ConfigError(f"`{new_key}`: {what}: raise it")
                echo(f"warning: {what}; raise {new_key} to {'train on' if split == 'train' else 'score'} them")
        if 0 in lengths:
            p = problems[lengths.index(0)]
            raise ConfigError(f"`model.path`: its tokenizer encodes the {split} prompt {p.prompt[:60]!r} to no "
                              "tokens: is it the model's own tokenizer?")
        n = max(lengths)
        if n + new > seq:
            p, over = problems[lengths.index(n)], sum(k + new > seq for k in lengths)
            raise ConfigError(f"`{new_key}`: {over} {split} prompt(s) leave no room for {new} new tokens in the "
                              f"engine's max_seq_len={seq} (rollout.engine.max_seq_len, or the model's positions), "
                              f"the longest {p.prompt[:60]!r} with {n} tokens: shorten the prompts, lower "
                              f"{new_key}, or raise rollout.engine.max_seq_len")


def _token_counts(tokenizer: Any, texts: list[str], *, special: bool) -> list[int]:
    """Tokens per text, as ``tokenizer(texts)`` counts them; a fast tokenizer's Rust backend is asked
    directly (transformers' per-encoding wrapping took 2.4 of 3.5 s for 100k prompts)."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=special)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def _check_gpus(cfg: PipelineConfig, gpus: int, trainer: int) -> None:
    """Refuse CUDA roles the cluster cannot place (Ray would wait for the GPUs forever)."""
    engines = 0
    if cfg.placement != "colocated" and cfg.rollout.engine.device.startswith("cuda"):
        engines = cfg.rollout.num_workers * cfg.rollout.tp_size
    if trainer + engines <= gpus:
        return
    key = "trainer.device" if trainer > gpus or not engines else "rollout.engine.device"
    wants = " and ".join(w for w in (f"{trainer} for the trainer (trainer.dp)" if trainer else "",
                                     f"{engines} for the engines (rollout.num_workers x rollout.tp_size)" if engines else "")
                         if w)
    raise ConfigError(f"`{key}`: cuda needs {wants}, but the Ray cluster has {gpus} GPU(s): use cpu, or run where "
                      "the GPUs are (on a GPU machine, or attached to a cluster that has them)")


def _check_sglang_device(engine: Any, gpus: int) -> None:
    launcher = engine.sglang.command[1:] == ("-m", "sglang.launch_server")
    if launcher and not engine.sglang.urls and not engine.device.startswith("cuda"):
        raise ConfigError(f"`rollout.engine.device`: {engine.device} (the cluster has {gpus} GPU(s)), but SGLang "
                          "servers run on GPUs: run where the GPUs are, or give rollout.engine.sglang.urls of "
                          "running servers")


def colocated_mem_fraction(cfg: PipelineConfig, parameters: int, device_bytes: int, model: Any) -> float:
    """The GPU memory fraction an SGLang server may take beside a trainer rank on its device
    (--mem-fraction-static: its weights and KV cache): what is left after the trainer's peak and
    the server's own working memory, estimated from the sizes, at most 0.85 and at least 0.05.

    The trainer holds fp32 weights, gradients and AdamW's two moments (16 bytes a parameter, over
    its dp ranks) plus the bf16 weights it gathers (2 bytes), and at the peak of a micro-batch
    one chunk of the LM head's logits (``modeling.head_logprobs``: at most
    ``HEAD_CHUNK_ELEMENTS`` of them, about 20 bytes each in its backward) and the layers'
    activations (about 56 bytes per hidden unit per layer and token, eager; compiled layers need less). The server needs about 8 GiB outside its static pool (CUDA graphs,
    a decode batch's activations and logits), and CUDA and the allocators 4 GiB of slack.
    Measured on an H200 (bench/RESULTS.md): at 0.5B the chunked head's trainer peaked at 31.3 GiB
    with micro-batches of 12,288 tokens and 42.1 GiB with one of 24,576 (eager layers); before
    the chunked head it passed 53 GiB at 16,384, and a server given 0.62 ran it out of memory."""
    static = parameters * (16 / max(1, cfg.trainer.dp) + 2)
    tokens = cfg.trainer.tokens_per_microbatch
    from meshrl.modeling import HEAD_CHUNK_ELEMENTS

    logits = min(tokens * int(model.vocab_size), HEAD_CHUNK_ELEMENTS) * 20
    activations = logits + tokens * 56 * int(model.hidden_size) * int(model.num_hidden_layers)
    left = (device_bytes - static - activations - 12 * 2**30) / device_bytes
    return round(min(0.85, max(0.05, left)), 3)


def sglang_transport(cfg: PipelineConfig) -> str:
    """How the trainer's pushes reach the SGLang servers: "tensor" (CUDA IPC handles through
    /update_weights_from_tensor: a server on the trainer's one GPU), else the backend of SGLang's
    weight-update group: nccl between distinct GPUs; gloo when a server shares the trainer's GPU
    (NCCL refuses two ranks on one device) or either side is on a CPU."""
    s = cfg.rollout.engine.sglang
    shared_gpu = (cfg.placement == "colocated" and cfg.trainer.dp == 1 and cfg.trainer.device == "cuda"
                  and cfg.rollout.engine.device.startswith("cuda"))
    if s.transport == "tensor" or (s.transport == "auto" and shared_gpu):
        return "tensor"
    chosen = s.group_backend
    if chosen != "auto":
        return chosen
    cuda = cfg.trainer.device == "cuda" and cfg.rollout.engine.device.startswith("cuda")
    return "nccl" if cuda and cfg.placement != "colocated" else "gloo"


def sglang_weight_dtype(cfg: PipelineConfig, hf_config: Any) -> str:
    """The dtype launched SGLang servers hold the weights in, when meshrl knows it: the ``--dtype``
    it passed (``rollout.engine.dtype``), or with ``auto`` the checkpoint's own dtype where it is
    16-bit (SGLang takes that as it is). "" otherwise, and for attached servers: the trainer's
    tensors go out as they are and the server casts them."""
    if cfg.rollout.engine.sglang.urls:
        return ""  # attached: launched with a --dtype meshrl did not choose
    if cfg.rollout.engine.dtype != "auto":
        return cfg.rollout.engine.dtype
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else ""
    return name if name in ("bfloat16", "float16") else ""


def settle_devices(cfg: PipelineConfig, echo: Callable[[str], None] = print) -> PipelineConfig:
    """``cfg`` with the engines' ``device=auto`` settled for the cluster, and a weight transport
    both sides can use (placement=disaggregated; colocated engines share the trainer's device).

    An engine actor sees no GPU unless it asks Ray for one, so "CUDA when available" is decided
    here: cuda when the cluster has a GPU for every engine rank besides the trainer's, else cpu.
    The distributed transport's group takes NCCL on a CUDA side and gloo on a CPU side, and a
    group needs one backend: with the trainer and the engines on different kinds of device the
    weights go through Ray's object store instead. Each choice is said.

    CUDA asked for where the cluster has too few GPUs fails here, naming the key: the cluster
    decides, not the driver's machine (its nodes may have GPUs the driver lacks)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    trainer = cfg.trainer.dp if cfg.trainer.device == "cuda" else 0
    _check_gpus(cfg, gpus, trainer)
    engine, reshard = cfg.rollout.engine, cfg.reshard
    if cfg.placement == "colocated":
        if engine.backend == "sglang":
            if engine.device == "auto":  # each server shares its trainer rank's device
                engine = msgspec.structs.replace(engine, device=cfg.trainer.device)
                cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, engine=engine))
            _check_sglang_device(engine, gpus)
        return cfg
    if engine.device == "auto":
        need = cfg.rollout.num_workers * cfg.rollout.tp_size
        device = "cuda" if gpus and gpus >= trainer + need else "cpu"
        if gpus:
            echo(f"rollout.engine.device=auto: {device} (the cluster has {gpus} GPU(s); the engines need "
                 f"{need}" + (f" besides the trainer's {trainer}" if trainer else "") + ")")
        engine = msgspec.structs.replace(engine, device=device)
    sides = {cfg.trainer.device, "cuda" if engine.device.startswith("cuda") else "cpu"}
    if engine.backend == "sglang":  # weights travel over SGLang's own group (sglang_transport), not reshard
        _check_sglang_device(engine, gpus)
    elif reshard.transport == "distributed" and reshard.backend == "auto" and len(sides) > 1:
        if cfg.rollout.tp_size > 1:
            raise ConfigError(f"`reshard.transport`: the trainer is on {cfg.trainer.device} and the tensor-parallel "
                              f"engines on {engine.device}: put both on cuda (rollout.engine.device=cuda)")
        echo(f"reshard.transport: object_store (the trainer is on {cfg.trainer.device}, the engines on "
             f"{engine.device}: one process group cannot join NCCL and gloo)")
        reshard = msgspec.structs.replace(reshard, transport="object_store")
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, engine=engine), reshard=reshard)


async def start_sglang_servers(cfg: PipelineConfig, rollouts: Any, trainer: Any, model_dir: str, out_dir: Path,
                               echo: Callable[[str], None] = print, *, kept: bool = False) -> None:
    """``backend=sglang``: every worker's server up and healthy, and trainer rank 0 in the
    servers' weight-update group (meshrl.actors.sglang_sync). ``kept``: the workers and their
    servers outlived a failed attempt (run.warm_resume, meshrl.pipeline.processes)."""
    from meshrl.engines.weights import load_hf_config
    from meshrl.mesh import actor_address

    s, logs, hf_config = cfg.rollout.engine.sglang, out_dir / "sglang", load_hf_config(model_dir)
    first = trainer.slice(**{d: 0 for d in trainer.sizes})
    trainer_ip, _ = await actor_address(first).within(60)
    fraction = None
    if cfg.placement == "colocated" and s.mem_fraction_static is None and cfg.trainer.device == "cuda":
        parameters, device_bytes = await first.device_memory.call_one().within(60)
        fraction = colocated_mem_fraction(cfg, parameters, device_bytes, hf_config)
        echo(f"sglang: each server shares its GPU with a trainer rank: --mem-fraction-static {fraction} "
             f"(what the trainer's estimated peak leaves of {device_bytes / 2**30:.0f} GiB; "
             "rollout.engine.sglang.mem_fraction_static sets it)")
    # waits for: every server's /health (a first start JIT-compiles kernels); unblocked by: the servers
    urls = (await rollouts.start_sglang.call(str(logs), trainer_ip, fraction).within(s.startup_timeout_s + 60)).values()
    where = ("kept from the failed attempt" if kept else "attached" if s.urls else f"launched, logs in {logs}")
    backend, dtype = sglang_transport(cfg), sglang_weight_dtype(cfg, hf_config)
    how = "by CUDA IPC (update_weights_from_tensor)" if backend == "tensor" else f"over a {backend} group"
    echo(f"sglang: {len(urls)} server(s) ({where}): {', '.join(urls)}; weights {how}"
         + (f", sent as {dtype}" if dtype else ""))
    await trainer.sglang_connect.call(list(urls), s.bucket_bytes, backend, s.pause_mode, cfg.reshard.timeout_s,
                                      s.request_timeout_s, dtype, kept).within(cfg.reshard.timeout_s + 30)

"""The trainer's side of SGLang's ``update_weights_from_distributed``, in the order the protocol
(``shared/SGLANG_PROTOCOL.md``) requires.

The trainer is rank 0 of a group built SGLang's way (``join_process_group``: tcp rendezvous,
``PrefixStore(group_name)``); engine i with ``tp_size = N_i`` joins at ``rank_offset = 1 + sum of
the N before it``. Full, Hugging Face-named tensors travel by broadcast from rank 0:

```text
connect:  GET /get_server_info on every engine (version, tp_size, dp_size == 1)
          POST /init_weights_update_group to every engine, NOT waiting for the replies,
          join the group as rank 0 (in a thread), then collect the replies; if any part
          fails, POST /destroy_weights_update_group to every engine that did not refuse
push v:   POST /pause_generation {mode}            every engine; mode abort is sent as retract,
            then POST /abort_request {abort_all}   where the server takes a retract (no 1 s wait)
          POST /begin_weight_update {selector}     0.5.21+
          per bucket (one in flight): POST /update_weights_from_distributed {names, dtypes,
            shapes, flush_cache: false, weight_version on the last} to every engine, then
            broadcast each tensor in exactly the names order, then wait for every reply
          POST /flush_cache until it is not 400    (bounded retries; once with an in_place or retract pause)
          POST /end_weight_update {}               0.5.21+
          POST /continue_generation {}
close:    POST /destroy_weights_update_group       0.5.10+; then destroy our group
```

A trainer that connects to engines which outlived the one before it (``connect(reset=True)``,
run.warm_resume) first destroys that trainer's group on them (0.5.10+): an engine still holding it
refuses a new one ("group already exists").

0.4.x takes one ``name``/``dtype``/``shape`` per call; ``load_format: "flattened_bucket"``
(0.5.10+, opt-in) broadcasts one uint8 tensor per bucket, each tensor's bytes at an offset aligned
to its dtype's size. ``rotary_emb.inv_freq`` is never sent; ``lm_head.weight`` is skipped when it
is the embedding's own storage (tied). The broadcast runs in a worker thread so the event loop
keeps sending the requests and reading the replies while rank 0 sits in the collective.

A failed push raises ``SGLangPushError`` and leaves the engines **paused**: SGLang loads in place,
so its weights may be a mix of versions, and a paused engine never generates from a mix; push
again to recover (a full push overwrites everything). An update opened by ``/begin_weight_update``
is closed (``/end_weight_update``, best effort) before the error is raised, so the next push can
open its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import weakref
from typing import Any, Iterable, Iterator, Literal, Protocol, Sequence

import msgspec
import torch

from meshrl.reshard.push import PushStats

_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)
_REASON_WAIT_S = 5.0
"""How long a failed broadcast waits for the engines' replies, which say why they did not receive."""


class SGLangEndpoint(Protocol):
    """One SGLang server's HTTP surface (``meshrl.engines.SGLangEngine`` provides it)."""

    @property
    def name(self) -> str: ...

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> tuple[int, Any]: ...


class SGLangSyncConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the trainer pushes weights to SGLang engines."""

    bucket_bytes: int = 512 * 2**20
    """Most bytes per update call (a tensor larger than this goes alone)."""
    group_name: str = "weight_update_group"
    """SGLang's group name (the store prefix both sides use)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """Group backend; gloo on CPU (tests against the TorchEngine server)."""
    master_address: str = ""
    """Address the engines reach this process at; empty: 127.0.0.1 for local engines, else this node's IP."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How generation pauses for an update (abort is what slime and AReaL use). in_place and retract
    keep the paused requests (retract puts them back in the waiting queue), so the cache cannot be
    flushed while they exist (/flush_cache answers 400 while requests run or wait): the push flushes
    once if it can and goes on (their KV, and SGLang's radix cache, keep entries from the old
    weights; retracted requests recompute theirs with the new ones)."""
    transport: Literal["group", "tensor"] = "group"
    """group: /update_weights_from_distributed, tensors broadcast over the group. tensor:
    /update_weights_from_tensor with CUDA IPC handles of the (CUDA) tensors, for servers on this
    process's GPU with tp_size 1: they load straight from our memory, no group, no copy."""
    dtype: str = ""
    """Floating-point tensors go out in this dtype (the one the servers hold their weights in, e.g.
    "bfloat16"); empty: as the trainer holds them. The servers cast on load either way, so this only
    saves bytes: half of them for fp32 master weights."""
    flattened_bucket: bool = False
    """Send each bucket as one uint8 tensor (load_format 'flattened_bucket', SGLang 0.5.10+)."""
    timeout_s: float = 600.0
    """Bound on the group rendezvous, each bucket (request + broadcast + replies) and each control call."""
    flush_retries: int = 40
    """Attempts at /flush_cache while it answers 400 (requests still running)."""
    flush_retry_s: float = 0.25
    """Seconds between flush attempts."""

    def __post_init__(self) -> None:
        if self.dtype not in ("", "bfloat16", "float16", "float32"):
            raise ValueError(f"SGLangSyncConfig.dtype: {self.dtype!r} is not one of '', 'bfloat16', 'float16', 'float32'")


class SGLangPushError(RuntimeError):
    """A push to SGLang engines failed; they stay paused (see the module docstring)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.5.23"``, ``"0.4.6.post5"``, ``"0.5.10rc1"`` -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise ValueError(f"cannot read an SGLang version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors, at most ``bucket_bytes`` per bucket (a bigger tensor alone); lazily."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor: each tensor's bytes in order, each offset aligned to its element size."""
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // t.element_size()) * t.element_size()
        offsets.append(total)
        total += t.numel() * t.element_size()
    flat = torch.zeros(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for t, off in zip(tensors, offsets):
        flat[off: off + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
    return flat


class _CudaHandle:
    """Pickles as torch's CUDA IPC rebuild of ``tensor``, its device named by UUID (what SGLang's
    patched ``rebuild_cuda_tensor`` takes, so the server finds the GPU whatever its own numbering)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.tensor)
        device = args[6]  # rebuild_cuda_tensor's storage_device
        return rebuild, (*args[:6], str(torch.cuda.get_device_properties(device).uuid), *args[7:])


def ipc_payload(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``serialized_named_tensors[rank]`` of /update_weights_from_tensor: base64 of the pickled
    ``[(name, tensor), ...]``, each CUDA tensor as an IPC handle (SGLang's MultiprocessingSerializer
    reads it with an unpickler that admits torch's rebuild functions)."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps([(name, _CudaHandle(t)) for name, t in named])).decode()


def _failure(reply: tuple[int, Any] | BaseException) -> str:
    """Why an engine's reply is a failure ("" when it is not): an exception, an HTTP error or success=false."""
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    if reply[0] != 200 or (isinstance(reply[1], dict) and reply[1].get("success") is False):
        return f"HTTP {reply[0]} {reply[1]!r}"[:2000]
    return ""


class SGLangWeightSender:
    """Rank 0 of the weight-update group: pushes full HF-named tensors to SGLang engines."""

    def __init__(self, engines: Sequence[SGLangEndpoint], config: SGLangSyncConfig = SGLangSyncConfig()):
        if not engines:
            raise ValueError("SGLangWeightSender needs at least one engine")
        self.engines, self.config = list(engines), config
        self.versions: list[tuple[int, int, int]] = []
        self.group: Any = None
        self._retracts: list[bool] = []
        """Per engine: whether an abort-mode pause is sent as retract + abort all (``_pause``; set by ``connect``)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.config.backend == "nccl" else torch.device("cpu")

    async def _all(self, method: str, path: str, bodies: Sequence[dict[str, Any] | None], what: str,
                   engines: Sequence[int] | None = None) -> list[Any]:
        """The same call on several engines at once; raises naming every engine that failed."""
        idx = list(range(len(self.engines))) if engines is None else list(engines)
        replies = await self._each(method, path, bodies, idx)
        bad = [f"{self.engines[i].name}: {why}" for i, r in zip(idx, replies) if (why := _failure(r))]
        if bad:
            raise SGLangPushError(f"{what} ({path}) failed on {len(bad)} of {len(idx)} engines: " + "; ".join(bad))
        return [r[1] for r in replies]

    async def _each(self, method: str, path: str, bodies: Sequence[dict[str, Any] | None],
                    idx: Sequence[int]) -> list[tuple[int, Any] | BaseException]:
        """Each engine's reply, or the exception its request raised."""
        return await asyncio.gather(*(self.engines[i].request(method, path, bodies[k], timeout_s=self.config.timeout_s)
                                      for k, i in enumerate(idx)), return_exceptions=True)

    def _master_address(self) -> str:
        if self.config.master_address:
            return self.config.master_address
        hosts = {re.sub(r"^\w+://", "", e.name).split("/")[0].rsplit(":", 1)[0] for e in self.engines}
        if hosts <= {"127.0.0.1", "localhost", "in-process"}:
            return "127.0.0.1"
        from meshrl.groups import routable_ip

        return routable_ip()

    async def connect(self, *, reset: bool = False) -> None:
        """Read every engine's version, then build the group (once). ``reset``: the engines outlived
        the trainer that joined them (run.warm_resume) and may still hold its group: destroy it first."""
        if self.group is not None:
            return
        from meshrl.groups import free_port, join_process_group

        infos = await self._all("GET", "/get_server_info", [None] * len(self.engines), "version detection")
        self.versions = [parse_version(i.get("version", "0")) for i in infos]
        self._retracts = [v >= (0, 5, 10) for v in self.versions]
        if self.config.transport == "tensor":
            shared = [e.name for e, i in zip(self.engines, infos) if int(i.get("tp_size", 1)) != 1 or int(i.get("dp_size", 1)) != 1]
            if shared:
                raise SGLangPushError(f"engines {shared} run tp_size or dp_size > 1: transport=tensor hands one "
                                      "server on this GPU our CUDA memory; use transport=group")
            self.group = "ipc"  # nothing to join: each push hands the servers handles to our memory
            return
        if reset:
            await self._destroy_stale()
        if self.config.flattened_bucket and min(self.versions) < (0, 5, 10):
            raise SGLangPushError(f"flattened_bucket needs SGLang 0.5.10+, engines report {self.versions}")
        sizes = [int(i.get("tp_size", 1)) for i in infos]
        multi_dp = [e.name for e, i in zip(self.engines, infos) if int(i.get("dp_size", 1)) != 1]
        if multi_dp:
            raise SGLangPushError(f"engines {multi_dp} run dp_size > 1: start one engine per data-parallel replica")
        world, offsets = 1 + sum(sizes), [1 + sum(sizes[:i]) for i in range(len(sizes))]
        addr, port, cfg = self._master_address(), free_port(), self.config
        bodies = [{"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                   "group_name": cfg.group_name, "backend": cfg.backend} for off in offsets]
        # Send the requests without waiting: the engines join while we join; waiting first deadlocks.
        everyone = range(len(self.engines))
        replies = asyncio.ensure_future(self._each("POST", "/init_weights_update_group", bodies, everyone))
        from meshrl.threads import in_thread

        def destroy_late(group: Any) -> None:  # joined after this connect gave up: nobody uses it
            import torch.distributed as dist

            dist.destroy_process_group(group)

        # a daemon thread, not the loop's executor: after a refusal it waits out its rendezvous alone,
        # and asyncio.run's exit does not wait for it
        join = asyncio.ensure_future(in_thread(
            join_process_group, cfg.group_name, 0, world, addr, port, cfg.backend, cfg.timeout_s,
            timeout_s=cfg.timeout_s + 5, what=f"joining SGLang's weight-update group {cfg.group_name!r}",
            late=destroy_late))
        try:
            # an engine that refuses at once (e.g. it still holds the group of a trainer that died) ends
            # the wait now, with its reason, not after the rendezvous' timeout_s
            await asyncio.wait({join, replies}, return_when=asyncio.FIRST_COMPLETED)
            if replies.done() and not join.done():
                refused = [f"{self.engines[i].name}: {why}" for i, r in zip(everyone, replies.result())
                           if (why := _failure(r))]
                if refused:
                    raise SGLangPushError(f"group init (/init_weights_update_group) refused by {len(refused)} of "
                                          f"{len(self.engines)} engines: " + "; ".join(refused))
            self.group = await join
            bad = [f"{self.engines[i].name}: {why}" for i, r in zip(everyone, await replies) if (why := _failure(r))]
            if bad:
                raise SGLangPushError(f"group init (/init_weights_update_group) failed on {len(bad)} of "
                                      f"{len(self.engines)} engines: " + "; ".join(bad))
        except BaseException:  # the group is unusable: nobody may keep a part of it
            if not join.done():  # its thread waits out its rendezvous alone, then fails
                join.cancel()
            await self._leave_joined(replies)
            if self.group is not None:
                import torch.distributed as dist

                dist.destroy_process_group(self.group)
                self.group = None
            raise

    async def _leave_joined(self, replies: asyncio.Future) -> None:
        """After a failed connect, destroy the group on every engine that may hold it: all but those that
        answered a refusal. NCCL's lazy init answers success before the rendezvous, and a reply lost to a
        timeout may follow a join; an engine left holding the group refuses every later connect with
        "group already exists". Best effort, bounded by ``_REASON_WAIT_S`` for the replies."""
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(replies), _REASON_WAIT_S)
        results = replies.result() if replies.done() and not replies.cancelled() else [None] * len(self.engines)
        replies.cancel()
        refused = {i for i, r in enumerate(results) if isinstance(r, tuple) and _failure(r)}
        await self._destroy_on([i for i, v in enumerate(self.versions) if v >= (0, 5, 10) and i not in refused])

    async def _destroy_on(self, idx: Sequence[int]) -> None:
        """POST /destroy_weights_update_group to engines ``idx``, best effort: the answers (the group
        existed or not) are not read."""
        if idx:
            await self._each("POST", "/destroy_weights_update_group", [{"group_name": self.config.group_name}] * len(idx), idx)

    async def _destroy_stale(self) -> None:
        """Destroy the group on every engine (``_destroy_on``); an engine older than 0.5.10 has no such
        call and would refuse the new group. 0.5.21+: first /end_weight_update, closing an update the
        dead trainer left open (the next /begin_weight_update would be refused)."""
        old = [self.engines[i].name for i, v in enumerate(self.versions) if v < (0, 5, 10)]
        if old:
            raise SGLangPushError(f"engines {old} outlived the trainer that joined them (run.warm_resume) and run "
                                  "SGLang < 0.5.10, which cannot destroy its weight-update group: set "
                                  "run.warm_resume=false to start them again with the trainer")
        if begun := [i for i, v in enumerate(self.versions) if v >= (0, 5, 21)]:
            await self._each("POST", "/end_weight_update", [{}] * len(begun), begun)  # answers not read either
        await self._destroy_on(range(len(self.engines)))

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        """Pause, send every tensor, flush, resume: the engines serve ``version`` afterwards."""
        await self.connect()
        start, cfg, everyone = time.perf_counter(), self.config, range(len(self.engines))
        single = any(v < (0, 5, 0) for v in self.versions)  # 0.4.x: one tensor per call
        buckets = _buckets(self._cast(self._select(named_tensors)), 0 if single else cfg.bucket_bytes)
        begin = [i for i, v in enumerate(self.versions) if v >= (0, 5, 21)]
        nbytes, opened = 0, False
        send = self._send_tensors if cfg.transport == "tensor" else self._send_bucket
        phases: dict[str, float] = {}
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark
            mark = now

        try:
            await self._pause()
            if begin:
                opened = True
                await self._all("POST", "/begin_weight_update", [{"selector": "all"} for _ in begin], "begin", begin)
            lap("pause_s")
            # One bucket of lookahead: the last one carries weight_version. Tensors are read lazily,
            # so a trainer may gather them bucket by bucket (FSDP2 full_tensor) as they are sent.
            bucket, b = next(buckets, None), 0
            lap("gather_s")
            while bucket is not None:
                following = next(buckets, None)
                lap("gather_s")
                nbytes += await send(bucket, None if following else str(version), b)
                lap("send_s")
                bucket, b = following, b + 1
            await self._flush(required=cfg.pause_mode == "abort")  # kept requests refuse a flush
            if begin:
                await self._all("POST", "/end_weight_update", [{} for _ in begin], "end", begin)
            lap("flush_s")
        except Exception as exc:
            if opened:  # close the update, or the next push's /begin_weight_update is refused and none recovers
                with contextlib.suppress(Exception):
                    await self._all("POST", "/end_weight_update", [{} for _ in begin], "end after a failure", begin)
            raise SGLangPushError(f"push of v{version} failed: {exc}; the engines stay paused (SGLang loads in "
                                  "place, so their weights may mix versions): push again") from exc
        await self._all("POST", "/continue_generation", [{} for _ in everyone], "continue")
        lap("continue_s")
        return PushStats(version=version, seconds=time.perf_counter() - start, bytes=nbytes, phases=phases)

    def _cast(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Floating-point tensors in ``config.dtype`` (after ``_select``: a cast copy has a storage of its own)."""
        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        for name, t in named:
            yield name, (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t)

    @staticmethod
    def _select(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop RoPE buffers, and ``lm_head.weight`` when it shares the embedding's storage (tied).

        Shared means the same address *while the embedding is alive*: a lazily gathered embedding is
        freed once its bucket is sent, and an untied ``lm_head`` gathered next often lands at its
        address (a weak reference tells the two apart). Sending a tied head is harmless (engines
        skip it); skipping an untied one would leave the engine's old head."""
        embed: weakref.ref | None = None
        for name, t in named:
            if name == "model.embed_tokens.weight":
                embed = weakref.ref(t)
            if name.endswith(_SKIP_SUFFIXES):
                continue
            if name == "lm_head.weight" and embed is not None:
                alive = embed()
                if alive is not None and alive.data_ptr() == t.data_ptr():
                    continue
            yield name, t

    async def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None, b: int) -> int:
        import torch.distributed as dist

        cfg, dev = self.config, self.device
        tensors = [t.detach().to(dev).contiguous() for _, t in bucket]
        names = [name for name, _ in bucket]
        meta = {"names": names, "dtypes": [_dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        bodies = []
        for v in self.versions:
            if v < (0, 5, 0):  # 0.4.x: one name/dtype/shape per call (push makes single-tensor buckets)
                body: dict[str, Any] = {"name": names[0], "dtype": meta["dtypes"][0], "shape": meta["shapes"][0]}
            else:
                body = dict(meta)
                body.update(abort_all_requests=False, weight_version=weight_version)
                if v >= (0, 5, 10):
                    body["load_format"] = "flattened_bucket" if cfg.flattened_bucket else None
            body.update(group_name=cfg.group_name, flush_cache=False)
            bodies.append(body)
        payload = [flatten_bucket(tensors)] if cfg.flattened_bucket else tensors

        def broadcast() -> None:
            for t in payload:  # exactly the names order
                dist.broadcast(t, src=0, group=self.group)

        # Requests first (they go out while the broadcast thread waits for the engines to join).
        replies = asyncio.ensure_future(self._all("POST", "/update_weights_from_distributed", bodies,
                                                  f"bucket {b + 1} ({names[0]}...)"))
        await asyncio.sleep(0)
        sending = asyncio.ensure_future(asyncio.to_thread(broadcast))
        try:
            # An engine that refuses an update replies without receiving: that reply, not the timeout,
            # ends the wait, and its reason is the error (a broadcast that fails first waits briefly for it).
            await asyncio.wait([sending, replies], timeout=cfg.timeout_s, return_when=asyncio.FIRST_EXCEPTION)
            if sending.done() and sending.exception() is not None and not replies.done():
                await asyncio.wait([replies], timeout=_REASON_WAIT_S)
            refused = replies.exception() if replies.done() else None
            if not sending.done():
                if refused is not None:
                    raise SGLangPushError(f"bucket {b + 1}: {refused}; its broadcast was abandoned, so the group is "
                                          "out of step: close and connect again") from refused
                raise SGLangPushError(f"bucket {b + 1}: broadcast did not finish within {cfg.timeout_s}s; "
                                      "the engines stay paused")
            if refused is not None:
                raise refused  # why the engines did not take it, whether or not the broadcast went through
            sending.result()
        except BaseException:
            replies.cancel()
            raise
        await replies
        return sum(t.numel() * t.element_size() for t in tensors)

    async def _send_tensors(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None, b: int) -> int:
        """transport=tensor: one /update_weights_from_tensor per engine with CUDA IPC handles of the
        bucket's tensors; they stay alive here until every engine has loaded them."""
        tensors = [t.detach().contiguous() for _, t in bucket]
        if any(not t.is_cuda for t in tensors):
            raise SGLangPushError("transport=tensor needs the trainer's tensors on its GPU (trainer.device=cuda)")
        torch.cuda.current_stream().synchronize()  # the gathers that made them are done before a server reads
        payload = ipc_payload([(name, t) for (name, _), t in zip(bucket, tensors)])
        body = {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": False,
                "abort_all_requests": False, "weight_version": weight_version}
        await self._all("POST", "/update_weights_from_tensor", [body] * len(self.engines),
                        f"bucket {b + 1} ({bucket[0][0]}...)")
        del tensors
        return sum(t.numel() * t.element_size() for _, t in bucket)

    async def _pause(self) -> None:
        """Pause every engine in ``pause_mode``. ``abort`` is sent as a ``retract`` pause and then an abort of
        everything where the server takes a retract (SGLang 0.5.10+): every request in flight still ends with
        finish reason ``abort``, and the push does not wait for SGLang's own abort-mode pause, which sleeps a
        whole second while any request holds its model-update lock (0.5.17: ``await asyncio.sleep(1.0)``
        after its abort). A server that refuses ``retract`` (400 naming it) gets a plain abort pause, now and
        at every later push."""
        cfg = self.config
        if cfg.pause_mode != "abort":
            await self._all("POST", "/pause_generation", [{"mode": cfg.pause_mode}] * len(self.engines), "pause")
            return
        sent = list(self._retracts)
        first = await self._each("POST", "/pause_generation", [{"mode": "retract" if r else "abort"} for r in sent],
                                 range(len(self.engines)))
        again = [i for i, r in enumerate(first)
                 if sent[i] and isinstance(r, tuple) and r[0] == 400 and "retract" in str(r[1])]
        for i in again:
            self._retracts[i] = False
        bad = [f"{self.engines[i].name}: {why}" for i, r in enumerate(first) if (why := _failure(r)) and i not in again]
        if again:
            await self._all("POST", "/pause_generation", [{"mode": "abort"}] * len(again), "pause", again)
        if bad:
            raise SGLangPushError(f"pause (/pause_generation) failed on {len(bad)} of {len(self.engines)} engines: "
                                  + "; ".join(bad))
        retracted = [i for i, r in enumerate(self._retracts) if r]
        if retracted:
            await self._all("POST", "/abort_request", [{"abort_all": True}] * len(retracted),
                            "abort after a retract pause", retracted)

    async def _flush(self, required: bool = True) -> None:
        """Flush every engine, retrying while it answers 400; without ``required`` (in_place or retract pause: the
        kept requests refuse it until they end) one attempt, and a refusal is not an error."""
        cfg, pending = self.config, list(range(len(self.engines)))
        for _ in range(cfg.flush_retries if required else 1):
            replies = await asyncio.gather(*(self.engines[i].request("POST", "/flush_cache", None,
                                                                     timeout_s=cfg.timeout_s) for i in pending))
            pending = [i for i, (status, _) in zip(pending, replies) if status != 200]
            if not pending or not required:
                return
            await asyncio.sleep(cfg.flush_retry_s)
        raise SGLangPushError(f"/flush_cache still refused after {cfg.flush_retries} attempts on "
                              f"{[self.engines[i].name for i in pending]} (requests still running?)")

    async def close(self) -> None:
        """Destroy the group on the engines (0.5.10+) and here."""
        import torch.distributed as dist

        if self.group is None:
            return
        if self.group == "ipc":
            self.group = None
            return
        newer = [i for i, v in enumerate(self.versions) if v >= (0, 5, 10)]
        try:
            if newer:
                await self._all("POST", "/destroy_weights_update_group",
                                [{"group_name": self.config.group_name}] * len(newer), "destroy group", newer)
        finally:
            dist.destroy_process_group(self.group)
            self.group = None

"""SGLang's distributed weight-update endpoints for the TorchEngine server (``serve.py``).

The engine joins the trainer's group exactly as SGLang does (``join_process_group``: tcp
rendezvous, ``PrefixStore(group_name)``, any backend; gloo on CPU), receives each bucket's
broadcasts in ``names`` order, and stages them; ``/end_weight_update`` makes the whole version
visible at once between two decode steps. Collectives run in a worker thread, so the server keeps
answering (``/health`` says 503 while an update is staged) and the trainer's requests and
broadcasts can arrive in either order.

Version branches follow the SGLang release the server reports (``compat_version``): from 0.5.21
an update needs ``/begin_weight_update`` first (and the whole version flips at
``/end_weight_update``); before it each call applies at once (begin/end answer 404, as they did
not exist); 0.4.x takes one ``name``/``dtype``/``shape`` per call; ``load_format:
"flattened_bucket"`` (one uint8 broadcast, offsets aligned to each dtype's size) needs 0.5.10+.

Unlike SGLang, the staging makes a failed update harmless: it is dropped, the engine stays on its
version, and the reply says why (``success: false``). A receive that fails or times out leaves its
group out of step with the trainer (gloo closes its connections on a timeout), so later updates
over it are refused at once until it is destroyed and joined again.

``/update_weights_from_disk`` loads a checkpoint directory between two steps (nothing applied when a
tensor does not fit). It is the one way to change weights of a ``--tp`` server: there every rank
reads its own shard at the same step (``schedule.py``), while the distributed endpoints would reach
rank 0 alone and are refused. Simplification: a one-rank server joins the trainer's group at
``rank_offset``; a TP server does not join it.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import torch
from aiohttp import web

from meshrl.engines.serve_http import BadRequest, flag, read_json
from meshrl.engines.torch_engine import TorchEngine


def _reply(ok: bool, message: str, status: int = 200) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=status)


def _disk_reply(ok: bool, message: str) -> web.Response:
    """``/update_weights_from_disk``'s answer: SGLang's fields, 400 on failure as SGLang does."""
    return web.json_response({"success": ok, "message": message, "num_paused_requests": 0}, status=200 if ok else 400)


def _version(text: str) -> tuple[int, int, int]:
    parts = (text.split(".") + ["0", "0"])[:3]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


_MARGIN_S = 5.0
"""How long past its deadline a receive's thread is waited for (it ends by itself at the deadline)."""


def _receive(pg: Any, tensor: torch.Tensor, deadline: float) -> None:
    """Receive ``tensor`` from group rank 0, given up by the backend itself at ``deadline``
    (``time.monotonic``). ``dist.broadcast`` would use the group's timeout from its own start, so a
    broadcast started late in a payload outlived the update's wait, and took the trainer's next
    update into abandoned buffers (gloo aborts the process when the sizes differ)."""
    import torch.distributed as dist

    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the trainer's broadcasts did not all arrive within the update's timeout")
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=left)
    pg.broadcast([tensor], opts).wait()


def _unflatten(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    out, off = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = torch.empty((), dtype=dtype).element_size()
        off = -(-off // size) * size
        n = size * int(torch.Size(shape).numel())
        out.append(flat[off: off + n].view(dtype).view(shape))
        off += n
    return out


class WeightSync:
    """The weight-update handlers of one server (one engine, any number of named groups)."""

    def __init__(self, engine: TorchEngine, compat_version: str, timeout_s: float = 600.0):
        self.engine, self.version, self.timeout_s = engine, _version(compat_version), timeout_s
        self.groups: dict[str, Any] = {}
        self.broken: dict[str, str] = {}  # group name -> why a receive over it failed (it is out of step)
        self.pending_version: int | None = None

    def routes(self) -> list[tuple[str, str, Any]]:
        out = [("POST", "/init_weights_update_group", self.init_group),
               ("POST", "/update_weights_from_distributed", self.update)]
        if self.version >= (0, 5, 10):
            out.append(("POST", "/destroy_weights_update_group", self.destroy_group))
        if self.version >= (0, 5, 21):
            out += [("POST", "/begin_weight_update", self.begin), ("POST", "/end_weight_update", self.end)]
        if self.engine.tp.size > 1:  # rank 0 alone would receive (and stage) these; the followers never would
            out = [(method, path, self._refused_under_tp) for method, path, _ in out]
        return out + [("POST", "/update_weight_version", self.set_version),
                      ("POST", "/update_weights_from_disk", self.from_disk)]

    async def _refused_under_tp(self, request: web.Request) -> web.Response:
        return _reply(False, f"{request.path} is not served with --tp > 1 (only rank 0 would receive the weights): "
                             "use /update_weights_from_disk, which every rank reads", 400)

    async def from_disk(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weights_from_disk``: load a checkpoint directory's safetensors between two
        steps (under TP every rank reads its own shard); ``weight_version`` labels it."""
        b = await read_json(request)
        path = b.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest(f"/update_weights_from_disk: model_path must be a checkpoint directory, got {path!r}")
        if b.get("load_format") not in (None, "auto", "safetensors"):
            return _disk_reply(False, f"load_format {b['load_format']!r}: TorchEngine reads safetensors only")
        try:
            version = None if b.get("weight_version") is None else int(b["weight_version"])
        except (TypeError, ValueError):
            return _disk_reply(False, f"weight_version must be an integer string for TorchEngine, got "
                                      f"{b['weight_version']!r}")
        if flag(b, "abort_all_requests", "/update_weights_from_disk"):
            self.engine.abort_all()
        try:
            n = await self.engine.update_weights_from_disk(path, version)
        except Exception as exc:  # no such dir, another model's tensors, a half-written file, a staging update
            return _disk_reply(False, f"update dropped, engine stays on version {self.engine.version}: "
                                      f"{type(exc).__name__}: {exc}")
        return _disk_reply(True, f"Succeeded to update model weights from {path} ({n} tensors) as version "
                                 f"{self.engine.version}.")

    async def init_group(self, request: web.Request) -> web.Response:
        from meshrl.groups import join_process_group

        b = await read_json(request)
        name = b.get("group_name", "weight_update_group")
        missing = [k for k in ("rank_offset", "world_size", "master_address", "master_port") if b.get(k) is None]
        if missing:
            raise BadRequest(f"/init_weights_update_group: missing {missing}")
        if name in self.groups:
            return _reply(False, f"group {name!r} already exists: destroy it first")
        try:
            self.groups[name] = await asyncio.to_thread(
                join_process_group, name, int(b["rank_offset"]), int(b["world_size"]), b["master_address"],
                int(b["master_port"]), b.get("backend", "nccl"), self.timeout_s)
        except Exception as exc:  # a bad address or a timeout: say so, keep serving
            return _reply(False, f"joining {name!r} failed: {type(exc).__name__}: {exc}")
        return _reply(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        name = (await read_json(request, default={})).get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        self.broken.pop(name, None)
        if pg is None:
            return _reply(False, f"no group {name!r}")
        dist.destroy_process_group(pg)
        return _reply(True, "Succeeded to destroy custom process group.")

    async def close(self, app: web.Application | None = None) -> None:
        """Leave every group (server shutdown)."""
        import torch.distributed as dist

        for pg in self.groups.values():
            dist.destroy_process_group(pg)
        self.groups.clear()
        self.broken.clear()

    async def begin(self, request: web.Request) -> web.Response:
        try:
            await self.engine.begin_weight_update()
        except RuntimeError as exc:  # one is already staging
            return _reply(False, str(exc))
        self.pending_version = None
        return _reply(True, "Weight update started.")

    async def end(self, request: web.Request) -> web.Response:
        if not self.engine.is_updating:
            return _reply(False, "no weight update in progress: call /begin_weight_update first")
        version = self.pending_version if self.pending_version is not None else self.engine.version
        await self.engine.end_weight_update(version)
        self.pending_version = None
        return _reply(True, f"Weight update applied as version {version}.")

    async def set_version(self, request: web.Request) -> web.Response:
        b = await read_json(request)
        try:
            version = int(b["new_version"])
        except (KeyError, TypeError, ValueError):
            return _reply(False, f"new_version must be an integer string for TorchEngine, got {b.get('new_version')!r}")
        if b.get("abort_all_requests"):
            self.engine.abort_all()
        self.engine.set_version(version)
        return _reply(True, f"Weight version updated to {version}.")

    async def update(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        b = await read_json(request)
        # Until the payload is known nothing can be received, so these refusals leave the trainer's
        # broadcast unanswered (it times out): they say so. Every later refusal receives first.
        unsent = "; the trainer's broadcast was not received: destroy and re-create the group"
        keys = ("name", "dtype", "shape") if self.version < (0, 5, 0) else ("names", "dtypes", "shapes")
        if any(k not in b for k in keys):
            raise BadRequest(f"/update_weights_from_distributed: send {list(keys)}{unsent}")
        names, dtypes, shapes = (b[k] for k in keys)
        if self.version < (0, 5, 0):  # one tensor per call
            names, dtypes, shapes = [names], [dtypes], [shapes]
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)
                and all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes)):
            raise BadRequest("/update_weights_from_distributed: names, dtypes and shapes must be lists of one entry "
                             f"per tensor (shapes: lists of non-negative ints){unsent}")
        group = b.get("group_name", "weight_update_group")
        pg = self.groups.get(group)
        if pg is None:
            return _reply(False, f"no group {group!r}: call /init_weights_update_group first{unsent}")
        if group in self.broken:
            await self.engine.abort_weight_update()  # the staged version would miss these tensors
            return _reply(False, f"group {group!r} is out of step since a receive over it failed "
                                 f"({self.broken[group]}): /destroy_weights_update_group, then "
                                 "/init_weights_update_group again; this update's broadcast was not received and "
                                 "the staged update, if any, is dropped")
        torch_dtypes = [getattr(torch, d, None) if isinstance(d, str) else None for d in dtypes]
        if not all(isinstance(d, torch.dtype) for d in torch_dtypes):
            bad = [d for d, t in zip(dtypes, torch_dtypes) if not isinstance(t, torch.dtype)]
            return _reply(False, f"unknown dtypes {bad[:3]} (torch attribute names, e.g. 'bfloat16'){unsent}")
        refuse: str | None = None  # said after the broadcast is received
        try:
            weight_version = None if b.get("weight_version") is None else int(b["weight_version"])
        except (TypeError, ValueError):
            weight_version, refuse = None, (f"weight_version must be an integer string for TorchEngine, got "
                                            f"{b['weight_version']!r}")
        flat = b.get("load_format") == "flattened_bucket"
        if flat and self.version < (0, 5, 10):
            refuse = refuse or "load_format 'flattened_bucket' needs 0.5.10+"
        # NCCL receives into GPU memory only; gloo into host memory (the engine copies either way)
        device = self.engine.device if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        if flat:
            total, sizes = 0, [torch.empty((), dtype=d).element_size() for d in torch_dtypes]
            for size, shape in zip(sizes, shapes):
                total = -(-total // size) * size + size * int(torch.Size(shape).numel())
            payload = [torch.empty(total, dtype=torch.uint8, device=device)]
        else:
            payload = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, torch_dtypes)]

        deadline = time.monotonic() + self.timeout_s

        def receive() -> None:
            for t in payload:  # the trainer broadcasts in names order
                _receive(pg, t, deadline)

        try:  # receive every broadcast even when the update will be refused: the group stays in step
            # the thread ends by the deadline: once this returns, no broadcast of this update is pending
            await asyncio.wait_for(asyncio.to_thread(receive), self.timeout_s + _MARGIN_S)
        except BaseException as exc:  # a timeout, a dead trainer, a cancelled request: out of step
            self.broken[group] = f"receiving {names[:3]}... failed: {type(exc).__name__}: {exc}"
            await self.engine.abort_weight_update()
            if not isinstance(exc, Exception):
                raise
            return _reply(False, f"{self.broken[group]}; the group is out of step now: "
                                 "/destroy_weights_update_group, then /init_weights_update_group again")
        if refuse is not None:
            await self.engine.abort_weight_update()  # the staged version would miss these tensors
            return _reply(False, f"update refused (its broadcast was received; the staged update, if any, is "
                                 f"dropped): {refuse}")
        tensors = _unflatten(payload[0], torch_dtypes, shapes) if flat else payload
        staged = self.version >= (0, 5, 21)
        if staged and not self.engine.is_updating:
            return _reply(False, "call /begin_weight_update before updating weights (SGLang 0.5.21+)")
        if b.get("abort_all_requests"):
            self.engine.abort_all()
        try:
            if staged:
                await self.engine.load_weights(zip(names, tensors))
            else:
                await self.engine.update_weights(zip(names, tensors),
                                                 self.engine.version if weight_version is None else weight_version)
        except Exception as exc:  # unknown name, wrong shape: drop the whole staged version
            await self.engine.abort_weight_update()
            return _reply(False, f"update dropped, engine stays on version {self.engine.version}: "
                                 f"{type(exc).__name__}: {exc}")
        if weight_version is not None and staged:
            self.pending_version = weight_version
        if b.get("flush_cache", True) and not self.engine.flush_cache():
            return _reply(False, "flush_cache failed: requests are running (pause generation first)")
        return _reply(True, "Succeeded to update parameter online from distributed.")

"""The trainer's side of weight pushes into SGLang servers (``rollout.engine.backend=sglang``).

Trainer dp rank 0 is rank 0 of SGLang's weight-update group (``meshrl.reshard.sglang``: pause,
buckets of full Hugging Face-named tensors by broadcast, flush, continue, the version stamped on
the server); the other dp ranks take part in the gathers only:

```text
connect (once):  rank 0: GET /get_server_info, POST /init_weights_update_group to every server,
                 join the group (nccl, or gloo when a server shares the trainer's GPU or all run
                 on CPUs)
push v:          every rank iterates the policy's tensors (FSDP2: each full_tensor() is an
                 all-gather over the dp ranks, one tensor at a time); rank 0 sends each bucket as
                 its tensors arrive, so at most a bucket of full tensors is held at once
```
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterator

import torch

from meshrl.reshard.push import PushStats

__all__ = ["SGLangSource"]


class SGLangSource:
    """One trainer rank's part in pushing to SGLang servers."""

    def __init__(self, named_parameters: Any, rank: int) -> None:
        self.named_parameters, self.rank = named_parameters, rank
        self.sender: Any = None
        self._engines: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        """One loop for every call (the trainer is a sync actor: one thread), so the servers' HTTP
        sessions live as long as the group."""

    def _run(self, coro: Any) -> Any:
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def connect(self, urls: list[str], *, bucket_bytes: int, backend: str, pause_mode: str, timeout_s: float,
                request_timeout_s: float, dtype: str = "", reset: bool = False) -> None:
        """Rank 0 joins SGLang's group with every server (the others have nothing to join);
        ``backend`` "tensor": no group, CUDA IPC handles (``SGLangSyncConfig.transport``); ``dtype``:
        the servers' weight dtype, which floating-point tensors are cast to before they go out; ``reset``:
        the servers outlived a trainer (run.warm_resume), whose group they may still hold."""
        self.close()
        if self.rank != 0:
            return
        from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
        from meshrl.reshard.sglang import SGLangSyncConfig, SGLangWeightSender

        transport = "tensor" if backend == "tensor" else "group"
        sync = SGLangSyncConfig(bucket_bytes=bucket_bytes, backend="gloo" if transport == "tensor" else backend,
                                transport=transport, pause_mode=pause_mode, timeout_s=timeout_s, dtype=dtype)
        self._engines = [SGLangEngine(url, config=SGLangEngineConfig(request_timeout_s=request_timeout_s)) for url in urls]
        self.sender = SGLangWeightSender(self._engines, sync)
        self._run(self.sender.connect(reset=reset))

    def _full(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        for name, t in self.named_parameters():
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    def push(self, version: int) -> PushStats:
        """Every rank: the policy as ``version`` into every server (rank 0 sends, the others gather)."""
        if self.rank != 0:
            for _ in self._full():  # the all-gathers rank 0's iteration waits for
                pass
            return PushStats(version=version, seconds=0.0, bytes=0)
        if self.sender is None:
            raise RuntimeError("sglang_push before sglang_connect: the controller connects the trainer to the "
                               "servers once, after they are healthy")
        return self._run(self.sender.push(self._full(), version))

    def close(self) -> None:
        """Leave the group (best effort: the servers may be gone already)."""
        sender, engines, self.sender, self._engines = self.sender, self._engines, None, []
        if sender is None:
            return
        try:
            self._run(sender.close())
        except Exception:  # noqa: BLE001 - a server that died or left takes its half of the group with it
            pass
        for engine in engines:
            with contextlib.suppress(Exception):
                self._run(engine.close())

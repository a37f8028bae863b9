"""A timed-out ``/update_weights_from_distributed`` receive leaves its group unusable, and says so.

The server receives the trainer's broadcasts in a worker thread and waits for it with a timeout.
Each broadcast was bounded only by the group's own gloo timeout, counted from its own start: when
a payload's second tensor never came, the wait gave up while the thread still sat in that
broadcast, which then took the next update's first tensor (a tensor of another size: gloo aborted
the whole server process). Now each broadcast is given only what is left of the update's timeout,
so the thread has ended (and gloo has closed the group's connections) when the reply goes out, and
the group is out of step: later updates over it must be refused at once, naming the fix, and apply
nothing; destroyed and joined again, it must work.

Real processes: the server (``WeightSync`` routes on aiohttp, 127.0.0.1) runs in the test process,
the trainer (rank 0 of a gloo group) in a spawned one, driven over a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time

import pytest
import torch
from aiohttp import web

import tiny
from meshrl.engines import TorchEngine, TorchEngineConfig
from meshrl.engines.serve_weights import WeightSync
from meshrl.mesh.distributed import free_port
from serving import app_session

pytestmark = pytest.mark.slow  # a trainer process starts (torch import) and two receives time out: ~15 s

TIMEOUT_S = 3.0  # the server's receive wait and both sides' group timeout
GROUP = "wt_group"
Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def _trainer(conn) -> None:
    """Rank 0: joins groups and broadcasts what it is told; answers (error or None, seconds)."""
    import torch.distributed as dist

    from meshrl.mesh.distributed import join_process_group

    torch.set_num_threads(1)
    pg = None
    while True:
        cmd, *args = conn.recv()
        t0, err = time.monotonic(), None
        try:
            if cmd == "join":
                pg = join_process_group(GROUP, 0, 2, "127.0.0.1", args[0], "gloo", TIMEOUT_S)
            elif cmd == "leave":
                dist.destroy_process_group(pg)
            elif cmd == "broadcast":  # after a pause, each tensor in order
                delay_s, tensors = args
                time.sleep(delay_s)
                for t in tensors:
                    dist.broadcast(t, src=0, group=pg)
            elif cmd == "quit":
                return
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        conn.send((err, time.monotonic() - t0))


def _engine() -> TorchEngine:
    hf = tiny.hf_model(tiny.qwen2(hidden_size=64, layers=1))
    return TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=2, max_seq_len=32))


@contextlib.asynccontextmanager
async def _serve(sync: WeightSync):
    app = web.Application()
    for method, path, handler in sync.routes():
        app.router.add_route(method, path, handler)
    try:
        async with app_session(app, timeout_s=60) as (s, _):
            yield s
    finally:
        await sync.close()


def test_a_timed_out_receive_breaks_the_group_until_it_is_recreated():
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    trainer = ctx.Process(target=_trainer, args=(child,), daemon=True)
    trainer.start()
    engine = _engine()
    live = {n: engine.get_weights_by_name(n).clone() for n in (Q, K)}

    async def ask(*cmd, within_s: float = 30.0):
        conn.send(cmd)
        assert await asyncio.to_thread(conn.poll, within_s), f"the trainer did not finish {cmd[0]} within {within_s} s"
        return conn.recv()

    async def main() -> None:
        sync = WeightSync(engine, "0.5.23", timeout_s=TIMEOUT_S)
        async with _serve(sync) as s:
            async def post(path, body):
                async with s.post(path, json=body) as r:
                    return (await r.json())

            async def join() -> None:
                port = free_port()
                init = asyncio.ensure_future(post("/init_weights_update_group", {
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": GROUP, "backend": "gloo"}))
                assert (await ask("join", port))[0] is None
                assert (await init)["success"]

            async def update(names, tensors, delay_s=0.0):
                """One bucket: (reply, seconds the reply took, the trainer's (error, seconds))."""
                assert (await post("/begin_weight_update", {}))["success"]
                t0 = time.monotonic()
                reply = asyncio.ensure_future(post("/update_weights_from_distributed", {
                    "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(live[n].shape) for n in names],
                    "group_name": GROUP, "flush_cache": False, "weight_version": "7"}))
                sent = asyncio.ensure_future(ask("broadcast", delay_s, tensors)) if tensors is not None else None
                body = await reply
                took = time.monotonic() - t0
                return body, took, (await sent if sent is not None else None)

            def unchanged() -> None:
                assert engine.version == 0 and not engine.is_updating
                for n, t in live.items():
                    assert torch.equal(engine.get_weights_by_name(n), t), f"{n} changed"

            await join()
            # 1. The trainer never broadcasts: the wait times out (gloo's own timeout closes the group).
            body, took, _ = await update([Q], None)
            assert not body["success"] and TIMEOUT_S - 0.5 < took < TIMEOUT_S + 5, (body, took)
            await post("/end_weight_update", {})
            # ... and every later update over it is refused at once, naming the fix; nothing applied.
            body, took, (err, _) = await update([Q], [live[Q] * 2])
            assert not body["success"] and took < 1.0, (body, took)
            assert "/destroy_weights_update_group" in body["message"], body
            assert err is not None  # the trainer learns at once too (its connection is closed)
            unchanged()
            assert not (await post("/end_weight_update", {}))["success"]  # the refusal dropped the staged update
            assert (await post("/destroy_weights_update_group", {"group_name": GROUP}))["success"]
            assert (await ask("leave"))[0] is None

            # 2. Two tensors; the trainer sends the first late and never the second: the second
            # broadcast, started late, must still end at the update's deadline.
            await join()
            body, took, (err, _) = await update([Q, K], [live[Q] * 3], delay_s=TIMEOUT_S - 1.0)
            assert not body["success"] and err is None, (body, err)
            await post("/end_weight_update", {})
            # The next bucket comes at once: refused, and no broadcast left behind takes its tensors.
            body, took, (err, _) = await update([Q, K], [live[Q] * 4, live[K] * 4])
            assert not body["success"] and took < 1.0, (body, took)
            assert "/destroy_weights_update_group" in body["message"], body
            unchanged()
            assert (await post("/destroy_weights_update_group", {"group_name": GROUP}))["success"]
            assert (await ask("leave"))[0] is None

            # 3. Re-created, the group works again.
            await join()
            body, _, (err, _) = await update([Q, K], [live[Q] * 5, live[K] * 5])
            assert body["success"] and err is None, (body, err)
            assert (await post("/end_weight_update", {}))["success"]
            assert engine.version == 7 and torch.equal(engine.get_weights_by_name(K), live[K] * 5)

    try:
        asyncio.run(main())
        conn.send(("quit",))
        trainer.join(timeout=30)
    finally:
        if trainer.is_alive():
            trainer.kill()

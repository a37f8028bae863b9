"""``meshrl.reshard.sglang`` against the TorchEngine server (``python -m meshrl.engines.serve``, 0.5.23
surface) over real HTTP on 127.0.0.1 and a real gloo group: the sender's own choices, beyond what
``test_sglang_engine.py`` covers.

* ``pause_mode="in_place"`` keeps the running requests, so ``/flush_cache`` answers 400 until they
  end (SGLANG_PROTOCOL.md: "in_place pause can never flush"): a push must not fail on that;
* a push that fails midway (0.5.21+: after ``/begin_weight_update``) must leave the engine so that
  the next push recovers it, as the sender's docstring promises;
* an engine that refuses an update without receiving its broadcast (it lost the group) must fail
  the push at once with its reason, not leave the trainer in the broadcast until the timeout or
  report only gloo's "connection closed".
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from meshrl.reshard.sglang import SGLangPushError, SGLangSyncConfig
from serving import running_server

pytestmark = pytest.mark.slow  # a server process starts (torch + transformers imports)
torch.set_num_threads(1)


def model(seed: int):
    return tiny.hf_model(tiny.qwen2(vocab_size=40, layers=1, heads=2, kv_heads=1, positions=64), seed=seed)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(model(seed).named_parameters())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    model(0).save_pretrained(ckpt)
    with running_server(ckpt, "--device", "cpu", "--dtype", "float32", "--max-batch-size", "4", "--max-seq-len", "64",
                        "--compat-version", "0.5.23") as url:
        yield url


def test_in_place_pause_pushes_with_requests_kept(server):
    """A request kept by an in-place pause blocks /flush_cache for the whole push; the push must still
    land, and the request then finish on the new weights. (A request that arrives during the pause is
    no such case: SGLang holds it in its tokenizer manager, outside the scheduler, and so does meshrl.)"""
    v1 = weights(1)
    sync = SGLangSyncConfig(backend="gloo", timeout_s=60.0, pause_mode="in_place", flush_retries=4, flush_retry_s=0.05,
                            group_name="in_place_group")
    req = GenerateRequest(input_ids=[5, 9, 3], sampling=SamplingParams(max_new_tokens=60, temperature=0))

    async def main():
        eng = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=60.0, sync=sync))
        try:
            for _ in range(20):  # catch the request mid-generation: paused in place, it refuses the flush
                gen = asyncio.ensure_future(eng.generate([req]))
                while await eng.flush_cache() and not gen.done():
                    await asyncio.sleep(0.002)
                await eng.pause("keep")
                if not await eng.flush_cache():
                    break
                await eng.resume()
                await gen
            else:
                pytest.fail("no request was caught running in 20 tries")
            await eng.update_weights(v1, 1)
            (res,) = await asyncio.wait_for(gen, 60)  # the push's /continue_generation let it run on
            rows = torch.tensor(await eng.get_weights_by_name("model.layers.0.mlp.up_proj.weight", 2))
            return res, rows, await eng.refresh_version()
        finally:
            await eng.close()

    res, rows, version = asyncio.run(main())
    assert version == 1 and torch.equal(rows, v1["model.layers.0.mlp.up_proj.weight"].detach()[:2])
    versions = res.completions[0].versions
    assert len(versions) == 60 and versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def test_push_again_after_a_push_that_failed_midway(server):
    """The trainer's tensors fail after the first bucket went out (a gather that raised): the engine
    stays paused, and the next full push must recover it (module docstring: "push again")."""
    v2, v3 = weights(2), weights(3)
    sync = SGLangSyncConfig(backend="gloo", timeout_s=60.0, bucket_bytes=4096, group_name="midway_group")

    def failing():
        for i, item in enumerate(v2.items()):
            if i == 3:
                raise RuntimeError("gather failed")
            yield item

    async def main():
        eng = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=60.0, sync=sync))
        try:
            with pytest.raises(Exception, match="gather failed"):
                await eng.update_weights(failing(), 2)
            assert (await eng.request("GET", "/health"))[0] == 503  # paused: never generates from a mix
            await eng.update_weights(v3, 3)
            rows = torch.tensor(await eng.get_weights_by_name("model.layers.0.mlp.up_proj.weight", 2))
            return rows, await eng.refresh_version(), (await eng.request("GET", "/health"))[0]
        finally:
            await eng.close()

    rows, version, health = asyncio.run(main())
    assert version == 3 and health == 200 and torch.equal(rows, v3["model.layers.0.mlp.up_proj.weight"].detach()[:2])


def test_an_update_refused_before_its_broadcast_fails_at_once_with_the_reason(server):
    """The server lost the group (restarted, or destroyed by someone else): it refuses the update at
    once without receiving. The trainer must not sit in its broadcast until the timeout, and must
    report the server's reason."""
    sync = SGLangSyncConfig(backend="gloo", timeout_s=30.0, group_name="lost_group")

    async def main():
        eng = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=60.0, sync=sync))
        try:
            await eng.update_weights(weights(4), 4)
            status, body = await eng.request("POST", "/destroy_weights_update_group", {"group_name": "lost_group"})
            assert status == 200 and body["success"], body
            start = time.monotonic()
            with pytest.raises(Exception) as info:
                await eng.update_weights(weights(5), 5)
            return time.monotonic() - start, str(info.value)
        finally:
            with contextlib.suppress(SGLangPushError):  # the server has no group to destroy any more
                await eng.close()

    seconds, message = asyncio.run(main())
    assert "no group 'lost_group'" in message and seconds < 15, (seconds, message)


@contextlib.asynccontextmanager
async def delaying_proxy(target: str, path: str, delay_s: float):
    """A real HTTP proxy on 127.0.0.1 in front of ``target`` that holds the reply to ``path`` for
    ``delay_s`` after the server gave it (a slow network, or a reply lost after the work was done)."""
    import aiohttp
    from aiohttp import web

    from meshrl.mesh.distributed import free_port

    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s, s.request(request.method, target + request.path,
                                                           data=await request.read(),
                                                           headers={"Content-Type": request.content_type}) as r:
            body, status, ctype = await r.read(), r.status, r.content_type
        if request.path == path:
            await asyncio.sleep(delay_s)
        return web.Response(body=body, status=status, content_type=ctype)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_a_failed_connect_leaves_no_group_on_the_engines(server):
    """The engine joined the group but its reply came too late, so the connect failed: the engine
    must not keep the group, or every later connect is refused with "group already exists" (as NCCL
    engines, whose init answers before the rendezvous, were left after a partial join)."""
    sync = SGLangSyncConfig(backend="gloo", timeout_s=3.0, group_name="late_reply_group")
    v6 = weights(6)

    async def main():
        async with delaying_proxy(server, "/init_weights_update_group", delay_s=6.0) as slow:
            eng = SGLangEngine(slow, config=SGLangEngineConfig(request_timeout_s=30.0, sync=sync))
            with pytest.raises(SGLangPushError, match="group init .* failed") as info:
                await eng.update_weights(weights(5), 5)
            assert "Timeout" in str(info.value), info.value
        again = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=30.0, sync=sync))
        try:
            await again.update_weights(v6, 6)  # joins anew: the failed connect left nothing behind
            rows = torch.tensor(await again.get_weights_by_name("model.layers.0.mlp.up_proj.weight", 2))
            return rows, await again.refresh_version()
        finally:
            await again.close()

    rows, version = asyncio.run(main())
    assert version == 6 and torch.equal(rows, v6["model.layers.0.mlp.up_proj.weight"].detach()[:2])


def test_an_engine_that_refuses_the_group_ends_the_connect_at_once_with_its_reason(server):
    """An engine that still holds the group (a trainer died without destroying it) refuses at once;
    the connect still waited out the rendezvous' timeout_s and raised the store's timeout, without the
    engine's reason."""
    sync = SGLangSyncConfig(backend="gloo", timeout_s=20.0, group_name="held_group")

    async def main() -> tuple[float, str]:
        holder = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=30.0, sync=sync))
        await holder.update_weights(weights(7), 7)  # the server now holds "held_group"
        late = SGLangEngine(server, config=SGLangEngineConfig(request_timeout_s=30.0, sync=sync))
        t0 = time.monotonic()
        try:
            with pytest.raises(SGLangPushError, match="refused by 1 of 1 engines") as info:
                await late.update_weights(weights(8), 8)
            return time.monotonic() - t0, str(info.value)
        finally:
            await late.close()
            await holder.close()

    took, message = asyncio.run(main())
    assert "already exists" in message and took < 15, (took, message)

"""SGLangEngine against the TorchEngine server, over real HTTP on 127.0.0.1 and a real gloo group.

The server runs in subprocesses (``python -m meshrl.engines.serve``) showing two SGLang surfaces:
0.5.23 (begin/end_weight_update, lists of names, flattened buckets) and 0.4.6 (one tensor per
call, applied at once). The test process is the trainer: rank 0 of SGLang's weight-update group,
pushing through exactly the code path a real SGLang server would see. After each push,
``/get_weights_by_name`` must return the new rows and generation must equal that of a fresh
engine loaded with the new weights.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from meshrl.reshard.sglang import SGLangPushError, SGLangSyncConfig, SGLangWeightSender
from meshrl.mesh.distributed import free_port
from serving import start_server, stop, wait_healthy

pytestmark = pytest.mark.slow  # two server processes start (torch + transformers imports): 10-20 s
torch.set_num_threads(1)

ENGINE_CFG = TorchEngineConfig(max_batch_size=8, max_seq_len=64)
REQS = [GenerateRequest(input_ids=[5, 9, 17, 4], sampling=SamplingParams(max_new_tokens=8, temperature=0)),
        GenerateRequest(input_ids=[11, 3], sampling=SamplingParams(max_new_tokens=6, temperature=0.9, n=2, seed=5))]


def config():
    return tiny.qwen2(hidden_size=64)


def model(seed: int):
    """The trainer's model at one version (sharp weights, so greedy outputs differ by version)."""
    return tiny.hf_model(config(), seed=seed, sharp=6.0)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(model(seed).named_parameters())  # tied: no lm_head entry, as a trainer's parameters


def sync(**kw) -> SGLangEngineConfig:
    kw = {"backend": "gloo", "bucket_bytes": 24 * 1024, "timeout_s": 60.0, **kw}
    return SGLangEngineConfig(request_timeout_s=60.0, sync=SGLangSyncConfig(**kw))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``{compat version: url}``, servers started together from the version-0 checkpoint."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    model(0).save_pretrained(ckpt)
    started = {compat: start_server(ckpt, "--device", "cpu", "--dtype", "float32", "--max-batch-size", "8",
                                    "--max-seq-len", "64", "--compat-version", compat)
               for compat in ("0.5.23", "0.4.6.post5")}  # both start at once; then wait for each
    try:
        for proc, url in started.values():
            wait_healthy(proc, url)
        yield {compat: url for compat, (_, url) in started.items()}
    finally:
        for proc, _ in started.values():
            stop(proc)


def reference(state: dict[str, torch.Tensor], reqs=REQS):
    """TorchEngine's generation of what the adapter sends: the n samples of an n > 1 request as n
    requests of their own, sample i seeded ``mix_seed(seed, i)`` (SGLangEngine._generate_one)."""
    import msgspec

    from meshrl.engines.sampling import mix_seed

    def one(sp: SamplingParams, i: int) -> SamplingParams:
        return msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else mix_seed(sp.seed, i))

    flat = [msgspec.structs.replace(r, sampling=one(r.sampling, i)) if r.sampling.n > 1 else r
            for r in reqs for i in range(r.sampling.n)]
    results = iter(asyncio.run(TorchEngine.from_hf_model(state, config(), ENGINE_CFG).generate(flat)))
    return [msgspec.structs.replace(first := next(results), completions=first.completions
                                    + [c for _ in range(r.sampling.n - 1) for c in next(results).completions])
            for r in reqs]


async def check_pushed(eng: SGLangEngine, state: dict[str, torch.Tensor], version: int, reqs=REQS) -> list:
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"):
        rows = torch.tensor(await eng.get_weights_by_name(name, truncate_size=3))
        assert torch.equal(rows, state[name].detach()[:3]), f"v{version}: {name} does not hold the pushed rows"
    assert await eng.refresh_version() == version == eng.version
    return await eng.generate(reqs)


def assert_same_generation(got, ref, version: int) -> None:
    for g, r in zip(got, ref):
        for cg, cr in zip(g.completions, r.completions):
            assert cg.output_ids == cr.output_ids
            assert torch.allclose(torch.tensor(cg.logprobs), torch.tensor(cr.logprobs), atol=1e-5)
            assert cg.versions == [version] * len(cg.output_ids) and cg.finish_reason == cr.finish_reason


def test_two_versions_through_the_sglang_protocol(servers):
    v1, v2, v3 = weights(1), weights(2), weights(3)
    ref1, ref2, ref3 = reference(v1), reference(v2), reference(v3)
    assert ref1[0].completions[0].output_ids != ref2[0].completions[0].output_ids  # the versions are distinguishable

    async def main():
        eng = SGLangEngine(servers["0.5.23"], config=sync())
        try:
            await eng.update_weights(v1, 1)
            got1 = await check_pushed(eng, v1, 1)
            await eng.update_weights(v2.items(), 2)
            got2 = await check_pushed(eng, v2, 2)
            # One uint8 broadcast per bucket, over a second group of the same server.
            flat = SGLangEngine(servers["0.5.23"], config=sync(flattened_bucket=True, group_name="flat_group"))
            await flat.update_weights(v3, 3)
            got3 = await check_pushed(flat, v3, 3)
            await flat.close()
            return got1, got2, got3
        finally:
            await eng.close()

    got1, got2, got3 = asyncio.run(main())
    assert_same_generation(got1, ref1, 1)
    assert_same_generation(got2, ref2, 2)
    assert_same_generation(got3, ref3, 3)


def test_failed_push_keeps_the_version_and_pauses(servers):
    v4, v5 = weights(4), weights(5)

    async def main():
        eng = SGLangEngine(servers["0.5.23"], config=sync(group_name="fail_group"))
        try:
            await eng.update_weights(v4, 4)
            bad = dict(v5)
            bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"][:-1]
            with pytest.raises(SGLangPushError, match=r"engine stays on version 4.*up_proj.*stay paused"):
                await eng.update_weights(bad, 5)
            assert eng.version == 4 and await eng.refresh_version() == 4
            rows = torch.tensor(await eng.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", 2))
            assert torch.equal(rows, v4["model.layers.0.self_attn.q_proj.weight"].detach()[:2])  # nothing of v5
            status, text = await eng.request("GET", "/health")
            assert status == 503 and text == "paused"  # never generates from a mix
            # The adapter must open an update first on 0.5.21+: claim 0.5.2 and the server refuses.
            await eng._sender.close()
            eng._sender = old = SGLangWeightSender([eng], eng.config.sync)
            await old.connect()
            old.versions = [(0, 5, 2)]
            with pytest.raises(SGLangPushError, match="call /begin_weight_update"):
                await old.push(v5.items(), 5)
            old.versions = [(0, 5, 23)]
            await old.push(v5.items(), 5)  # a full push recovers, and generation resumes
            eng._version = 5
            assert (await eng.request("GET", "/health"))[0] == 200
            return await check_pushed(eng, v5, 5)
        finally:
            await eng.close()

    got = asyncio.run(main())
    assert_same_generation(got, reference(v5), 5)


def test_legacy_single_tensor_protocol(servers):
    v6 = weights(6)

    async def main():
        eng = SGLangEngine(servers["0.4.6.post5"], config=sync(group_name="legacy_group"))
        try:
            assert await eng.server_version() == (0, 4, 6)
            with pytest.raises(ValueError, match="sampling_seed"):  # 0.4.x has no per-request seeds
                await eng.generate(REQS[1:])
            await eng.update_weights(v6, 6)
            return await check_pushed(eng, v6, 6, REQS[:1])
        finally:
            await eng.close()

    got = asyncio.run(main())
    assert_same_generation(got, reference(v6, REQS[:1]), 6)


def test_a_request_given_up_on_is_aborted_on_the_server(servers):
    """A /generate that times out (or is cancelled) is aborted on the server too: nothing keeps running
    there, and a retry may reuse its request id."""
    retry = GenerateRequest(input_ids=[5, 9], request_id="given-up", sampling=SamplingParams(max_new_tokens=4,
                                                                                            temperature=0))

    async def main():
        eng = SGLangEngine(servers["0.5.23"], config=SGLangEngineConfig(generate_timeout_s=0.5))
        try:
            await eng.pause("keep")  # the request waits: only the timeout can end it
            try:
                with pytest.raises(TimeoutError, match="/generate: no reply within 0.5s"):
                    await eng.generate([retry])
                assert await eng.flush_cache()  # nothing runs or waits on the server any more
            finally:
                await eng.resume()
            return await eng.generate([retry])
        finally:
            await eng.close()

    (res,) = asyncio.run(main())
    assert res.request_id == "given-up" and len(res.completions[0].output_ids) == 4


def test_a_refused_update_still_receives_its_broadcast(servers):
    """The server must take every broadcast of the group, refused or not; else the trainer's next
    bucket lands in the following update, which would then apply the wrong tensor as a new version."""
    import torch.distributed as dist

    from meshrl.mesh.distributed import join_process_group

    url, name, group = servers["0.5.23"], "model.layers.0.self_attn.q_proj.weight", "refuse_group"

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def post(path, body):
                async with s.post(url + path, json=body) as r:
                    return r.status, await r.json()

            st, rows = await post("/get_weights_by_name", {"name": name, "truncate_size": 1000})
            live = torch.tensor(rows)
            port = free_port()
            init = asyncio.ensure_future(post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": group, "backend": "gloo"}))
            pg = await asyncio.to_thread(join_process_group, group, 0, 2, "127.0.0.1", port, "gloo", 60.0)
            assert (await init)[1]["success"]
            try:
                async def update(tensor, weight_version):
                    assert (await post("/begin_weight_update", {}))[1]["success"]
                    reply = asyncio.ensure_future(post("/update_weights_from_distributed", {
                        "names": [name], "dtypes": ["float32"], "shapes": [list(tensor.shape)], "group_name": group,
                        "flush_cache": False, "weight_version": weight_version}))
                    sent = asyncio.to_thread(dist.broadcast, tensor, 0, pg)
                    await asyncio.wait_for(sent, 20)  # the server received it (or this times out)
                    _, body = await reply
                    _, end = await post("/end_weight_update", {})
                    return body, end

                body, end = await update(torch.ones_like(live), "step-1")  # not an integer version: refused
                assert not body["success"] and "broadcast was received" in body["message"]
                assert not end["success"]  # the refusal dropped the staged update
                body, end = await update(live * 2, "8")
                assert body["success"] and end["success"]
                st, rows = await post("/get_weights_by_name", {"name": name, "truncate_size": 1000})
                assert torch.equal(torch.tensor(rows), live * 2)  # this update's tensor, not the refused one's
                await update(live, "9")  # put the checkpoint's value back
            finally:
                await post("/destroy_weights_update_group", {"group_name": group})
                dist.destroy_process_group(pg)

    asyncio.run(main())

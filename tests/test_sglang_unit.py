"""The SGLang adapter's pure parts: version parsing, bucketing, flattened buckets, tied-embedding
skipping, and that SGLangEngine satisfies the Engine protocol (no server needed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshrl.engines import Engine
from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from meshrl.reshard.sglang import SGLangSyncConfig, SGLangWeightSender, _buckets, flatten_bucket, parse_version


def test_parse_version():
    assert parse_version("0.5.23") == (0, 5, 23)
    assert parse_version("0.4.6.post5") == (0, 4, 6)
    assert parse_version("0.5.10rc1") == (0, 5, 10)
    with pytest.raises(ValueError, match="cannot read an SGLang version"):
        parse_version("dev")


def test_flatten_bucket_aligns_offsets():
    a, b = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.0], dtype=torch.float32)
    flat = flatten_bucket([a, b])
    assert flat.numel() == 4 + 8  # b starts at offset 4, a multiple of its element size
    assert torch.equal(flat[4:].view(torch.float32), b) and torch.equal(flat[:3], a)


def test_buckets_keep_order_and_bound_size():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1])]  # float32: 4 bytes each
    out = list(_buckets(iter(named), 80))
    assert [[n for n, _ in b] for b in out] == [["t0", "t1"], ["t2"], ["t3", "t4"]]  # t2 (120 B) goes alone


def test_tied_lm_head_and_rotary_buffers_are_not_sent():
    embed = torch.zeros(4, 2)
    sender = SGLangWeightSender([SGLangEngine("http://127.0.0.1:1")])
    named = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed),
             ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(1)), ("model.norm.weight", torch.zeros(2))]
    assert [n for n, _ in sender._select(iter(named))] == ["model.embed_tokens.weight", "model.norm.weight"]
    untied = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed.clone())]
    assert [n for n, _ in sender._select(iter(untied))] == ["model.embed_tokens.weight", "lm_head.weight"]


def test_floating_point_tensors_go_out_in_the_servers_dtype():
    master = torch.randn(3, 2)
    named = [("model.norm.weight", master), ("model.layers.0.mlp.index", torch.arange(3))]
    sender = SGLangWeightSender([SGLangEngine("http://127.0.0.1:1")], SGLangSyncConfig(dtype="bfloat16"))
    (_, norm), (_, index) = sender._cast(iter(named))
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, master.to(torch.bfloat16))
    assert index.dtype == torch.int64
    plain = SGLangWeightSender([SGLangEngine("http://127.0.0.1:1")])
    assert next(plain._cast(iter(named)))[1] is master
    with pytest.raises(ValueError, match="'bf16' is not one of"):
        SGLangSyncConfig(dtype="bf16")


def test_sglang_engine_is_an_engine_and_fails_clearly():
    eng = SGLangEngine("http://127.0.0.1:1/", config=SGLangEngineConfig(retry_backoff_s=0.01))
    assert isinstance(eng, Engine) and eng.name == "http://127.0.0.1:1" and eng.version == 0
    with pytest.raises(ValueError, match="exactly one of url"):
        SGLangEngine()

    async def main():
        try:
            await eng.pause()
        finally:
            await eng.close()

    with pytest.raises(ConnectionError, match=r"/pause_generation.*after 4 attempts"):
        asyncio.run(main())


def test_an_untied_lm_head_gathered_where_the_freed_embedding_was_is_sent():
    """A trainer may gather tensors lazily, one bucket at a time: the gathered embedding is freed once
    sent, and the untied head gathered next often lands at its address. Compared by address alone,
    it was taken for tied and never sent (the engine kept its old head)."""
    sender = SGLangWeightSender([SGLangEngine("http://127.0.0.1:1")])
    addresses = []

    def gathered():  # each full tensor made when asked for, dropped by the consumer after its bucket
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            t = torch.ones(2048, 4096) if name != "model.norm.weight" else torch.ones(4096)  # 32 MiB: a block
            addresses.append(t.data_ptr())  # the allocator hands back at the same address
            yield name, t
            del t

    sent = []
    for name, t in sender._select(gathered()):
        sent.append(name)
        del t  # as _send_bucket leaves it: nothing keeps a sent tensor
    if addresses[0] != addresses[2]:
        pytest.skip("the allocator placed the head elsewhere: nothing to tell apart here")
    assert sent == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]

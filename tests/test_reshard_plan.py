"""The reshard planner and layouts, in one process: hypothesis draws model shapes, source meshes
and placements, engine TP sizes and bucket sizes; the plan must cover every destination element
exactly once with the right source element, move no byte twice, and respect ``bucket_bytes``.
The chunk rule is checked against DTensor's own, and a one-process push against the engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiny
from meshrl.engines.layout import EngineLayout, ModelSpec
from meshrl.reshard import GroupRanks, ReshardConfig, ReshardError, Resharder, dest_layout, plan_transfers
from meshrl.reshard.layout import SourceLayout, box_shape, shard_box, source_tensor, to_slices

torch.set_num_threads(1)


def spec(hidden_per_head: int, heads: int, kv_heads: int, inter: int, vocab: int, tied: bool, bias: bool) -> ModelSpec:
    return ModelSpec(model_type="qwen2" if bias else "llama", vocab_size=vocab, hidden_size=heads * hidden_per_head,
                     intermediate_size=inter, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=hidden_per_head, rms_norm_eps=1e-6, qkv_bias=bias, o_bias=False, mlp_bias=False,
                     qk_norm=False, tie_word_embeddings=tied, max_position_embeddings=32, eos_token_ids=(),
                     rope_inv_freq=(1.0,), rope_attention_scaling=1.0)


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    kv = tp * draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 2))
    s = spec(draw(st.integers(1, 3)), heads, kv, tp * draw(st.integers(1, 5)), draw(st.integers(1, 23)),
             draw(st.booleans()), draw(st.booleans()))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = draw(st.lists(st.tuples(*[st.sampled_from([None, 0, 1]) for _ in mesh]), min_size=1, max_size=4))
    replicas = draw(st.integers(1, 2))
    itemsize = draw(st.sampled_from([2, 4]))
    bucket = draw(st.integers(itemsize, 4096))
    return s, tp, mesh, placements, replicas, itemsize, bucket


def global_tensors(layout: EngineLayout) -> dict[str, torch.Tensor]:
    """Every HF tensor, filled with distinct values (so a misplaced element shows)."""
    out, base = {}, 0
    for name in layout.hf_index:
        shape = layout.hf_shape(name)
        out[name] = torch.arange(base, base + math.prod(shape), dtype=torch.float64).reshape(shape)
        base += math.prod(shape)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_covers_every_destination_element_once(case):
    s, tp, mesh, placements, replicas, itemsize, bucket = case
    layout = EngineLayout(s)
    full = global_tensors(layout)
    tensors = []
    for i, (name, t) in enumerate(full.items()):
        pl = tuple(p if p is None or p < t.dim() else None for p in placements[i % len(placements)])
        tensors.append(source_tensor(name, t.shape, "float32", mesh, pl))
    source = SourceLayout(num_ranks=math.prod(mesh), tensors=tuple(tensors))
    dest = dest_layout(layout, tp, replicas, "float16" if itemsize == 2 else "float32")
    plan = plan_transfers(source, dest, bucket)
    assert plan_transfers(source, dest, bucket) is plan  # cached per layout pair
    local = [{t.name: full[t.name][to_slices(t.owned[r])] for t in source.tensors if t.owned[r]}
             for r in range(source.num_ranks)]
    hits = [{n: torch.zeros(shape, dtype=torch.int32) for n, shape in r.params} for r in dest.ranks]
    got = [{n: torch.full(shape, -1.0, dtype=torch.float64) for n, shape in r.params} for r in dest.ranks]
    for b in plan.buckets:
        assert b.nbytes <= bucket, (b.nbytes, bucket)
        assert b.nbytes == sum(t.numel for t in b.transfers) * itemsize
        for t in b.transfers:
            assert box_shape(t.src_box) == box_shape(t.dst_box)
            hits[t.dst][t.param][to_slices(t.dst_box)] += 1
            got[t.dst][t.param][to_slices(t.dst_box)] = local[t.src][t.hf_name][to_slices(t.src_box)]
    for d, r in enumerate(dest.ranks):
        for name, h in hits[d].items():
            assert bool((h == 1).all()), f"dst rank {d} {name}: elements covered {h.min()}..{h.max()} times"
        for p in r.pieces:
            assert torch.equal(got[d][p.param][to_slices(p.local_box)], full[p.hf_name][to_slices(p.hf_box)])
    stored = sum(math.prod(shape) for r in dest.ranks for _, shape in r.params)
    assert plan.nbytes == stored * itemsize  # minimal: each stored element moves once


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), st.data())
def test_chunk_rule_matches_dtensor(shape, data):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = [data.draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh]
    placements = [Replicate() if d is None else Shard(d) for d in dims]
    coord = [data.draw(st.integers(0, n - 1)) for n in mesh]
    local, offset = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
    box = shard_box(shape, mesh, coord, dims)
    if box is None:
        assert math.prod(local) == 0
    else:
        assert box_shape(box) == tuple(local) and tuple(a for a, _ in box) == tuple(offset)


def test_uneven_dp3_and_errors():
    q = source_tensor("w", (64, 8), "float32", (3,), (0,))
    assert [b[0] for b in q.owned] == [(0, 22), (22, 44), (44, 64)]
    assert source_tensor("w", (4,), "float32", (3,), (0,)).owned[2] is None  # torch.chunk: 2, 2, 0
    layout = EngineLayout(spec(2, 2, 2, 4, 7, True, True))
    full = global_tensors(layout)
    dest = dest_layout(layout, 2, 1, "float32")
    partial = SourceLayout(num_ranks=1, tensors=tuple(source_tensor(n, t.shape, "float32", (1,), (None,))
                                                      for n, t in full.items() if "q_proj" not in n))
    with pytest.raises(ValueError, match="no tensor for 2 engine weights"):
        plan_transfers(partial, dest, 1024)
    wrong = SourceLayout(num_ranks=1, tensors=tuple(source_tensor(n, (t.shape[0] + 1,) + t.shape[1:], "float32", (1,),
                                                                  (None,)) for n, t in full.items()))
    with pytest.raises(ValueError, match="shape mismatch"):
        plan_transfers(wrong, dest, 1024)
    with pytest.raises(ValueError, match="num_attention_heads=2 is not divisible by tp_size=4"):
        dest_layout(layout, 4)


def _engine(hf_config, state, **kw):
    from meshrl.engines import TorchEngine, TorchEngineConfig

    return TorchEngine.from_hf_model(state, hf_config, TorchEngineConfig(max_batch_size=2, max_seq_len=32, **kw))


@pytest.fixture(scope="module")
def qwen():
    cfg = tiny.qwen2(vocab_size=40, intermediate_size=48, layers=1, positions=32, tied=False)
    return cfg, tiny.hf_model(cfg, seed=0).state_dict(), tiny.hf_model(cfg, seed=1).state_dict()


def test_one_process_push_stages_then_flips(qwen):
    """Source and destination in one process (world 1): direct copies into staging, one flip."""
    from meshrl.reshard import source_layout

    cfg, old, new = qwen
    engine = _engine(cfg, old, dtype="bfloat16")
    source = source_layout(new)
    dest = dest_layout(engine.model.layout, 1, 1, "bfloat16")
    res = Resharder(source, dest, GroupRanks.colocated(1), 0, config=ReshardConfig(bucket_bytes=2048))
    stats = asyncio.run(res.receive(engine, 7, sources=new))
    assert engine.version == 7 and stats.bytes == 0  # nothing crossed a process boundary
    for name, t in new.items():
        assert torch.equal(engine.get_weights_by_name(name), t.to(torch.bfloat16)), name
    # write_in_place: no staging, same result
    engine2 = _engine(cfg, old)
    res2 = Resharder(source, dest_layout(engine2.model.layout), GroupRanks.colocated(1), 0)
    assert res2.write_in_place(engine2, new, 3).bytes == sum(t.numel() * 4 for n, t in new.items())
    assert engine2.version == 3 and all(torch.equal(engine2.get_weights_by_name(n), t) for n, t in new.items())


def test_bad_sources_leave_engine_on_its_version(qwen):
    cfg, old, new = qwen
    engine = _engine(cfg, old)
    from meshrl.reshard import source_layout

    res = Resharder(source_layout(new), dest_layout(engine.model.layout), GroupRanks.colocated(1), 0)
    broken = dict(new)
    broken["model.norm.weight"] = broken["model.norm.weight"][:-1]
    with pytest.raises(ReshardError, match=r"local tensors differ from the layout.*model\.norm\.weight"):
        asyncio.run(res.receive(engine, 1, sources=broken))
    assert engine.version == 0 and not engine.is_updating
    assert torch.equal(engine.get_weights_by_name("model.norm.weight"), old["model.norm.weight"])

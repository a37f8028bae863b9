"""Tensor parallelism: the declared plan covers every HF tensor exactly once, and TP=2 (two real
processes, gloo) generates exactly what TP=1 does."""

from __future__ import annotations

import asyncio
import datetime
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.layout import EngineLayout, ModelSpec
from meshrl.mesh.distributed import free_port
from processes import run_processes

torch.set_num_threads(1)


def config(arch: str = "qwen2"):
    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None)
    return Qwen2Config(**kw, tie_word_embeddings=True) if arch == "qwen2" else Qwen3Config(**kw, head_dim=16)


def hf_model(arch: str = "qwen2"):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config(arch)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return m


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_plan_covers_each_hf_tensor_once(arch):
    hf = hf_model(arch)
    state = hf.state_dict()
    layout = EngineLayout(ModelSpec.from_hf_config(hf.config))
    tp = 2
    hits = {name: torch.zeros_like(t, dtype=torch.int32) for name, t in state.items() if not layout.is_skipped(name)}
    for pl in layout.params.values():
        for rank in range(tp):
            local = torch.full(pl.local_shape(tp), float("nan"))
            for hf_name, src, dst in pl.local_slices(rank, tp):
                local[dst] = state[hf_name][src]
                hits[hf_name][src] += 1
            assert not torch.isnan(local).any(), f"{pl.name} rank {rank} has unfilled entries"
            if pl.name.endswith("qkv.weight"):  # column-parallel fused: [q_r | k_r | v_r]
                q = state[pl.parts[0].hf_name]
                assert torch.equal(local[: q.shape[0] // tp], q[rank * q.shape[0] // tp: (rank + 1) * q.shape[0] // tp])
            if pl.shard_dim is None:
                assert pl.local_shape(tp) == pl.shape
    for name, h in hits.items():
        expected = 1 if layout.params[layout.hf_index[name][0]].shard_dim is not None else tp
        assert bool((h == expected).all()), name  # sharded: once over all ranks; replicated: once per rank


REQS = [GenerateRequest(input_ids=[5, 9, 17, 4], sampling=SamplingParams(max_new_tokens=10, temperature=0)),
        GenerateRequest(input_ids=[11, 3, 8], sampling=SamplingParams(max_new_tokens=7, temperature=0.9, n=3, seed=5)),
        GenerateRequest(input_ids=[2, 60, 33, 7, 7, 1], sampling=SamplingParams(max_new_tokens=9, temperature=1.0,
                                                                                top_p=0.7, seed=6))]


def _rank_main(rank: int, path: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.engines.tp import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = TensorParallel.from_device_mesh(mesh, "tp")
    engine = TorchEngine.from_pretrained(path, TorchEngineConfig(max_batch_size=4, max_seq_len=32), tp=tp)
    assert engine.model.num_heads == 2 and engine.cache.num_kv_heads == 1  # half the heads per rank
    res = asyncio.run(engine.generate(REQS))
    torch.save([[(c.output_ids, c.logprobs) for c in r.completions] for r in res], os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_generates_what_tp1_generates(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "ckpt")
    run_processes(_rank_main, (str(tmp_path / "ckpt"), free_port(), str(tmp_path)), 2, timeout_s=120, what="TP ranks")
    ref = asyncio.run(TorchEngine.from_pretrained(str(tmp_path / "ckpt"), TorchEngineConfig(
        max_batch_size=4, max_seq_len=32)).generate(REQS))
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for r, g in zip(ref, got):
            for c, (ids, lps) in zip(r.completions, g):
                assert ids == c.output_ids
                assert torch.allclose(torch.tensor(lps), torch.tensor(c.logprobs), atol=1e-5)

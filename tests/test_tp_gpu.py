"""Leader-driven tensor parallelism on two GPUs: NCCL all-reduces inside CUDA graphs, the schedule
over a gloo group beside them, and ``serve --tp 2`` on CUDA. Needs two CUDA devices
(``nvidia-h200-x2``); the same paths run on gloo over CPU in tests/test_engine_tp.py."""

from __future__ import annotations

import asyncio
import datetime
import os

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.mesh.distributed import free_port
from processes import run_processes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

GREEDY = [GenerateRequest(input_ids=list(range(3 + i, 19 + 2 * i)), request_id=f"g{i}",
                          sampling=SamplingParams(max_new_tokens=24, temperature=0)) for i in range(4)]
CFG = dict(dtype="bfloat16", max_batch_size=8, max_seq_len=96)


def _checkpoint(path: str) -> None:
    cfg = tiny.qwen2(vocab_size=512, hidden_size=256, layers=3, heads=8, positions=128, tied=False)
    # sharp logits: greedy tokens do not flip with TP's other summation order
    tiny.hf_model(cfg, sharp=6.0).to(torch.bfloat16).save_pretrained(path)


def _greedy_under(path: str, state: dict[str, torch.Tensor] | None, prompts: list[list[int]],
                  outputs: list[list[int]]) -> None:
    """Each output token is the model's argmax given the tokens before it, up to bf16 noise: two
    summation orders (TP's all-reduce, one GPU's GEMM) may pick either of two near-tied tokens, and
    the continuations then differ, so outputs are checked token by token, not against each other."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    if state is not None:
        hf.load_state_dict(state, strict=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out], device="cuda:0")).logits[0, len(prompt) - 1: -1].float()
        picked = logits.gather(1, torch.tensor(out, device="cuda:0")[:, None])[:, 0]
        gap, scale = (logits.max(-1).values - picked).max().item(), logits.abs().max().item()
        assert gap <= 0.25 + 0.01 * scale, f"a token {gap:.3f} below the argmax's logit (|logits| <= {scale:.1f})"


def _scaled(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v * 0.9 if v.dim() == 2 else v for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


def _rank(rank: int, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from meshrl.engines.tp import TensorParallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    tp = TensorParallel(rank=rank, size=2, group=dist.group.WORLD, leader_driven=True, control_group=control)
    engine = TorchEngine.from_pretrained(path, TorchEngineConfig(**CFG, device=f"cuda:{rank}"), tp=tp)
    assert engine._graphs is not None  # the all-reduces run inside captured graphs

    async def lead() -> list:
        await engine.start()
        first = asyncio.ensure_future(engine.generate(GREEDY[:2]))
        while engine.steps < 5:
            await asyncio.sleep(0)
        late = asyncio.ensure_future(engine.generate(GREEDY[2:]))  # joins five steps late
        before = await first + await late
        await engine.update_weights(_scaled(path).items(), version=1)
        after = await engine.generate(GREEDY)
        await engine.shutdown()
        return [[c.output_ids for c in r.completions] for r in before + after] + [[after[0].completions[0].versions]]

    async def follow() -> list:
        task = asyncio.ensure_future(engine.follow())
        await engine.update_weights(_scaled(path).items(), version=1)  # returns once rank 0 flipped to 1
        await task
        return [engine.version, engine.steps]

    torch.save(asyncio.run(lead() if rank == 0 else follow()), os.path.join(out, f"{rank}.pt"))
    os._exit(0)  # (destroy_process_group on an NCCL group whose kernels CUDA graphs captured can hang at exit)


def test_leader_driven_tp2_over_nccl_with_cuda_graphs(tmp_path):
    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    run_processes(_rank, (path, free_port(), str(tmp_path)), 2, timeout_s=240, what="NCCL TP ranks")
    lead, follow = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    assert follow[0] == 1 and lead[-1] == [[1] * 24]

    async def reference():
        eng = TorchEngine.from_pretrained(path, TorchEngineConfig(**CFG, device="cuda:0"))
        before = await eng.generate(GREEDY)
        await eng.update_weights(_scaled(path).items(), version=1)
        return [[c.output_ids for c in r.completions] for r in before + await eng.generate(GREEDY)]

    ref = asyncio.run(reference())
    prompts = [r.input_ids for r in GREEDY]
    got = [out for [out] in lead[:-1]]
    _greedy_under(path, None, prompts, got[:4])
    _greedy_under(path, _scaled(path), prompts, got[4:])
    assert [out[:4] for out in got] == [out[:4] for [out] in ref]  # (no near-ties this early)
    assert got[:4] != got[4:]  # the update changed what is generated


def test_server_with_tp2_on_two_gpus(tmp_path):
    import json
    import urllib.request

    from serving import running_server

    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    (tmp_path / "v1").mkdir()
    from safetensors.torch import save_file

    save_file(_scaled(path), str(tmp_path / "v1" / "model.safetensors"))

    def post(url: str, route: str, body: dict) -> dict:
        req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    with running_server(path, "--tp", "2", "--device", "cuda", "--dtype", "bfloat16", "--max-batch-size", "8",
                        "--max-seq-len", "96", timeout_s=240) as url:
        info = json.load(urllib.request.urlopen(url + "/get_server_info", timeout=30))
        gen = [post(url, "/generate", {"input_ids": r.input_ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
               ["output_ids"] for r in GREEDY]
        disk = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v1"), "weight_version": "1"})
        after = post(url, "/generate", {"input_ids": GREEDY[0].input_ids,
                                        "sampling_params": {"max_new_tokens": 24, "temperature": 0}})

    assert info["tp_size"] == 2 and info["device"] == "cuda:0" and disk["success"]
    prompts = [r.input_ids for r in GREEDY]
    _greedy_under(path, None, prompts, gen)
    _greedy_under(path, _scaled(path), prompts[:1], [after["output_ids"]])
    assert after["meta_info"]["weight_version"] == "1" and after["output_ids"] != gen[0]

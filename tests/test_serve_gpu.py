"""The standalone server on a GPU takes weight updates as a trainer sends them.

The server (``python -m meshrl.engines.serve``, bf16 on the last GPU) joins a group with this
process through ``SGLangEngine``; pushed weights must land bit for bit, by plain and by flattened
buckets, and the engine must generate on them. NCCL (trainer on GPU 0) needs two GPUs, as NCCL will
not put two ranks of a group on one device; gloo runs on one.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams
from meshrl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from meshrl.reshard.sglang import SGLangSyncConfig
from serving import running_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAMES = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
         "model.norm.weight")


def _config():
    return tiny.qwen2(vocab_size=256, hidden_size=128, positions=128)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    m = tiny.hf_model(_config(), seed=seed).to("cuda:0", torch.bfloat16)
    return {n: p.detach() for n, p in m.named_parameters()}


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"))])
def test_weight_updates_into_a_gpu_server(tmp_path, backend):
    tiny.hf_model(_config()).to(torch.bfloat16).save_pretrained(tmp_path)  # the pushes replace every weight

    async def main(url: str) -> None:
        torch.cuda.set_device(0)
        for version, flat in ((1, False), (2, True)):
            sync = SGLangSyncConfig(backend=backend, bucket_bytes=64 * 1024, timeout_s=60.0, flattened_bucket=flat,
                                    group_name=f"{backend}_{version}")
            eng = SGLangEngine(url, config=SGLangEngineConfig(request_timeout_s=60.0, sync=sync))
            try:
                state = _weights(version)
                await eng.update_weights(state, version)
                assert await eng.refresh_version() == version
                for name in NAMES:
                    rows = torch.tensor(await eng.get_weights_by_name(name, truncate_size=3), dtype=torch.float32)
                    assert torch.equal(rows, state[name][:3].float().cpu()), f"v{version}: {name}"
                (res,) = await eng.generate([GenerateRequest(input_ids=[5, 9, 17], sampling=SamplingParams(
                    max_new_tokens=6, temperature=0))])
                assert res.completions[0].versions == [version] * 6
            finally:
                await eng.close()

    with running_server(tmp_path, "--device", "cuda", "--dtype", "bfloat16", "--max-batch-size", "8", "--max-seq-len",
                        "64", env={"CUDA_VISIBLE_DEVICES": str(torch.cuda.device_count() - 1)}, timeout_s=120) as url:
        asyncio.run(main(url))

"""GPU paths of TorchEngine (bf16, CUDA graphs, Triton kernels), and the GPU benchmark's CPU smoke run.

The Triton kernels are also checked without a GPU, by Triton's CPU interpreter, when Triton is
installed (it is not in CPU-only CI, where that test is skipped).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if __name__ == "__main__":  # run as a script by test_triton_kernels_in_interpreter
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tiny  # noqa: E402
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _kernel_checks(device: str) -> None:
    """Each Triton kernel against the torch computation it replaces, on random bf16 data."""
    from meshrl.engines.kv_cache import KVCache, decode_attention, rope_and_write
    from meshrl.engines.model import rms_norm_fused, silu_mul_fused_
    from meshrl.engines.sampling import sample, sample_and_record_fused

    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)  # noqa: E731
    # RMSNorm and SiLU*up round where HF's modules do
    x, w = rnd(5, 96) * 3, rnd(96)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm_fused(x, w, 1e-6), ref, rtol=2e-2, atol=1e-2)  # 2 roundings: <= 2 ulps
    gu = rnd(3, 2 * 40)
    ref = (torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:])
    torch.testing.assert_close(silu_mul_fused_(gu.clone()), ref, rtol=2e-2, atol=1e-2)
    # RoPE + KV write, then attention over each row's [0, pos], with 1 and several position splits
    b, h, hkv, d, s = 3, 6, 2, 32, 1024
    cache = KVCache(num_layers=2, rows=4, num_kv_heads=hkv, max_seq_len=s, head_dim=d, dtype=torch.bfloat16,
                    device=device)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    pos = torch.tensor([0, 37, 700], device=device)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(d // 2) / (d // 2)))[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rope = torch.stack((cos, torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), -1)), 1).to(device, torch.bfloat16)
    qkv = rnd(b, (h + 2 * hkv) * d)
    heads = qkv.float().view(b, h + 2 * hkv, d)
    c, sn = rope[pos, 0].float()[:, None], rope[pos, 1].float()[:, None]
    rotated = heads[:, : h + hkv] * c + heads[:, : h + hkv].roll(d // 2, -1) * sn
    rope_and_write(cache, 1, qkv, pos, rope, h)
    torch.testing.assert_close(qkv.view(b, -1, d)[:, :h].float(), rotated[:, :h], rtol=1e-2, atol=2e-2)
    for r in range(b):
        torch.testing.assert_close(cache.kv[1, 0, r, :, pos[r]].float(), rotated[r, h:], rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(cache.kv[1, 1, r, :, pos[r]].float(), heads[r, h + hkv:], rtol=0, atol=0)
    for bound in (1024, 704):
        out = decode_attention(cache, 1, qkv, pos, h, d ** -0.5, bound).float().view(b, h, d)
        for r in range(b):
            n = int(pos[r]) + 1
            k = cache.kv[1, 0, r, :, :n].float().repeat_interleave(h // hkv, 0)  # [H, n, D]
            v = cache.kv[1, 1, r, :, :n].float().repeat_interleave(h // hkv, 0)
            q = qkv.view(b, -1, d)[r, :h].float()
            ref = torch.softmax((q[:, None] @ k.transpose(1, 2)) * d ** -0.5, -1) @ v  # [H, 1, D]
            torch.testing.assert_close(out[r], ref[:, 0], rtol=2e-2, atol=2e-2)
    # sampler: same tokens and log-probs as ``sample`` on the upcast logits, plus the bookkeeping writes
    rows, vocab = 6, 20000
    logits = rnd(rows, vocab) * 2
    ist = torch.zeros(rows, 6, dtype=torch.int64, device=device)
    ist[:, 1], ist[:, 2] = 10, torch.arange(rows, device=device)
    ist[:, 3] = torch.randint(0, 2**32, (rows,), generator=g).to(device)
    greedy = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool, device=device)
    fst = torch.stack((torch.where(greedy, 1.0, 1 / 0.7), torch.ones(rows, device=device)), 1)
    flags = torch.stack((greedy, torch.zeros_like(greedy)), 1)
    from meshrl.engines.sampling import uniform
    tok, lp = sample(logits.float(), inv_temperature=fst[:, 0], u=uniform(ist[:, 3], ist[:, 2]),
                     top_k=torch.full((rows,), vocab, device=device), top_p=fst[:, 1], greedy=greedy,
                     filtered=flags[:, 1], any_greedy=True, all_greedy=False, any_filtered=False)
    out_tok = torch.zeros(rows, 8, dtype=torch.int64, device=device)
    out_lp = torch.zeros(rows, 8, dtype=torch.float32, device=device)
    sample_and_record_fused(logits, ist, fst, flags, out_tok, out_lp, cols=(0, 1, 2, 3))
    col = torch.arange(rows, device=device)
    assert out_tok[col, col].tolist() == tok.tolist() == ist[:, 0].tolist()
    torch.testing.assert_close(out_lp[col, col], lp, rtol=0, atol=1e-4)
    assert ist[:, 1].tolist() == [11] * rows and ist[:, 2].tolist() == list(range(1, rows + 1))


def _config(layers: int):
    return tiny.qwen2(vocab_size=1024, hidden_size=256, layers=layers, heads=8, positions=512, tied=False)


def _engine_checks(device: str) -> None:
    """A bf16 engine on the fused path: log-probs of its own samples match an fp32 HF forward."""
    with torch.device(device):
        hf = tiny.hf_model(_config(layers=2), dtype=torch.bfloat16)
    eng = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(dtype="bfloat16", device=device, max_batch_size=4,
                                                                 max_seq_len=96, cuda_graphs=device == "cuda"))
    assert eng.model.fused_kernels
    hf32 = hf.float()
    reqs = [GenerateRequest(input_ids=list(range(3 + i, 20 + 9 * i)),
                            sampling=SamplingParams(max_new_tokens=12, temperature=0 if i == 2 else 0.8, seed=i,
                                                    ignore_eos=True)) for i in range(3)]
    for req, res in zip(reqs, asyncio.run(eng.generate(reqs))):
        c, t = res.completions[0], req.sampling.temperature or 1.0
        with torch.no_grad():
            logits = hf32(torch.tensor([req.input_ids + c.output_ids], device=device)).logits[0, len(req.input_ids) - 1: -1]
        ref = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(c.output_ids, device=device)[:, None])[:, 0]
        assert float((ref.cpu() - torch.tensor(c.logprobs)).abs().max()) <= 2e-2
        if req.sampling.temperature == 0:
            assert c.output_ids == logits.argmax(-1).tolist()[:1] + c.output_ids[1:]  # first token: HF's argmax


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_in_interpreter():
    out = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "kernel checks passed" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
@needs_cuda
def test_triton_kernels_on_gpu():
    _kernel_checks("cuda")
    _engine_checks("cuda")


@pytest.mark.slow
def test_gpu_benchmark_script_runs_tiny_on_cpu(monkeypatch, capsys):
    """The bench's main() in this process (an interpreter of its own would only add its start-up)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    monkeypatch.setenv("MESHRL_NO_TRITON", os.environ.get("MESHRL_NO_TRITON", "0"))  # main() sets it: restored after
    import gpu_engine

    assert gpu_engine.main(["--tiny"]) == 0
    stdout = capsys.readouterr().out
    assert "log-prob check vs HF forward" in stdout and "(PASS" in stdout, stdout
    table = stdout.split("step/floor")[-1].splitlines()
    assert {line.split()[1] for line in table if line.strip()} == {"torch-engine", "hf", "hf-static"}, stdout


def _hf_cuda(sharp: float | None = None):
    with torch.device("cuda"):
        return tiny.hf_model(_config(layers=4), dtype=torch.bfloat16, sharp=sharp)


@pytest.mark.gpu
@needs_cuda
def test_bf16_cuda_graphs_match_eager_and_hf():
    hf = _hf_cuda()
    reqs = [GenerateRequest(input_ids=list(range(3 + i, 40 + 7 * i)),
                            sampling=SamplingParams(max_new_tokens=48, temperature=0.8, seed=i, ignore_eos=True))
            for i in range(5)]
    cfg = dict(dtype="bfloat16", device="cuda", max_batch_size=8, max_seq_len=160)
    graphs = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(**cfg, cuda_graphs=True))
    eager = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(**cfg, cuda_graphs=False))
    assert graphs._graphs is not None and eager._graphs is None
    a, b = asyncio.run(graphs.generate(reqs)), asyncio.run(eager.generate(reqs))
    for r_a, r_b, req in zip(a, b, reqs):
        c = r_a.completions[0]
        assert len(c.output_ids) == 48
        # graphs attend over the whole max_seq_len under a mask, eager over the needed prefix: same math
        # up to bf16 reduction order, so compare log-probs rather than demand identical samples
        with torch.no_grad():
            logits = hf(torch.tensor([req.input_ids + c.output_ids], device="cuda")).logits[0, len(req.input_ids) - 1: -1]
        ref = torch.log_softmax(logits.float() / 0.8, -1).gather(1, torch.tensor(c.output_ids, device="cuda")[:, None])
        assert float((ref.squeeze(1).cpu() - torch.tensor(c.logprobs)).abs().max()) <= 2e-2
        assert r_b.completions[0].output_ids[:4] == c.output_ids[:4]


@pytest.mark.gpu
@needs_cuda
def test_weight_update_is_seen_by_captured_graphs():
    hf = _hf_cuda()
    eng = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(dtype="bfloat16", device="cuda", max_batch_size=4,
                                                                 max_seq_len=64))
    req = [GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=6, temperature=0))]
    asyncio.run(eng.update_weights({"lm_head.weight": torch.zeros(1024, 256)}, version=1))
    c = asyncio.run(eng.generate(req))[0].completions[0]
    assert c.output_ids == [0] * 6 and c.versions == [1] * 6  # replayed graphs read the new (zero) head


@pytest.mark.gpu
@needs_cuda
def test_lagged_stops_equal_synchronous_on_gpu():
    """On CUDA stop hits are read a step late (pinned copies); results equal the synchronous check's."""
    hf = _hf_cuda(sharp=6.0)  # sharp logits: greedy choices do not flip with the batch's rounding
    cfg = TorchEngineConfig(dtype="bfloat16", device="cuda", max_batch_size=4, max_seq_len=96)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(7)]
    base = TorchEngine.from_hf_model(hf, config=cfg)
    assert base._batch.lagged_stops
    free = [r.completions[0].output_ids for r in asyncio.run(base.generate(
        [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=16, temperature=0)) for p in prompts]))]
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=16, temperature=0,
                                                                 stop_token_ids=(free[i][2 + i],)))
            for i, p in enumerate(prompts)]
    results = []
    for lagged in (False, True):
        eng = TorchEngine.from_hf_model(hf, config=cfg)
        eng._batch.lagged_stops = lagged
        results.append([(c.output_ids, c.finish_reason) for r in asyncio.run(eng.generate(reqs))
                        for c in r.completions])
    assert results[0] == results[1]
    assert [reason for _, reason in results[0]].count("stop") >= 5


@pytest.mark.gpu
@needs_cuda
def test_host_runs_at_most_a_few_steps_ahead_of_the_gpu():
    """With no stop check to read (ignore_eos), the host still waits for the GPU every few steps.

    Each step gets ~1 ms of extra GPU work, so the GPU is the slow side; an event of our own after
    every step counts the steps the GPU has not finished yet when the host moves on.
    """
    from meshrl.engines.batch import RUN_AHEAD_STEPS

    eng = TorchEngine.from_hf_model(_hf_cuda(), config=TorchEngineConfig(
        dtype="bfloat16", device="cuda", max_batch_size=4, max_seq_len=96))
    batch, marks, ahead = eng._batch, [], []
    after_decode = batch.after_decode

    def slow_after_decode(tok):
        torch.cuda._sleep(2_000_000)  # GPU cycles: about a millisecond
        out = after_decode(tok)
        marks.append(torch.cuda.Event())
        marks[-1].record()
        ahead.append(sum(not e.query() for e in marks[-64:]))
        return out

    batch.after_decode = slow_after_decode
    reqs = [GenerateRequest(input_ids=[1, 2, 3 + i], sampling=SamplingParams(max_new_tokens=60, ignore_eos=True))
            for i in range(4)]
    results = asyncio.run(eng.generate(reqs))
    assert all(len(r.completions[0].output_ids) == 60 for r in results)
    assert len(ahead) >= 50
    assert max(ahead) <= RUN_AHEAD_STEPS + 1, ahead


@pytest.mark.gpu
@needs_cuda
def test_streams_add_up_to_generate_with_graphs_and_lagged_stops():
    """CUDA graphs, lagged stop checks, a read every step: each sample's deltas add up to what
    ``generate`` returns, and no delta before the last holds the stop token."""
    hf = _hf_cuda(sharp=6.0)
    cfg = TorchEngineConfig(dtype="bfloat16", device="cuda", max_batch_size=8, max_seq_len=96)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(4)]
    free = [r.completions[0].output_ids for r in asyncio.run(TorchEngine.from_hf_model(hf, config=cfg).generate(
        [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=24, temperature=0)) for p in prompts]))]
    reqs = [GenerateRequest(input_ids=p, request_id=f"s{i}", sampling=SamplingParams(
        max_new_tokens=24, temperature=0, stop_token_ids=(free[i][4 + 3 * i],))) for i, p in enumerate(prompts)]

    async def run(stream: bool):
        eng = TorchEngine.from_hf_model(hf, config=cfg)
        assert eng._batch.lagged_stops and eng._graphs is not None

        async def one(r):
            if not stream:
                return (await eng.generate([r]))[0].completions[0].output_ids, None
            deltas = [d async for d in eng.generate_stream(r)]
            return sum((d.output_ids for d in deltas), []), deltas

        return await asyncio.gather(*(one(r) for r in reqs))

    plain, streamed = asyncio.run(run(False)), asyncio.run(run(True))
    for (ids, _), (got, deltas) in zip(plain, streamed):
        assert got == ids and len(deltas) > 2
        assert all(ids[-1] not in d.output_ids for d in deltas[:-1]) and deltas[-1].finish_reason is not None


def _patch_interpreter_scalars() -> None:
    """Triton's interpreter keeps scalars as 1-element arrays, which NumPy 2 refuses to ``int()`` (a
    loop bounded by a loaded value fails); give its module an ``int`` that accepts them."""
    import builtins

    import numpy as np
    import triton.runtime.interpreter as interp

    class _IntMeta(type):  # behaves as ``int`` in isinstance checks and calls, but takes 1-element arrays
        def __instancecheck__(cls, obj):
            return isinstance(obj, builtins.int)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, builtins.int)

        def __call__(cls, x=0, *a):
            return builtins.int(x.reshape(-1)[0]) if isinstance(x, np.ndarray) else builtins.int(x, *a)

    interp.int = _IntMeta("int", (), {})


if __name__ == "__main__":
    _patch_interpreter_scalars()
    _kernel_checks("cpu")
    _engine_checks("cpu")
    print("kernel checks passed")

"""TorchEngine vs Hugging Face ``generate`` on one GPU: tokens/s, decode step time, bandwidth floor.

Run on an H200 (needs torch, transformers, and ``msgspec`` for meshrl's request types):

    python bench/gpu_engine.py                     # Qwen2.5-0.5B (batch 128) and 7B (batch 32) shapes
    python bench/gpu_engine.py --models 0.5b --rounds 5
    python bench/gpu_engine.py --tiny              # a 2-layer model on CPU: checks the script runs

Each model is built from a Qwen2.5-shaped config with random bf16 weights (HF's own init, directly
on the GPU). All sides generate ``--new-tokens`` tokens for ``--batch`` prompts of ``--prompt-len``
random tokens with temperature-1 sampling and no early stop (the config has no EOS; TorchEngine
also gets ``ignore_eos``):

- ``hf``: plain ``generate`` (dynamic cache, eager);
- ``hf-static``: ``generate(cache_implementation="static")``, which HF compiles with torch.compile
  on CUDA (warm-up rounds absorb the compilation);
- ``torch-engine``: TorchEngine (CUDA graphs on by default; ``--compile`` adds torch.compile).

The decode step time is (full run - prefill-only run) / (new_tokens - 1). Its floor is the bytes one
step must read — every weight once (the embedding table only as the LM head) plus the KV cache at
the mean context length — divided by ``--hbm-tb-s`` (4.0 TB/s, about what an H200 sustains).

A correctness check runs first: TorchEngine's log-probs of its own samples (4 prompts, 24 tokens
each; ``--logprob-prompts`` adds a larger set) against HF forward passes over the same tokens. In
float32 the engine must match HF's forward within 1e-4. In bf16 no decode path can match a forward
pass bit for bit: a decode step's matmuls have one row per sequence where the forward has the whole
sequence, so cuBLAS picks other kernels and rounds elsewhere. The script therefore prints HF's *own*
incremental decode (its ``generate`` path: prompt, then one token at a time over its KV cache)
against the same forward beside the engine's figure, and both against the float32 forward of the
same bf16 weights (the function both approximate), and HF's forward of all the sequences in one
right-padded batch against each alone (the same function of the same tokens; only the batch around a
sequence changes). bench/RESULTS.md has the figures.

``--profile`` prints torch.profiler kernel tables of the engine's decode (CUDA graph replays, and
the same step run eagerly); ``--torch-ops`` also runs the engine without its Triton kernels
(``MESHRL_NO_TRITON=1``: the torch-op path, i.e. the engine before them) for an A/B in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig  # noqa: E402

SHAPES = {  # Qwen2.5 configs (config.json of the released checkpoints)
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
DEFAULT_BATCH = {"0.5b": 128, "7b": 32, "tiny": 4}


def build_hf(shape: str, device: torch.device, dtype: torch.dtype, max_len: int):
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(32768, max_len), rope_theta=1e6,
                      rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, rounds: int, warmup: int) -> float:
    """Median seconds of ``fn`` over ``rounds`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def hf_runner(model, ids: torch.Tensor, new: int, static: bool):
    def run(n_new: int = new):
        with torch.no_grad():
            kw = {"cache_implementation": "static"} if static else {}
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=0, **kw)
        assert out.shape == (ids.shape[0], ids.shape[1] + n_new), out.shape
    return run


def engine_runner(engine: TorchEngine, ids: torch.Tensor, new: int):
    def run(n_new: int = new):
        reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=n_new, temperature=1.0,
                                                                     ignore_eos=True)) for p in ids.tolist()]
        res = asyncio.run(engine.generate(reqs))
        assert all(len(r.completions[0].output_ids) == n_new for r in res)
    return run


def _logprobs_of(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
    """Log-probs (temperature 0.8, float32 softmax) of the tokens ``out`` under ``logits`` ``[len(out), V]``."""
    idx = torch.tensor(out, device=logits.device)[:, None]
    return torch.log_softmax(logits.float() / 0.8, -1).gather(1, idx)[:, 0].cpu()


def _forward_logprobs(model, prompt: list[int], out: list[int], device: torch.device) -> torch.Tensor:
    """HF forward log-probs of the tokens ``out`` after ``prompt``: one pass over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out], device=device)).logits[0, len(prompt) - 1: -1]
    return _logprobs_of(logits, out)


def _incremental_logprobs(model, prompt: list[int], out: list[int], device: torch.device) -> torch.Tensor:
    """The same log-probs along HF's own generation path: the prompt, then one token at a time over
    HF's KV cache (what ``generate`` runs), so every token's matmuls have one row, as in any decode."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        r = model(torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
        logits = [r.logits[0, -1]]
        for tok in out[:-1]:
            r = model(torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
            logits.append(r.logits[0, -1])
    return _logprobs_of(torch.stack(logits), out)


def _batched_forward_logprobs(model, prompts: list[list[int]], outs: list[list[int]], device: torch.device
                              ) -> list[torch.Tensor]:
    """``_forward_logprobs`` of every sequence from one right-padded batch: the same function of the
    same tokens (the mask hides the padding), only the matmul shapes differ, so this is how far HF's
    own bf16 forward moves when nothing but the batch around a sequence changes."""
    seqs = [p + o for p, o in zip(prompts, outs)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    return [_logprobs_of(logits[i, len(p) - 1: len(p) + len(o) - 1], o) for i, (p, o) in enumerate(zip(prompts, outs))]


def check_logprobs(model, engine: TorchEngine, vocab: int, device: torch.device, ref32=None,
                   prompts_lens: tuple[int, ...] = (5, 17, 33, 64), new: int = 24) -> dict:
    """|diff| (max, mean) of log-probs of the engine's own samples (temperature 0.8): engine vs HF
    forward in the model dtype; and, below float32, HF's incremental decode (its ``generate`` path)
    vs the same forward, and both against ``ref32`` (the model upcast to float32) when given."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompts_lens]
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=new, temperature=0.8, seed=i,
                                                                 ignore_eos=True)) for i, p in enumerate(prompts)]
    diffs: dict[str, list[torch.Tensor]] = {}
    results = [r.completions[0] for r in asyncio.run(engine.generate(reqs))]
    low_precision = next(model.parameters()).dtype != torch.float32
    batched = _batched_forward_logprobs(model, prompts, [c.output_ids for c in results], device) if low_precision else None
    for i, (p, c) in enumerate(zip(prompts, results)):
        eng, hf = torch.tensor(c.logprobs), _forward_logprobs(model, p, c.output_ids, device)
        pairs = [("engine vs hf", eng - hf)]
        if low_precision:
            inc = _incremental_logprobs(model, p, c.output_ids, device)
            pairs += [("hf-inc vs hf", inc - hf), ("engine vs hf-inc", eng - inc), ("hf-batch vs hf", batched[i] - hf)]
            if ref32 is not None:
                fp32 = _forward_logprobs(ref32, p, c.output_ids, device)
                pairs += [("hf vs hf-fp32", hf - fp32), ("hf-inc vs hf-fp32", inc - fp32),
                          ("engine vs hf-fp32", eng - fp32)]
        for k, v in pairs:
            diffs.setdefault(k, []).append(v)
    return {k: (float(torch.cat(v).abs().max()), float(torch.cat(v).abs().mean())) for k, v in diffs.items()}


def report_logprobs(tag: str, d: dict, dtype: torch.dtype) -> None:
    for k, (mx, mean) in d.items():
        print(f"[{tag}] log-probs {k:18}: max |diff| {mx:.2e}  mean {mean:.2e}", flush=True)
    if dtype == torch.float32:
        err, tol = d["engine vs hf"][0], 1e-4
        print(f"[{tag}] log-prob check vs HF forward: max |diff| = {err:.2e} "
              f"({'PASS' if err <= tol else 'FAIL'}, tolerance {tol:g})", flush=True)
        return
    (mx, mean), (inc_mx, inc_mean), (b_mx, b_mean) = d["engine vs hf"], d["hf-inc vs hf"], d["hf-batch vs hf"]
    ok = lambda v: "PASS" if v <= 2e-2 else "over"  # noqa: E731
    print(f"[{tag}] log-prob check vs HF bf16 forward (target 2e-2): engine mean {mean:.2e} ({ok(mean)}), max "
          f"{mx:.2e} ({ok(mx)}); HF's own incremental decode: mean {inc_mean:.2e} ({ok(inc_mean)}), max "
          f"{inc_mx:.2e} ({ok(inc_mx)}); HF's forward in one padded batch: mean {b_mean:.2e} ({ok(b_mean)}), "
          f"max {b_mx:.2e} ({ok(b_mx)})", flush=True)


def profile_engine(engine: TorchEngine, ids: torch.Tensor, steps: int, rows: int) -> None:
    """Kernel tables of ``steps`` decode steps: with CUDA graphs, then the same step run eagerly."""
    from torch.profiler import ProfilerActivity, profile

    run = engine_runner(engine, ids, steps)
    graphs = engine._graphs
    for label in ("graphs", "eager"):
        engine._graphs = graphs if label == "graphs" else None  # eager: the same core, launched op by op
        run()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.self_device_time_total for e in ev)
        print(f"[profile {label}] {steps} tokens x {ids.shape[0]}: wall {wall * 1e3:.1f} ms, GPU kernels "
              f"{gpu_us / 1e3:.1f} ms ({len(ev)} kernel names, {sum(e.count for e in ev)} launches)", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    engine._graphs = graphs


def floor_s(model, batch: int, prompt: int, new: int, dtype: torch.dtype, tb_s: float) -> float:
    """Bytes one decode step must read (weights once + KV at the mean context) / bandwidth."""
    cfg = model.config
    size = torch.empty((), dtype=dtype).element_size()
    params = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size  # the input embedding: B rows gathered, not read whole
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * size
    return (params * size + batch * (prompt + new / 2) * kv_per_token) / (tb_s * 1e12)


def make_engine(model, cfg: TorchEngineConfig, torch_ops: bool) -> TorchEngine:
    """A TorchEngine; ``torch_ops``: without the Triton kernels (read when the model is built)."""
    os.environ["MESHRL_NO_TRITON"] = "1" if torch_ops else "0"
    try:
        return TorchEngine.from_hf_model(model, config=cfg)
    finally:
        os.environ.pop("MESHRL_NO_TRITON")


def bench_model(shape: str, args, device: torch.device, dtype: torch.dtype) -> list[tuple]:
    batch = args.batch or DEFAULT_BATCH[shape]
    prompt, new = args.prompt_len, args.new_tokens
    model = build_hf(shape, device, dtype, prompt + new)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    cfg = TorchEngineConfig(dtype=str(dtype).removeprefix("torch."), device=str(device), max_batch_size=batch,
                            max_seq_len=max(prompt + new, 96), cuda_graphs=not args.no_cuda_graphs, compile=args.compile)
    engines = {}
    for name in ["torch-engine"] + (["torch-engine-torchops"] if args.torch_ops else []):
        t0 = time.perf_counter()
        engines[name] = eng = make_engine(model, cfg, torch_ops=name.endswith("torchops"))
        print(f"[{shape}] {name} ready in {time.perf_counter() - t0:.1f}s (KV cache {eng.cache.nbytes / 2**30:.2f} "
              f"GiB, cuda_graphs={eng._graphs is not None}, triton kernels={eng.model.fused_kernels})", flush=True)
    ref32 = copy.deepcopy(model).float() if dtype != torch.float32 else None  # the exact function of these weights
    for name, eng in engines.items():
        report_logprobs(f"{shape} {name}", check_logprobs(model, eng, vocab, device, ref32), dtype)
        if args.logprob_prompts:
            lens = tuple(int(n) for n in args.logprob_prompts.split(","))
            report_logprobs(f"{shape} {name} {len(lens)} prompts x {args.logprob_tokens}",
                            check_logprobs(model, eng, vocab, device, ref32, lens, args.logprob_tokens), dtype)
    del ref32
    if args.logprobs_only:
        return []
    if args.profile and device.type == "cuda":
        profile_engine(engines["torch-engine"], ids, args.profile, rows=25)
    rows = []
    runners = [(name, engine_runner(eng, ids, new)) for name, eng in engines.items()]
    if not args.skip_hf:
        runners += [("hf", hf_runner(model, ids, new, static=False))]
    if not args.skip_hf_static and shape in args.hf_static_models.split(","):
        runners += [("hf-static", hf_runner(model, ids, new, static=True))]
    floor = floor_s(model, batch, prompt, new, dtype, args.hbm_tb_s)
    for name, run in runners:
        warm = args.warmup + (2 if name == "hf-static" else 0)  # compilation happens in the first calls
        t0 = time.perf_counter()
        full = timed(run, device, args.rounds, warm)
        pre = timed(lambda: run(1), device, args.rounds, 1)
        step = (full - pre) / max(1, new - 1)
        rows.append((shape, name, batch, batch * new / full, step, floor, full, pre))
        print(f"[{shape}] {name}: {batch * new / full:,.0f} tok/s, decode step {step * 1e3:.3f} ms "
              f"(floor {floor * 1e3:.3f} ms), prefill {pre * 1e3:.1f} ms [{time.perf_counter() - t0:.0f}s]", flush=True)
    del engines, runners, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0.5b,7b", help="comma-separated: 0.5b, 7b")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU, float32, 4 x (8 + 8) tokens")
    p.add_argument("--batch", type=int, default=0, help="0: 128 for 0.5b, 32 for 7b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hbm-tb-s", type=float, default=4.0)
    p.add_argument("--compile", action="store_true", help="TorchEngine: torch.compile the decode step")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--hf-static-models", default="0.5b,7b,tiny", help="models that also run hf-static")
    p.add_argument("--torch-ops", action="store_true", help="also run the engine without its Triton kernels")
    p.add_argument("--logprobs-only", action="store_true", help="only the log-prob check, no throughput")
    p.add_argument("--logprob-prompts", default="", metavar="LENS",
                   help="also check log-probs on prompts of these comma-separated lengths")
    p.add_argument("--logprob-tokens", type=int, default=64, help="tokens per prompt of --logprob-prompts")
    p.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="profile the engine generating TOKENS tokens per prompt (CUDA only)")
    args = p.parse_args(argv)
    if args.tiny:
        shapes, device, dtype = ["tiny"], torch.device("cpu"), torch.float32
        args.prompt_len, args.new_tokens, args.rounds = 8, 8, 1
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: run with --tiny on CPU")
        shapes, device, dtype = args.models.split(","), torch.device("cuda"), torch.bfloat16
    t0 = time.perf_counter()
    rows = [r for s in shapes for r in bench_model(s, args, device, dtype)]
    print(f"\n(whole run {time.perf_counter() - t0:.0f}s; {torch.__version__}"
          f"{', ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''})")
    print(f"\n{'model':6} {'impl':13} {'batch':>5} {'tok/s':>10} {'vs hf':>6} {'vs static':>9} {'step ms':>8} "
          f"{'floor ms':>8} {'step/floor':>10}")
    for shape, name, batch, tps, step, floor, _, _ in rows:
        base = {n: t for s, n, _, t, *_ in rows if s == shape}
        vs = lambda k: f"{tps / base[k]:.2f}x" if k in base else "-"  # noqa: E731
        print(f"{shape:6} {name:13} {batch:5d} {tps:10,.0f} {vs('hf'):>6} {vs('hf-static'):>9} {step * 1e3:8.3f} "
              f"{floor * 1e3:8.3f} {step / floor:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

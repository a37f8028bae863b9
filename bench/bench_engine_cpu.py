"""TorchEngine vs Hugging Face ``generate`` on the 2-core CPU, same model, batch, sampling and lengths.

Run: ``OMP_NUM_THREADS=1 pytest bench/bench_engine_cpu.py --benchmark-only``. Each case builds an
embedded-default-sized Qwen2 model (random weights, float32) and generates ``new_tokens`` tokens
for ``prompts x n`` sequences with temperature-1 sampling and no early stop (HF: no EOS in the
config; TorchEngine: ``ignore_eos``), one thread each. Prompts are 8-16 tokens long (uniform; HF
gets them left-padded with an attention mask, as its batched ``generate`` needs), except in
``fixed`` where all have 12. HF runs first, then the engine on the same weights and prompts; the
engine case writes ``speedup`` (HF time / engine time), both write ``tok_per_s`` into
``extra_info``, and one line per pair is printed. ``test_speedup_paired`` then alternates the two,
one call each per round, and prints the median of the rounds' ratios (with min and max): the figure
to quote, since a shared machine's load shifts between the separate runs of the first cases.

Cases: ``small`` (hidden 64, 2 layers, 64 sequences), ``default`` (hidden 128, 4 layers, 256
sequences), ``fixed`` (``default`` with equal prompt lengths: no padding for HF to waste),
``grpo`` (the ``default`` model, 32 prompts x 8 samples: TorchEngine prefills each prompt once, HF's
``num_return_sequences`` prefills every copy), ``wide`` (hidden 64, 512 sequences, 12 new tokens), ``long`` (``default`` with 40 new tokens: decode
dominates),
``example_ppo`` / ``example_grpo`` (the workload of examples/async_ppo.py: 4-6-token prompts,
4 new tokens; 64 sequences in flight for PPO, 64 prompts x 4 samples for GRPO).

Timing is CPU time of this process (``time.process_time``), not wall time: the machine is shared
and both sides run on one thread, so CPU time is the cost that does not depend on the neighbours.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig  # noqa: E402

torch.set_num_threads(1)

CASES = {  # hidden, layers, prompts, n, (min, max) prompt tokens, new_tokens
    "small": (64, 2, 64, 1, (8, 16), 8),
    "default": (128, 4, 256, 1, (8, 16), 8),
    "fixed": (128, 4, 256, 1, (12, 12), 8),
    "grpo": (128, 4, 32, 8, (8, 16), 8),
    "wide": (64, 2, 512, 1, (8, 16), 12),
    "long": (128, 4, 256, 1, (8, 16), 40),
    # What examples/async_ppo.py asks of its engine: "37+45="-sized prompts, 4-token answers,
    # 16 prompts x 4 requests in flight: 64 sequences (PPO) or, with 4 samples each, 256 (GRPO).
    "example_ppo": (128, 4, 64, 1, (4, 6), 4),
    "example_grpo": (128, 4, 64, 4, (4, 6), 4),
}
ROUNDS = 5
_times: dict[str, float] = {}


class _Case:
    def __init__(self, name: str):
        hidden, layers, prompts, n, (lo, hi), new = CASES[name]
        self.n, self.new, self.sequences = n, new, prompts * n
        cfg = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=True, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(cfg).eval()
        self.engine = TorchEngine.from_hf_model(self.hf, config=TorchEngineConfig(
            max_batch_size=self.sequences, max_seq_len=hi + new, device="cpu", dtype="float32"))
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(lo, hi + 1, (prompts,), generator=g).tolist()
        ps = [torch.randint(1, 64, (k,), generator=g).tolist() for k in lengths]
        self.ids = torch.tensor([[0] * (hi - len(p)) + p for p in ps])  # left-padded for HF
        self.mask = torch.tensor([[0] * (hi - len(p)) + [1] * len(p) for p in ps])
        self.reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(
            max_new_tokens=new, temperature=1.0, top_p=1.0, top_k=-1, n=n, ignore_eos=True)) for p in ps]

    def run_hf(self) -> int:
        with torch.no_grad():
            out = self.hf.generate(input_ids=self.ids, attention_mask=self.mask,
                                   max_new_tokens=self.new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   num_return_sequences=self.n, pad_token_id=0)
        return (out.shape[1] - self.ids.shape[1]) * out.shape[0]

    def run_engine(self) -> int:
        res = asyncio.run(self.engine.generate(self.reqs))
        return sum(len(c.output_ids) for r in res for c in r.completions)


_cases: dict[str, _Case] = {}


def _case(name: str) -> _Case:
    if name not in _cases:
        _cases.clear()
        _cases[name] = _Case(name)
    return _cases[name]


@pytest.mark.parametrize("impl", ["hf", "engine"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.benchmark(timer=time.process_time, group="engine-cpu")
def test_generate_cpu(benchmark, request, case, impl):
    c = _case(case)
    fn = c.run_hf if impl == "hf" else c.run_engine
    tokens = fn()  # warm-up; also checks the lengths
    assert tokens == c.sequences * c.new
    benchmark.pedantic(fn, rounds=ROUNDS, iterations=1)
    t = benchmark.stats.stats.median
    _times[f"{case}/{impl}"] = t
    benchmark.extra_info["tok_per_s"] = tokens / t
    if impl == "engine" and f"{case}/hf" in _times:
        speedup = _times[f"{case}/hf"] / t
        benchmark.extra_info["speedup"] = speedup
        line = (f"[bench_engine_cpu] {case}: {c.sequences} seq x {c.new} tok  HF {tokens / _times[f'{case}/hf']:,.0f} "
                f"tok/s  TorchEngine {tokens / t:,.0f} tok/s  speedup {speedup:.2f}x")
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print("\n" + line, flush=True)


PAIRED_ROUNDS = 11


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.benchmark(timer=time.process_time, group="engine-cpu-paired")
def test_speedup_paired(benchmark, request, case):
    """HF and TorchEngine alternate, one call each per round; the speedup is the median of the rounds'
    ratios. Load that shifts between rounds (these machines are shared) hits both sides of a pair
    alike, so this figure is steadier than the ratio of two separate medians above."""
    c = _case(case)
    ratios: list[float] = []

    def pair() -> None:
        t0 = time.process_time()
        hf_tokens = c.run_hf()
        t1 = time.process_time()
        engine_tokens = c.run_engine()
        t2 = time.process_time()
        assert hf_tokens == engine_tokens == c.sequences * c.new
        ratios.append((t1 - t0) / (t2 - t1))

    pair()  # warm-up
    ratios.clear()
    benchmark.pedantic(pair, rounds=PAIRED_ROUNDS, iterations=1)
    ratios.sort()
    median = ratios[len(ratios) // 2]
    benchmark.extra_info.update(speedup=median, speedup_min=ratios[0], speedup_max=ratios[-1])
    line = (f"[bench_engine_cpu paired] {case}: speedup median {median:.2f}x over {len(ratios)} rounds "
            f"(min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x)")
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + line, flush=True)

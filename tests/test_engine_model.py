"""TorchEngine against Hugging Face: greedy tokens, log-probs, checkpoint loading, name mapping, errors.

Every reference comes from a real ``transformers`` model built from a config with random weights,
run with HF's own ``generate`` and forward pass, in float32 on CPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import tiny
from meshrl.engines import GenerateRequest, SamplingParams, TorchEngine, TorchEngineConfig
from meshrl.engines.layout import EngineLayout, ModelSpec

torch.set_num_threads(1)
EOS = 3
SMALL = dict(vocab_size=96, hidden_size=64, positions=64, eos_token_id=EOS, pad_token_id=0)


def make_config(arch: str):
    if arch == "qwen2":
        return tiny.qwen2(**SMALL)
    if arch == "qwen3":
        return tiny.qwen3(**SMALL, head_dim=24)
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return tiny.llama(**SMALL, attention_bias=True, rope_parameters=llama3_rope)


def make_hf(arch: str, seed: int = 0):
    # HF's init std (0.02) gives near-uniform logits; sharpen them so greedy is meaningful
    return tiny.hf_model(make_config(arch), seed=seed, sharp=6.0)


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_greedy(hf, prompt: list[int], max_new: int, eos: int = EOS) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def hf_logprobs(hf, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of HF's forward pass at each output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1]
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled.float(), -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def generate(engine, reqs):
    return asyncio.run(engine.generate(reqs))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_tokens_equal_hf_generate(arch):
    hf = make_hf(arch)
    ps = prompts(6, hf.config.vocab_size)  # 6 prompts on 4 rows: the last two join mid-stream
    eos = hf_greedy(hf, ps[0], 12, eos=-1)[4]  # an EOS that the first prompt reaches early
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=4, max_seq_len=48),
                                       eos_ids=[eos])
    res = generate(engine, [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=0))
                            for p in ps])
    reasons = []
    for p, r in zip(ps, res):
        c = r.completions[0]
        ref = hf_greedy(hf, p, 12, eos=eos)
        assert c.output_ids == ref, (p, c.output_ids, ref)
        # a stop token sampled as the last allowed token ends by length (SGLang's precedence)
        assert c.finish_reason == ("stop" if ref[-1] == eos and len(ref) < 12 else "length")
        reasons.append(c.finish_reason)
        assert torch.allclose(torch.tensor(c.logprobs), hf_logprobs(hf, p, c.output_ids, 0.0), atol=1e-4)
    assert "stop" in reasons and r.prompt_tokens == len(ps[-1])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sampled_logprobs_equal_hf_forward(arch):
    """Log-probs are those of the temperature-scaled distribution before top-k/top-p truncation."""
    hf = make_hf(arch, seed=2)
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=16, max_seq_len=48))
    ps = prompts(4, hf.config.vocab_size, seed=3)
    params = [SamplingParams(max_new_tokens=10, temperature=0.7, ignore_eos=True, n=2, seed=11),
              SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.8, ignore_eos=True, seed=12),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, ignore_eos=True, n=3, seed=13),
              SamplingParams(max_new_tokens=10, temperature=0.9, top_k=7, top_p=0.6, ignore_eos=True, seed=14)]
    res = generate(engine, [GenerateRequest(input_ids=p, sampling=sp) for p, sp in zip(ps, params)])
    for p, sp, r in zip(ps, params, res):
        assert len(r.completions) == sp.n
        for c in r.completions:
            assert len(c.output_ids) == 10 and c.finish_reason == "length"
            ref = hf_logprobs(hf, p, c.output_ids, sp.temperature)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)
            if sp.top_k > 0:  # a truncated distribution never yields a token outside the top k
                with torch.no_grad():
                    logits = hf(torch.tensor([p + c.output_ids])).logits[0, len(p) - 1: -1]
                rank = (logits > logits.gather(1, torch.tensor(c.output_ids)[:, None])).sum(1)
                assert int(rank.max()) < sp.top_k


def test_from_pretrained_directory_matches_in_memory(tmp_path):
    hf = make_hf("qwen2", seed=4)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = TorchEngineConfig(max_batch_size=4, max_seq_len=40)
    a = TorchEngine.from_pretrained(str(tmp_path), cfg)
    b = TorchEngine.from_hf_model(hf.state_dict(), hf.config, cfg)
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0))
            for p in prompts(3, 96, seed=5)]
    assert [r.completions[0].output_ids for r in generate(a, reqs)] == \
           [r.completions[0].output_ids for r in generate(b, reqs)]
    assert a.eos_ids == (EOS,)


def test_from_pretrained_reads_the_files_transformers_reads(tmp_path):
    """Only the model's weight files: a LoRA adapter saved beside them is not the model's (its names
    failed the load), and a sharded save is read through its index."""
    from safetensors.torch import save_file

    hf = make_hf("qwen2", seed=4)
    cfg = TorchEngineConfig(max_batch_size=4, max_seq_len=40)
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0)) for p in prompts(3, 96)]
    want = [r.completions[0].output_ids for r in generate(TorchEngine.from_hf_model(hf, config=cfg), reqs)]
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf.save_pretrained(single, safe_serialization=True)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for d in (single, sharded):
        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}, str(d / "adapter_model.safetensors"))
        got = [r.completions[0].output_ids for r in generate(TorchEngine.from_pretrained(str(d), cfg), reqs)]
        assert got == want, d.name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_weights_round_trip_through_fused_layout(arch):
    """Every HF weight comes back out of the fused engine layout unchanged (tied lm_head included)."""
    hf = make_hf(arch)
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=1, max_seq_len=16))
    state = hf.state_dict()
    for name, t in state.items():
        assert torch.equal(engine.get_weights_by_name(name), t), name
    layout = EngineLayout(ModelSpec.from_hf_config(hf.config))
    assert set(layout.hf_index) | layout.skipped_hf_names == set(state)


def test_bad_input_errors_name_the_problem():
    hf = make_hf("qwen2")
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_batch_size=2, max_seq_len=16))
    with pytest.raises(ValueError, match="exceed max_seq_len=16"):
        generate(engine, [GenerateRequest(input_ids=[5] * 10, sampling=SamplingParams(max_new_tokens=7))])
    with pytest.raises(ValueError, match=r"outside \[0, 96\)"):
        generate(engine, [GenerateRequest(input_ids=[5, 96])])
    with pytest.raises(ValueError, match="n=3 exceeds max_batch_size=2"):
        generate(engine, [GenerateRequest(input_ids=[5], sampling=SamplingParams(max_new_tokens=2, n=3))])
    with pytest.raises(ValueError, match="request_id 'x' is already in flight"):
        two = SamplingParams(max_new_tokens=2)
        generate(engine, [GenerateRequest(input_ids=[5], request_id="x", sampling=two),
                          GenerateRequest(input_ids=[6], request_id="x", sampling=two)])
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate.weight"):
        asyncio.run(engine.update_weights({"model.layers.0.mlp.gate.weight": torch.zeros(2)}, 1))
    with pytest.raises(ValueError, match=r"q_proj.weight: expected shape \(64, 64\)"):
        asyncio.run(engine.update_weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)}, 1))
    state = hf.state_dict()
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="missing 1 weights.*up_proj"):
        TorchEngine.from_hf_model(state, hf.config, TorchEngineConfig(max_batch_size=1, max_seq_len=16))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        from transformers import GPT2Config
        ModelSpec.from_hf_config(GPT2Config())
    with pytest.raises(ValueError, match="holds no sequence"):
        TorchEngine.from_hf_model(hf, config=TorchEngineConfig(kv_cache_bytes=100, max_seq_len=16))
    for scaling in ({"rope_type": "dynamic", "factor": 2.0},
                    {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                     "original_max_position_embeddings": 64}):
        cfg = tiny.llama(vocab_size=96, hidden_size=64, layers=1, heads=2, intermediate_size=64, positions=128,
                         rope_scaling=scaling)
        with pytest.raises(ValueError, match=f"{scaling['rope_type']} RoPE scaling is not supported"):
            ModelSpec.from_hf_config(cfg)


def test_kv_budget_sets_rows():
    hf = make_hf("qwen2")
    per_row = 2 * 2 * 2 * 32 * 16 * 4  # kv * layers * kv_heads * seq * head_dim * fp32
    engine = TorchEngine.from_hf_model(hf, config=TorchEngineConfig(max_seq_len=32, kv_cache_bytes=5 * per_row + 7))
    assert engine.max_batch_size == 5 and engine.cache.nbytes == 5 * per_row

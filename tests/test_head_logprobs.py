"""The chunked LM-head log-probs (``modeling.policy_logprobs``) against the full logits.

The trainer's log-probs and entropies no longer go through ``[B, T, V]`` logits: the head runs on
the predicting positions only, chunk by chunk, with a hand-written backward. These check values
and gradients against the plain autograd path (``response_logprobs`` + ``entropy_from_logits``)
in float64, over chunk sizes, temperatures, ragged and masked rows, and that a model whose head
is more than a linear map (Gemma 2's logit soft-capping) takes the full path and still agrees.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, Qwen2Config, Qwen3Config

from meshrl.algos import entropy_from_logits
from meshrl.modeling import _fusable, head_logprobs, pack, policy_logprobs, response_logprobs


def reference(hidden, weight, targets, temperature):
    z = hidden @ weight.t()
    z = z / temperature if temperature > 0 else z
    logp = z.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_head_logprobs_match_full_logits_and_their_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    up_logp, up_ent = torch.randn(7, dtype=torch.float64, generator=g), torch.randn(7, dtype=torch.float64, generator=g)

    logp, ent = head_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk)
    ((logp * up_logp).sum() + (ent * up_ent).sum()).backward()
    got = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = reference(hidden, weight, targets, temperature)
    ((ref_logp * up_logp).sum() + (ref_ent * up_ent).sum()).backward()
    for a, b in zip(got, (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_head_logprobs_without_entropy_and_gradient_of_log_probs_alone():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (6,), generator=g)
    logp, ent = head_logprobs(hidden, weight, targets, entropy=False, chunk_tokens=4)
    assert ent is None
    logp.sum().backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref, _ = reference(h2, w2, targets, 1.0)
    ref.sum().backward()
    torch.testing.assert_close(logp.detach(), ref.detach())
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_bf16_head_keeps_float32_results_and_accumulates_the_weight_gradient_in_float32():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 8, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(13, 8, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 13, (40,), generator=g)
    logp, ent = head_logprobs(hidden, weight, targets, chunk_tokens=5)
    assert logp.dtype == ent.dtype == torch.float32
    logp.sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    ref, _ = reference(hidden.detach().double().requires_grad_(), weight.detach().double(), targets, 1.0)
    torch.testing.assert_close(logp.detach().double(), ref.detach(), rtol=0, atol=0.05)


def _model(kind: str):
    common = dict(vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    if kind == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif kind == "llama3-bias":  # attention biases, an MLP bias and Llama 3's RoPE scaling
        cfg = LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif kind == "qwen3":  # each head's queries and keys normed
        cfg = Qwen3Config(**common, head_dim=4, tie_word_embeddings=True)
    else:
        cfg = Gemma2Config(**common, head_dim=4, final_logit_softcapping=3.0, attn_logit_softcapping=None,
                           query_pre_attn_scalar=4, sliding_window=64)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="eager")


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gemma2"])
def test_policy_logprobs_equal_the_full_logits_path_with_gradients(kind):
    model = _model(kind)
    assert (_fusable(model) is None) == (kind == "gemma2")  # soft-capped logits: the full path
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    responses = [[11, 12, 13, 14], [15], [16, 17]]
    packed = pack(prompts, responses, pad_id=0, loss_masks=[None, None, [1, 0]])
    temperature = 0.8

    logp, ent = policy_logprobs(model, packed, temperature=temperature, chunk_tokens=2)
    (logp.sum() + 0.3 * ent.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False).logits
    ref = response_logprobs(logits, packed, temperature=temperature)
    index = packed.predict_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    ref_ent = entropy_from_logits(torch.gather(logits, 1, index) / temperature)
    ref_ent = torch.where(packed.response_mask > 0, ref_ent, torch.zeros_like(ref_ent))
    (ref.sum() + 0.3 * ref_ent.sum()).backward()

    torch.testing.assert_close(logp.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-10, atol=1e-10)
    assert (logp[packed.response_mask == 0] == 0).all() and (ent[packed.response_mask == 0] == 0).all()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


class _Called:
    """The model called through a wrapper, as ``lora.BaseModel`` calls it: the shared-prompt passes
    then go through the model's own forward and its cache (``shared_prompts.fits``)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama3-bias", "qwen3"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_shared_prompts_give_the_same_logprobs_entropies_and_gradients(kind, attention):
    """GRPO groups (rows with one prompt) run their prompt once and reuse its keys and values: the
    same numbers as every row run whole, gradients included (the prompt's summed over its rows),
    both through the model's forward with its cache and through ``meshrl.shared_prompts``' own
    passes. Prompts of different lengths (padding between a short prompt and its response),
    one-token and empty responses, a loss mask, and a prompt that only one row has."""
    from meshrl import shared_prompts

    model = _model(kind)
    model.set_attn_implementation(attention)
    assert shared_prompts.fits(model, model.get_decoder()) and not shared_prompts.fits(_Called(model), model.get_decoder())
    prompts = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5], [4, 5], [6, 7, 8, 9, 10], [11]]
    responses = [[12, 13, 14, 15], [16], [17, 18, 19], [20, 21, 22, 12, 13], [], [14, 15], [16, 17]]
    packed = pack(prompts, responses, pad_id=0, loss_masks=[None, None, [1, 0, 1], None, None, None, None])
    assert packed.prompt_keys == [0, 0, 0, 3, 3, 5, 6]

    import meshrl.modeling as modeling

    runs = {}
    for path, caller, share in (("own passes", model, True), ("model's forward", _Called(model), True),
                                ("whole rows", model, False)):
        calls = []
        forward = modeling._decoder_output
        modeling._decoder_output = lambda *a, **k: (calls.append(tuple(k["input_ids"].shape)), forward(*a, **k))[1]
        try:
            logp, ent = policy_logprobs(caller, packed, temperature=0.8, share_prompts=share)
        finally:
            modeling._decoder_output = forward
        (logp.sum() + 0.3 * ent.sum()).backward()
        runs[path] = (logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls)
        model.zero_grad(set_to_none=True)
    ref, ref_ent, ref_grads, ref_calls = runs["whole rows"]
    assert ref_calls == [(7, 7)]
    assert runs["model's forward"][3] == [(4, 5), (7, 4)]  # 4 distinct prompts, then 7 rows' responses
    assert runs["own passes"][3] == []  # no call of the model's forward
    # HF's eager attention takes its softmax in float32 even for a float64 model; SDPA keeps float64
    tol = 1e-6 if attention == "eager" else 1e-10
    for path in ("own passes", "model's forward"):
        logp, ent, grads, _ = runs[path]
        torch.testing.assert_close(logp, ref, rtol=tol, atol=tol, msg=lambda m: f"{path}: {m}")
        torch.testing.assert_close(ent, ref_ent, rtol=tol, atol=tol, msg=lambda m: f"{path}: {m}")
        assert torch.count_nonzero(logp) == int(packed.response_mask.sum())
        # float64 models still norm in float32 (HF's RMSNorm upcasts to float32): other shapes, other roundings
        # (a key bias's gradient is 0 but for that rounding: softmax is blind to a shift of every key)
        scale = max(g.abs().max().item() for g in ref_grads.values())
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=max(tol, 1e-7) * scale,
                                       msg=lambda m: f"{path}, {name}: {m}")
    # checked at each call, not only at the first: another attention afterwards takes the model's forward
    model.config._attn_implementation = "flex_attention"
    assert not shared_prompts.fits(model, model.get_decoder())


def test_rows_keep_their_prompt_keys_and_a_batch_without_shared_prompts_runs_whole():
    packed = pack([[1, 2], [3], [1, 2]], [[4], [5, 6], [7]], pad_id=0)
    part = packed.rows([2, 1, 0], width=3)
    assert part.prompt_keys == [0, 1, 0] and part.prompt_lengths == [2, 1, 2]
    assert part.input_ids.tolist() == [[1, 2, 7], [3, 5, 6], [1, 2, 4]]
    model = _model("qwen2")
    import meshrl.modeling as modeling

    lone = packed.rows([0, 1])  # two different prompts: nothing to share
    assert modeling._shared_prompt_hidden(model, model.get_decoder(), lone) is None

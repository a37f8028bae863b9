"""Hugging Face model helpers shared by the warm start, the trainer and the reference worker.

Sequences are packed right-padded as ``prompt + response``; per-token quantities (log-probs,
values, masks) are returned over *response* tokens only, shape ``[B, R]`` with ``R`` the longest
response, which is what ``meshrl.algos`` expects. Response token ``j`` of sample ``i`` sits at
position ``P_i + j`` and is predicted by the logits at position ``P_i + j - 1``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from meshrl import shared_prompts

__all__ = ["Packed", "pack", "response_logprobs", "policy_logprobs", "head_logprobs", "compile_head", "ValueModel", "load_causal_lm",
           "count_parameters", "disable_dropout", "no_progress_bars"]


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout rate of ``model`` set to 0, in place (the saved config keeps its own values).

    RL recomputes log-probs and values that must equal the engine's and the reference's (which run
    without dropout): with dropout on, the importance ratio and the KL are noise even when the
    policy has not moved, and the noise differs with the dp size. Modules stay in train mode, so
    activation checkpointing still applies. Covers ``nn.Dropout`` modules and the float rates that
    attention modules pass to their kernels (``attention_dropout``, ``dropout``)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off meanwhile ("Writing model shards" on every save): the run's
    own progress line is the one a user reads."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@dataclass
class Packed:
    """A right-padded batch of ``prompt + response`` sequences."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    predict_index: torch.Tensor  # [B, R] position whose logits predict response token j
    response_mask: torch.Tensor  # [B, R] 1.0 on response tokens (times the sample's loss mask)
    response_ids: torch.Tensor  # [B, R] response tokens (pad where masked)
    prompt_lengths: list[int] | None = None
    """Each row's prompt tokens (on the host, wherever the tensors are)."""
    prompt_keys: list[int] | None = None
    """Rows with equal keys have equal prompts (``policy_logprobs`` runs such a prompt once)."""

    def to(self, device: torch.device | str) -> "Packed":
        return Packed(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.predict_index, self.response_mask,
                                                self.response_ids)), self.prompt_lengths, self.prompt_keys)

    def rows(self, index: list[int], width: int | None = None) -> "Packed":
        """Rows ``index`` (their tokens up to ``width``), with their prompt lengths and keys."""
        idx = torch.tensor(index, dtype=torch.long, device=self.input_ids.device)
        width = self.input_ids.shape[1] if width is None else width
        return Packed(self.input_ids[idx, :width], self.attention_mask[idx, :width], self.predict_index[idx],
                      self.response_mask[idx], self.response_ids[idx],
                      None if self.prompt_lengths is None else [self.prompt_lengths[i] for i in index],
                      None if self.prompt_keys is None else [self.prompt_keys[i] for i in index])

    def with_response_mask(self, response_mask: torch.Tensor) -> "Packed":
        return Packed(self.input_ids, self.attention_mask, self.predict_index, response_mask, self.response_ids,
                      self.prompt_lengths, self.prompt_keys)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> Packed:
    """Pack ``prompts[i] + responses[i]`` right-padded; every prompt needs at least one token.

    Rows are padded as Python lists and each field becomes a tensor in one call: a tensor per row
    cost more than the step's attention on the embedded model (256 rows of 14 tokens)."""
    if len(prompts) != len(responses):
        raise ValueError(f"pack: {len(prompts)} prompts but {len(responses)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    T = max(lengths)
    R = max(1, max(len(r) for r in responses))
    ids, attn, predict, rmask, rids, keys = [], [], [], [], [], []
    first: dict[tuple[int, ...], int] = {}  # a prompt's first row: its key
    for i, (p, r) in enumerate(zip(prompts, responses)):
        keys.append(first.setdefault(tuple(p), i))
        if not p:
            raise ValueError(f"pack: prompt {i} is empty")
        n, k, tail = lengths[i], len(r), R - len(r)
        ids.append([*p, *r, *[pad_id] * (T - n)])
        attn.append([1] * n + [0] * (T - n))
        predict.append([*range(len(p) - 1, n - 1), *[0] * tail])
        rids.append([*r, *[pad_id] * tail])
        mask = loss_masks[i] if loss_masks is not None and loss_masks[i] is not None else None
        if mask is not None and len(mask) != k:
            raise ValueError(f"pack: loss mask {i} has {len(mask)} entries for {k} response tokens")
        rmask.append([*(mask if mask is not None else [1] * k), *[0] * tail])
    return Packed(torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
                  torch.tensor(predict, dtype=torch.long), torch.tensor(rmask, dtype=torch.float32),
                  torch.tensor(rids, dtype=torch.long), [len(p) for p in prompts], keys)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 if it is (bf16 logits are upcast; a float64 model, as the
    invariant tests train, keeps its precision through the log-probs and the losses)."""
    return t if t.dtype == torch.float64 else t.float()


def response_logprobs(
    logits: torch.Tensor, packed: Packed, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the response tokens under ``log_softmax(logits / temperature)``.

    ``logits`` is ``[B, T, V]``; temperature 0 (greedy sampling) means the unscaled logits, as
    in the engines (meshrl/engines/types.py).
    """
    index = packed.predict_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = at_least_fp32(torch.gather(logits, 1, index))  # [B, R, V]
    if temperature > 0:
        picked = picked / temperature
    logp = picked.log_softmax(-1).gather(-1, packed.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(packed.response_mask > 0, logp, torch.zeros_like(logp))


HEAD_CHUNK_ELEMENTS = 2**28
"""Logits per chunk of ``head_logprobs`` (tokens × vocabulary): 1 GiB in float32."""


def policy_logprobs(
    model, packed: Packed, *, temperature: float = 1.0, entropy: bool = True, chunk_tokens: int | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens under ``log_softmax(logits / temperature)``, and
    with ``entropy`` each position's entropy ``[B, R]`` (differentiable); 0 where the response mask is.

    The same numbers as ``response_logprobs`` and ``entropy_from_logits`` over the full logits, but
    the LM head runs only at the positions that predict a response token, in chunks of
    ``chunk_tokens`` (default: ``HEAD_CHUNK_ELEMENTS`` logits), and its backward recomputes each
    chunk: no ``[B, T, V]`` logits, no float32 copy of them, whatever the vocabulary
    (``head_logprobs``). ``model`` is a causal LM (or a callable with it as ``.model``, as
    ``lora.BaseModel``); one whose head is not a plain bias-free linear map (logit soft-capping,
    scaled logits) or that cannot skip its logits takes the full-logits path.

    ``share_prompts``: rows with one prompt (a GRPO group; ``packed.prompt_keys``) run that
    prompt's forward once; its keys and values serve each of them (``_shared_prompt_hidden``).
    """
    lm = model if isinstance(model, nn.Module) else model.model
    fused = _fusable(lm)
    if fused is None:
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False).logits
        if not entropy:
            return response_logprobs(logits, packed, temperature=temperature), None
        from meshrl.algos import entropy_from_logits

        index = packed.predict_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        scaled = at_least_fp32(torch.gather(logits, 1, index))  # [B, R, V], gathered once for both
        scaled = scaled / temperature if temperature > 0 else scaled
        logp = scaled.log_softmax(-1).gather(-1, packed.response_ids.unsqueeze(-1)).squeeze(-1)
        valid = packed.response_mask > 0
        return (torch.where(valid, logp, torch.zeros_like(logp)),
                torch.where(valid, entropy_from_logits(scaled), torch.zeros_like(logp)))
    decoder, head = fused
    picked = _shared_prompt_hidden(model, decoder, packed) if share_prompts else None
    if picked is None:
        hidden = _decoder_output(model, decoder, input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                                 use_cache=False)  # [B, T, H], after the final norm
        picked = torch.gather(hidden, 1, packed.predict_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, R, H]
    b, r = packed.predict_index.shape
    # the weight as the model holds it now: under FSDP2 the root's unsharded parameter (the root
    # keeps it through backward), so its gradient is reduced with the root's others
    logp, ent = head_logprobs(picked.reshape(b * r, -1), head.weight, packed.response_ids.reshape(-1),
                              temperature=temperature, entropy=entropy, chunk_tokens=chunk_tokens)
    valid = packed.response_mask > 0
    logp = torch.where(valid, logp.reshape(b, r), torch.zeros((), dtype=logp.dtype, device=logp.device))
    if ent is not None:
        ent = torch.where(valid, ent.reshape(b, r), torch.zeros((), dtype=ent.dtype, device=ent.device))
    return logp, ent


def _decoder_output(model, decoder: nn.Module, **inputs):
    """The decoder's last hidden state (after the final norm) for ``model(**inputs)``, with the
    model's own head run on one position only; with ``use_cache``, also the returned cache."""
    captured: list[torch.Tensor] = []

    def keep(_module, _args, out) -> None:
        captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

    handle = decoder.register_forward_hook(keep)
    try:
        # logits_to_keep=1: the model's own head runs on one position; ours on the ones that count.
        # The whole model is called, not the decoder: under FSDP2 the root gathers its parameters.
        out = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    if not inputs.get("use_cache"):
        return captured[-1]
    cache = getattr(out, "cache", None)  # transformers >= 5.2x; `past_key_values` before
    return captured[-1], cache if cache is not None else getattr(out, "past_key_values", None)


@functools.cache
def _cache_kwarg_of(cls: type) -> str:
    try:
        return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def _cache_kwarg(decoder: nn.Module) -> str:
    """The decoder's name for a given cache: ``cache`` (transformers >= 5.2x), ``past_key_values`` before."""
    return _cache_kwarg_of(type(decoder))


_NO_SHARED_PROMPTS: set[type] = set()
"""Model classes whose cache cannot serve several rows from one prompt (found at first use)."""


def _shared_prompt_hidden(model, decoder: nn.Module, packed: Packed) -> torch.Tensor | None:
    """``[B, R, H]``: the hidden states that predict each response token, with each distinct prompt
    of ``packed`` run once. The prompts' forward (``[G, P]``) returns their keys and values; every
    row takes its prompt's (a differentiable ``index_select``: the backward sums the rows' gradients
    into the prompt) and runs its response tokens but the last (``[B, R-1]``) at positions after its
    prompt. Response token 0 is predicted by the prompt's last hidden state, token ``j`` by the row's
    own at ``j - 1``. A Llama-family decoder runs both passes without the model's forward
    (``meshrl.shared_prompts``); others through it, with its cache between them. None (the caller
    runs every row whole): no two rows share a prompt, or the model's cache is not a plain per-layer
    key/value cache (sliding windows, hybrid layers)."""
    keys, lengths = packed.prompt_keys, packed.prompt_lengths
    if keys is None or lengths is None or len(set(keys)) == len(keys) or type(decoder) in _NO_SHARED_PROMPTS:
        return None
    device = packed.input_ids.device
    group_of: dict[int, int] = {}
    rows_group = [group_of.setdefault(k, len(group_of)) for k in keys]  # [B] each row's prompt
    first = {g: i for i, g in reversed(list(enumerate(rows_group)))}  # a row of each prompt
    firsts = [first[g] for g in range(len(group_of))]
    plen = torch.tensor([lengths[i] for i in firsts], device=device)  # [G]
    width = max(lengths[i] for i in firsts)
    prompt_mask = (torch.arange(width, device=device)[None, :] < plen[:, None]).long()  # [G, P]
    prompt_ids = packed.input_ids[torch.tensor(firsts, device=device), :width] * prompt_mask  # [G, P]
    group = torch.tensor(rows_group, device=device)  # [B]
    row_plen = plen[group]  # [B]
    r = packed.response_ids.shape[1]
    steps = torch.arange(r - 1, device=device)[None, :]
    response_len = packed.attention_mask.sum(1) - row_plen  # [B]
    if shared_prompts.fits(model, decoder):  # the same two passes without the model's forward
        return shared_prompts._Passes.forward(decoder, prompt_ids, prompt_mask, group, row_plen,
                                              packed.response_ids[:, :-1], steps < response_len[:, None])
    hidden, cache = _decoder_output(model, decoder, input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers) or not hasattr(cache, "reorder_cache"):
        _NO_SHARED_PROMPTS.add(type(decoder))
        return None
    last = hidden[group, row_plen - 1]  # [B, H]: predicts response token 0
    if r == 1:
        return last[:, None]
    cache.reorder_cache(group)  # [G, ...] -> [B, ...] keys and values
    mask = torch.cat([prompt_mask[group], (steps < response_len[:, None]).long()], 1)  # [B, P + R - 1]
    given = {_cache_kwarg(decoder): cache}
    own, _ = _decoder_output(model, decoder, input_ids=packed.response_ids[:, :-1], attention_mask=mask,
                             position_ids=row_plen[:, None] + steps, use_cache=True, **given)  # [B, R-1, H]
    return torch.cat([last[:, None], own], 1)


_FUSABLE: dict[type, bool] = {}


def _fusable(lm: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, head) of a causal LM whose logits are ``head(decoder(...))`` and nothing more."""
    cls = type(lm)
    if cls not in _FUSABLE:
        try:
            takes = "logits_to_keep" in inspect.signature(lm.forward).parameters
        except (TypeError, ValueError):
            takes = False
        _FUSABLE[cls] = takes and hasattr(lm, "get_decoder") and hasattr(lm, "get_output_embeddings")
    if not _FUSABLE[cls]:
        return None
    config = getattr(lm, "config", None)
    if any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    if getattr(lm, "logit_scale", None) is not None:
        return None
    head, decoder = lm.get_output_embeddings(), lm.get_decoder()
    if type(head) is not nn.Linear or head.bias is not None or decoder is None or decoder is lm:
        return None
    return decoder, head


def head_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
    entropy: bool = True, chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / temperature)`` at ``targets`` (``[N]``), and the entropy of
    each row's distribution, without the ``[N, V]`` logits: chunk by chunk of rows, the backward
    recomputing each chunk's logits (one more head matmul, against storing them). Float32 results
    (float64 for float64 inputs); temperature 0 means the unscaled logits."""
    if chunk_tokens is None:
        chunk_tokens = max(1, HEAD_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    scale = 1.0 / temperature if temperature > 0 else 1.0
    logp, ent = _HeadLogprobs.apply(hidden, weight, targets, scale, chunk_tokens, entropy)
    return logp, (ent if entropy else None)


def _head_forward(z: torch.Tensor, targets: torch.Tensor, scale: float, want_entropy: bool):
    """Log-probs at ``targets``, log-normaliser and (or an empty) entropy of one chunk's logits ``z``."""
    z = at_least_fp32(z) * scale
    norm = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - norm
    if not want_entropy:
        return logp, norm, z.new_empty(0)
    logp_all = z - norm[:, None]
    return logp, norm, -(logp_all.exp() * logp_all).sum(-1)


def _head_backward(z: torch.Tensor, norm: torch.Tensor, targets: torch.Tensor, g_logp: torch.Tensor | None,
                   g_ent: torch.Tensor | None, scale: float) -> torch.Tensor:
    """d loss / d (the chunk's unscaled logits), in their dtype."""
    logp_all = at_least_fp32(z) * scale - norm[:, None]
    p = logp_all.exp()
    dz = torch.zeros_like(p)
    if g_logp is not None:
        g = g_logp[:, None].to(p.dtype)
        hit = torch.arange(p.shape[-1], device=p.device)[None, :] == targets[:, None]
        dz = dz + torch.where(hit, g, 0.0) - p * g
    if g_ent is not None:
        g = g_ent[:, None].to(p.dtype)
        ent = -(p * logp_all).sum(-1, keepdim=True)
        dz = dz - g * p * (logp_all + ent)
    return (dz * scale).to(z.dtype)


class _Math:
    """The chunk math, eager or (``compile_head``) compiled: one fused kernel per pass over a chunk
    instead of one per elementwise op, each a read of a [chunk, V] float32 tensor."""

    forward, backward = staticmethod(_head_forward), staticmethod(_head_backward)


def compile_head(backend: str = "inductor") -> None:
    """Compile ``head_logprobs``' chunk math with ``torch.compile`` (``backend``), for the rest of the
    process (the first chunk of each shape pays the compile)."""
    if _Math.forward is _head_forward:
        _Math.forward = staticmethod(torch.compile(_head_forward, dynamic=True, backend=backend))
        _Math.backward = staticmethod(torch.compile(_head_backward, dynamic=True, backend=backend))


class _HeadLogprobs(torch.autograd.Function):
    """``head_logprobs``' forward and backward, chunked (d log p_t / dz = onehot_t − p;
    dH / dz = −p (log p + H); z = logits · scale)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk, want_entropy):
        n = hidden.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=dtype, device=hidden.device)
        for a in range(0, n, chunk):
            z = hidden[a : a + chunk] @ weight.t()  # in the model's dtype, as its own head computes them
            lp, norm, h = _Math.forward(z, targets[a : a + chunk], scale, want_entropy)
            logp[a : a + chunk], lse[a : a + chunk] = lp, norm
            if want_entropy:
                ent[a : a + chunk] = h
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (want_h or want_w):
            return None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if want_h else None
        acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[a : a + ctx.chunk]
            b = a + h.shape[0]
            dz = _Math.backward(h @ weight.t(), lse[a:b], targets[a:b], None if g_logp is None else g_logp[a:b],
                                None if g_ent is None else g_ent[a:b], ctx.scale)
            if want_h:
                grad_h[a:b] = dz @ weight
            if want_w:
                grad_w += dz.t() @ h
        return grad_h, (grad_w.to(weight.dtype) if want_w else None), None, None, None, None


class ValueModel(nn.Module):
    """A critic: the policy's architecture without the LM head, plus a scalar value head.

    ``forward`` returns ``[B, R]`` values at the positions that predict each response token,
    i.e. V(s_t) of the state before response token t is emitted.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no arbitrary initial baseline
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ValueModel":
        return cls(AutoModel.from_pretrained(path, dtype=dtype))

    def forward(self, packed: Packed) -> torch.Tensor:
        hidden = self.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False).last_hidden_state
        index = packed.predict_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        values = at_least_fp32(self.head(torch.gather(hidden, 1, index)).squeeze(-1))  # [B, R]
        return torch.where(packed.response_mask > 0, values, torch.zeros_like(values))


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a local Hugging Face causal LM directory; fail with the path when it is not one."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {path} is not a Hugging Face model directory (no config.json)")
    AutoConfig.from_pretrained(path)  # a clear error for a broken config before weights load
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

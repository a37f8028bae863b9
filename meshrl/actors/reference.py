"""The ReferenceWorker role: log-probs of a frozen reference policy, for the KL term.

Takes samples in the queue's wire format and returns them with ``ref_logprobs`` filled in,
computed the same way as the trainer's (``log_softmax(logits / temperature)``).
"""

from __future__ import annotations

from typing import Any

import torch

from meshrl.actors.train_step import split_by_tokens
from meshrl.cpu import attention_for, compute_process
from meshrl.mesh import Actor, endpoint
from meshrl.modeling import load_causal_lm, pack, policy_logprobs
from meshrl.queues import decode_samples, encode_samples

__all__ = ["ReferenceWorker"]


class ReferenceWorker(Actor):
    def __init__(self, model_path: str, *, temperature: float, tokens_per_microbatch: int = 16384, threads: int = 1) -> None:
        compute_process(threads)
        self.model = load_causal_lm(model_path).eval().requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0
        self.temperature, self.tokens_per_microbatch = temperature, tokens_per_microbatch

    @endpoint
    @torch.no_grad()
    def annotate(self, encoded_samples: bytes | list[Any]) -> bytes | list[Any]:
        """The samples with ``ref_logprobs``: a blob in, a blob out; ``ObjectRef``s of blobs in
        Ray's object store (meshrl.queues.parcels: one per group) in, one ref of each annotated
        blob out (fetched from, and put into, the object store here: the caller moves refs only)."""
        if isinstance(encoded_samples, list):
            import ray

            blobs = [decode_samples(b) for b in ray.get(encoded_samples)]
            self._annotate([s for blob in blobs for s in blob])  # one pass, micro-batched over every blob
            return [ray.put(encode_samples(blob)) for blob in blobs]
        samples = decode_samples(encoded_samples)
        self._annotate(samples)
        return encode_samples(samples)

    def _annotate(self, samples: list[Any]) -> None:
        """Fill in each sample's ``ref_logprobs``, micro-batched by tokens."""
        lengths = [s.num_tokens for s in samples]
        for rows in split_by_tokens(range(len(samples)), lengths, self.tokens_per_microbatch):
            chunk = [samples[i] for i in rows]
            packed = pack([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id=self.pad_id)
            with attention_for(packed.input_ids.device, packed.input_ids.shape[1]):
                logp, _ = policy_logprobs(self.model, packed, temperature=self.temperature, entropy=False, share_prompts=True)
            for s, row in zip(chunk, logp):
                s.ref_logprobs = row[: len(s.response_ids)].tolist()

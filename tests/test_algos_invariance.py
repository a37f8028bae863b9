"""Invariance: with the global normaliser passed in, the gradient of a batch equals the sum of the
gradients of any split of its sequences into micro-batches (every aggregation mode, every loss),
and the micro-batch metrics combine (reduce_metrics) into the whole batch's, in float64."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import (
    AGGREGATION_MODES,
    TruncatedTokenIS,
    decoupled_ppo_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_k2,
    kl_loss,
    make_aggregator,
    ppo_policy_loss,
    reduce_metrics,
    value_loss,
)

torch.set_num_threads(1)
F64 = torch.float64
B, T, V = 8, 7, 5


def make_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=F64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn(B, T, generator=g, dtype=F64) * 0.3  # offsets: some ratios clip, some not
    behavior = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # one all-masked row
    lengths[1], old[1] = T, 0.0  # and one full row at ratio 1 that never clips: no loss's gradient is vacuous
    mask = torch.arange(T) < lengths[:, None]  # [B, T]
    return {
        "logits": logits,
        "tokens": tokens,
        "old_offset": old,
        "behavior_offset": behavior,
        "advantages": torch.randn(B, T, generator=g, dtype=F64),
        "seq_advantages": torch.randn(B, generator=g, dtype=F64),
        "returns": torch.randn(B, T, generator=g, dtype=F64),
        "mask": mask,
    }


def losses(params: torch.Tensor, batch: dict, rows: torch.Tensor, agg) -> list:
    """Every loss on the sequences ``rows``, with log-probs and values that depend on ``params``."""
    logits = batch["logits"][rows] + params  # [b, T, V]
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, batch["tokens"][rows, :, None]).squeeze(-1)  # [b, T]
    old = (lp + batch["old_offset"][rows]).detach()
    behavior = (lp + batch["behavior_offset"][rows]).detach()
    mask, adv = batch["mask"][rows], batch["advantages"][rows]
    values = logits[..., 0]  # a stand-in critic head sharing the parameters
    entropy = entropy_from_logits(logits)
    return [
        ppo_policy_loss(
            lp, old, adv, mask, aggregate=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
            behavior_logprobs=behavior, importance_sampling=TruncatedTokenIS(1.5), entropy=entropy,
        ),
        decoupled_ppo_loss(lp, old, behavior, adv, mask, aggregate=agg, is_cap=1.3),
        gspo_policy_loss(
            lp, old, batch["seq_advantages"][rows], mask, aggregate=agg, clip_low=0.05,
            clip_high=0.05,
        ),
        value_loss(
            values, values.detach() + 0.1, batch["returns"][rows], mask, aggregate=agg, clip=0.2
        ),
        kl_loss(lp, behavior, mask, aggregate=agg, estimator=kl_k2),
        (agg(entropy, mask), {"num_tokens": mask.sum().to(F64)}),
    ]


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.permutations(list(range(B))),
    st.lists(st.integers(1, B - 1), max_size=4, unique=True),
)
def test_microbatch_gradients_sum_to_batch_gradient(seed, order, cuts):
    batch = make_batch(seed)
    mask = batch["mask"]
    # No cuts drawn: the extreme split, 8 micro-batches of one sequence each.
    bounds = [0, *sorted(cuts), B] if cuts else list(range(B + 1))
    parts = [torch.tensor(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    for mode in AGGREGATION_MODES:
        # The global normaliser, fixed before splitting.
        agg = make_aggregator(mode, num_tokens=int(mask.sum()), num_seqs=B, max_tokens=T)
        n_losses = len(losses(torch.zeros(V, dtype=F64), batch, torch.arange(B), agg))
        for k in range(n_losses):
            full_params = torch.zeros(V, dtype=F64, requires_grad=True)
            full_loss, full_metrics = losses(full_params, batch, torch.arange(B), agg)[k]
            full_loss.backward()
            micro_params = torch.zeros(V, dtype=F64, requires_grad=True)
            micro_total, micro_metrics = 0.0, []
            for rows in parts:
                loss, metrics = losses(micro_params, batch, rows, agg)[k]
                loss.backward()  # gradients accumulate, as in the trainer
                micro_total = micro_total + loss.detach()
                micro_metrics.append(metrics)
            assert full_params.grad.abs().sum() > 0, (mode, k)  # the case is not vacuous
            torch.testing.assert_close(micro_params.grad, full_params.grad, atol=1e-6, rtol=0)
            torch.testing.assert_close(micro_total, full_loss.detach(), atol=1e-6, rtol=0)
            combined = reduce_metrics(micro_metrics)
            for name, value in full_metrics.items():
                torch.testing.assert_close(combined[name], value, atol=1e-6, rtol=0)

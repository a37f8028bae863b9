"""meshrl.algos losses, IS weights, KL, entropy, aggregation and metrics: hand-computed cases,
hypothesis properties (zero loss at ratio 1 / zero advantage, masked positions inert, finiteness)
and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import (
    MaskedSeqIS,
    MaskedTokenIS,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    TokenMean,
    TruncatedSeqIS,
    TruncatedTokenIS,
    decoupled_ppo_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimator,
    kl_in_reward,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    make_aggregator,
    make_importance_sampling,
    make_policy_loss,
    ppo_policy_loss,
    reduce_metrics,
    value_loss,
)

torch.set_num_threads(1)
F64 = torch.float64
NAN, INF = float("nan"), float("inf")
PROPS = settings(max_examples=30, deadline=None)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# --- aggregation and metrics ----------------------------------------------------------------


def test_aggregators_hand_computed():
    x = t([[1, 2, 3], [4, 5, NAN]])
    mask = t([[1, 1, 0], [1, 0, 0]]).bool()
    close(TokenMean(num_tokens=6)(x, mask), 7 / 6)  # (1 + 2 + 4) / 6
    close(SeqMeanTokenMean(num_seqs=4)(x, mask), 1.375)  # (1.5 + 4) / 4
    close(SeqMeanTokenSum(num_seqs=2, max_tokens=10)(x, mask), 0.35)  # 7 / 20
    close(make_aggregator("seq_mean_token_sum", num_seqs=2, max_tokens=10)(x, mask), 0.35)
    assert isinstance(make_aggregator("token_mean", num_tokens=t(6.0)), TokenMean)


def test_reduce_metrics_hand_computed():
    mbs = [
        {"num_tokens": t(2.0), "ratio_mean": t(1.0), "ratio_max": t(1.5)},
        {"num_tokens": t(6.0), "ratio_mean": t(2.0), "ratio_max": t(1.2)},
        {"num_tokens": t(0.0), "ratio_mean": t(0.0), "ratio_max": t(0.0)},
    ]
    out = reduce_metrics(mbs)
    close(out["num_tokens"], 8.0)
    close(out["ratio_mean"], 1.75)  # (2·1 + 6·2) / 8
    close(out["ratio_max"], 1.5)


# --- PPO ------------------------------------------------------------------------------------


def ppo_case():
    # Ratios 1.5, 0.5, 1.1, 2.0 on 4 valid tokens; a 5th masked token holds inf/NaN garbage.
    old = t([[-1.0, -1.0, -1.0, -1.0, NAN]])
    logprobs = (old + t([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(2.0), 0]]))
    logprobs = torch.where(torch.isnan(logprobs), -INF, logprobs).requires_grad_()
    adv = t([[1.0, -1.0, -2.0, -1.0, NAN]])
    mask = t([[1, 1, 1, 1, 0]]).bool()
    return logprobs, old, adv, mask


def test_ppo_hand_computed_asymmetric_clip():
    logprobs, old, adv, mask = ppo_case()
    loss, m = ppo_policy_loss(
        logprobs, old, adv, mask, aggregate=TokenMean(4), clip_low=0.2, clip_high=0.28
    )
    loss.backward()
    # Per token: max(−1.5, −1.28) = −1.28 (clipped high); max(0.5, 0.8) = 0.8 (clipped low);
    # 2.2 and 2.0 unclipped. Sum 3.72 / 4.
    close(loss, 0.93)
    close(logprobs.grad, [[0, 0, 2.2 / 4, 2.0 / 4, 0]])
    close(m["clip_frac_high"], 0.25)
    close(m["clip_frac_low"], 0.25)
    close(m["ratio_mean"], 1.275)
    close(m["ratio_max"], 2.0)
    # mean of r − 1 − log r over 1.5, 0.5, 1.1, 2.0
    close(m["approx_kl"], (0.0945349 + 0.1931472 + 0.0046898 + 0.3068528) / 4)
    close(m["num_tokens"], 4.0)
    assert "mismatch_kl" not in m and "entropy" not in m


def test_ppo_dual_clip_hand_computed():
    logprobs, old, adv, mask = ppo_case()
    loss, m = ppo_policy_loss(
        logprobs, old, adv, mask, aggregate=TokenMean(4), clip_high=0.28, dual_clip=1.5
    )
    loss.backward()
    # Token 3 (A = −1, ρ = 2): min(2.0, 1.5) = 1.5, no gradient. Sum 3.22 / 4.
    close(loss, 0.805)
    close(logprobs.grad, [[0, 0, 0.55, 0, 0]])
    close(m["dual_clip_frac"], 0.25)


def is_case():
    # Importance ratios target/behaviour of 0.5, 1, 3, 1.5 on one row of 4 valid tokens.
    target = t([[-1.0, -1.0, -1.0, -1.0]])
    behavior = target - t([[math.log(0.5), 0.0, math.log(3.0), math.log(1.5)]])
    return target, behavior, torch.ones(1, 4, dtype=torch.bool)


def test_token_is_weights_hand_computed():
    target, behavior, mask = is_case()
    w = TruncatedTokenIS(cap=2.0)(target, behavior, mask)
    close(w.weights, [[0.5, 1.0, 2.0, 1.5]])
    close(w.metrics["is_truncated_frac"], 0.25)
    close(w.metrics["is_weight_mean"], 1.25)
    close(w.metrics["is_weight_max"], 2.0)
    w = MaskedTokenIS(low=0.6, high=2.0)(target, behavior, mask)
    close(w.weights, [[0.0, 1.0, 0.0, 1.5]])
    close(w.metrics["is_dropped_frac"], 0.5)


def test_sequence_is_weights_hand_computed():
    # Row 0: ρ 0.5·1·3·1.5 = 2.25. Row 1: 2·0.25 = 0.5 on 2 valid tokens.
    target = t([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, NAN, NAN]])
    rho = t([[0.5, 1.0, 3.0, 1.5], [2.0, 0.25, 1.0, 1.0]])
    behavior = target - rho.log()
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    w = TruncatedSeqIS(cap=2.0)(target, behavior, mask)
    close(w.weights, [[2, 2, 2, 2], [0.5, 0.5, 0, 0]])
    close(w.metrics["is_weight_mean"], 1.5)  # (8 + 1) / 6
    close(w.metrics["is_truncated_frac"], 4 / 6)
    w = MaskedSeqIS(low=0.6, high=3.0)(target, behavior, mask)
    close(w.weights, [[2.25, 2.25, 2.25, 2.25], [0, 0, 0, 0]])
    close(w.metrics["is_dropped_frac"], 2 / 6)


def test_ppo_with_truncated_is_and_mismatch_kl():
    target, behavior, mask = is_case()
    logprobs = target.clone().requires_grad_()
    loss, m = ppo_policy_loss(
        logprobs, target, t([1.0]), mask, aggregate=TokenMean(4), behavior_logprobs=behavior,
        importance_sampling=make_importance_sampling("truncated_token", is_cap=2.0),
    )
    loss.backward()
    close(loss, -1.25)  # −(0.5 + 1 + 2 + 1.5) / 4 with [B] advantages broadcast
    close(logprobs.grad, [[-0.125, -0.25, -0.5, -0.375]])
    # k3 of KL(behaviour ‖ current): ρ − 1 − log ρ for ρ = 0.5, 1, 3, 1.5
    close(m["mismatch_kl"], (0.1931472 + 0 + 0.9013877 + 0.0945349) / 4)
    close(m["is_weight_max"], 2.0)


def test_decoupled_ppo_hand_computed():
    proximal = t([[-1.0, -1.0]])
    logprobs = (proximal + t([[math.log(1.5), math.log(0.9)]])).requires_grad_()
    behavior = proximal - t([[math.log(0.5), math.log(3.0)]])  # weights π_prox/π_behav = 0.5, 3
    loss, m = decoupled_ppo_loss(
        logprobs, proximal, behavior, t([[1.0, 1.0]]), torch.ones(1, 2), aggregate=TokenMean(2),
        clip_low=0.2, clip_high=0.2, is_cap=4.0,
    )
    loss.backward()
    # Token 0: max(−1.5, −1.2)·0.5 = −0.6 (clipped); token 1: −0.9·3 = −2.7.
    close(loss, -1.65)
    close(logprobs.grad, [[0.0, -1.35]])
    close(m["is_dropped_frac"], 0.0)
    loss, m = decoupled_ppo_loss(
        logprobs, proximal, behavior, t([1.0]), torch.ones(1, 2), aggregate=TokenMean(2), is_cap=2.0
    )
    close(loss, -0.3)  # token 1's weight 3 > cap: dropped, still counted in the normaliser
    close(m["is_dropped_frac"], 0.5)


def test_gspo_hand_computed():
    old = t([[-1.0, -1.0, -1.0], [-1.0, NAN, NAN]])
    logprobs = (old + t([[0.3, -0.1, 0.1], [-0.5, 0, 0]])).nan_to_num(nan=0.0).requires_grad_()
    mask = t([[1, 1, 1], [1, 0, 0]]).bool()
    loss, m = gspo_policy_loss(
        logprobs, old, t([2.0, -1.0]), mask, aggregate=SeqMeanTokenMean(2), clip_low=0.2,
        clip_high=0.2,
    )
    loss.backward()
    # Row 0: s = e^0.1 = 1.1051709, −2s unclipped. Row 1: s = e^−0.5 < 0.8, A < 0 → 0.8 (clipped).
    close(loss, (-2 * 1.1051709 + 0.8) / 2)
    # ∂/∂log π_t of −A·s/3 per row-0 token, then / num_seqs = 2.
    g = -2 * 1.1051709 / 3 / 2
    close(logprobs.grad, [[g, g, g], [0, 0, 0]])
    close(m["clip_frac_low"], 0.25)
    close(m["ratio_mean"], (3 * 1.1051709 + 0.6065307) / 4)
    close(m["approx_kl"], (0.0498588 + 0.0048374 + 0.0051709 + 0.1065307) / 4)
    loss, m = gspo_policy_loss(
        logprobs, old, t([2.0, 0.0]), mask, aggregate=SeqMeanTokenMean(2), clip_high=0.05
    )
    close(loss, -2 * 1.05 / 2)
    close(m["clip_frac_high"], 0.75)


def test_make_policy_loss_binds_the_same_functions():
    target, behavior, mask = is_case()
    adv = t([[1.0, -1.0, 2.0, -0.5]])
    lp = target + t([[0.3, -0.3, 0.05, 0.5]])
    tis = TruncatedTokenIS(2.0)
    agg = TokenMean(4)
    pairs = [
        (
            make_policy_loss("ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0),
            ppo_policy_loss(
                lp, target, adv, mask, aggregate=agg, clip_high=0.28, dual_clip=3.0,
                behavior_logprobs=behavior,
            ),
        ),
        (
            make_policy_loss("decoupled_ppo", clip_low=0.2, clip_high=0.2, is_cap=2.0),
            decoupled_ppo_loss(lp, target, behavior, adv, mask, aggregate=agg, is_cap=2.0),
        ),
        (
            make_policy_loss("gspo", clip_low=0.1, clip_high=0.1, importance_sampling=tis),
            gspo_policy_loss(
                lp, target, adv, mask, aggregate=agg, clip_low=0.1, clip_high=0.1,
                behavior_logprobs=behavior, importance_sampling=tis,
            ),
        ),
    ]
    for bound, (expected_loss, expected_metrics) in pairs:
        loss, metrics = bound(lp, target, behavior, adv, mask, aggregate=agg)
        assert torch.equal(loss, expected_loss), bound
        assert metrics.keys() == expected_metrics.keys()
    # The decoupled loss really applies the cap: token 2 (weight 3) is dropped.
    _, m = make_policy_loss("decoupled_ppo", clip_low=0.2, clip_high=0.2, is_cap=2.0)(
        lp, target, behavior, adv, mask, aggregate=agg
    )
    close(m["is_dropped_frac"], 0.25)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        make_policy_loss("ppo2", clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="`dual_clip`"):
        make_policy_loss("gspo", clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    with pytest.raises(ValueError, match="`behavior_logprobs`"):
        make_policy_loss("decoupled_ppo", clip_low=0.2, clip_high=0.2)(
            lp, target, None, adv, mask, aggregate=agg
        )


# --- value, entropy, KL ---------------------------------------------------------------------


def test_value_loss_hand_computed():
    values = t([[1.0, 2.0, 1.0, NAN]]).requires_grad_()
    old, returns = t([[1.5, 1.5, 1.5, NAN]]), t([[2.0, 1.0, 0.0, INF]])
    mask = t([[1, 1, 1, 0]]).bool()
    loss, m = value_loss(values, old, returns, mask, aggregate=TokenMean(3), clip=0.2)
    loss.backward()
    # Errors 1, 1, 1; clipped errors 0.49, 0.49, 1.69 (V_clip = 1.3). ½(1 + 1 + 1.69) / 3.
    close(loss, 0.615)
    close(values.grad, [[-1 / 3, 1 / 3, 0, 0]])
    close(m["value_clip_frac"], 1 / 3)
    close(m["value_error"], 1.0)
    values.grad = None
    loss, _ = value_loss(values, old, returns, mask, aggregate=TokenMean(3))
    loss.backward()
    close(loss, 0.5)
    close(values.grad, [[-1 / 3, 1 / 3, 1 / 3, 0]])


def test_entropy_hand_computed():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, -INF, 0.0, -INF]]]).requires_grad_()
    h = entropy_from_logits(logits)
    close(h, [[math.log(4), math.log(2)]])
    probs = t([[0.5, 0.25, 0.25]])
    close(entropy_from_logits(probs.log()), [1.0397208])  # ½ ln 2 + ½ ln 4
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 1, [1, 3]] == 0).all()


def test_kl_estimators_hand_computed():
    lp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    close(kl_k1(lp, ref), [[0.5, -1.0]])
    close(kl_k2(lp, ref), [[0.125, 0.5]])
    close(kl_k3(lp, ref), [[0.1065307, 0.7182818]])
    close(kl_k3(lp, ref, t([[1, 0]])), [[0.1065307, 0.0]])
    assert kl_estimator("k2") is kl_k2
    close(kl_in_reward(t([[0.0, 1.0]]), lp, ref, torch.ones(1, 2), kl_coef=0.1), [[-0.05, 1.1]])
    lp = lp.clone().requires_grad_()
    loss, m = kl_loss(lp, ref, torch.ones(1, 2), aggregate=TokenMean(2), estimator=kl_k3)
    loss.backward()
    close(loss, 0.41240625)
    close(lp.grad, [[(1 - 0.6065307) / 2, (1 - 2.7182818) / 2]])
    close(m["kl"], 0.41240625)


# --- properties -----------------------------------------------------------------------------

lp_values = st.floats(-30, 0, allow_nan=False)
any_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
modes = st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])


@st.composite
def loss_batch(draw, elements=lp_values):
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    def grid(elements):
        return draw(st.lists(st.lists(elements, min_size=n, max_size=n), min_size=b, max_size=b))

    mask = torch.tensor(grid(st.booleans()))
    grid_t = lambda e: t(grid(e))  # noqa: E731
    return grid_t(elements), grid_t(elements), grid_t(elements), grid_t(any_finite), mask


def aggregator(mode, mask):
    return make_aggregator(
        mode, num_tokens=max(1, int(mask.sum())), num_seqs=mask.shape[0], max_tokens=mask.shape[1]
    )


def all_losses(lp, old, behav, adv, mask, agg, values=None):
    """Every loss in the package on the same inputs: name → (loss, metrics)."""
    lps = {}
    out = {}
    for name in ("ppo", "ppo_tis", "decoupled", "gspo", "value", "kl"):
        lps[name] = lp.detach().clone().requires_grad_()
    out["ppo"] = ppo_policy_loss(
        lps["ppo"], old, adv, mask, aggregate=agg, clip_high=0.28, dual_clip=3.0,
        behavior_logprobs=behav,
    )
    out["ppo_tis"] = ppo_policy_loss(
        lps["ppo_tis"], old, adv, mask, aggregate=agg, behavior_logprobs=behav,
        importance_sampling=MaskedSeqIS(0.5, 2.0),
    )
    out["decoupled"] = decoupled_ppo_loss(
        lps["decoupled"], old, behav, adv, mask, aggregate=agg, is_cap=5.0
    )
    out["gspo"] = gspo_policy_loss(
        lps["gspo"], old, adv, mask, aggregate=agg, behavior_logprobs=behav,
        importance_sampling=TruncatedSeqIS(2.0),
    )
    out["value"] = value_loss(
        lps["value"], old if values is None else values, adv, mask, aggregate=agg, clip=0.5
    )
    out["kl"] = kl_loss(lps["kl"], old, mask, aggregate=agg)
    for name, (loss, _) in out.items():
        loss.backward()
    return {name: (loss.detach(), metrics, lps[name].grad) for name, (loss, metrics) in out.items()}


@PROPS
@given(loss_batch(), modes)
def test_ratio_one_and_zero_advantage_give_zero_loss_and_gradient(batch, mode):
    lp, _, behav, _, mask = batch
    agg = aggregator(mode, mask)
    zero_adv = torch.zeros_like(lp)
    for fn in (
        lambda x: ppo_policy_loss(x, lp, zero_adv, mask, aggregate=agg, dual_clip=2.0),
        lambda x: decoupled_ppo_loss(x, lp, behav, zero_adv, mask, aggregate=agg),
        lambda x: gspo_policy_loss(x, lp, zero_adv[:, 0], mask, aggregate=agg),
    ):
        x = lp.clone().requires_grad_()
        loss, m = fn(x)
        loss.backward()
        assert loss.item() == 0.0
        assert (x.grad == 0).all()
        assert m["approx_kl"].item() == 0.0 and m["clip_frac_low"].item() == 0.0


@PROPS
@given(loss_batch(), modes, st.sampled_from([NAN, INF, -INF, -7.0]))
def test_masked_positions_change_nothing(batch, mode, junk):
    lp, old, behav, adv, mask = batch
    agg = aggregator(mode, mask)
    clean = all_losses(lp, old, behav, adv, mask, agg)
    j = lambda x: torch.where(mask, x, junk)  # noqa: E731
    dirty = all_losses(j(lp), j(old), j(behav), j(adv), mask, agg)
    for name in clean:
        loss, metrics, grad = clean[name]
        loss2, metrics2, grad2 = dirty[name]
        assert torch.equal(loss, loss2), name
        assert torch.equal(grad, grad2), name
        assert (grad2[~mask] == 0).all(), name
        assert metrics.keys() == metrics2.keys()
        for k in metrics:
            assert torch.equal(metrics[k], metrics2[k]), (name, k)


@PROPS
@given(loss_batch(elements=any_finite), modes)
def test_no_nan_or_inf_for_finite_inputs(batch, mode):
    lp, old, behav, adv, mask = batch
    agg = aggregator(mode, mask)
    for name, (loss, metrics, grad) in all_losses(lp, old, behav, adv, mask, agg).items():
        assert torch.isfinite(loss), name
        assert torch.isfinite(grad).all(), name
        for k, v in metrics.items():
            assert torch.isfinite(v), (name, k)
    for est in (kl_k1, kl_k2, kl_k3):
        assert torch.isfinite(est(lp, old, mask)).all()
    assert torch.isfinite(entropy_from_logits(lp)).all()


def test_all_masked_rows_and_batches_are_finite():
    lp = t([[-1.0, NAN], [NAN, NAN]]).requires_grad_()
    mask = t([[1, 0], [0, 0]]).bool()
    for m in (mask, torch.zeros_like(mask)):
        agg = SeqMeanTokenMean(2)
        x = lp.detach()
        res = all_losses(x, x, x, torch.zeros(2, 2, dtype=F64), m, agg)
        for name, (loss, metrics, grad) in res.items():
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
            assert all(torch.isfinite(v) for v in metrics.values()), name


# --- bad input ------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    lp, mask, agg = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3), TokenMean(6)
    with pytest.raises(ValueError, match="`old_logprobs`"):
        ppo_policy_loss(lp, torch.zeros(2, 4, dtype=F64), lp, mask, aggregate=agg)
    with pytest.raises(ValueError, match="`logprobs`.*floating"):
        ppo_policy_loss(lp.long(), lp, lp, mask, aggregate=agg)
    with pytest.raises(ValueError, match="`advantages`"):
        ppo_policy_loss(lp, lp, torch.zeros(3, dtype=F64), mask, aggregate=agg)
    with pytest.raises(ValueError, match="`mask`"):
        ppo_policy_loss(lp, lp, lp, torch.ones(2, 2), aggregate=agg)
    with pytest.raises(ValueError, match="`proximal_logprobs`"):
        decoupled_ppo_loss(lp, lp[:1], lp, lp, mask, aggregate=agg)
    with pytest.raises(ValueError, match="`behavior_logprobs`"):
        gspo_policy_loss(lp, lp, lp, mask, aggregate=agg, behavior_logprobs=lp[:, :2])
    with pytest.raises(ValueError, match="`importance_sampling` needs `behavior_logprobs`"):
        ppo_policy_loss(lp, lp, lp, mask, aggregate=agg, importance_sampling=TruncatedTokenIS(2))
    with pytest.raises(ValueError, match="not both"):
        decoupled_ppo_loss(
            lp, lp, lp, lp, mask, aggregate=agg, is_cap=2.0,
            importance_sampling=TruncatedTokenIS(2),
        )
    with pytest.raises(ValueError, match="`clip_low`"):
        ppo_policy_loss(lp, lp, lp, mask, aggregate=agg, clip_low=1.0)
    with pytest.raises(ValueError, match="`dual_clip`"):
        ppo_policy_loss(lp, lp, lp, mask, aggregate=agg, dual_clip=0.9)
    with pytest.raises(ValueError, match="`returns`"):
        value_loss(lp, lp, lp[:, :1], mask, aggregate=agg)
    with pytest.raises(ValueError, match="`ref_logprobs`"):
        kl_k3(lp, lp[0])
    with pytest.raises(ValueError, match="`entropy`"):
        ppo_policy_loss(lp, lp, lp, mask, aggregate=agg, entropy=lp[0])
    with pytest.raises(ValueError, match="`logits`"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="`num_tokens`"):
        TokenMean(0)
    with pytest.raises(ValueError, match="`max_tokens`"):
        make_aggregator("seq_mean_token_sum", num_seqs=2)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        make_aggregator("mean", num_tokens=1)
    with pytest.raises(ValueError, match="unknown mode"):
        make_importance_sampling("clip", is_cap=2)
    with pytest.raises(ValueError, match="`is_cap`"):
        make_importance_sampling("truncated_seq")
    with pytest.raises(ValueError, match="low < high"):
        MaskedTokenIS(2.0, 1.0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimator("k4")
    with pytest.raises(ValueError, match="`per_token`"):
        TokenMean(3)(torch.zeros(3, dtype=F64), torch.ones(3))


def test_algos_imports_only_torch():
    import subprocess
    import sys

    code = (
        "import sys, meshrl.algos as a;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('msgspec', 'ray')"
        " or (m.startswith('meshrl.') and not m.startswith('meshrl.algos')));"
        "assert not bad, bad; assert all(hasattr(a, n) for n in a.__all__)"
    )
    env = {"OMP_NUM_THREADS": "1", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)

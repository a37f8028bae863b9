"""meshrl.algos.advantages: hand-computed cases, hypothesis properties and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshrl.algos import (
    discounted_returns,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

torch.set_num_threads(1)
F64 = torch.float64
NAN = float("nan")
PROPS = settings(max_examples=40, deadline=None)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# --- hand-computed --------------------------------------------------------------------------


def test_gae_hand_computed_with_hole_padding_and_bootstrap():
    # Row 0: plain. Row 1: same valid tokens with a masked tool token in the middle and NaN
    # garbage in masked slots. Row 2: row 0 truncated, bootstrapped with V(s_T) = 2.
    rewards = t([[0, 0, 1, 0, 0], [0, NAN, 0, 1, NAN], [0, 0, 1, 0, 0]])
    values = t([[0.5, 0.6, 0.7, 0, 0], [0.5, 9.0, 0.6, 0.7, NAN], [0.5, 0.6, 0.7, 0, 0]])
    mask = t([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 0, 0]]).bool()
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap_values=t([0, 0, 2.0]))
    # δ2 = 1 − 0.7 = 0.3; δ1 = 0.9·0.7 − 0.6 = 0.03; A1 = 0.03 + 0.72·0.3 = 0.246;
    # δ0 = 0.9·0.6 − 0.5 = 0.04; A0 = 0.04 + 0.72·0.246 = 0.21712. Bootstrap: δ2 = 1 + 1.8 − 0.7.
    expected_adv = t(
        [
            [0.21712, 0.246, 0.3, 0, 0],
            [0.21712, 0, 0.246, 0.3, 0],
            [1.15024, 1.542, 2.1, 0, 0],
        ]
    )
    expected_ret = t(
        [
            [0.71712, 0.846, 1.0, 0, 0],
            [0.71712, 0, 0.846, 1.0, 0],
            [1.65024, 2.142, 2.8, 0, 0],
        ]
    )
    torch.testing.assert_close(adv, expected_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, expected_ret, atol=1e-12, rtol=0)


def test_gae_lambda_zero_is_one_step_td():
    rewards, values = t([[1.0, 2.0]]), t([[0.5, 1.5]])
    adv, _ = gae(rewards, values, torch.ones(1, 2, dtype=torch.bool), gamma=0.5, lam=0.0)
    # A0 = 1 + 0.5·1.5 − 0.5 = 1.25; A1 = 2 − 1.5 = 0.5
    torch.testing.assert_close(adv, t([[1.25, 0.5]]))


def test_gae_outputs_are_detached():
    values = t([[0.5, 0.6]]).requires_grad_()
    adv, ret = gae(t([[0.0, 1.0]]), values, torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_discounted_returns_hand_computed_skips_masked():
    rewards = t([[1, 2, 3, 0], [1, 100, 2, 3]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 1]])  # float 0/1 masks are accepted
    out = discounted_returns(rewards, mask, gamma=0.5)
    # G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    torch.testing.assert_close(out, t([[2.75, 3.5, 3.0, 0], [2.75, 0, 3.5, 3.0]]))


def test_reinforce_pp_hand_computed():
    rewards = t([[0, 0, 1], [0, -1, 7]])
    mask = t([[1, 1, 1], [1, 1, 0]]).bool()
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    # Returns 1,1,1,-1,-1: mean 0.2, population var (3·0.64 + 2·1.44)/5 = 0.96.
    std = math.sqrt(0.96)
    expected = t([[0.8 / std, 0.8 / std, 0.8 / std], [-1.2 / std, -1.2 / std, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[0, 0], t(0.8164966), atol=1e-5, rtol=0)


def test_reinforce_pp_all_masked_is_zero():
    adv = reinforce_pp_advantages(t([[NAN, 1.0]]), torch.zeros(1, 2, dtype=torch.bool))
    assert torch.equal(adv, t([[0.0, 0.0]]))


REWARDS = [1, 2, 0, 0.5, 0, 4, 1]
GROUPS = [10, 7, 10, -3, 10, 7, 10]  # arbitrary ids, sizes 4, 2 and 1


def test_grpo_hand_computed_unequal_groups():
    adv = grpo_advantages(t(REWARDS), torch.tensor(GROUPS))
    # Group 10: mean 0.5, Bessel std sqrt(1/3) → ±0.8660254; group 7: mean 3, std sqrt(2).
    expected = t([0.8660254, -0.7071068, -0.8660254, 0, -0.8660254, 0.7071068, 0.8660254])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_dr_grpo_drops_std():
    adv = grpo_advantages(t(REWARDS), torch.tensor(GROUPS), scale_by_std=False)
    torch.testing.assert_close(adv, t([0.5, -1, -0.5, 0, -0.5, 1, 0.5]))


def test_grpo_constant_group_is_zero_not_nan():
    adv = grpo_advantages(t([3.0, 3.0, 3.0]), torch.tensor([1, 1, 1]))
    assert torch.equal(adv, t([0.0, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize(("value", "n"), [(0.7, 7), (0.3, 6), (0.1, 8), (0.1, 3)])
def test_constant_group_is_exactly_zero_in_float32_too(dtype, value, n):
    """In float32 the rounded mean of seven 0.7s left r − mean ≈ 6e-8 and a Bessel std as small:
    divided by std + 1e-6 that was a same-sign advantage of 0.056 on every sample of the group."""
    rewards, groups = torch.full((n,), value, dtype=dtype), torch.zeros(n, dtype=torch.long)
    for adv in (grpo_advantages(rewards, groups), grpo_advantages(rewards, groups, scale_by_std=False),
                rloo_advantages(rewards, groups)):
        assert adv.dtype == dtype and torch.equal(adv, torch.zeros(n, dtype=dtype))
    token_rewards = torch.zeros(n, 3, dtype=dtype)
    token_rewards[:, -1] = value  # REINFORCE++: the same return on every valid token of the batch
    adv = reinforce_pp_advantages(token_rewards, torch.ones(n, 3, dtype=torch.bool))
    assert adv.dtype == dtype and torch.equal(adv, torch.zeros(n, 3, dtype=dtype))


def test_non_finite_rewards_still_poison_their_group():
    """The exact zero for constant groups must not hide a NaN/inf reward (the trainer skips such a
    step because its loss is not finite)."""
    for bad in (NAN, math.inf):
        rewards, groups = t([bad, bad, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
        for adv in (grpo_advantages(rewards, groups), rloo_advantages(rewards, groups)):
            assert adv[:2].isnan().all() and adv[2:].isfinite().all()
        token_rewards = t([[0.0, bad], [0.0, bad]])
        assert reinforce_pp_advantages(token_rewards, torch.ones(2, 2)).isnan().all()


def test_rloo_hand_computed():
    adv = rloo_advantages(t(REWARDS), torch.tensor(GROUPS))
    # r=1 in group 10: others (0, 0, 1) mean 1/3 → 2/3; group 7: 2 − 4 = −2.
    expected = t([2 / 3, -2, -2 / 3, 0, -2 / 3, 2, 2 / 3])
    torch.testing.assert_close(adv, expected)


# --- properties -----------------------------------------------------------------------------

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def token_batch(draw, max_b=4, max_t=6):
    b = draw(st.integers(1, max_b))
    n = draw(st.integers(1, max_t))
    def grid(elements):
        return draw(st.lists(st.lists(elements, min_size=n, max_size=n), min_size=b, max_size=b))

    return t(grid(finite)), t(grid(finite)), torch.tensor(grid(st.booleans()))


@PROPS
@given(token_batch())
def test_gae_gamma_lambda_one_is_reward_to_go_minus_value(batch):
    rewards, values, mask = batch
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # Reward-to-go over valid tokens, computed independently with a reversed masked cumsum.
    r = torch.where(mask, rewards, 0.0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    expected = torch.where(mask, to_go - values, 0.0)
    tol = 1e-9 * (1 + rewards.abs().sum() + values.abs().max())
    torch.testing.assert_close(adv, expected, atol=tol, rtol=0)
    torch.testing.assert_close(ret, torch.where(mask, to_go, 0.0), atol=tol, rtol=0)


@PROPS
@given(token_batch(), st.floats(0, 1), st.floats(0, 1), st.data())
def test_gae_masked_positions_change_nothing(batch, gamma, lam, data):
    rewards, values, mask = batch
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    junk = data.draw(st.sampled_from([NAN, math.inf, -math.inf, 123.0]))
    dirty_rewards, dirty_values = torch.where(mask, rewards, junk), torch.where(mask, values, junk)
    adv2, ret2 = gae(dirty_rewards, dirty_values, mask, gamma=gamma, lam=lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@PROPS
@given(token_batch(), st.floats(0, 1))
# returns near 1e6 a hair apart: the mean's rounding (1e-10), divided by std + eps, once summed to 1e-4
@example(batch=(torch.tensor([[0.0, -1e6], [0.0, -1e6 + 1e-10]], dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64),
                torch.tensor([[False, True], [False, True]])), gamma=0.0)
def test_reinforce_pp_finite_zero_mean_masked_zero(batch, gamma):
    rewards, _, mask = batch
    adv = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    assert torch.isfinite(adv).all()
    assert (adv[~mask] == 0).all()
    assert abs(float(adv.sum())) < 1e-6 * max(1, int(mask.sum()))


@st.composite
def grouped(draw, dtype=F64):
    n = draw(st.integers(1, 12))
    # a few repeated values, so that groups of equal rewards (all right, all wrong) come up
    element = st.one_of(finite, st.sampled_from([0.0, 0.1, 0.7, 1.0]))
    rewards = t(draw(st.lists(element, min_size=n, max_size=n)), dtype)
    ids = torch.tensor(draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4)))
    which = draw(st.lists(st.integers(0, len(ids) - 1), min_size=n, max_size=n))
    groups = ids[torch.tensor(which)]
    return rewards, groups


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])  # float32: the trainer's
@PROPS
@given(data=st.data(), scale_by_std=st.booleans())
def test_group_advantages_sum_to_zero_per_group(dtype, data, scale_by_std):
    rewards, groups = data.draw(grouped(dtype))
    grpo = grpo_advantages(rewards, groups, scale_by_std=scale_by_std)
    rel = 1e-9 if dtype == F64 else 1e-6  # the result is rounded to the input's dtype
    for adv in (grpo, rloo_advantages(rewards, groups)):
        assert torch.isfinite(adv).all() and adv.dtype == dtype
        for g in groups.unique():
            sel = groups == g
            scale = 1 + float(rewards[sel].abs().max())  # rounding grows with the rewards
            assert abs(float(adv[sel].double().sum())) <= rel * int(sel.sum()) * scale
            if (rewards[sel] == rewards[sel][0]).all():
                assert (adv[sel] == 0).all()  # all right or all wrong: exactly no signal


# --- bad input ------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
    r, m = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3)
    with pytest.raises(ValueError, match="`values`"):
        gae(r, torch.zeros(2, 4, dtype=F64), m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="`mask`"):
        gae(r, r, torch.ones(3, 2), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="`token_rewards`.*floating"):
        discounted_returns(torch.zeros(2, 3, dtype=torch.long), m, gamma=1.0)
    with pytest.raises(ValueError, match="`token_rewards`.*2 dims"):
        discounted_returns(torch.zeros(3, dtype=F64), torch.ones(3), gamma=1.0)
    with pytest.raises(ValueError, match="`gamma`"):
        gae(r, r, m, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="`lam`"):
        gae(r, r, m, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="`bootstrap_values`"):
        gae(r, r, m, gamma=1.0, lam=1.0, bootstrap_values=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="`group_ids`.*integer"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="`group_ids`.*shape"):
        rloo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="`rewards`"):
        grpo_advantages(torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long))


def test_informative_groups_marks_only_groups_whose_rewards_differ():
    from meshrl.algos import informative_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5 + 1e-9, 2.0])
    groups = torch.tensor([7, 7, -3, -3, 40, 40, 5, 5, 9])  # arbitrary ids; 9 is a group of one
    keep = informative_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False]
    # interleaved ids: membership, not position, decides
    keep = informative_groups(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([1, 2, 2, 1]))
    assert keep.tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="group_ids"):
        informative_groups(rewards, groups[:3])

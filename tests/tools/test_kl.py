"""KL estimators k1/k2/k3, verl's kl_penalty modes, and the KL coefficient controllers."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossplug import LossplugError
from lossplug.tools.kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    ProportionalKLController,
    k1,
    k2,
    k3,
    kl_penalty,
    kl_shaped_rewards,
)


def _pair(B=4, T=6, dtype=torch.float64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    ref = logp + torch.randn(B, T, generator=g, dtype=dtype) * spread
    return logp, ref


def test_formulas_on_a_small_example():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    torch.testing.assert_close(k1(logp, ref), torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(k2(logp, ref), torch.tensor([0.125, 0.5, 0.0], dtype=torch.float64))
    d = ref - logp
    torch.testing.assert_close(k3(logp, ref), d.exp() - d - 1)
    assert k3(logp, ref)[2] == 0


def test_gradients_flow_through_logp_only():
    logp, ref = _pair(seed=1)
    lp = logp.clone().requires_grad_()
    rf = ref.clone().requires_grad_()
    for fn, expected in ((k1, torch.ones_like(logp)), (k2, logp - ref), (k3, 1 - (ref - logp).exp())):
        lp.grad = None
        out = fn(lp, rf)
        assert torch.autograd.grad(out.sum(), rf, allow_unused=True, retain_graph=True)[0] is None
        out.sum().backward()
        torch.testing.assert_close(lp.grad, expected)


def test_gradcheck_k3_and_k2_float64():
    logp, ref = _pair(B=3, T=4, seed=2)
    lp = logp.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: k3(x, ref), (lp,))
    assert torch.autograd.gradcheck(lambda x: k2(x, ref), (lp,))
    mask = torch.rand(3, 4) < 0.6
    assert torch.autograd.gradcheck(lambda x: k3(x, ref, mask), (lp,))


def test_k3_is_finite_at_plus_minus_100_in_float32_and_float64():
    for dtype in (torch.float32, torch.float64):
        logp = torch.tensor([0.0, -100.0, -50.0], dtype=dtype, requires_grad=True)
        ref = torch.tensor([-100.0, 0.0, -50.0], dtype=dtype)
        out = k3(logp, ref)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()
        assert out[0].item() == pytest.approx(99.0)  # δ = −100: exp(−100) + 100 − 1, no clamp below
        assert out[1].item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)  # δ = +100 clamped at 20
        assert logp.grad[1] == 0  # zero gradient where the clamp is active


def test_half_precision_is_computed_in_float32():
    logp = torch.tensor([0.0], dtype=torch.float16)
    ref = torch.tensor([-100.0], dtype=torch.float16)
    assert k3(ref, logp).dtype == torch.float32
    assert torch.isfinite(k3(ref, logp)).all()


@given(st.lists(st.floats(-100, 100), min_size=1, max_size=16), st.lists(st.floats(-100, 0), min_size=1, max_size=16))
def test_property_k2_k3_nonnegative_and_finite(deltas, logps):
    n = min(len(deltas), len(logps))
    for dtype in (torch.float32, torch.float64):
        logp = torch.tensor(logps[:n], dtype=dtype, requires_grad=True)
        ref = logp.detach() + torch.tensor(deltas[:n], dtype=dtype)
        for fn in (k2, k3, lambda a, b: kl_penalty(a, b, "abs")):
            out = fn(logp, ref)
            assert torch.isfinite(out).all()
            assert (out >= 0).all()
        # verl's low_var_kl is exp(δ) − δ − 1 evaluated naively: ≥ 0 only up to rounding (see the next test)
        assert (kl_penalty(logp, ref, "low_var_kl") >= -1e-6).all()
        (g,) = torch.autograd.grad(k3(logp, ref).sum(), logp)
        assert torch.isfinite(g).all()


@given(st.integers(2, 12), st.integers(0, 10_000), st.floats(0.1, 4.0))
def test_property_k1_and_k3_are_unbiased_kl_estimators(vocab, seed, scale):
    """Σ_x π(x)·k(x) over the whole support is KL(π‖π_ref) ≥ 0 for k1 and k3 (k2 is biased)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, -1)
    ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, -1)
    p = logp.exp()
    kl = (p * (logp - ref)).sum()
    assert kl >= -1e-12
    torch.testing.assert_close((p * k1(logp, ref)).sum(), kl)
    torch.testing.assert_close((p * k3(logp, ref)).sum(), kl, atol=1e-10, rtol=1e-9)


def test_k3_is_nonnegative_where_verls_rounding_is_not():
    logp = torch.zeros(1)
    ref = torch.tensor([4e-8])
    assert kl_penalty(logp, ref, "low_var_kl").item() < 0  # 1 − 4e-8 rounds down in float32
    assert k3(logp, ref).item() == 0


def test_mask_zeroes_and_protects_non_action_positions():
    logp, ref = _pair(seed=3)
    mask = torch.rand(4, 6) < 0.5
    mask[0, 0] = True
    lp = logp.masked_fill(~mask, float("nan")).requires_grad_()
    rf = ref.masked_fill(~mask, float("-inf"))
    for fn in (k1, k2, k3, lambda a, b, m: kl_penalty(a, b, "k3+", m)):
        out = fn(lp, rf, mask)
        assert torch.isfinite(out).all() and (out[~mask] == 0).all()
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    torch.testing.assert_close(k3(lp, rf, mask)[mask], k3(logp, ref)[mask])


def test_k3_equals_verl_low_var_kl_inside_verl_clamps():
    logp, ref = _pair(seed=4, spread=0.8)
    assert ((ref - logp).exp() - (ref - logp) - 1 < 10).all()
    torch.testing.assert_close(k3(logp, ref), kl_penalty(logp, ref, "low_var_kl"))
    # outside, verl saturates the estimate at 10; lossplug keeps the exact value
    big = torch.tensor([-5.0], dtype=torch.float64)
    assert kl_penalty(big, torch.zeros(1, dtype=torch.float64), "k3").item() == 10
    assert k3(big, torch.zeros(1, dtype=torch.float64)).item() == pytest.approx(math.exp(5) - 6)


def test_straight_through_modes_value_of_base_gradient_of_k2():
    logp, ref = _pair(seed=5)
    for base in ("kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"):
        lp = logp.clone().requires_grad_()
        out = kl_penalty(lp, ref, base + "+")
        torch.testing.assert_close(out, kl_penalty(logp, ref, base))
        out.sum().backward()
        torch.testing.assert_close(lp.grad, logp - ref)


# ---------------------------------------------------------------------------------------------------------------------
# verl 0.9.1


@pytest.fixture(scope="module")
def verl_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def test_mode_list_matches_verl(verl_algos):
    logp, ref = _pair(seed=6)
    for mode in KL_PENALTY_MODES:
        verl_algos.kl_penalty(logp, ref, mode)  # every mode we list, verl accepts
    with pytest.raises(NotImplementedError):
        verl_algos.kl_penalty(logp, ref, "full")


@pytest.mark.parametrize("mode", KL_PENALTY_MODES)
@pytest.mark.parametrize("spread", [0.5, 5.0, 40.0])  # 40: exercises both of verl's clamps
def test_kl_penalty_matches_verl(verl_algos, mode, spread):
    logp, ref = _pair(B=5, T=9, seed=7, spread=spread)
    ours_lp, verl_lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours = kl_penalty(ours_lp, ref, mode)
    theirs = verl_algos.kl_penalty(verl_lp, ref, mode)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    w = torch.randn(5, 9, dtype=torch.float64)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    torch.testing.assert_close(ours_lp.grad, verl_lp.grad, atol=1e-6, rtol=1e-6)


def test_proportional_controller_matches_verl(verl_algos):
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    ours = ProportionalKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    theirs = verl_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    for _ in range(200):
        kl, n = float(rng.uniform(0, 15)), int(rng.integers(1, 512))
        ours.update(kl, n)
        theirs.update(kl, n)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)


def test_proportional_controller_is_exactly_the_numpy_formula():
    # the controller clips with min/max (numpy is no dependency): bit-identical to verl's np.clip form, clip edges
    # and a multiplier that stays a float included
    np = pytest.importorskip("numpy")
    for d in (0.0, 4.8, 4.8 + 1e-15, 6.0, 7.2, 7.2 - 1e-15, 7.2 + 1e-15, 1e-300, 3.0, 9.0, 1e6):
        for n in (0, 1, 37, 4999):  # 5000 steps at the lower clip would zero the coefficient (refused)
            ours = ProportionalKLController(init_kl_coef=0.2, target_kl=6.0, horizon=1000)
            expected = float(0.2 * (1 + np.clip(d / 6.0 - 1, -0.2, 0.2) * n / 1000))
            assert ours.update(d, n) == expected
            assert type(ours.value) is float


@pytest.mark.parametrize(("numpy_type", "value"), [("float64", 0.5), ("float32", 0.5), ("int64", 0), ("float16", 2.0)])
def test_controllers_take_numpy_scalars(numpy_type, value):
    kl = getattr(pytest.importorskip("numpy"), numpy_type)(value)
    for ours in (ProportionalKLController(0.2, 6.0, horizon=1000), AdaptiveKLController(0.2, 0.5)):
        plain = type(ours)(*((0.2, 6.0, 1000) if isinstance(ours, ProportionalKLController) else (0.2, 0.5)))
        assert ours.update(kl, 10) == plain.update(kl.item(), 10)


def test_controllers_refuse_numpy_arrays_and_bools_like_before():
    np = pytest.importorskip("numpy")
    with pytest.raises(LossplugError, match="current_kl: must be a number, got ndarray"):
        AdaptiveKLController(0.2, 0.5).update(np.array(0.5))
    with pytest.raises(LossplugError, match="current_kl: must be a number, got bool"):
        AdaptiveKLController(0.2, 0.5).update(np.bool_(True))


def test_fixed_controller_matches_verl(verl_algos):
    ours, theirs = FixedKLController(0.05), verl_algos.FixedKLController(0.05)
    ours.update(3.0, 10)
    theirs.update(3.0, 10)
    assert ours.value == theirs.value == 0.05


# ---------------------------------------------------------------------------------------------------------------------
# KL in the reward: TRL ≤ 0.11's compute_rewards and verl's apply_kl_penalty


def _trl_ppo_compute_rewards(scores, logprobs, ref_logprobs, masks, kl_ctl_value):
    """TRL ≤ 0.11's ``PPOTrainer.compute_rewards``, transcribed (``_kl_penalty`` = TRL's default "kl":
    logprob − ref_logprob)."""
    rewards, non_score_rewards, kls = [], [], []
    for score, logprob, ref_logprob, mask in zip(scores, logprobs, ref_logprobs, masks):
        kl = logprob - ref_logprob
        kls.append(kl)
        non_score_reward = -kl_ctl_value * kl
        non_score_rewards.append(non_score_reward)
        reward = non_score_reward.clone()
        last_non_masked_index = mask.nonzero()[-1]
        reward[last_non_masked_index] += score
        rewards.append(reward)
    return torch.stack(rewards), torch.stack(non_score_rewards), torch.stack(kls)


def test_kl_shaped_rewards_match_trl_ppo_on_action_tokens():
    logp, ref = _pair(B=4, T=7, seed=11)
    mask = torch.rand(4, 7) < 0.7
    mask[:, 0] = True
    mask[2, 3:] = False  # right padding
    mask[1, :2] = False  # left padding
    mask[1, 4] = True
    scores = torch.randn(4, dtype=torch.float64)
    out = kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.05)
    rewards, non_score, kls = _trl_ppo_compute_rewards(scores, logp, ref, mask, 0.05)
    torch.testing.assert_close(out.rewards, torch.where(mask, rewards, 0.0))
    torch.testing.assert_close(out.non_score_rewards, torch.where(mask, non_score, 0.0))
    torch.testing.assert_close(out.kl, torch.where(mask, kls, 0.0))
    assert (out.rewards.sum(-1) - out.non_score_rewards.sum(-1)).allclose(scores)  # each score lands exactly once


def test_kl_shaped_rewards_match_verl_apply_kl_penalty(verl_algos):
    """verl's apply_kl_penalty body (importing ray_trainer costs ~20 s, so it is transcribed around verl's own
    kl_penalty, masked_mean and AdaptiveKLController)."""
    from verl.utils.torch_functional import masked_mean

    logp, ref = _pair(B=5, T=8, seed=12, spread=0.7)
    mask = torch.rand(5, 8) < 0.7
    mask[:, 0] = True
    token_scores = torch.where(mask, torch.randn(5, 8, dtype=torch.float64), 0.0)
    for mode in ("kl", "low_var_kl", "mse"):
        verl_ctrl = verl_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
        ours_ctrl = ProportionalKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
        kld = verl_algos.kl_penalty(logp, ref, kl_penalty=mode) * mask
        verl_rewards = token_scores - verl_ctrl.value * kld
        current_kl = torch.mean(masked_mean(kld, mask=mask, axis=-1), dim=0).item()
        verl_ctrl.update(current_kl=current_kl, n_steps=5)

        out = kl_shaped_rewards(token_scores, logp, ref, mask, kl_coef=ours_ctrl.value, mode=mode)
        ours_ctrl.update(out.kl_mean, n_steps=5)
        torch.testing.assert_close(out.rewards, verl_rewards, atol=1e-6, rtol=1e-6)
        assert out.kl_mean.item() == pytest.approx(current_kl, rel=1e-6)
        assert ours_ctrl.value == pytest.approx(verl_ctrl.value, rel=1e-6)


def test_kl_shaped_rewards_errors():
    logp, ref = _pair(B=2, T=3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(LossplugError, match=r"scores: must be \[B\] or \[B, T\] aligned with logp \[2, 3\], got \[3\]"):
        kl_shaped_rewards(torch.zeros(3), logp, ref, mask, kl_coef=0.1)
    with pytest.raises(LossplugError, match="kl_coef: must be >= 0.0"):
        kl_shaped_rewards(torch.zeros(2), logp, ref, mask, kl_coef=-0.1)
    empty = mask.clone()
    empty[0] = False
    with pytest.raises(
        LossplugError, match=r"action_mask: every response needs at least one action token .* row \[0\]"
    ):
        kl_shaped_rewards(torch.zeros(2), logp, ref, empty, kl_coef=0.1)
    with pytest.raises(LossplugError, match=r"scores: must be finite — row \[1\]"):
        kl_shaped_rewards(torch.tensor([0.0, float("nan")]), logp, ref, mask, kl_coef=0.1)
    with pytest.raises(LossplugError, match="unknown KL penalty"):
        kl_shaped_rewards(torch.zeros(2), logp, ref, mask, kl_coef=0.1, mode="k4")


# ---------------------------------------------------------------------------------------------------------------------
# PPO-Penalty (arXiv:1707.06347, §4)


def test_adaptive_controller_follows_ppo_penalty_rule():
    c = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.01)
    assert c.update(0.01 / 1.5 - 1e-6) == 0.5  # d < d_targ / 1.5: halve
    assert c.update(0.01 * 1.5 + 1e-6) == 1.0  # d > 1.5 · d_targ: double
    assert c.update(0.01) == 1.0  # inside the band: unchanged
    assert c.update(0.01 / 1.5) == 1.0  # the band's edges are inside (strict inequalities)
    assert c.update(0.015) == 1.0
    assert c.update(torch.tensor(1.0), 128) == 2.0  # accepts a 0-d tensor and verl's n_steps
    assert c.update(0.0) == 1.0
    c2 = AdaptiveKLController(1.0, 0.01, max_kl_coef=2.0, min_kl_coef=0.5)
    assert [c2.update(1.0) for _ in range(3)] == [2.0, 2.0, 2.0]
    assert [c2.update(0.0) for _ in range(3)] == [1.0, 0.5, 0.5]
    state = c2.state_dict()
    c3 = AdaptiveKLController(1.0, 0.01)
    c3.load_state_dict(state)
    assert c3.value == 0.5


def test_controller_errors():
    with pytest.raises(LossplugError, match="init_kl_coef: must be > 0.0"):
        AdaptiveKLController(0.0, 0.01)
    with pytest.raises(LossplugError, match="target_kl: must be > 0.0"):
        AdaptiveKLController(1.0, -1)
    with pytest.raises(LossplugError, match="tolerance: must be > 1.0"):
        AdaptiveKLController(1.0, 0.01, tolerance=1.0)
    with pytest.raises(LossplugError, match="min_kl_coef"):
        AdaptiveKLController(1.0, 0.01, min_kl_coef=3.0, max_kl_coef=2.0)
    with pytest.raises(LossplugError, match="current_kl: must be finite, got nan"):
        AdaptiveKLController(1.0, 0.01).update(float("nan"))
    with pytest.raises(LossplugError, match="current_kl must be a scalar"):
        AdaptiveKLController(1.0, 0.01).update(torch.ones(2))
    with pytest.raises(LossplugError, match="horizon: must be > 0.0"):
        ProportionalKLController(0.1, 6.0, 0)
    with pytest.raises(LossplugError, match="n_steps: .*non-positive"):
        ProportionalKLController(0.1, 6.0, horizon=10).update(0.0, 100)
    with pytest.raises(LossplugError, match="kl_coef: must be >= 0.0"):
        FixedKLController(-0.1)


# ---------------------------------------------------------------------------------------------------------------------
# input errors


def test_input_errors_name_field_rule_and_place():
    logp, ref = _pair(B=2, T=3)
    with pytest.raises(LossplugError, match=r"ref_logp: shape must match logp \[2, 3\], got \[2, 2\]"):
        k3(logp, ref[:, :2])
    with pytest.raises(LossplugError, match="action_mask: must be a bool tensor, got torch.int64"):
        k1(logp, ref, torch.ones(2, 3, dtype=torch.long))
    bad = logp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(LossplugError, match=r"logp: must be finite on action positions — \(row 1, pos 2\)"):
        k2(bad, ref)
    with pytest.raises(LossplugError, match="max_log_ratio: must be > 0.0"):
        k3(logp, ref, max_log_ratio=-1.0)
    with pytest.raises(LossplugError, match="unknown KL penalty 'low_var'.*did you mean 'low_var_kl'"):
        kl_penalty(logp, ref, "low_var")
    with pytest.raises(LossplugError, match="unknown KL penalty 'full'"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(LossplugError, match="logp: must be a float tensor"):
        k1(logp.long(), ref)

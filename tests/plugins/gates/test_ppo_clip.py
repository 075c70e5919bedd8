"""ppo_clip through the public API: PPO's sign-aware clip (arXiv:1707.06347), clip-higher and dual-clip."""

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad

# the contract rejects log-probs > 0: the example's log-probs (old = 0) are shifted by SHIFT on both sides
SHIFT = -2.0


def run(gate: dict, *, reduction="token", mask=None, **fields):
    return loss_and_grad({"gates": [gate], "reduction": {"name": reduction}}, action_mask=mask, **fields)


def per_token_objective(gate: dict, ratio, advantage):
    """One single-token response per element: the loss of each is minus that token's objective."""
    out = []
    for r, a in zip(ratio, advantage):
        res, _ = run(
            gate, logp=(r.log() + SHIFT).reshape(1, 1), old_logp=torch.full((1, 1), SHIFT), advantage=a.reshape(1)
        )
        out.append(-res.loss.detach())
    return torch.stack(out)


def test_sign_aware_clip_worked_example():
    ratio = torch.tensor([1.3, 0.7, 1.3, 0.7])
    advantage = torch.tensor([1.0, 1.0, -1.0, -1.0])
    gate = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}
    objective = per_token_objective(gate, ratio, advantage)
    torch.testing.assert_close(objective, torch.tensor([1.2, 0.7, -1.3, -0.8]))

    # (-objective.mean()).backward(): four one-token responses under the token mean
    result, grad = run(
        gate, logp=(ratio.log() + SHIFT).reshape(4, 1), old_logp=torch.full((4, 1), SHIFT), advantage=advantage
    )
    torch.testing.assert_close(result.loss, -torch.tensor([1.2, 0.7, -1.3, -0.8]).mean())
    grad = grad.reshape(4)
    torch.testing.assert_close(grad[[0, 3]], torch.zeros(2))
    assert grad[1] < 0 and grad[2] > 0
    # the raw branch keeps its gradient: d(-r·A/4)/dlogp = -r·A/4
    torch.testing.assert_close(grad[[1, 2]], -(ratio * advantage)[[1, 2]] / 4)
    assert result.metrics["ppo_clip/clip_frac_high"] == 0.25 and result.metrics["ppo_clip/clip_frac_low"] == 0.25
    assert result.metrics["ppo_clip/active_token_frac"] == 0.5


def test_clamp_then_multiply_is_not_the_surrogate():
    ratio = torch.tensor([1.3, 0.7, 1.3, 0.7])
    advantage = torch.tensor([1.0, 1.0, -1.0, -1.0])
    objective = per_token_objective({"name": "ppo_clip"}, ratio, advantage)
    assert not torch.allclose(objective, ratio.clamp(0.8, 1.2) * advantage)


def test_clip_higher_is_asymmetric():
    ratio = torch.tensor([1.25, 1.25, 0.75])
    advantage = torch.tensor([1.0, 1.0, -1.0])
    plain = per_token_objective({"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}, ratio, advantage)
    higher = per_token_objective({"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}, ratio, advantage)
    torch.testing.assert_close(plain, torch.tensor([1.2, 1.2, -0.8]))
    torch.testing.assert_close(higher, torch.tensor([1.25, 1.25, -0.8]))


def test_dual_clip_bounds_negative_advantages():
    # A < 0: objective = max(min(r·A, clip(r)·A), c·A); c = 3
    ratio = torch.tensor([5.0, 2.0, 5.0, 0.5])
    advantage = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    gate = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0}
    objective = per_token_objective(gate, ratio, advantage)
    # r = 5, A = −1: PPO alone gives −5, dual-clip bounds it at −3; r = 2: −2 > −3 untouched;
    # A > 0 is never dual-clipped (r = 5 → 1.2); r = .5, A = −1: lower clip → −0.8
    torch.testing.assert_close(objective, torch.tensor([-3.0, -2.0, 1.2, -0.8]))
    without = per_token_objective({**gate, "dual_clip_c": None}, ratio, advantage)
    torch.testing.assert_close(without, torch.tensor([-5.0, -2.0, 1.2, -0.8]))

    result, grad = run(
        gate, logp=(ratio.log() + SHIFT).reshape(4, 1), old_logp=torch.full((4, 1), SHIFT), advantage=advantage
    )
    grad = grad.reshape(4)
    # dual-clipped, upper-clipped and lower-clipped tokens carry no gradient; the raw branch r = 2 does
    torch.testing.assert_close(grad[[0, 2, 3]], torch.zeros(3))
    torch.testing.assert_close(grad[1], torch.tensor(2.0 / 4))
    assert result.metrics["ppo_clip/clip_frac_dual"] == 0.25
    assert result.metrics["ppo_clip/active_token_frac"] == 0.25


def test_dual_clip_parameter_must_exceed_one():
    with pytest.raises(lossplug.RecipeError, match="dual_clip_c"):
        lossplug.Recipe.load({"gates": [{"name": "ppo_clip", "dual_clip_c": 1.0}], "reduction": "token"})


@pytest.mark.parametrize("delta", [1.05, 1.1, 1.2, 1.28, 1.5, 3.0])
def test_delta_is_trls_two_sided_clip_loss_and_gradient(delta):
    """float64 oracle: TRL GRPOTrainer._compute_loss's ``coef_1 = clamp(coef_1, max=delta)`` then
    ``−min(coef_1·A, clip(r)·A)`` (INTELLECT-2, arXiv:2505.07291) — for δ inside the clip range too."""
    g = torch.Generator().manual_seed(int(delta * 100))
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) - 1.5
    logp = old + 0.3 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    gate = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28, "delta": delta}
    result, grad = run(gate, logp=logp, old_logp=old, advantage=adv)

    theirs = logp.clone().requires_grad_()
    coef_1 = (theirs - old).exp()
    coef_2 = coef_1.clamp(1 - 0.2, 1 + 0.28)
    a = adv.unsqueeze(-1)
    per_token = -torch.minimum(coef_1.clamp(max=delta) * a, coef_2 * a)
    reference = per_token.mean()
    reference.backward()
    torch.testing.assert_close(result.loss, reference, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, theirs.grad, rtol=1e-13, atol=1e-15)
    # the capped branch is the minimum exactly where its gradient is zero
    capped = ((coef_1 > delta) & (delta * a < coef_2 * a)).double().mean()
    assert result.metrics["ppo_clip/delta_frac"] == pytest.approx(float(capped))
    if delta >= 1.28:  # δ ≥ 1 + eps_high: the dual clip at c = δ, bit for bit
        dual, dual_grad = run({**gate, "delta": None, "dual_clip_c": delta}, logp=logp, old_logp=old, advantage=adv)
        assert torch.equal(dual.loss, result.loss) and torch.equal(dual_grad, grad)


def test_delta_below_one_is_refused():
    with pytest.raises(lossplug.RecipeError, match="delta"):
        lossplug.compile_recipe(lossplug.Recipe.model_validate({"gates": [{"name": "ppo_clip", "delta": 0.9}]}))

"""gspo / gspo_token through the public API: a worked sequence-ratio example (arXiv:2507.18071), sequence-level
clipping, empty responses, and the gradient routing that tells the two variants apart."""

import math

import pytest
import torch

import lossplug

WIDE = {"eps_low": 0.5, "eps_high": 0.5}  # a clip range the examples stay inside


def recipe(name="gspo", reduction="response", **params):
    return lossplug.Recipe.load({"gates": [{"name": name, **params}], "reduction": {"name": reduction}})


def run(rec, *, logp, validate="full", unchecked=False, **fields):
    logp = logp.clone().requires_grad_()
    make = lossplug.PolicyBatch.unchecked if unchecked else lossplug.PolicyBatch
    batch = make(logp=logp, **fields)
    result = lossplug.policy_loss(batch, rec, validate=validate, metrics="full")
    result.loss.backward()
    return result, logp.grad


def worked_example():
    # the worked example: all its log-probs are already ≤ 0
    old_logp = torch.tensor([[-1.0, -2.0, float("nan")], [-1.0, -2.0, -3.0]])
    new_logp = old_logp + torch.tensor([[0.1, 0.3, 9.0], [0.1, 0.3, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    return new_logp, old_logp, mask


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_geometric_sequence_ratio_worked_example(name):
    new_logp, old_logp, mask = worked_example()
    result, grad = run(
        recipe(name, **WIDE), logp=new_logp, old_logp=old_logp, action_mask=mask, advantage=torch.ones(2)
    )
    expected = torch.tensor(0.2).exp()
    m = result.metrics
    # both responses have the same geometric-mean ratio exp(.2), although their lengths differ
    assert m[f"{name}/seq_ratio/min"] == pytest.approx(expected.item(), rel=1e-6)
    assert m[f"{name}/seq_ratio/max"] == pytest.approx(expected.item(), rel=1e-6)
    # per-response mean of s_i·A = exp(.2)
    torch.testing.assert_close(result.loss, -expected)
    # NaN at the masked position leaks neither into the loss nor into the gradient
    assert torch.isfinite(result.loss) and torch.isfinite(grad).all()
    assert grad[0, 2] == 0
    # ∂loss/∂logp_iu = −s_i·A / (B·|y_i|) under the per-response mean, for both variants
    torch.testing.assert_close(grad[0, :2], torch.full((2,), -expected / 4))
    torch.testing.assert_close(grad[1], torch.full((3,), -expected / 6))


def test_empty_response_is_rejected():
    new_logp, old_logp, mask = worked_example()
    empty = mask.clone()
    empty[0] = False
    with pytest.raises(lossplug.BatchValidationError, match="action_mask.*at least one action"):
        lossplug.policy_loss(
            lossplug.PolicyBatch(logp=new_logp, old_logp=old_logp, action_mask=empty, advantage=torch.ones(2)), recipe()
        )


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("reduction", ["response", "token", "sequence_sum"])
def test_empty_response_without_validation_is_finite(name, reduction):
    new_logp, old_logp, mask = worked_example()
    mask = mask.clone()
    mask[0] = False
    result, grad = run(
        recipe(name, reduction, **WIDE),
        logp=new_logp,
        old_logp=old_logp,
        action_mask=mask,
        advantage=torch.ones(2),
        validate="off",
        unchecked=True,
    )
    assert torch.isfinite(result.loss) and torch.isfinite(grad).all()
    assert (grad[0] == 0).all()
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_clip_is_per_sequence_not_per_token():
    # response 0: one token far above the clip range, the others below it: its geometric mean stays inside,
    # so (unlike token-level PPO) every token keeps its gradient
    old = torch.full((2, 3), -2.0)
    new = old + torch.tensor([[0.3, -0.1, -0.1], [0.3, 0.3, 0.3]])
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    result, grad = run(
        recipe("gspo", eps_low=0.2, eps_high=0.2), logp=new, old_logp=old, action_mask=mask, advantage=adv
    )
    s0 = math.exp(0.1 / 3)
    torch.testing.assert_close(grad[0], torch.full((3,), -s0 / 6))
    # response 1: s = exp(.3) > 1.2 with A > 0 — the whole response is clipped, no gradient anywhere
    torch.testing.assert_close(grad[1], torch.zeros(3))
    m = result.metrics
    assert m["gspo/active_seq_frac"] == 0.5 and "gspo/active_token_frac" not in m
    assert m["gspo/clip_frac_high"] == 0.5 and m["gspo/clip_frac_low"] == 0
    assert m["effective/seq_frac"] == 0.5 and m["effective/token_frac"] == 0.5
    token_ppo, ppo_grad = run(
        lossplug.Recipe.load({"gates": [{"name": "ppo_clip"}], "reduction": "response"}),
        logp=new,
        old_logp=old,
        action_mask=mask,
        advantage=adv,
    )
    assert ppo_grad[0, 0] == 0  # token-level PPO drops that token


def test_variants_agree_for_sequence_advantages_and_differ_for_token_advantages():
    torch.manual_seed(1)
    old = -torch.rand(3, 5) - 0.5
    new = old + 0.05 * torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    mask[:, 0] = True
    seq_adv = torch.randn(3)
    for reduction in ("response", "token", "sequence_sum"):
        a, ga = run(recipe("gspo", reduction, **WIDE), logp=new, old_logp=old, action_mask=mask, advantage=seq_adv)
        b, gb = run(
            recipe("gspo_token", reduction, **WIDE), logp=new, old_logp=old, action_mask=mask, advantage=seq_adv
        )
        torch.testing.assert_close(a.loss, b.loss)
        torch.testing.assert_close(ga, gb)
    tok_adv = torch.randn(3, 5)
    _, ga = run(recipe("gspo", "token", **WIDE), logp=new, old_logp=old, action_mask=mask, advantage=tok_adv)
    _, gb = run(recipe("gspo_token", "token", **WIDE), logp=new, old_logp=old, action_mask=mask, advantage=tok_adv)
    assert not torch.allclose(ga, gb)
    # GSPO-token routes each token's advantage to its own log-prob: grad = −s_i·A_it / N
    seq_log_ratio = torch.where(mask, new - old, 0).sum(-1) / mask.sum(-1)
    expected = -seq_log_ratio.exp().unsqueeze(-1) * tok_adv / mask.sum()
    torch.testing.assert_close(gb, torch.where(mask, expected, 0))


def test_defaults_and_parameters():
    params = recipe().gates[0].params
    assert params["eps_low"] == 3e-4 and params["eps_high"] == 4e-4 and params["log_ratio_clamp"] == 10.0
    with pytest.raises(lossplug.RecipeError, match="eps_low"):
        recipe(eps_low=1.5)
    with pytest.raises(lossplug.RecipeError, match="unknown parameter 'eps'"):
        recipe(eps=0.1)
    preset = lossplug.Recipe.preset("gspo")
    assert preset.gates[0].name == "gspo" and preset.reduction.name == "response"
    assert lossplug.Recipe.from_yaml(preset.to_yaml()).to_dict() == preset.to_dict()
    assert lossplug.registry().plugins["gate"]["gspo"].level == "sequence"
    assert "2507.18071" in lossplug.registry().presets["gspo"].source

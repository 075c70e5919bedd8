"""importance_sampling, rollout_is, cispo_rollout: SkyRL's losses anchored at the rollout log-probs.

Two oracles each, float64, loss and gradient: the formula transcribed here (always), and SkyRL 0.3.0's own
``ppo_utils``, read from its wheel (``tests/_origins.py``; its ratios go through float32 in ``safe_exp_delta``: 1e-6 relative there).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

from ._field_origins import skyrl_config, skyrl_ppo_utils

SHAPES = [(1, 1), (3, 7), (6, 10), (8, 33)]
GATES = ["importance_sampling", "rollout_is", "cispo_rollout"]
PARAMS = {
    "importance_sampling": [{}],
    "rollout_is": [{}, {"eps_low": 0.1, "eps_high": 0.3}, {"eps_low": 0.5, "eps_high": 2.0}],
    "cispo_rollout": [{}, {"eps_low": 0.2, "eps_high": 0.2}, {"eps_low": 0.0, "eps_high": 0.5}],
}
CASES = [(g, p) for g in GATES for p in PARAMS[g]]


def fields(B: int, T: int, seed: int, scale: float = 0.8, token_advantage: bool = False) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=scale, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True  # every response has an action (short shapes would leave rows empty)
    return {k: f[k] for k in ("logp", "behavior_logp", "advantage", "action_mask")}


def run(gate: dict, f: dict, reduction: str = "token_sum"):
    return loss_and_grad(
        {"gates": [gate], "reduction": {"name": reduction}},
        logp=f["logp"],
        behavior_logp=f["behavior_logp"],
        advantage=f["advantage"],
        action_mask=f["action_mask"],
    )


# -- the formula, transcribed from SkyRL's definitions (summed over the action tokens: SkyRL's reduce_loss) ----------


def transcribed(name: str, params: dict, logp, behavior, adv, mask):
    """SkyRL's per-token loss summed over the actions, from its docstrings and code read as formulas."""
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(logp)
    log_ratio = logp - behavior
    if name == "importance_sampling":
        per_token = -(log_ratio.exp() * adv)  # Tinker's importance_sampling: −(p_θ/q)·A
    else:
        ratio = log_ratio.clamp(-20, 20).exp()
        if name == "rollout_is":
            low, high = 1 - params.get("eps_low", 0.2), 1 + params.get("eps_high", 0.2)
            calibrated = torch.where((ratio > low) & (ratio < high), ratio, torch.zeros_like(ratio))
        else:
            low, high = 1 - params.get("eps_low", 0.0), 1 + params.get("eps_high", 5.0)
            calibrated = ratio.clamp(low, high)
        per_token = -(calibrated.detach() * adv * logp)
    return (per_token * mask).sum()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("token_advantage", [False, True])
def test_against_the_transcribed_formula(name, params, B, T, token_advantage):
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=token_advantage)
        result, grad = run({"name": name, **params}, f)
        logp = f["logp"].clone().requires_grad_()
        expected = transcribed(name, params, logp, f["behavior_logp"], f["advantage"], f["action_mask"].double())
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,params", CASES)
def test_token_reduction_is_skyrls_token_mean(name, params):
    # SkyRL's token_mean divides the advantages by the step's action tokens before summing
    f = fields(6, 10, seed=4)
    result, grad = run({"name": name, **params}, f, reduction="token")
    n = f["action_mask"].sum()
    logp = f["logp"].clone().requires_grad_()
    scaled = transcribed(name, params, logp, f["behavior_logp"], f["advantage"] / n, f["action_mask"].double())
    scaled.backward()
    torch.testing.assert_close(result.loss, scaled, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


# -- SkyRL's own code -------------------------------------------------------------------------------------------------


def skyrl_loss(ppo_utils, name: str, params: dict, logp, behavior, adv, mask):
    if name == "importance_sampling":  # through the Tinker API: old_log_probs are the datum's sampling log-probs
        fn, config = ppo_utils.importance_sampling_loss, skyrl_config(policy_loss_type=name)
        loss, _ = fn(logp, behavior, adv, config, loss_mask=mask, rollout_logprobs=behavior)
        return loss
    if name == "rollout_is":
        config = skyrl_config(
            policy_loss_type=name, eps_clip_low=params.get("eps_low", 0.2), eps_clip_high=params.get("eps_high", 0.2)
        )
        fn = ppo_utils.rollout_is_policy_loss
    else:  # cispo through the Tinker API, old_log_probs = sampling log-probs
        config = skyrl_config(
            policy_loss_type="cispo",
            cispo={
                "cispo_eps_clip_low": params.get("eps_low", 0.0),
                "cispo_eps_clip_high": params.get("eps_high", 5.0),
            },
        )
        fn = ppo_utils.compute_policy_loss_cispo
    loss, _ = fn(logp, behavior, adv, config, loss_mask=mask, rollout_logprobs=behavior)
    return loss


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("name,params", CASES)
def test_against_skyrl(ppo_utils, name, params, B, T):
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=True)
        result, grad = run({"name": name, **params}, f)
        logp = f["logp"].clone().requires_grad_()
        expected = skyrl_loss(
            ppo_utils, name, params, logp, f["behavior_logp"], f["advantage"], f["action_mask"].double()
        )
        expected.backward()
        # SkyRL's safe_exp_delta exponentiates in float32
        torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-7)


# -- properties ------------------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    f = fields(B, T, seed=draw(st.integers(0, 2**20)), scale=draw(st.sampled_from([0.0, 0.05, 0.5, 2.0])))
    return f


def coefficients(name: str, f: dict, params: dict | None = None):
    """−∂loss/∂logp ÷ A on the action tokens under token_sum: each gate's per-token weight of the policy gradient."""
    _, grad = run({"name": name, **(params or {})}, f)
    adv = f["advantage"][:, None].expand_as(grad)
    return (-grad / adv)[f["action_mask"]], f


@given(batches())
def test_rollout_is_weight_is_the_ratio_inside_the_interval_else_zero(f):
    weight, _ = coefficients("rollout_is", f)
    ratio = (f["logp"] - f["behavior_logp"]).exp()[f["action_mask"]]
    inside = (ratio > 0.8) & (ratio < 1.2)
    torch.testing.assert_close(weight, torch.where(inside, ratio, torch.zeros_like(ratio)), rtol=1e-12, atol=1e-12)


@given(batches())
def test_cispo_rollout_weight_is_saturated_never_dropped(f):
    weight, _ = coefficients("cispo_rollout", f, {"eps_low": 0.2, "eps_high": 0.2})
    assert bool((weight >= 0.8 - 1e-12).all() & (weight <= 1.2 + 1e-12).all())


@given(batches())
def test_importance_sampling_gradient_is_the_ratio_times_the_advantage(f):
    weight, _ = coefficients("importance_sampling", f)
    ratio = (f["logp"] - f["behavior_logp"]).exp()[f["action_mask"]]
    torch.testing.assert_close(weight, ratio, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", GATES)
def test_needs_no_old_logp_and_reads_behavior_logp(name):
    plugin = lossplug.registry().plugins["gate"][name]
    assert plugin.required_fields(plugin.params()) == ("behavior_logp",)
    f = fields(3, 5, seed=1)
    result, _ = run({"name": name}, f)  # no old_logp in the batch: valid, and no update/* metric
    assert "update/approx_kl" not in result.metrics
    with pytest.raises(lossplug.BatchValidationError, match="behavior_logp"):
        loss_and_grad(
            {"gates": [name], "reduction": "token"},
            logp=f["logp"],
            advantage=f["advantage"],
            action_mask=f["action_mask"],
        )


def test_rollout_is_is_dis_with_skyrls_defaults():
    f = fields(6, 10, seed=2)
    a, ga = run({"name": "rollout_is", "eps_low": 0.2, "eps_high": 0.28}, f)
    b, gb = run({"name": "dis", "low": 0.2, "high": 0.28}, f)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    assert lossplug.registry().plugins["gate"]["rollout_is"].params().eps_high == 0.2  # SkyRL's eps_clip_high


def test_parameters_are_checked():
    with pytest.raises(lossplug.RecipeError, match="eps_low"):
        lossplug.Recipe.load({"gates": [{"name": "rollout_is", "eps_low": 0.0}]})
    with pytest.raises(lossplug.RecipeError, match="eps_high"):
        lossplug.Recipe.load({"gates": [{"name": "cispo_rollout", "eps_high": -1}]})

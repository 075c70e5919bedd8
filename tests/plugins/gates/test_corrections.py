"""tis / icepop (token and sequence) through the public API: worked engine-ratio coefficients."""

import math

import pytest
import torch

import lossplug

SHIFT = -1.0  # old_logp; behavior_logp = SHIFT − log(engine ratio) keeps every log-prob ≤ 0


def run(gates: list, *, logp, old_logp, behavior_logp, advantage, reduction="sequence_sum", mask=None):
    logp = logp.clone().requires_grad_()
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask
    batch = lossplug.PolicyBatch(
        logp=logp, old_logp=old_logp, behavior_logp=behavior_logp, advantage=advantage, action_mask=mask
    )
    result = lossplug.policy_loss(batch, {"gates": gates, "reduction": {"name": reduction}}, metrics="full")
    result.loss.backward()
    return result, logp.grad


def engine_example():
    engine = torch.tensor([[0.5, 1.0, 3.0]])
    old = torch.full((1, 3), SHIFT)
    return engine, old, old - engine.log()


@pytest.mark.parametrize(
    "gate, expected, active",
    [
        ({"name": "tis", "cap": 2.0}, [0.5, 1.0, 2.0], 1.0),
        ({"name": "icepop", "low": 0.8, "high": 1.2}, [0.0, 1.0, 0.0], 1 / 3),
    ],
)
def test_worked_example_coefficients(gate, expected, active):
    engine, old, behavior = engine_example()
    # reinforce (A·logp) as the update gate, one response under sequence_sum: ∂loss/∂logp = −weight·A
    result, grad = run(
        ["reinforce", gate], logp=old.clone(), old_logp=old, behavior_logp=behavior, advantage=torch.ones(1)
    )
    torch.testing.assert_close(-grad, torch.tensor([expected]))
    name = gate["name"]
    assert result.metrics[f"{name}/active_token_frac"] == pytest.approx(active)
    # the engine ratio is reported on its own, never mixed with the update ratio
    assert result.metrics["ratio/engine/max"] == pytest.approx(3.0)
    assert result.metrics["ratio/update/max"] == 1.0


def test_icepop_accepts_inside_inclusive_bounds():
    engine, old, behavior = engine_example()
    result, grad = run(
        ["reinforce", {"name": "icepop", "low": 0.5, "high": 3.0}],
        logp=old.clone(),
        old_logp=old,
        behavior_logp=behavior,
        advantage=torch.ones(1),
    )
    torch.testing.assert_close(-grad, engine)  # ρ = .5 and ρ = 3 sit on the bounds: kept


def gate_input(old, behavior, mask=None):
    logp = torch.full_like(old, -1.0, requires_grad=True)
    mask = torch.ones_like(old, dtype=torch.bool) if mask is None else mask
    return lossplug.GateInput.from_batch(
        lossplug.PolicyBatch.unchecked(
            logp=logp, action_mask=mask, advantage=torch.ones_like(old), old_logp=old, behavior_logp=behavior
        )
    )


@pytest.mark.parametrize("name", ["tis", "tis_seq", "icepop", "icepop_seq"])
def test_weights_are_detached(name):
    engine, old, behavior = engine_example()
    # even when the log-probs they read require grad, the weights carry none
    old = old.clone().requires_grad_()
    behavior = behavior.clone().requires_grad_()
    plugin = lossplug.registry().plugins["gate"][name]
    out = plugin(gate_input(old, behavior), plugin.params())
    assert out.objective is None and not out.weight.requires_grad
    assert out.weight.shape == ((1, 3) if plugin.level == "token" else (1,))
    assert plugin.role == "correction" and set(plugin.requires) == {"old_logp", "behavior_logp"}


def test_sequence_ratio_is_the_product_of_token_ratios():
    # verl's rollout_is="sequence": ρ_i = exp(Σ_t log ρ_t); the masked NaN position is never read
    old = torch.tensor([[-1.0, -1.0, float("nan")], [-1.0, -1.0, -1.0]])
    behavior = torch.tensor([[-1.2, -1.1, float("nan")], [-1.0, -0.9, -1.05]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    sums = torch.tensor([0.3, -0.05])
    for gate, weight in [
        ({"name": "tis_seq", "cap": 1.2}, sums.exp().clamp(max=1.2)),
        ({"name": "icepop_seq", "low": 0.9, "high": 1.2}, torch.tensor([0.0, math.exp(-0.05)])),
        ({"name": "tis_seq", "cap": 5.0, "ratio": "geometric"}, (sums / torch.tensor([2.0, 3.0])).exp()),
    ]:
        result, grad = run(
            ["reinforce", gate],
            logp=torch.full((2, 3), -1.0),
            old_logp=old,
            behavior_logp=behavior,
            advantage=torch.ones(2),
            mask=mask,
        )
        # sequence_sum over B = 2: ∂loss/∂logp_it = −w_i / 2 on action tokens
        expected = torch.where(mask, -weight.unsqueeze(-1) / 2, 0)
        torch.testing.assert_close(grad, expected)
        assert f"{gate['name']}/active_seq_frac" in result.metrics
        assert f"{gate['name']}/active_token_frac" not in result.metrics


def test_corrections_cannot_be_update_gates():
    with pytest.raises(lossplug.RecipeError, match="update gate"):
        lossplug.Recipe.load({"gates": ["tis"], "reduction": "token"})
    with pytest.raises(lossplug.RecipeError, match="low"):
        lossplug.Recipe.load(
            {"gates": ["reinforce", {"name": "icepop", "low": 2.0, "high": 1.0}], "reduction": "token"}
        )


def test_icepop_accepts_equal_bounds_like_verl():
    # verl's "1.0_1.0" keeps only ρ = 1 exactly
    lossplug.Recipe.load({"gates": ["reinforce", {"name": "icepop", "low": 1.0, "high": 1.0}], "reduction": "token"})


@pytest.mark.parametrize(
    "gate",
    [
        {"name": "tis", "cap": 1.5},
        {"name": "tis_seq", "cap": 1.5},
        {"name": "icepop", "low": 0.5, "high": 2.0},
        {"name": "icepop_seq", "low": 0.5, "high": 2.0},
    ],
)
def test_batch_normalize_gives_mean_one_over_the_batch(gate):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 6, generator=g, dtype=torch.float64) - 0.1
    behavior = old - 0.3 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 6, generator=g) > 0.3
    mask[:, 0] = True
    plugin = lossplug.registry().plugins["gate"][gate["name"]]
    params = {k: v for k, v in gate.items() if k != "name"}
    raw = plugin(gate_input(old, behavior, mask), plugin.params(**params))
    out = plugin(gate_input(old, behavior, mask), plugin.params(**params, batch_normalize=True))
    if out.weight.ndim == 1:  # one weight per response: their mean over the responses
        mean = out.weight.mean()
    else:  # per token: the mean over the action tokens
        mean = out.weight[mask].mean()
    torch.testing.assert_close(mean, torch.tensor(1.0, dtype=torch.float64))
    factor = out.metrics["rollout_is_batch_norm_factor"]()
    torch.testing.assert_close(out.weight * factor, raw.weight)


def test_batch_normalize_leaves_all_zero_weights_alone():
    # every ratio outside [low, high]: the mean is 0 (≤ 1e-8), verl then divides by nothing (factor 1)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    plugin = lossplug.registry().plugins["gate"]["icepop"]
    out = plugin(gate_input(old, old - 2.0), plugin.params(low=0.5, high=2.0, batch_normalize=True))
    assert torch.equal(out.weight, torch.zeros(2, 3, dtype=torch.float64))
    assert float(out.metrics["rollout_is_batch_norm_factor"]()) == 1.0


@pytest.mark.parametrize(
    "name, params",
    [
        ("rollout_rs", {"options": "seq_sum_k1,token_k3,seq_max_k2", "threshold": "0.5_2.0,0.1,0.2"}),
        ("rollout_rs", {"options": "seq_mean_k2", "threshold": 0.05}),
        ("tis_seq", {"cap": 3.0}),
        ("icepop", {"low": 0.8, "high": 1.25}),
    ],
)
def test_non_default_rollout_corrections_conform(name, params):
    from lossplug.testing import assert_conforms

    assert_conforms(name, kind="gate", params=params)


@pytest.mark.parametrize("name", ["tis", "tis_seq"])
def test_floor_reproduces_trls_truncate_with_clip_min(name):
    """TRL's *_truncate modes clamp the engine ratio to [clip_min, clip_max] (grpo_trainer.py, the
    vllm_importance_sampling_correction block): ``tis(floor=clip_min, cap=clip_max)`` is that weight."""
    torch.manual_seed(3)
    B, T = 4, 6
    mask = torch.rand(B, T) < 0.8
    mask[:, 0] = True
    old = -torch.rand(B, T, dtype=torch.float64) * 2
    behavior = -torch.rand(B, T, dtype=torch.float64) * 2
    diff = (old - behavior) * mask
    if name == "tis_seq":
        diff = diff.sum(-1)
    expected = torch.clamp(torch.exp(diff), min=0.7, max=1.4)
    plugin = lossplug.registry().plugins["gate"][name]
    out = plugin(gate_input(old, behavior, mask), plugin.params(floor=0.7, cap=1.4, log_ratio_clamp=80))
    if name == "tis":
        out_weight, expected = torch.where(mask, out.weight, 0), torch.where(mask, expected, 0)
    else:
        out_weight = out.weight
    torch.testing.assert_close(out_weight, expected, rtol=1e-15, atol=0)


def test_floor_must_not_exceed_cap():
    with pytest.raises(lossplug.RecipeError, match=r"floor \(3.0\) must not exceed cap \(2.0\)"):
        lossplug.Recipe.load({"gates": ["ppo_clip", {"name": "tis", "floor": 3.0, "cap": 2.0}], "reduction": "token"})


@pytest.mark.parametrize("name", ["tis", "tis_seq"])
def test_tis_without_a_clamp_is_trls_arithmetic_and_saturates_at_the_cap(name):
    """``log_ratio_clamp: null`` (trl_equivalent's TIS): TRL's ``clamp(exp(old − sampling), max=cap)`` in float64
    — equal to the clamped gate inside ±20, and past float range (old − behaviour = 900) the weight is the cap, not
    inf or NaN."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5
    behavior = old - 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    behavior[1, 2] = old[1, 2] - 900.0  # an engine that gave the token e^-900 less probability
    behavior = behavior.clamp(max=0)
    logp = old + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    fields = dict(logp=logp.clamp(max=0), old_logp=old, behavior_logp=behavior, advantage=adv, reduction="token")
    result, grad = run([{"name": "reinforce"}, {"name": name, "cap": 2.0, "log_ratio_clamp": None}], **fields)
    log_ratio = old - behavior
    if name == "tis_seq":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    weight = log_ratio.exp().clamp(max=2.0)  # TRL: no clamp before exp
    expected_grad = -(weight * adv.unsqueeze(-1)).expand(4, 6) / 24
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, expected_grad, rtol=1e-13, atol=1e-15)
    if name == "tis":  # the e^900 token: weight 2 (the cap)
        assert grad[1, 2] == pytest.approx(-2.0 * float(adv[1]) / 24)

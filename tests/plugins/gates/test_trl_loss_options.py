"""TRL 1.16's remaining GRPOConfig loss options against lossplug's gates, numerically (float64, loss and gradient
with respect to the log-probs ≤ 1e-8 relative).

TRL's static methods are called as they are (``GRPOTrainer.get_off_policy_mask``, ``get_gamma_weights``);
``get_high_entropy_mask`` is called unbound with a stand-in ``self`` whose accelerator is one process (or several,
gathered). What lives inline in ``_compute_loss`` / ``_generate_and_score_completions`` is reproduced verbatim below,
each block citing ``trl/trainer/grpo_trainer.py`` (TRL 1.16.0) by line.

TRL option → lossplug recipe stage::

    loss_type="cispo", importance_sampling_level="sequence"  → cispo_seq(eps_low=null, ratio_max=epsilon_high,
                                                                          log_ratio_clamp=null)
    loss_type="sapo",  importance_sampling_level="sequence"  → sapo_seq(tau_pos, tau_neg, log_ratio_clamp=80)
    loss_type="grpo",  importance_sampling_level="sequence", delta → gspo(eps_low, eps_high, delta, log_ratio_clamp=80)
    loss_type="vespo" (+ vLLM IS token_truncate/token_mask)  → vespo(k_pos, lambda_pos, k_neg, lambda_neg,
                                                                      engine_correction, engine_ratio_min/max)
    off_policy_mask_threshold=δ                              → correction off_policy_mask(threshold=δ,
                                                                 sampling_logp=behavior_logp | old_logp)
    top_entropy_quantile=ρ                                   → correction top_entropy(quantile=ρ)
    vllm_importance_sampling_mode token_truncate (clip_min None)  → tis(cap=clip_max, log_ratio_clamp=80)
                                  token_mask                      → icepop(low=clip_min or 1e-300, high=clip_max or
                                                                           1e300, log_ratio_clamp=80)
                                  sequence_truncate (clip_min None) → tis_seq(cap=clip_max, log_ratio_clamp=80)
                                  sequence_mask                   → icepop_seq(low, high as token_mask,
                                                                               log_ratio_clamp=80)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer

B, T = 8, 9
RTOL = 1e-8


def fields(seed: int, *, spread: float = 0.5, token_advantage: bool = False, engine_spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < length.unsqueeze(-1)
    mask &= (torch.rand(B, T, generator=g) > 0.15) | (torch.arange(T) == 0)  # holes: tool tokens
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.05)
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    behavior = (old + engine_spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    sign = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0).to(torch.float64)
    if token_advantage:
        adv = sign[:, None] * (0.2 + torch.rand(B, T, generator=g, dtype=torch.float64))
    else:
        adv = sign * (0.2 + torch.rand(B, generator=g, dtype=torch.float64))
        adv[3] = 0.0  # A = 0: TRL's "≥ 0" side
    # float32 values (TRL's entropies are float32; it takes the quantile of entropies.float(), and float64 entropies
    # would be compared against their own float32 rounding — a token at the minimum could fall below the 0-quantile)
    entropy = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2).float().double()
    entropy[0, :3] = entropy[1, 0]  # ties
    return dict(logp=logp, old_logp=old, behavior_logp=behavior, advantage=adv, action_mask=mask, entropy=entropy)


def lossplug_run(f, gates, reduction):
    logp = f["logp"].clone().requires_grad_()
    batch = lossplug.PolicyBatch(**{**f, "logp": logp})
    recipe = lossplug.Recipe.model_validate({"gates": gates, "reduction": {"name": reduction}})
    loss = lossplug.policy_loss(batch, recipe, metrics="full").loss
    loss.backward()
    return loss.detach(), logp.grad


def trl_run(f, per_token_loss_fn, loss_type):
    """TRL's aggregation of ``per_token_loss`` (grpo_trainer.py:3149-3170; gradient accumulation 1)."""
    per_token_logps = f["logp"].clone().requires_grad_()
    mask = f["action_mask"].to(torch.float64)
    # TRL's torch.where(cond, <Python float>, <Python float>) (sapo's temperatures, vespo's k and λ) takes torch's
    # default dtype: float32 constants in a float64 computation unless the default is float64. lossplug keeps
    # constants in the compute dtype, which is TRL's float32 in training; in float64 the default dtype says the same.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        per_token_loss = per_token_loss_fn(per_token_logps, mask)
    finally:
        torch.set_default_dtype(default)
    if loss_type in ["grpo", "sapo"]:  # grpo_trainer.py:3150
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:  # cispo, dapo, vespo (grpo_trainer.py:3168-3173) with num_items_in_batch = the micro-batch's tokens
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    return loss.detach(), per_token_logps.grad


def assert_close(ours, theirs):
    (loss, grad), (trl_loss, trl_grad) = ours, theirs
    torch.testing.assert_close(loss, trl_loss, rtol=RTOL, atol=0)
    torch.testing.assert_close(grad, trl_grad, rtol=RTOL, atol=1e-15)


def advantages_2d(f):
    adv = f["advantage"]
    return adv.unsqueeze(1) if adv.dim() == 1 else adv  # grpo_trainer.py:3055-3056


def trl_coef_1(f, per_token_logps, mask, level):
    """grpo_trainer.py:3083-3094: the token or sequence importance weight."""
    log_ratio = per_token_logps - f["old_logp"]
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    return torch.exp(log_importance_weights)


# ---------------------------------------------------------------------------------------------------------------------
# importance_sampling_level="sequence" for cispo and sapo; delta with sequence level


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize("epsilon_high", [5.0, 1.05, 0.9])
def test_cispo_sequence_level(seed, token_advantage, epsilon_high):
    f = fields(seed, token_advantage=token_advantage)

    def trl(per_token_logps, mask):
        coef_1 = trl_coef_1(f, per_token_logps, mask, "sequence")
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()  # grpo_trainer.py:3110-3111
        return -clamped_ratios * advantages_2d(f) * per_token_logps

    gate = {"name": "cispo_seq", "eps_low": None, "ratio_max": epsilon_high, "log_ratio_clamp": None}
    assert_close(lossplug_run(f, [gate], "token"), trl_run(f, trl, "cispo"))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize("tau", [(1.0, 1.05), (3.0, 0.5)])
def test_sapo_sequence_level(seed, token_advantage, tau):
    f = fields(seed, token_advantage=token_advantage)
    tau_pos, tau_neg = tau

    def trl(per_token_logps, mask):
        coef_1 = trl_coef_1(f, per_token_logps, mask, "sequence")
        advantages = advantages_2d(f)
        temperatures = torch.where(advantages > 0, tau_pos, tau_neg)  # grpo_trainer.py:3121-3123
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        return -soft_coef_1 * advantages

    gate = {"name": "sapo_seq", "tau_pos": tau_pos, "tau_neg": tau_neg, "log_ratio_clamp": 80.0}
    assert_close(lossplug_run(f, [gate], "response"), trl_run(f, trl, "sapo"))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize("delta", [1.05, 1.3, 3.0])
def test_grpo_sequence_level_with_delta(seed, token_advantage, delta):
    f = fields(seed, token_advantage=token_advantage, spread=0.8)
    epsilon_low, epsilon_high = 0.2, 0.28

    def trl(per_token_logps, mask):
        coef_1 = trl_coef_1(f, per_token_logps, mask, "sequence")
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)  # grpo_trainer.py:3113-3119
        coef_1 = torch.clamp(coef_1, max=delta)
        advantages = advantages_2d(f)
        return -torch.min(coef_1 * advantages, coef_2 * advantages)

    gate = {"name": "gspo", "eps_low": epsilon_low, "eps_high": epsilon_high, "delta": delta, "log_ratio_clamp": 80.0}
    assert_close(lossplug_run(f, [gate], "response"), trl_run(f, trl, "grpo"))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_without_delta_is_unchanged(name):
    """delta=None leaves the objective bit for bit min(s·A, clip(s)·A)."""
    f = fields(4, spread=0.8)
    logp = f["logp"].clone().requires_grad_()
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**{**f, "logp": logp}))
    plugin = lossplug.registry().plugins["gate"][name]
    p = plugin.params.model_validate({"eps_low": 0.2, "eps_high": 0.28})
    out = plugin(inp, p)
    mask = f["action_mask"]
    seq = torch.where(mask, f["logp"] - f["old_logp"], 0).sum(-1) / mask.sum(-1)
    s = seq.clamp(-10, 10).exp().unsqueeze(-1)
    adv = f["advantage"].unsqueeze(-1)
    expected = torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv).expand(mask.shape)
    assert torch.equal(torch.where(mask, out.objective.detach(), 0), torch.where(mask, expected, 0))


# ---------------------------------------------------------------------------------------------------------------------
# vLLM importance sampling: TRL's ratio (grpo_trainer.py:2660-2707), and the correction gates that reproduce it


def trl_vllm_is_ratio(f, mode, clip_min, clip_max):
    """grpo_trainer.py:2660-2707, verbatim (old_per_token_logps / sampling_per_token_logps from the batch)."""
    old_per_token_logps, sampling_per_token_logps = f["old_logp"], f["behavior_logp"]
    mask = f["action_mask"].to(torch.float64)
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio, min=clip_min, max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    return vllm_importance_sampling_ratio


def vllm_is_gate(mode, clip_min, clip_max):
    """The correction stage a vllm_importance_sampling_mode maps to."""
    if mode.endswith("truncate"):
        assert clip_min is None, "tis has no lower bound"
        return {"name": "tis" if mode.startswith("token") else "tis_seq", "cap": clip_max, "log_ratio_clamp": 80.0}
    return {
        "name": "icepop" if mode.startswith("token") else "icepop_seq",
        "low": clip_min if clip_min is not None else 1e-300,
        "high": clip_max if clip_max is not None else 1e300,
        "log_ratio_clamp": 80.0,
    }


VLLM_MODES = [
    ("token_truncate", None, 3.0),
    ("token_truncate", None, 1.2),
    ("token_mask", None, 3.0),
    ("token_mask", 0.8, 1.25),
    ("token_mask", 0.8, None),
    ("sequence_truncate", None, 3.0),
    ("sequence_truncate", None, 1.2),
    ("sequence_mask", None, 3.0),
    ("sequence_mask", 0.5, 2.0),
]


@pytest.mark.parametrize("mode,clip_min,clip_max", VLLM_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_importance_sampling_modes(mode, clip_min, clip_max, seed):
    f = fields(seed, engine_spread=0.3)
    ratio = trl_vllm_is_ratio(f, mode, clip_min, clip_max)
    gate = vllm_is_gate(mode, clip_min, clip_max)
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    plugin = lossplug.registry().plugins["gate"][gate["name"]]
    weight = plugin(inp, plugin.params.model_validate({k: v for k, v in gate.items() if k != "name"})).weight
    mask = f["action_mask"]
    if weight.ndim == 1:
        torch.testing.assert_close(weight, ratio.squeeze(-1), rtol=RTOL, atol=0)
    else:
        torch.testing.assert_close(torch.where(mask, weight, 0), torch.where(mask, ratio, 0), rtol=RTOL, atol=0)
    # and in the loss: TRL multiplies its per-token loss by the ratio (grpo_trainer.py:3146-3147)
    epsilon_low, epsilon_high = 0.2, 0.28

    def trl(per_token_logps, mask_):
        coef_1 = trl_coef_1(f, per_token_logps, mask_, "token")
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        advantages = advantages_2d(f)
        return -torch.min(coef_1 * advantages, coef_2 * advantages) * ratio

    update = {"name": "ppo_clip", "eps_low": epsilon_low, "eps_high": epsilon_high, "log_ratio_clamp": 80.0}
    assert_close(lossplug_run(f, [update, gate], "response"), trl_run(f, trl, "grpo"))


def test_tis_has_no_lower_bound_for_truncate_with_clip_min():
    """``*_truncate`` with ``vllm_importance_sampling_clip_min`` set raises low ratios to clip_min: tis/tis_seq
    have no lower bound, so this setting has no exact lossplug mapping yet (the adapter must refuse it)."""
    assert "low" not in lossplug.registry().plugins["gate"]["tis"].params.model_fields
    assert "low" not in lossplug.registry().plugins["gate"]["tis_seq"].params.model_fields


# ---------------------------------------------------------------------------------------------------------------------
# VESPO


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize(
    "params",
    [
        dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0),  # TRL's defaults
        dict(k_pos=0.7, lambda_pos=0.3, k_neg=1.3, lambda_neg=0.0),  # λ floored at 1e-4; float32 rounding of k, λ
    ],
)
@pytest.mark.parametrize(
    "engine",
    [(None, None, None), ("token_truncate", None, 3.0), ("token_truncate", 0.7, 1.3), ("token_mask", 0.8, 1.25)],
)
def test_vespo(seed, token_advantage, params, engine):
    f = fields(seed, token_advantage=token_advantage, spread=0.15, engine_spread=0.2)
    mode, clip_min, clip_max = engine
    importance_sampling_ratio = None if mode is None else trl_vllm_is_ratio(f, mode, clip_min, clip_max)

    def trl(per_token_logps, mask):
        advantages = advantages_2d(f)
        log_ratio = per_token_logps - f["old_logp"]  # grpo_trainer.py:3083
        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=importance_sampling_ratio,
            **params,
        )
        return -phi_seq * advantages * per_token_logps  # grpo_trainer.py:3136

    gate = {"name": "vespo", **params}
    if mode is not None:
        gate.update(engine_correction=mode, engine_ratio_min=clip_min, engine_ratio_max=clip_max)
    assert_close(lossplug_run(f, [gate], "token"), trl_run(f, trl, "vespo"))


def test_vespo_phi_of_one_is_one_and_bounds_must_contain_one():
    f = fields(0)
    f["old_logp"] = f["logp"].clone()
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    plugin = lossplug.registry().plugins["gate"]["vespo"]
    out = plugin(inp, plugin.params())
    mask = f["action_mask"]
    # on-policy w = 1: φ(1) = 1, the plain policy gradient A·logp
    torch.testing.assert_close(
        torch.where(mask, out.objective, 0), torch.where(mask, f["advantage"][:, None] * f["logp"], 0)
    )
    with pytest.raises(lossplug.RecipeError, match="must contain 1"):
        lossplug.Recipe.model_validate(
            {"gates": [{"name": "vespo", "engine_correction": "token_mask", "engine_ratio_min": 1.1}]}
        )


# ---------------------------------------------------------------------------------------------------------------------
# off_policy_mask_threshold


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize("sampling", ["behavior_logp", "old_logp"])
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.3])
def test_off_policy_mask(seed, token_advantage, sampling, threshold):
    f = fields(seed, token_advantage=token_advantage, spread=0.5, engine_spread=0.5)
    epsilon_low, epsilon_high = 0.2, 0.28

    def trl(per_token_logps, mask):
        advantages = advantages_2d(f)
        # grpo_trainer.py:3068-3081: sampling log-probs when vLLM provides them, else the old ones
        off_policy_mask = GRPOTrainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=f[sampling],
            mask=mask,
            off_policy_threshold=threshold,
        )
        coef_1 = trl_coef_1(f, per_token_logps, mask, "token")
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        return per_token_loss * off_policy_mask  # grpo_trainer.py:3140-3141

    update = {"name": "ppo_clip", "eps_low": epsilon_low, "eps_high": epsilon_high, "log_ratio_clamp": 80.0}
    gate = {"name": "off_policy_mask", "threshold": threshold, "sampling_logp": sampling}
    ours, theirs = lossplug_run(f, [update, gate], "response"), trl_run(f, trl, "grpo")
    assert_close(ours, theirs)


def test_off_policy_mask_drops_only_negative_advantage_responses_that_drifted():
    f = fields(3, spread=0.5, engine_spread=0.5)
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    plugin = lossplug.registry().plugins["gate"]["off_policy_mask"]
    weight = plugin(inp, plugin.params(threshold=0.0)).weight
    mask = f["action_mask"]
    drift = torch.where(mask, f["behavior_logp"] - f["logp"], 0).sum(-1) / mask.sum(-1)
    expected = ((f["advantage"] >= 0) | (drift <= 0)).to(torch.float64)
    assert torch.equal(weight, expected.unsqueeze(-1).expand(B, T)) and 0 < expected.sum() < B


# ---------------------------------------------------------------------------------------------------------------------
# top_entropy_quantile


def stand_in(ranks: list[torch.Tensor] | None = None):
    """A minimal ``self`` for ``GRPOTrainer.get_high_entropy_mask``: one process, or ``ranks`` — the other
    processes' action entropies, gathered after this one's (``pad_across_processes`` pads to the longest)."""

    def pad_across_processes(t, dim, pad_index):
        width = max([t.numel()] + [r.numel() for r in ranks or []])
        return torch.cat([t, t.new_full((width - t.numel(),), pad_index)])

    def gather(t):
        width = t.numel()
        others = [torch.cat([r.float(), r.new_full((width - r.numel(),), -1e9).float()]) for r in ranks or []]
        return torch.cat([t, *others])

    return SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=pad_across_processes, gather=gather))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rho", [1.0, 0.8, 0.5, 0.2, 0.05, 0.0])
def test_top_entropy(seed, rho):
    f = fields(seed)
    mask_f = f["action_mask"].to(torch.float64)
    entropy_mask = GRPOTrainer.get_high_entropy_mask(stand_in(), f["entropy"], mask_f, 1 - rho)  # :3049-3050
    epsilon_low, epsilon_high = 0.2, 0.28

    def trl(per_token_logps, mask):
        coef_1 = trl_coef_1(f, per_token_logps, mask, "token")
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        advantages = advantages_2d(f)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        return per_token_loss * entropy_mask  # grpo_trainer.py:3143-3144

    update = {"name": "ppo_clip", "eps_low": epsilon_low, "eps_high": epsilon_high, "log_ratio_clamp": 80.0}
    gate = {"name": "top_entropy", "quantile": rho}
    assert_close(lossplug_run(f, [update, gate], "response"), trl_run(f, trl, "grpo"))
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    weight = (
        lossplug.registry()
        .plugins["gate"]["top_entropy"](inp, lossplug.registry().plugins["gate"]["top_entropy"].params(quantile=rho))
        .weight
    )
    assert torch.equal(weight.bool(), entropy_mask)


@pytest.mark.parametrize("rho", [0.8, 0.2])
def test_top_entropy_on_one_of_several_processes(rho):
    """TRL gathers every process's action entropies before the quantile; the gate sees its own micro-batch only.
    Its threshold equals TRL's when the gate is given every process's tokens, and is a per-rank one otherwise."""
    f, other = fields(0), fields(1)
    gathered = stand_in([other["entropy"][other["action_mask"]]])
    mask_f = f["action_mask"].to(torch.float64)
    trl_mask = GRPOTrainer.get_high_entropy_mask(gathered, f["entropy"], mask_f, 1 - rho)
    both = {k: torch.cat([f[k], other[k]]) for k in f}
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**both))
    plugin = lossplug.registry().plugins["gate"]["top_entropy"]
    weight = plugin(inp, plugin.params(quantile=rho)).weight
    assert torch.equal(weight[:B].bool(), trl_mask)


@pytest.mark.parametrize("n_rows", [1, 3, 40])
@pytest.mark.parametrize("q", [0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_sorted_quantile_is_torch_quantile(n_rows, q):
    """The accelerator path (a sort with the unselected positions pushed to the end) against torch.quantile."""
    from lossplug.plugins.gates.top_entropy import masked_quantile, sorted_quantile

    g = torch.Generator().manual_seed(n_rows)
    values = torch.rand(n_rows, 37, generator=g, dtype=torch.float64).round(decimals=2)  # ties
    mask = torch.rand(n_rows, 37, generator=g) > 0.4
    expected = torch.quantile(values[mask].float(), q)
    assert torch.equal(sorted_quantile(values, mask, q), expected)
    assert torch.equal(masked_quantile(values, mask, q), expected)
    none = torch.zeros_like(mask)
    assert torch.isnan(sorted_quantile(values, none, q)) and torch.isnan(masked_quantile(values, none, q))


def test_top_entropy_makes_no_host_sync():
    b = 4
    logp = torch.empty(b, T, device="meta").requires_grad_()
    batch = lossplug.PolicyBatch.unchecked(
        logp=logp,
        old_logp=torch.empty(b, T, device="meta"),
        behavior_logp=torch.empty(b, T, device="meta"),
        advantage=torch.empty(b, device="meta"),
        action_mask=torch.empty(b, T, dtype=torch.bool, device="meta"),
        entropy=torch.empty(b, T, device="meta"),
    )
    gates = ["ppo_clip", {"name": "top_entropy", "quantile": 0.2}, {"name": "off_policy_mask", "threshold": 0.1}]
    recipe = lossplug.Recipe.model_validate({"gates": gates + ["icepop"], "reduction": {"name": "token"}})
    for metrics in ("off", "basic", "full"):
        result = lossplug.policy_loss(batch, recipe, validate="off", metrics=metrics)
        result.loss.backward()
        assert result.loss.device.type == "meta"
    for name in ("vespo", "cispo_seq", "sapo_seq"):
        params = {"engine_correction": "token_mask"} if name == "vespo" else {}
        recipe = lossplug.Recipe.model_validate({"gates": [{"name": name, **params}], "reduction": {"name": "token"}})
        lossplug.policy_loss(batch, recipe, validate="off", metrics="full").loss.backward()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rho=st.floats(0.0, 1.0), rho2=st.floats(0.0, 1.0))
def test_top_entropy_keeps_at_least_the_top_fraction_and_more_for_a_larger_quantile(seed, rho, rho2):
    """At least ⌈ρ·(n − 1)⌉ of the n action tokens pass (those at or above the interpolated quantile), the weight is
    nested in ρ, and it is 0 off the actions."""
    f = fields(seed % 97)
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    plugin = lossplug.registry().plugins["gate"]["top_entropy"]
    small, large = sorted((rho, rho2))
    w_small = plugin(inp, plugin.params(quantile=small)).weight.bool()
    w_large = plugin(inp, plugin.params(quantile=large)).weight.bool()
    mask = f["action_mask"]
    n = int(mask.sum())
    assert not (w_large & ~mask).any() and not (w_small & ~w_large).any()
    assert int(w_small.sum()) >= math.ceil(small * (n - 1) - 1e-6) and int(w_small.sum()) >= 1

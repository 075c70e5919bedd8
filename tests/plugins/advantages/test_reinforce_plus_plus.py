"""``reinforce_plus_plus_baseline`` with the KL in the advantage (``kl_coef`` > 0) — NeMo-RL's Reinforce++ with
``use_kl_in_reward`` — against NeMo-RL's estimator transcribed in float64 loops (NVIDIA-NeMo/RL 7ea279ab,
``nemo_rl/algorithms/advantage_estimator.py`` ``ReinforcePlusPlusAdvantageEstimator.compute_advantage`` with
``minus_baseline: true``, ``nemo_rl/algorithms/utils.py`` ``calculate_kl`` and
``calculate_baseline_and_std_per_prompt``; NeMo-RL is not on a package index the tests can pin).

* ``variance: biased`` equals NeMo-RL on the action tokens (≤ 1e-12), for k1/k2/k3, with both clamps binding;
  ``variance: unbiased`` equals the same loops with verl's ``masked_whiten`` (Bessel factor, ε added);
* the two differences the docstring names: a group of one (NeMo-RL: 0; here ``R_i``, then whitened) and the values
  off the action tokens (NeMo-RL's are not 0);
* hypothesis: ``kl_coef: 0`` is today's estimator exactly, and a zero KL (``ref_logp = old_logp``) through the
  ``[B, T]`` path equals today's ``[B]`` advantage on every action token;
* the policy gradient of ``ppo_clip`` on these advantages against the same surrogate written out (float64);
* the fields it then requires, and bad input refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug import BatchValidationError, LossplugError
from lossplug.testing import assert_conforms
from lossplug.testing.batches import loss_and_grad

F64 = torch.float64
NAME = "reinforce_plus_plus_baseline"
ATOL = 1e-12


def plugin():
    return lossplug.registry().lookup("advantage", NAME, "test")


def advantage(batch, **params):
    p = plugin()
    return p(batch, p.params(**params)).advantage


def rollout(seed: int, *, groups=(3, 3, 2), T: int = 6, spread: float = 1.0, holes: bool = True) -> dict:
    """Prompt groups of ``groups`` rows (shuffled), multi-turn masks (observation tokens inside the response when
    ``holes``), a score per response, old and reference log-probs ``spread`` apart (NaN off the actions)."""
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), k) for k, n in enumerate(groups)])
    group = group[torch.randperm(group.numel(), generator=g)]
    B = group.numel()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    if holes:
        mask[:, 1:] &= torch.rand(B, T - 1, generator=g) > 0.2
    old = -(0.05 + 3 * torch.rand(B, T, generator=g, dtype=F64))
    ref = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    nan = torch.full((B, T), math.nan, dtype=F64)
    return {
        "score": (torch.rand(B, generator=g) < 0.5).to(F64) + 0.25 * torch.rand(B, generator=g, dtype=F64),
        "old": torch.where(mask, old, nan),
        "ref": torch.where(mask, ref, nan),
        "mask": mask,
        "group": group,
    }


def batch_of(r: dict) -> lossplug.PolicyBatch:
    return lossplug.PolicyBatch(
        logp=torch.where(r["mask"], r["old"], 0.0),
        action_mask=r["mask"],
        reward=r["score"],
        group_id=r["group"],
        old_logp=r["old"],
        ref_logp=r["ref"],
    )


# -- NeMo-RL's estimator, transcribed (loops, float64) ----------------------------------------------------------------


def nemo_calculate_kl(logprobs: float, reference: float, kl_type: str, input_clamp, output_clamp) -> float:
    logr = reference - logprobs
    if input_clamp is not None:
        logr = min(max(logr, -input_clamp), input_clamp)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr * logr / 2
    else:
        kl = math.exp(logr) - 1 - logr
    if output_clamp is not None:
        kl = min(max(kl, -output_clamp), output_clamp)
    return kl


def nemo_reinforce_plus_plus(
    r: dict, kl_coef: float, kl_type: str = "k3", input_clamp=20.0, output_clamp=10.0, *, bessel: bool = False
) -> list[list[float]]:
    """``ReinforcePlusPlusAdvantageEstimator.compute_advantage`` (minus_baseline, use_kl_in_reward) element by
    element; ``bessel`` swaps NeMo-RL's normalisation for verl's masked_whiten (÷(N−1) in float32's n, +1e-8)."""
    score, group, mask = r["score"].tolist(), r["group"].tolist(), r["mask"].tolist()
    old, ref = r["old"].tolist(), r["ref"].tolist()
    B, T = len(score), len(mask[0])
    adv = []
    for i in range(B):
        members = [j for j in range(B) if group[j] == group[i]]
        baseline = score[i] if len(members) <= 1 else sum(score[j] for j in members) / len(members)
        row = []
        for t in range(T):
            kl = nemo_calculate_kl(old[i][t], ref[i][t], kl_type, input_clamp, output_clamp) if mask[i][t] else 0.0
            row.append(score[i] - baseline - kl_coef * kl)
        adv.append(row)
    cells = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]
    n = len(cells)
    n_eps = float(torch.tensor(n) + 1e-8)  # verl: the integer count + 1e-8 is float32
    mean = sum(adv[i][t] for i, t in cells) / (n_eps if bessel else n)
    var = sum((adv[i][t] - mean) ** 2 for i, t in cells) / (n_eps if bessel else n)
    if bessel:
        factor = float(torch.tensor(n, dtype=torch.float32) / torch.tensor(n - 1, dtype=torch.float32))
        rstd = 1 / math.sqrt(var * factor + 1e-8)
    else:
        rstd = 1 / math.sqrt(max(var, 1e-8))
    return [[(adv[i][t] - mean) * rstd for t in range(T)] for i in range(B)]


def on_actions(x, mask):
    return torch.where(mask, torch.as_tensor(x, dtype=F64), 0.0)


# -- against NeMo-RL --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_biased_variance_equals_nemo_rls_reinforce_plus_plus_with_kl_in_reward(kl_type, seed):
    r = rollout(seed)
    got = advantage(batch_of(r), kl_coef=0.3, kl_estimator=kl_type, variance="biased")
    assert got.shape == r["mask"].shape and got.dtype == F64
    expected = on_actions(nemo_reinforce_plus_plus(r, 0.3, kl_type), r["mask"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert bool((got[~r["mask"]] == 0).all())


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_both_clamps_bind_as_nemo_rls(kl_type):
    """|ref − old| up to ~60: the input clamp (3 here) and the output clamp (2 here) both bind on some tokens."""
    r = rollout(5, spread=20.0)
    delta = (r["ref"] - r["old"])[r["mask"]]
    assert bool((delta.abs() > 3).any()) and bool((delta.abs() < 3).any())
    params = {"kl_estimator": kl_type, "kl_input_clamp": 3.0, "kl_output_clamp": 2.0, "variance": "biased"}
    got = advantage(batch_of(r), kl_coef=0.7, **params)
    expected = on_actions(nemo_reinforce_plus_plus(r, 0.7, kl_type, 3.0, 2.0), r["mask"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    unclamped = advantage(batch_of(r), kl_coef=0.7, kl_estimator=kl_type, kl_input_clamp=None, kl_output_clamp=None)
    expected = on_actions(nemo_reinforce_plus_plus(r, 0.7, kl_type, None, None, bessel=True), r["mask"])
    torch.testing.assert_close(unclamped, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 3])
def test_unbiased_variance_is_verls_masked_whiten_of_the_same_values(seed):
    r = rollout(seed)
    got = advantage(batch_of(r), kl_coef=0.3)
    expected = on_actions(nemo_reinforce_plus_plus(r, 0.3, bessel=True), r["mask"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_center_and_no_whitening_of_the_kl_values():
    r = rollout(4)
    raw = advantage(batch_of(r), kl_coef=0.3, whiten=False)
    score, group, mask = r["score"], r["group"], r["mask"]
    mean = torch.stack([score[group == k].mean() for k in group])
    kl = torch.tensor(
        [
            [nemo_calculate_kl(o, f, "k3", 20.0, 10.0) for o, f in zip(ro, rf)]
            for ro, rf in zip(r["old"].tolist(), r["ref"].tolist())
        ],
        dtype=F64,
    )
    torch.testing.assert_close(raw, on_actions((score - mean)[:, None] - 0.3 * kl, mask), atol=ATOL, rtol=0)
    centered = advantage(batch_of(r), kl_coef=0.3, whiten="center")
    torch.testing.assert_close(centered, on_actions(raw - raw[mask].mean(), mask), atol=ATOL, rtol=0)


def test_the_kl_is_each_tokens_own_not_a_sum_over_later_tokens():
    """One response whose only non-zero KL is on its first token: only that token's advantage moves."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.full((2, 3), -1.0, dtype=F64)
    ref = old.clone()
    ref[0, 0] = -2.0
    batch = lossplug.PolicyBatch(
        logp=old,
        action_mask=mask,
        reward=torch.tensor([1.0, 0.0], dtype=F64),
        group_id=torch.tensor([0, 0]),
        old_logp=old,
        ref_logp=ref,
    )
    raw = advantage(batch, kl_coef=1.0, whiten=False)
    k3 = math.exp(-1.0) - 1 + 1
    expected = torch.tensor([[0.5 - k3, 0.5, 0.5], [-0.5, -0.5, -0.5]], dtype=F64)
    torch.testing.assert_close(raw, expected, atol=ATOL, rtol=0)


def test_where_nemo_rl_differs_a_group_of_one_and_the_positions_off_the_actions():
    r = rollout(6, groups=(3, 3, 1))
    single = (r["group"] == 2).nonzero().item()
    raw = advantage(batch_of(r), kl_coef=0.3, whiten=False)
    no_kl = advantage(batch_of(r), whiten=False)
    assert float(no_kl[single]) == float(r["score"][single])  # verl's convention: R_i (NeMo-RL: R_i − R_i = 0)
    nemo = torch.tensor(nemo_reinforce_plus_plus(r, 0.3, bessel=False), dtype=F64)
    got = advantage(batch_of(r), kl_coef=0.3, variance="biased")
    assert not torch.allclose(torch.where(r["mask"], got, 0), torch.where(r["mask"], nemo, 0))
    assert bool((raw[~r["mask"]] == 0).all()) and bool((nemo[~r["mask"]] != 0).any())


# -- invariants -------------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**16), whiten=st.sampled_from([True, False, "center"]), holes=st.booleans())
def test_kl_coef_zero_is_todays_estimator_exactly(seed, whiten, holes):
    r = rollout(seed, holes=holes)
    today = advantage(batch_of(r), whiten=whiten)
    assert torch.equal(advantage(batch_of(r), whiten=whiten, kl_coef=0.0), today)
    assert plugin().required_fields(plugin().params(kl_coef=0.0)) == ("reward", "group_id")


@given(
    seed=st.integers(0, 2**16),
    whiten=st.sampled_from([True, False, "center"]),
    kl_type=st.sampled_from(["k1", "k2", "k3"]),
    coef=st.floats(0.001, 5.0),
)
def test_a_zero_kl_through_the_token_path_is_todays_advantage_on_every_action(seed, whiten, kl_type, coef):
    r = rollout(seed)
    r = {**r, "ref": r["old"].clone()}
    today = advantage(batch_of(r), whiten=whiten)
    tokens = advantage(batch_of(r), whiten=whiten, kl_coef=coef, kl_estimator=kl_type)
    torch.testing.assert_close(tokens, on_actions(today[:, None].expand_as(tokens), r["mask"]), atol=1e-12, rtol=0)


@given(seed=st.integers(0, 2**16))
def test_biased_variance_without_the_kl_is_nemo_rls_minus_baseline(seed):
    r = rollout(seed)
    got = advantage(batch_of(r), variance="biased")
    expected = on_actions(nemo_reinforce_plus_plus(r, 0.0), r["mask"])
    torch.testing.assert_close(on_actions(got[:, None].expand_as(expected), r["mask"]), expected, atol=ATOL, rtol=0)


# -- the loss on these advantages -------------------------------------------------------------------------------------


def test_ppo_clip_loss_and_gradient_on_the_kl_advantages():
    r = rollout(7)
    mask = r["mask"]
    recipe = {
        "advantage": {"name": NAME, "kl_coef": 0.3, "variance": "biased"},
        "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
        "reduction": "token",
    }
    g = torch.Generator().manual_seed(8)
    old = torch.where(mask, r["old"], 0.0)
    logp = (old + 0.2 * torch.randn(old.shape, generator=g, dtype=F64)).clamp(max=-1e-4).requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp,
        action_mask=mask,
        reward=r["score"],
        group_id=r["group"],
        old_logp=old,
        ref_logp=torch.where(mask, r["ref"], 0.0),
    )
    adv = lossplug.estimate_advantages(batch, recipe).advantage
    result, grad = loss_and_grad(recipe, logp=logp, action_mask=mask, old_logp=old, advantage=adv)
    loss = result.loss

    a = on_actions(nemo_reinforce_plus_plus(r, 0.3), mask)
    x = logp.detach().clone().requires_grad_()
    ratio = torch.exp(x - old)
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    (expected_grad,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, expected_grad, 0), atol=ATOL, rtol=0)


# -- fields and refusals ----------------------------------------------------------------------------------------------


def test_kl_coef_requires_old_and_reference_log_probs():
    p = plugin()
    assert p.required_fields(p.params()) == ("reward", "group_id")
    assert p.required_fields(p.params(kl_coef=0.01)) == ("reward", "group_id", "old_logp", "ref_logp")
    r = rollout(0)
    recipe = {"advantage": {"name": NAME, "kl_coef": 0.01}, "gates": ["ppo_clip"], "reduction": "token"}
    no_ref = lossplug.PolicyBatch(
        logp=torch.where(r["mask"], r["old"], 0.0),
        action_mask=r["mask"],
        reward=r["score"],
        group_id=r["group"],
        old_logp=r["old"],
    )
    with pytest.raises((LossplugError, BatchValidationError), match="ref_logp"):
        lossplug.estimate_advantages(no_ref, recipe)


def test_bad_params_are_refused_by_name():
    p = plugin()
    with pytest.raises(ValueError, match="kl_coef"):
        p.params(kl_coef=-0.1)
    with pytest.raises(ValueError, match="kl_estimator"):
        p.params(kl_estimator="k4")
    with pytest.raises(ValueError, match="variance: biased"):
        p.params(variance="biased", whiten="center")


def test_a_non_finite_reference_log_prob_on_an_action_is_refused_by_position():
    r = rollout(0)
    ref = r["ref"].clone()
    i, t = (r["mask"]).nonzero()[1].tolist()
    ref[i, t] = math.nan
    with pytest.raises((LossplugError, BatchValidationError), match=r"ref_logp") as err:
        lossplug.estimate_advantages(
            batch_of({**r, "ref": ref}),
            {"advantage": {"name": NAME, "kl_coef": 0.01}, "gates": ["ppo_clip"], "reduction": "token"},
        )
    assert str(i) in str(err.value)


@pytest.mark.parametrize("params", [{"kl_coef": 0.05}, {"kl_coef": 0.05, "variance": "biased"}, {"variance": "biased"}])
def test_conforms(params):
    assert_conforms(NAME, kind="advantage", params=params)

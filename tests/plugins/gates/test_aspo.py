"""aspo: loss, gradient and metrics against a float64 transcription of Archer2.0's ``compute_policy_loss_archer`` (with
its actor's per-response entropy split), the gradient token by token against its closed form, and its invariants.

Archer2.0 (wizard-III/Archer2.0, commit b08d963) is a fork of verl, not an installable package: its loss is
transcribed below line by line as its code writes it, independently of the plugin.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad

SHAPES = [(1, 1), (2, 5), (4, 9), (8, 33)]


def archer_loss(old_log_prob, log_prob, advantages, response_mask, entropy, split=True, q=0.8, c_neg=3.0, c_pos=3.0):
    """Archer2.0's ``compute_policy_loss_archer`` with the bounds its ``dp_actor`` passes (0.2 / 0.4 and 3.0), the
    ``high_entropy_mask`` its actor computes (the tokens at most their response's 0.8 entropy quantile — its name
    notwithstanding), ``token-mean``; ``split=False``: every token takes the 0.2 bounds. Returns the loss and the
    four fractions it logs."""
    mask = response_mask
    masked_entropy = torch.where(mask.bool(), entropy.detach(), torch.nan)
    q80 = torch.nanquantile(masked_entropy, q=q, dim=-1, keepdim=True)
    high_entropy_mask = (masked_entropy <= q80) & mask if split else mask.clone()

    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    negative_clip_ratio = torch.where(
        high_entropy_mask, torch.clamp(ratio, min=1 - 0.2, max=None), torch.clamp(ratio, min=1 - 0.4, max=None)
    )
    positive_clip_ratio = torch.where(
        high_entropy_mask, torch.clamp(ratio, min=None, max=1 + 0.2), torch.clamp(ratio, min=None, max=1 + 0.4)
    )
    clip_ratio = torch.where(advantages < 0, negative_clip_ratio, positive_clip_ratio)

    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    pg_clipfrac_upper = masked_mean(torch.gt(ratio, clip_ratio).float(), mask)
    pg_clipfrac_lower = masked_mean(torch.lt(ratio, clip_ratio).float(), mask)

    negative_pg_losses_clip = -advantages * negative_clip_ratio
    positive_pg_losses_clip = (
        -advantages * (positive_clip_ratio / positive_clip_ratio.detach()) / positive_clip_ratio.detach()
    )

    negative_dual_clip_ratio = torch.clamp(negative_clip_ratio, min=None, max=c_neg)
    negative_clipped_mask = torch.gt(negative_clip_ratio, negative_dual_clip_ratio)
    negative_dual = masked_mean(negative_clipped_mask.float(), mask & (advantages < 0))
    negative_pg_losses_dual = -advantages * negative_dual_clip_ratio.detach() * log_prob
    negative_pg_losses = torch.where(negative_clipped_mask, negative_pg_losses_dual, negative_pg_losses_clip)

    positive_dual_clip_ratio = torch.clamp(1 / positive_clip_ratio, min=None, max=c_pos)
    positive_clipped_mask = torch.gt(1 / positive_clip_ratio, positive_dual_clip_ratio)
    positive_dual = masked_mean(positive_clipped_mask.float(), mask & (advantages > 0))
    positive_pg_losses_dual = -advantages * positive_dual_clip_ratio.detach() * log_prob
    positive_pg_losses = torch.where(positive_clipped_mask, positive_pg_losses_dual, positive_pg_losses_clip)

    pg_losses = torch.where(advantages < 0, negative_pg_losses, positive_pg_losses)
    pg_loss = (pg_losses * mask).sum() / mask.sum()
    return pg_loss, {
        "upper": pg_clipfrac_upper,
        "lower": pg_clipfrac_lower,
        "negative_dual": negative_dual,
        "positive_dual": positive_dual,
    }


def batch(B, T, seed, spread=0.6):
    """float64: a stale update (some ratios far past 3 and below 1/3), token advantages with zeros, entropies with
    ties, the first token of every response an action."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64) * 2).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(B, T, generator=g) < 0.1, 0.0, adv)
    entropy = (torch.rand(B, T, generator=g, dtype=torch.float64) * 8).round() / 4  # ties at the quantile
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return dict(logp=logp, old_logp=old, advantage=adv, entropy=entropy, action_mask=mask)


UNIFORM = {"high_entropy_eps_low": None, "high_entropy_eps_high": None}


@pytest.mark.parametrize("split", [True, False], ids=["entropy-split", "uniform"])
def test_loss_gradient_and_metrics_match_archer(split):
    worst = {"loss": 0.0, "grad": 0.0}
    branches = torch.zeros(4, dtype=torch.long)  # the four regimes seen: cut, dual (either sign), flipped, PPO
    for B, T in SHAPES:
        for seed in range(4):
            f = batch(B, T, seed)
            gate = {"name": "aspo"} if split else {"name": "aspo", **UNIFORM}
            fields = f if split else {k: v for k, v in f.items() if k != "entropy"}
            result, grad = loss_and_grad({"gates": [gate], "reduction": "token"}, **fields)

            logp = f["logp"].clone().requires_grad_()
            expected, fractions = archer_loss(
                f["old_logp"], logp, f["advantage"], f["action_mask"], f["entropy"], split=split
            )
            expected.backward()
            mask = f["action_mask"]
            torch.testing.assert_close(result.loss.detach(), expected.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(
                torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14
            )
            worst["loss"] = max(worst["loss"], float((result.loss.detach() - expected.detach()).abs()))
            worst["grad"] = max(worst["grad"], float((torch.where(mask, grad - logp.grad, 0)).abs().max()))

            m = result.metrics
            n = int(mask.sum())
            assert m["aspo/clip_frac_high"] == pytest.approx(float(fractions["upper"]), abs=1e-6)
            assert m["aspo/clip_frac_low"] == pytest.approx(float(fractions["lower"]), abs=1e-6)
            adv = f["advantage"]
            # Archer divides its dual fractions by the tokens of that sign; lossplug by every action token
            for name, sign in (("negative_dual", adv < 0), ("positive_dual", adv > 0)):
                count = int((mask & sign).sum())
                mine = m[f"aspo/dual_frac_{'neg' if name.startswith('neg') else 'pos'}"] * n
                assert mine == pytest.approx(float(fractions[name]) * count if count else 0.0, abs=1e-4)

            ratio = (f["logp"] - f["old_logp"]).exp()
            branches += torch.tensor(
                [
                    int((mask & (((adv < 0) & (ratio < 0.6)) | ((adv >= 0) & (ratio > 1.4)))).sum()),
                    int((mask & (((adv < 0) & (ratio > 3)) | ((adv > 0) & (ratio < 1 / 3)))).sum()),
                    int((mask & (adv > 0) & (ratio > 1 / 3) & (ratio < 1.2)).sum()),
                    int((mask & (adv < 0) & (ratio > 0.8) & (ratio < 3)).sum()),
                ]
            )
    assert bool((branches > 5).all()), branches  # every regime is exercised, not just the on-policy one
    print(f"aspo vs Archer2.0 (split={split}): max |Δloss| {worst['loss']:.2e}, max |Δgrad| {worst['grad']:.2e}")


def closed_form_gradient(r, a, logp, eps_low, eps_high, c_neg=3.0, c_pos=3.0):
    """d objective / d logp of one token, from the paper's reading of the code: the flipped weight A/r for positive
    tokens inside the clip, PPO's A·r for negative ones, c·A past the dual bounds, 0 where cut."""
    if a < 0:
        n = max(r, 1 - eps_low)
        if n > c_neg:
            return c_neg * a
        return a * r if r > 1 - eps_low else 0.0
    p = min(r, 1 + eps_high)
    if 1 / p > c_pos:
        return c_pos * a
    return a / r if r < 1 + eps_high else 0.0


def test_gradient_token_by_token_is_the_closed_form():
    f = batch(6, 11, seed=11)
    result, grad = loss_and_grad({"gates": [{"name": "aspo", **UNIFORM}], "reduction": "token"}, **f)
    n = int(f["action_mask"].sum())
    ratio = (f["logp"] - f["old_logp"]).exp()
    for b in range(6):
        for t in range(11):
            if not f["action_mask"][b, t]:
                assert grad[b, t] == 0
                continue
            # the loss is −Σ J / n: its gradient is −(dJ/dlogp)/n
            expected = -closed_form_gradient(float(ratio[b, t]), float(f["advantage"][b, t]), 0, 0.2, 0.2) / n
            assert float(grad[b, t]) == pytest.approx(expected, rel=1e-10, abs=1e-15), (b, t)


def test_the_positive_value_is_the_flipped_ratio_and_the_dual_value_uses_logp():
    old = torch.full((1, 4), math.log(0.5), dtype=torch.float64)
    probs = torch.tensor([[0.6, 0.5, 0.8, 0.1]], dtype=torch.float64)  # r = 1.2, 1, 1.6 (cut), 0.2 (< 1/3: dual)
    fields = dict(
        logp=probs.log(), old_logp=old, advantage=torch.tensor([2.0]), action_mask=torch.ones(1, 4, dtype=torch.bool)
    )
    plugin = lossplug.registry().plugins["gate"]["aspo"]
    batch_ = lossplug.PolicyBatch(**fields)
    out = plugin(lossplug.GateInput.from_batch(batch_), plugin.params(**UNIFORM))
    expected = [2 / 1.2, 2 / 1.0, 2 / 1.2, 3 * 2 * math.log(0.1)]
    assert out.objective[0].tolist() == pytest.approx(expected, rel=1e-12)


def test_on_policy_it_is_the_policy_gradient():
    # r = 1: value A, gradient A·∇logπ, whatever the sign (the flip and PPO's ratio coincide)
    f = batch(4, 9, seed=3)
    f["logp"] = f["old_logp"].clone()
    result, grad = loss_and_grad({"gates": ["aspo"], "reduction": "token"}, **f)
    mask, n = f["action_mask"], int(f["action_mask"].sum())
    torch.testing.assert_close(grad, torch.where(mask, -f["advantage"] / n, 0), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(result.loss.detach(), -torch.where(mask, f["advantage"], 0).sum() / n)


def test_the_entropy_split_is_per_response_and_additive_over_micro_batches():
    f = batch(4, 9, seed=5)
    full, grad = loss_and_grad({"gates": ["aspo"], "reduction": "token"}, **f)
    n = int(f["action_mask"].sum())
    normalizer = lossplug.Normalizer(action_tokens=n, sequences=4)
    total, parts = 0.0, []
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part = {k: v[rows] for k, v in f.items()}
        r, g = loss_and_grad({"gates": ["aspo"], "reduction": "token"}, normalizer=normalizer, **part)
        total += float(r.loss.detach())
        parts.append(g)
    assert total == pytest.approx(float(full.loss.detach()), rel=1e-12)
    torch.testing.assert_close(torch.cat(parts), grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"high_entropy_eps_low": None}, "set both"),
        ({"high_entropy_eps_high": None}, "set both"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"positive_dual_clip_c": 0.5}, "positive_dual_clip_c"),
        ({"entropy_quantile": 1.5}, "entropy_quantile"),
    ],
)
def test_bad_parameters_are_named(params, message):
    with pytest.raises(lossplug.RecipeError, match=message):
        lossplug.Recipe.load({"gates": [{"name": "aspo", **params}], "reduction": "token"})


def test_the_entropy_split_requires_entropy_and_the_uniform_bounds_do_not():
    f = batch(2, 5, seed=1)
    del f["entropy"]
    with pytest.raises(lossplug.BatchValidationError, match=r"entropy: required by recipe.gates\[0\] \(aspo\)"):
        loss_and_grad({"gates": ["aspo"], "reduction": "token"}, **f)
    result, _ = loss_and_grad({"gates": [{"name": "aspo", **UNIFORM}], "reduction": "token"}, **f)
    assert torch.isfinite(result.loss)


@given(
    seed=st.integers(0, 2**16),
    spread=st.floats(0.01, 3.0),
    split=st.booleans(),
)
def test_every_tokens_gradient_has_its_advantages_sign_and_is_bounded(seed, spread, split):
    # the flip changes the weight, never the direction: dJ/dlogp = w·A with 0 ≤ w ≤ max(c, e^20 clamp irrelevant)
    f = batch(3, 7, seed, spread=spread)
    gate = {"name": "aspo"} if split else {"name": "aspo", **UNIFORM}
    _, grad = loss_and_grad({"gates": [gate], "reduction": "token"}, **f)
    n = int(f["action_mask"].sum())
    objective_grad = -grad * n
    adv = f["advantage"]
    assert bool((objective_grad * adv >= 0).all())
    # weights: c for the dual branches, r ≤ c for negative ones, 1/r ≤ c for positive ones
    assert bool((objective_grad.abs() <= 3.0 * adv.abs() * (1 + 1e-9)).all())

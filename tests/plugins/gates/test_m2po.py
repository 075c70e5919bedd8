"""m2po: the second-moment mask against a transcription of AReaL's rule and against AReaL's own code (float64, the
mask, the loss and the gradient), and its invariants."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.plugins.gates.m2po import second_moment_keep
from lossplug.testing.batches import loss_and_grad

SHAPES = [(1, 1), (2, 5), (4, 9), (8, 33)]
THRESHOLDS = [0.005, 0.04, 0.3, 5.0]


def stale_batch(B, T, seed, spread=0.25):
    """float64 log-probs: π_old a little off π_behave (a few tokens far off), π_θ a little off π_old."""
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    engine = spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    engine = torch.where(torch.rand(B, T, generator=g) < 0.1, 5 * engine, engine)
    old = (behave + engine).clamp(max=-1e-3)
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(logp=logp, old_logp=old, behavior_logp=behave, advantage=adv, action_mask=mask)


def transcribed_keep(m2, mask, threshold):
    """AReaL's rule read from its docstring and code, as a loop: sort the action tokens' m² descending, drop the
    largest until the mean of the rest is below the threshold (all but the last one if it never is)."""
    flat = [(float(v), i) for i, (v, valid) in enumerate(zip(m2.flatten().tolist(), mask.flatten().tolist())) if valid]
    order = [i for _, i in sorted(flat, key=lambda pair: -pair[0])]
    values = dict((i, v) for v, i in flat)
    n = len(order)
    drop = n - 1
    for k in range(n):
        rest = [values[i] for i in order[k:]]
        if sum(rest) / len(rest) < threshold:
            drop = k
            break
    keep = torch.zeros(m2.numel(), dtype=torch.bool)
    keep[order[drop:]] = True
    return keep.view_as(mask)


def gate_weight(fields, **params):
    plugin = lossplug.registry().plugins["gate"]["m2po"]
    batch = lossplug.PolicyBatch(**fields)
    return plugin(lossplug.GateInput.from_batch(batch), plugin.params(**params)).weight


def transcribed_areal_loss(f, keep, eps=0.2):
    """AReaL's per-micro-batch PPO loss after M2PO: Σ over the kept tokens of the clipped surrogate ÷ the kept count."""
    logp = f["logp"].clone().requires_grad_()
    ratio = torch.exp(logp - f["old_logp"])
    adv = f["advantage"].unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    loss = -torch.where(keep, surrogate, 0).sum() / keep.sum()
    loss.backward()
    return loss.detach(), logp.grad


def test_mask_weight_loss_and_gradient_match_the_transcription():
    worst = {"loss_abs": 0.0, "loss_rel": 0.0, "grad_abs": 0.0}
    masked_some = 0
    for B, T in SHAPES:
        for seed, threshold in enumerate(THRESHOLDS):
            f = stale_batch(B, T, seed)
            delta = f["behavior_logp"] - f["old_logp"]
            keep = transcribed_keep(delta.square(), f["action_mask"], threshold)
            n, kept = int(f["action_mask"].sum()), int(keep.sum())
            masked_some += kept < n
            renormalized = gate_weight(f, threshold=threshold, renormalize=True)
            torch.testing.assert_close(renormalized, keep.double() * n / kept, rtol=0, atol=0)
            torch.testing.assert_close(gate_weight(f, threshold=threshold), keep.double())
            m2po = {"name": "m2po", "threshold": threshold, "renormalize": True}
            recipe = {"gates": [{"name": "ppo_clip"}, m2po], "reduction": "token"}
            result, grad = loss_and_grad(recipe, **f)
            expected_loss, expected_grad = transcribed_areal_loss(f, keep)
            torch.testing.assert_close(result.loss, expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            error = float((result.loss.detach() - expected_loss).abs())
            worst["loss_abs"] = max(worst["loss_abs"], error)
            worst["loss_rel"] = max(worst["loss_rel"], error / float(expected_loss.abs()))
            worst["grad_abs"] = max(worst["grad_abs"], float((grad - expected_grad).abs().max()))
    assert masked_some >= len(SHAPES)  # the cases exercise the rule, not only the keep-everything branch
    print("m2po vs transcription", worst)


def test_matches_areal(areal):
    worst = {"loss_abs": 0.0, "loss_rel": 0.0, "grad_abs": 0.0}
    for B, T in SHAPES:
        for seed, threshold in enumerate(THRESHOLDS):
            f = stale_batch(B, T, 100 + seed)
            mask = f["action_mask"]
            # AReaL's names: old_logp is the behaviour policy's, prox_logp the proximal (lossplug's old_logp)
            areal_mask = areal.apply_m2po_masking(f["behavior_logp"], f["old_logp"], mask, threshold)
            keep = gate_weight(f, threshold=threshold) > 0
            assert torch.equal(keep, areal_mask)
            logp = f["logp"].clone().requires_grad_()
            areal_loss, _ = areal.ppo_actor_loss_fn(
                logprobs=logp,
                proximal_logprobs=f["old_logp"],
                old_logprobs=f["behavior_logp"],
                advantages=f["advantage"].unsqueeze(-1).expand_as(mask),
                eps_clip=0.2,
                loss_mask=areal_mask,
            )
            areal_loss.backward()
            m2po = {"name": "m2po", "threshold": threshold, "renormalize": True}
            recipe = {"gates": [{"name": "ppo_clip"}, m2po], "reduction": "token"}
            result, grad = loss_and_grad(recipe, **f)
            torch.testing.assert_close(result.loss, areal_loss.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)
            error = float((result.loss.detach() - areal_loss.detach()).abs())
            worst["loss_abs"] = max(worst["loss_abs"], error)
            worst["loss_rel"] = max(worst["loss_rel"], error / float(areal_loss.detach().abs()))
            worst["grad_abs"] = max(worst["grad_abs"], float((grad - logp.grad).abs().max()))
    print("m2po vs AReaL", worst)


@given(
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    threshold=st.floats(1e-4, 2.0),
    spread=st.floats(0.0, 2.0),
    seed=st.integers(0, 10_000),
)
def test_the_kept_second_moment_is_below_the_threshold_and_the_dropped_tokens_are_the_largest(
    B, T, threshold, spread, seed
):
    f = stale_batch(B, T, seed, spread)
    mask = f["action_mask"]
    m2 = (f["old_logp"] - f["behavior_logp"]).square()
    keep = second_moment_keep(f["old_logp"] - f["behavior_logp"], mask, threshold)
    assert not bool((keep & ~mask).any())
    kept = int(keep.sum())
    assert kept >= 1
    assert kept == 1 or float(m2[keep].mean()) < threshold
    dropped = mask & ~keep
    if bool(dropped.any()):
        assert float(m2[dropped].min()) >= float(m2[keep].max())
        # minimal: keeping the smallest dropped token as well would break the bound
        with_one_more = torch.cat([m2[keep], m2[dropped].min().reshape(1)])
        assert float(with_one_more.mean()) >= threshold


@given(B=st.integers(1, 5), T=st.integers(1, 12), seed=st.integers(0, 10_000), threshold=st.floats(1e-4, 2.0))
def test_on_policy_keeps_every_token_with_weight_one(B, T, seed, threshold):
    f = stale_batch(B, T, seed)
    f["behavior_logp"] = f["old_logp"].clone()
    weight = gate_weight(f, threshold=threshold, renormalize=True)
    assert torch.equal(weight[f["action_mask"]], torch.ones(int(f["action_mask"].sum()), dtype=torch.float64))

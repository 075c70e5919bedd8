"""PPO-epoch diagnostics of TRL ≤ 0.11's PPOTrainer.loss and the ratio guard."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossplug import LossplugError
from lossplug.tools.diagnostics import (
    RatioGuardWarning,
    approx_kl,
    entropy_from_logits,
    masked_mean_var,
    policy_clip_fraction,
    policy_kl,
    ppo_diagnostics,
    ratio_guard,
)

# ---------------------------------------------------------------------------------------------------------------------
# TRL ≤ 0.11's PPOTrainer.loss(), transcribed apart from the config object (TRL's helpers inlined)


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _masked_var(values, mask, unbiased=True):
    mean = _masked_mean(values, mask)
    centered_values = values - mean
    variance = _masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def _entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, axis=-1) - torch.sum(pd * logits, axis=-1)


def _trl_ppo_loss(
    old_logprobs,
    values,
    logits,
    vpreds,
    logprobs,
    mask,
    advantages,
    returns,
    cliprange_value=0.2,
    cliprange=0.2,
    vf_coef=0.1,
    ratio_threshold=10.0,
):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * _masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = _masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = _masked_mean(torch.max(pg_losses, pg_losses2), mask)
    pg_clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses).float(), mask)
    loss = pg_loss + vf_coef * vf_loss
    avg_ratio = _masked_mean(ratio, mask).item()
    if avg_ratio > ratio_threshold:
        pg_loss, vf_loss, loss = pg_loss * 0.0, vf_loss * 0.0, loss * 0.0
    entropy = _masked_mean(_entropy_from_logits(logits), mask)
    approxkl = 0.5 * _masked_mean((logprobs - old_logprobs) ** 2, mask)
    policykl = _masked_mean(old_logprobs - logprobs, mask)
    return_mean, return_var = _masked_mean(returns, mask), _masked_var(returns, mask)
    value_mean, value_var = _masked_mean(values, mask), _masked_var(values, mask)
    stats = {
        "policy/entropy": entropy,
        "policy/approx_kl": approxkl,
        "policy/policy_kl": policykl,
        "policy/clip_frac": pg_clipfrac,
        "policy/advantages_mean": _masked_mean(advantages, mask),
        "returns/mean": return_mean,
        "returns/var": return_var,
        "value/vpred_mean": _masked_mean(vpreds, mask),
        "value/error": _masked_mean((vpreds - returns) ** 2, mask),
        "value/clip_frac": vf_clipfrac,
        "value/mean": value_mean,
        "value/var": value_var,
    }
    return pg_loss, vf_loss, loss, {k: v.detach() for k, v in stats.items()}


def _epoch_batch(B=4, T=6, V=11, seed=0, drift=0.3):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    logits = torch.randn(B, T, V, generator=g, dtype=dt) * 2
    logp = torch.log_softmax(logits, -1)[..., 0]
    old = logp + torch.randn(B, T, generator=g, dtype=dt) * drift
    adv = torch.randn(B, T, generator=g, dtype=dt)
    values = torch.randn(B, T, generator=g, dtype=dt)
    vpreds = values + torch.randn(B, T, generator=g, dtype=dt) * 0.3
    returns = values + torch.randn(B, T, generator=g, dtype=dt)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    return dict(logits=logits, logp=logp, old=old, adv=adv, values=values, vpreds=vpreds, returns=returns, mask=mask)


@pytest.mark.parametrize("seed", range(3))
def test_matches_trl_ppo_statistics(seed):
    b = _epoch_batch(seed=seed)
    *_, stats = _trl_ppo_loss(
        b["old"], b["values"], b["logits"], b["vpreds"], b["logp"], b["mask"].double(), b["adv"], b["returns"]
    )
    ours = ppo_diagnostics(
        b["logp"],
        b["old"],
        b["mask"],
        advantages=b["adv"],
        eps_low=0.2,
        logits=b["logits"],
        values=b["vpreds"],
        old_values=b["values"],
        returns=b["returns"],
        value_clip_eps=0.2,
    )
    assert set(stats) <= set(ours)
    for key, expected in stats.items():
        torch.testing.assert_close(ours[key], expected.to(ours[key].dtype), msg=key)
    assert 0 < ours["policy/clip_frac"] < 1 and 0 < ours["value/clip_frac"] < 1
    # the separate functions agree with the bundle
    torch.testing.assert_close(approx_kl(b["logp"], b["old"], b["mask"]), ours["policy/approx_kl"])
    torch.testing.assert_close(policy_kl(b["logp"], b["old"], b["mask"]), ours["policy/policy_kl"])
    torch.testing.assert_close(policy_clip_fraction(b["logp"], b["old"], b["adv"], b["mask"]), ours["policy/clip_frac"])


def test_precomputed_entropy_equals_logits_path_and_nothing_has_grad():
    b = _epoch_batch(seed=4)
    logp = b["logp"].clone().requires_grad_()
    ent = entropy_from_logits(b["logits"], b["mask"])
    a = ppo_diagnostics(logp, b["old"], b["mask"], logits=b["logits"])
    c = ppo_diagnostics(logp, b["old"], b["mask"], entropy=ent)
    torch.testing.assert_close(a["policy/entropy"], c["policy/entropy"])
    assert not any(v.requires_grad for v in a.values())
    assert set(a) == {"policy/approx_kl", "policy/policy_kl", "policy/ratio_mean", "policy/entropy"}


def test_sequence_level_advantages_broadcast():
    b = _epoch_batch(seed=5)
    seq_adv = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(
        policy_clip_fraction(b["logp"], b["old"], seq_adv, b["mask"]),
        policy_clip_fraction(b["logp"], b["old"], seq_adv[:, None].expand(4, 6), b["mask"]),
    )


@given(st.integers(0, 10_000), st.sampled_from([1, 2, 5, 1000]))
def test_property_entropy_chunking_and_non_contiguous_logits(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(3, 6, 9, generator=g) * 3
    logits = wide[:, :-1]  # non-contiguous [3, 5, 9]
    mask = torch.rand(3, 5, generator=g) < 0.6
    ent = entropy_from_logits(logits, mask, chunk_tokens=chunk)
    expected = torch.where(mask, _entropy_from_logits(logits), 0.0)
    torch.testing.assert_close(ent, expected)
    assert (ent >= -1e-6).all() and (ent <= torch.log(torch.tensor(9.0)) + 1e-5).all()


def test_entropy_never_materialises_a_batch_by_vocab_copy():
    # an expanded view of 8 × 1024 × 2^20 floats (32 GiB if copied) over one real row of 4 MiB
    row = torch.randn(1, 1, 1 << 20)
    logits = row.expand(8, 1024, 1 << 20)
    mask = torch.zeros(8, 1024, dtype=torch.bool)
    mask[0, 3] = mask[5, 1000] = mask[7, 0] = True
    ent = entropy_from_logits(logits, mask)
    expected = _entropy_from_logits(row[0, 0].double()).float()
    torch.testing.assert_close(ent[mask], expected.expand(3), rtol=1e-4, atol=1e-4)
    assert (ent[~mask] == 0).all()


def test_entropy_with_masked_vocabulary_is_finite():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.log(torch.tensor([[2.0]])))


def test_masked_mean_var_is_unbiased_and_refuses_one_token():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    mean, var = masked_mean_var(x, mask)
    torch.testing.assert_close(mean, x[mask].mean())
    torch.testing.assert_close(var, x[mask].var(unbiased=True))
    with pytest.raises(LossplugError, match="returns: the unbiased variance needs at least 2 action tokens, got 1"):
        masked_mean_var(x, torch.tensor([[True, False, False], [False, False, False]]), name="returns")
    with pytest.raises(
        LossplugError, match=r"returns: must be finite on action positions — \(row 0, pos 2\), \(row 1, pos 1\)"
    ):
        masked_mean_var(x, torch.ones(2, 3, dtype=torch.bool), name="returns")


# ---------------------------------------------------------------------------------------------------------------------
# verl 0.9.1: pg_clipfrac and ppo_kl of compute_policy_loss_vanilla


class _ActorCfg(dict):
    def __init__(self, low, high):
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = low, low, high
        self.global_batch_info = {}


@pytest.mark.parametrize("low, high", [(0.2, 0.2), (0.2, 0.28)])
def test_policy_metrics_match_verl_vanilla(low, high):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    b = _epoch_batch(B=6, T=10, seed=6, drift=0.4)
    _, metrics = core_algos.compute_policy_loss_vanilla(
        b["old"], b["logp"], b["adv"], b["mask"], config=_ActorCfg(low, high)
    )
    ours = policy_clip_fraction(b["logp"], b["old"], b["adv"], b["mask"], eps_low=low, eps_high=high)
    assert ours.item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    assert policy_kl(b["logp"], b["old"], b["mask"]).item() == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# ratio guard


def test_ratio_guard_passes_a_normal_batch_untouched():
    b = _epoch_batch(seed=7, drift=0.1)
    logp = b["logp"].clone().requires_grad_()
    loss = (logp * b["adv"]).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ratio_guard(loss, logp, b["old"], b["mask"], threshold=10.0)
    assert out.loss is loss and not out.skipped
    assert out.metrics["ratio_guard/skipped"].item() == 0.0
    torch.testing.assert_close(out.mean_ratio, ((logp - b["old"]).exp()[b["mask"]]).mean().detach())


def test_ratio_guard_skips_a_runaway_batch_like_trl():
    b = _epoch_batch(seed=8)
    old = b["logp"] - 3.0  # ratio e^3 ≈ 20 everywhere
    logp = b["logp"].clone().requires_grad_()
    pg_loss, vf_loss, loss, _ = _trl_ppo_loss(
        old, b["values"], b["logits"], b["vpreds"], logp, b["mask"].double(), b["adv"], b["returns"]
    )
    assert loss.item() == 0.0  # TRL skipped it
    raw = (-(logp - old).exp() * b["adv"])[b["mask"]].mean()
    with pytest.warns(RatioGuardWarning, match=r"mean update ratio of the batch \(20.09\) exceeds the threshold 10.00"):
        out = ratio_guard({"policy": raw, "total": raw * 2}, logp, old, b["mask"], threshold=10.0)
    assert out.skipped and out.metrics["ratio_guard/skipped"].item() == 1.0
    assert out.loss["policy"].item() == 0.0 and out.loss["total"].item() == 0.0
    assert out.loss["total"].requires_grad  # graph kept: every rank still runs backward
    out.loss["total"].backward()
    assert (logp.grad == 0).all()


def test_ratio_guard_is_strict_at_the_threshold():
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ratio_guard(torch.tensor(1.0), logp, logp, mask, threshold=1.0).skipped


# ---------------------------------------------------------------------------------------------------------------------
# errors


def test_errors_name_field_rule_and_place():
    b = _epoch_batch(B=2, T=3, seed=9)
    logp, old, mask = b["logp"], b["old"], b["mask"]
    with pytest.raises(LossplugError, match=r"old_logp: shape must match logp \[2, 3\], got \[2, 2\]"):
        approx_kl(logp, old[:, :2], mask)
    with pytest.raises(LossplugError, match="action_mask: must be a bool tensor"):
        policy_kl(logp, old, mask.long())
    with pytest.raises(LossplugError, match="eps_low: must be >= 0.0, got -0.1"):
        policy_clip_fraction(logp, old, b["adv"], mask, eps_low=-0.1)
    with pytest.raises(LossplugError, match="eps_low: must be < 1"):
        policy_clip_fraction(logp, old, b["adv"], mask, eps_low=1.0)
    with pytest.raises(LossplugError, match="entropy: give either logits or precomputed entropy"):
        ppo_diagnostics(logp, old, mask, logits=b["logits"], entropy=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(LossplugError, match="value_clip_eps: the value clip fraction needs values, old_values"):
        ppo_diagnostics(logp, old, mask, returns=b["returns"], value_clip_eps=0.2)
    with pytest.raises(LossplugError, match="action_mask: the micro-batch needs at least one action token"):
        ppo_diagnostics(logp, old, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(LossplugError, match=r"logits: must be \[B, T, V\] aligned with logp \[2, 3\]"):
        ppo_diagnostics(logp, old, mask, logits=b["logits"][:, :2])
    bad = b["returns"].clone()
    bad[1, 0] = float("nan")
    with pytest.raises(LossplugError, match=r"returns: must be finite on action positions — \(row 1, pos 0\)"):
        ppo_diagnostics(logp, old, mask, returns=bad)
    with pytest.raises(LossplugError, match="threshold: must be > 0.0"):
        ratio_guard(torch.tensor(1.0), logp, old, mask, threshold=-1)
    with pytest.raises(LossplugError, match=r"loss: must be a scalar loss tensor, got \[2\]"):
        ratio_guard(torch.ones(2), logp, old, mask)
    nan_logits = b["logits"].clone()
    nan_logits[0, 0, 0] = float("nan")
    with pytest.raises(
        LossplugError, match=r"logits: must give a finite entropy on action positions .* — \(row 0, pos 0\)"
    ):
        entropy_from_logits(nan_logits, mask)
    with pytest.raises(LossplugError, match="logits: must be 3-d"):
        entropy_from_logits(logp, mask)

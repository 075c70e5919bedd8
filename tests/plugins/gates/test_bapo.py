"""bapo: the bounds it picks, its loss, gradient and metrics against a float64 transcription of the BAPO authors'
``compute_policy_loss_bapo`` (one rank, and two ranks pooling their statistic as the authors' ``all_reduce`` does),
and its invariants.

The authors' code (WooooDyy/BAPO, commit 7287044, ``recipe/bapo/policy_loss.py``) is a verl recipe, not an
installable package: it is transcribed below as it is written — a Python loop with ``.item()`` that tries one pair of
bounds at a time — independently of the plugin, which evaluates every pair at once.
"""

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.peers import Peers
from lossplug.testing.batches import loss_and_grad

PAPER = dict(lower_start=0.6, lower_max=0.9, lower_step=0.05, upper_start=1.2, upper_max=3.0, upper_step=0.05)


def reference_bounds(ranks, target, lower_start, lower_max, lower_step, upper_start, upper_max, upper_step, eps=1e-8):
    """The authors' search: ``ranks`` is a list of ``(ratio, advantages, response_mask)``, one per data-parallel rank
    (one: no ``all_reduce``). Returns ``(ratio_low_cur, ratio_high_cur, pos_neg_ratio)`` as they record them."""

    def effective(clip_low, clip_high):
        sums = []
        for ratio, advantages, response_mask in ranks:
            clip_min = ratio.new_tensor(float(clip_low))
            clip_max = ratio.new_tensor(float(clip_high))
            ratio_pos = torch.minimum(ratio, clip_max)
            ratio_neg = torch.maximum(ratio, clip_min)
            effective_ratio = torch.where(advantages >= 0, ratio_pos, ratio_neg)
            effective_adv = effective_ratio * advantages * response_mask
            sums.append((effective_adv.clamp(min=0).sum(), (-effective_adv.clamp(max=0)).sum()))
        pos_contrib, neg_contrib = sums[0]
        if len(ranks) > 1:  # torch.distributed.all_reduce(SUM) of the float32 stack, cast back
            stats = sum(torch.stack([p.to(torch.float32), n.to(torch.float32)]) for p, n in sums)
            pos_contrib, neg_contrib = stats[0].to(pos_contrib.dtype), stats[1].to(neg_contrib.dtype)
        if torch.all(neg_contrib <= 0):
            return ranks[0][0].new_tensor(float("inf"))
        return pos_contrib / (neg_contrib + ranks[0][0].new_tensor(eps))

    ratio_low_cur, ratio_high_cur = lower_start, upper_start
    ratio_low_max, ratio_high_max = lower_max, upper_max
    ratio_low_step, ratio_high_step = max(lower_step, 0.0), max(upper_step, 0.0)
    target_ratio = max(target, 0.0)
    pos_neg_ratio = effective(ratio_low_cur, ratio_high_cur)
    while pos_neg_ratio.item() < target_ratio and ratio_low_cur < ratio_low_max and ratio_low_step > 0:
        ratio_low_cur = min(ratio_low_cur + ratio_low_step, ratio_low_max)
        pos_neg_ratio = effective(ratio_low_cur, ratio_high_cur)
        if pos_neg_ratio.item() >= target_ratio:
            break
    while pos_neg_ratio.item() < target_ratio and ratio_high_cur < ratio_high_max and ratio_high_step > 0:
        ratio_high_cur = min(ratio_high_cur + ratio_high_step, ratio_high_max)
        pos_neg_ratio = effective(ratio_low_cur, ratio_high_cur)
        if pos_neg_ratio.item() >= target_ratio:
            break
    return ratio_low_cur, ratio_high_cur, pos_neg_ratio.item()


def reference_loss(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c=3.0):
    """The authors' loss at the chosen bounds (``token-mean``), and its ``pg_clipfrac`` / ``pg_clipfrac_lower``."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, low, high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    mask = response_mask.to(ratio.dtype)
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).float() * mask).sum() / mask.sum()
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    pg_clipfrac_lower = (lower * mask).sum() / mask.sum()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return (pg_losses * mask).sum() / mask.sum(), pg_clipfrac, pg_clipfrac_lower


def batch(B, T, seed, spread=0.5, skew=0.0):
    """float64: a stale update (ratios from ~0.2 to ~5), token advantages shifted by ``skew`` (negative: the negative
    tokens dominate and the bounds move), the first token of every response an action."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) + skew
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return dict(logp=logp, old_logp=old, advantage=adv, action_mask=mask)


def balance_of(metrics, prefix=""):
    """The reference's ``pos_neg_ratio`` from the gate's ``pos_contrib`` / ``neg_contrib`` metrics."""
    positive, negative = metrics[f"{prefix}pos_contrib"], metrics[f"{prefix}neg_contrib"]
    return float("inf") if negative <= 0 else positive / (negative + 1e-8)


def ratio_of(f):
    return torch.exp(torch.clamp(f["logp"] - f["old_logp"], -20, 20))


def oracle(f, target, **ranges):
    ranges = {**PAPER, **ranges}
    low, high, balance = reference_bounds([(ratio_of(f), f["advantage"], f["action_mask"])], target, **ranges)
    logp = f["logp"].clone().requires_grad_()
    loss, clipfrac, clipfrac_lower = reference_loss(f["old_logp"], logp, f["advantage"], f["action_mask"], low, high)
    loss.backward()
    return low, high, balance, loss.detach(), logp.grad, clipfrac, clipfrac_lower


CASES = [  # (shape, skew, target): searches that stop at the start, inside the upper range, at the end
    ((4, 9), 0.0, 1.0),
    ((4, 9), 0.0, 1.2),
    ((8, 33), -0.2, 0.8),
    ((8, 33), 0.0, 1.2),
    ((6, 17), 0.2, 0.6),
    ((4, 9), -0.3, 0.6),
    ((1, 1), 0.0, 0.5),
]


def test_bounds_loss_gradient_and_metrics_match_the_authors_code():
    worst = {"loss": 0.0, "grad": 0.0}
    stops = set()
    for (B, T), skew, target in CASES:
        for seed in range(6):
            f = batch(B, T, seed, skew=skew)
            low, high, balance, loss, grad_ref, clipfrac, clipfrac_lower = oracle(f, target)
            gate = {"name": "bapo", "target": target}
            result, grad = loss_and_grad({"gates": [gate], "reduction": "token"}, **f)
            m = result.metrics
            assert (m["bapo/clip_low"], m["bapo/clip_high"]) == (low, high), (B, T, skew, target, seed)
            assert balance_of(m, "bapo/") == pytest.approx(balance, rel=1e-12)
            mask = f["action_mask"]
            torch.testing.assert_close(result.loss.detach(), loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(
                torch.where(mask, grad, 0), torch.where(mask, grad_ref, 0), rtol=1e-12, atol=1e-14
            )
            worst["loss"] = max(worst["loss"], float((result.loss.detach() - loss).abs()))
            worst["grad"] = max(worst["grad"], float(torch.where(mask, grad - grad_ref, 0).abs().max()))
            assert m["bapo/clip_frac_low"] + m["bapo/clip_frac_high"] == pytest.approx(float(clipfrac), abs=1e-6)
            assert m["bapo/clip_frac_dual"] == pytest.approx(float(clipfrac_lower), abs=1e-6)
            stops.add(
                "start"
                if (low, high) == (0.6, 1.2)
                else "end"
                if (low, high) == (0.9, 3.0)
                else "lower"
                if high == 1.2
                else "upper"
            )
    # never inside the lower range: raising c_low raises the negative contribution max(r, c_low)·|A| (the statistic
    # is the clipped surrogate's value), so ρ only falls there — the lower bound either stays or goes to its max
    assert stops == {"start", "upper", "end"}, stops
    print(f"bapo vs the authors' code: max |Δloss| {worst['loss']:.2e}, max |Δgrad| {worst['grad']:.2e}")


def test_the_steps_accumulate_as_python_floats():
    # 1.2 + 6 × 0.05 = 1.5000000000000002 and 1.2 + 23 × 0.05 = 2.349999999999999: the reference's bounds
    for seed, expected in ((0, 1.5000000000000002), (4, 2.349999999999999)):
        f = batch(4, 9, seed=seed, skew=0.0)
        assert oracle(f, 1.0)[:2] == (0.9, expected)
        result, _ = loss_and_grad({"gates": [{"name": "bapo", "target": 1.0}], "reduction": "token"}, **f)
        assert (result.metrics["bapo/clip_low"], result.metrics["bapo/clip_high"]) == (0.9, expected)


def test_the_run_scripts_settings_and_fixed_bounds():
    f = batch(6, 17, seed=4, skew=-0.7)
    script = dict(lower_start=0.8, lower_max=0.95, lower_step=0.05, upper_start=1.2, upper_max=2.0, upper_step=0.1)
    low, high, balance, loss, *_ = oracle(f, 0.5, **script)
    result, _ = loss_and_grad({"gates": [{"name": "bapo", "target": 0.5, **script}], "reduction": "token"}, **f)
    assert (result.metrics["bapo/clip_low"], result.metrics["bapo/clip_high"]) == (low, high)
    torch.testing.assert_close(result.loss.detach(), loss, rtol=1e-12, atol=1e-14)
    # no steps: PPO with those explicit bounds and verl's dual clip, whatever the balance
    fixed = {"lower_step": 0.0, "upper_step": 0.0, "lower_start": 0.8, "upper_start": 1.28, "lower_max": 0.8}
    bapo, g1 = loss_and_grad({"gates": [{"name": "bapo", **fixed}], "reduction": "token"}, **f)
    ppo = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}
    ppo_result, g2 = loss_and_grad({"gates": [ppo], "reduction": "token"}, **f)
    torch.testing.assert_close(bapo.loss, ppo_result.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)


class _Ranks:
    """Two in-process "ranks" (threads) whose collectives meet at a barrier: what ``torch.distributed`` gives a gate."""

    def __init__(self, size):
        self.size, self.barrier, self.slots, self.calls = size, threading.Barrier(size), [None] * size, 0

    def peers(self, rank):
        def all_sum(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            self.calls += rank == 0
            return total

        def all_gather(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            everyone = torch.cat(list(self.slots))
            self.barrier.wait()
            return everyone

        return Peers(size=self.size, all_gather=all_gather, all_sum=all_sum)


def test_two_ranks_pick_the_same_bounds_from_their_pooled_statistic():
    parts = [batch(3, 9, seed=21, skew=-1.0), batch(5, 13, seed=22, skew=0.4)]
    target = 0.9
    low, high, balance = reference_bounds(
        [(ratio_of(f), f["advantage"], f["action_mask"]) for f in parts], target, **PAPER
    )
    alone = [reference_bounds([(ratio_of(f), f["advantage"], f["action_mask"])], target, **PAPER)[:2] for f in parts]
    assert alone[0] != alone[1] and (low, high) not in alone[:1]  # pooling changes what each rank alone would pick
    ranks, out = _Ranks(2), [None, None]
    plugin = lossplug.registry().plugins["gate"]["bapo"]
    params = plugin.params(target=target)

    def run(rank):
        logp = parts[rank]["logp"].clone().requires_grad_()
        fields = {**parts[rank], "logp": logp}
        inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**fields), peers=ranks.peers(rank))
        gate = plugin(inp, params)
        mask = parts[rank]["action_mask"]
        loss = -torch.where(mask, gate.objective, 0).sum() / mask.sum()
        loss.backward()
        metrics = {k: float(v()) for k, v in gate.metrics.items()}
        out[rank] = (loss.detach(), logp.grad, metrics)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert ranks.calls == 1  # one pooled sum per call: every candidate pair at once
    for rank, f in enumerate(parts):
        loss, grad, metrics = out[rank]
        assert (metrics["clip_low"], metrics["clip_high"]) == (low, high)
        assert balance_of(metrics) == pytest.approx(balance, rel=1e-6)  # (float32 sums, as the all_reduce)
        logp = f["logp"].clone().requires_grad_()
        expected, *_ = reference_loss(f["old_logp"], logp, f["advantage"], f["action_mask"], low, high)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-14)
        mask = f["action_mask"]
        torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lower_max": 0.5}, "lower_max"),
        ({"upper_max": 1.1}, "upper_max"),
        ({"target": -0.1}, "target"),
        ({"lower_start": 1.2}, "lower_start"),
        ({"upper_start": 0.9}, "upper_start"),
        ({"lower_step": -0.05}, "lower_step"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
    ],
)
def test_bad_parameters_are_named(params, message):
    with pytest.raises(lossplug.RecipeError, match=message):
        lossplug.Recipe.load({"gates": [{"name": "bapo", **params}], "reduction": "token"})


@given(seed=st.integers(0, 2**16), skew=st.floats(-2.0, 1.0), target=st.floats(0.0, 3.0))
def test_the_chosen_bounds_meet_the_target_or_are_the_last_pair(seed, skew, target):
    f = batch(3, 8, seed, skew=skew)
    result, _ = loss_and_grad({"gates": [{"name": "bapo", "target": target}], "reduction": "token"}, **f)
    m = result.metrics
    low, high, balance = m["bapo/clip_low"], m["bapo/clip_high"], balance_of(m, "bapo/")
    assert 0.6 <= low <= 0.9 and 1.2 <= high <= 3.0
    assert high == 1.2 or low == 0.9  # the upper bound moves only once the lower one is exhausted
    assert low in (0.6, 0.9)  # and the lower one never stops inside its range (ρ falls as it rises)
    assert balance >= target or (low, high) == (0.9, 3.0)

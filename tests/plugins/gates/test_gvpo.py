"""gvpo against the authors' loss (github.com/jszkc/GVPO ``compute_policy_loss_gvpo`` at 627aa25, transcribed below as
a per-response loop over a uid → mean table, float64): loss and gradient of one micro-step, of a whole verl step
(micro-batches × ranks, each holding whole groups) and pooled over two peer ranks; the detached group mean; whole
groups enforced; extreme log-ratios."""

from __future__ import annotations

import pytest
import torch

import lossplug

from ._two_ranks import run_on_two_ranks, two_rank_peers

BETA = 0.1


def authors_micro_loss(old_log_prob, log_prob, advantages, response_mask, uid, n, beta=BETA, pooled=None):
    """The authors' loss of one micro-batch on one rank: Σ_i ½((rθ_i − mean_uid) − mean_t A_i)² / (n − 1), the
    means over ``pooled`` = (rθ, uid) of every rank of the micro-step (their all-gather of a detached copy)."""
    mask = response_mask.to(log_prob.dtype)
    rtheta = ((log_prob * mask).sum(-1) - (old_log_prob * mask).sum(-1)) * beta
    r_minus_avg = (advantages * mask).sum(-1) / mask.sum(-1)
    all_r, all_uid = (rtheta.detach(), uid) if pooled is None else pooled
    means = {}
    for u in torch.unique(all_uid).tolist():
        members = all_r[all_uid == u]
        assert members.shape[0] == n
        means[u] = members.mean()
    loss = torch.zeros((), dtype=log_prob.dtype)
    for i in range(len(rtheta)):
        loss = loss + 0.5 * ((rtheta[i] - means[int(uid[i])]) - r_minus_avg[i]) ** 2
    return loss / (n - 1)


def step(seed=0, groups=4, n=4, T=7):
    """A step of ``groups`` prompt groups of ``n`` rollouts, rows in group order, centred advantages per token (verl's
    GRPO without std: R − R̄ on every action token), NaN off the actions."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    reward = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    uid = torch.arange(B) // n
    centred = reward - reward.view(groups, n).mean(-1).repeat_interleave(n)
    adv = centred.unsqueeze(-1).expand(B, T)
    nan = torch.full((B, T), float("nan"), dtype=torch.float64)
    return {
        "old": torch.where(mask, old, nan),
        "logp": torch.where(mask, logp, nan),
        "adv": torch.where(mask, adv, nan),
        "mask": mask,
        "uid": uid,
        "n": n,
    }


def gvpo_recipe(reduction="response", **params):
    return {"gates": [{"name": "gvpo", "beta": BETA, **params}], "reduction": reduction}


def lossplug_loss(x, rows, leaf, normalizer=None, peers=None, **params):
    batch = lossplug.PolicyBatch(
        logp=leaf[rows],
        old_logp=x["old"][rows],
        advantage=x["adv"][rows],
        action_mask=x["mask"][rows],
        group_id=x["uid"][rows],
    )
    return lossplug.policy_loss(batch, gvpo_recipe(**params), normalizer, peers=peers).loss


def zeroed(x):
    """The authors' inputs: verl holds finite values off the mask (their code multiplies by the mask)."""
    return {k: torch.nan_to_num(v) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}


@pytest.mark.parametrize("group_size", [None, 4])
def test_one_micro_batch_matches_the_authors_loss_and_gradient(group_size):
    x = step(seed=1)
    z = zeroed(x)
    B = x["mask"].shape[0]
    ours_leaf = x["logp"].clone().requires_grad_()
    ours = lossplug_loss(x, slice(None), ours_leaf, group_size=group_size)
    ours.backward()
    theirs_leaf = z["logp"].clone().requires_grad_()
    theirs = authors_micro_loss(z["old"], theirs_leaf, z["adv"], z["mask"], z["uid"], x["n"])
    theirs.backward()
    # the authors sum over the micro-batch; the response reduction averages over its B responses
    torch.testing.assert_close(ours * B, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_leaf.grad * B, torch.where(x["mask"], theirs_leaf.grad, 0), rtol=1e-12, atol=1e-12)
    assert float((ours_leaf.grad * B - theirs_leaf.grad).abs().max()) < 1e-12


def test_a_verl_step_of_whole_group_micro_batches_is_the_authors_times_their_micro_batch_size():
    # verl: world_size 2, ppo_micro_batch_size_per_gpu 4 (= n), 2 accumulation steps; the authors' loss of each
    # micro-batch × 1/GA, the ranks' gradients averaged — against lossplug's response reduction under the step's
    # Normalizer, each micro-batch's share summed
    x = step(seed=2, groups=4, n=4)
    z = zeroed(x)
    micro, ranks, ga = 4, 2, 2
    theirs_leaf = z["logp"].clone().requires_grad_()
    theirs = sum(
        authors_micro_loss(z["old"][r], theirs_leaf[r], z["adv"][r], z["mask"][r], z["uid"][r], x["n"]) / ga / ranks
        for r in (slice(s, s + micro) for s in range(0, 16, micro))
    )
    theirs.backward()
    ours_leaf = x["logp"].clone().requires_grad_()
    normalizer = lossplug.Normalizer.for_masks([x["mask"]])
    ours = sum(lossplug_loss(x, slice(s, s + micro), ours_leaf, normalizer, group_size=4) for s in range(0, 16, micro))
    ours.backward()
    torch.testing.assert_close(ours * micro, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_leaf.grad * micro, torch.where(x["mask"], theirs_leaf.grad, 0), rtol=1e-12, atol=0)


def test_a_group_split_over_two_peer_ranks_is_pooled_as_the_authors_all_gather():
    # each group of 4 has two rollouts on each rank (the authors' _balance_batch spreads a group over the ranks)
    x = step(seed=3, groups=2, n=4)
    z = zeroed(x)
    ranks = (torch.tensor([0, 1, 4, 5]), torch.tensor([2, 3, 6, 7]))
    theirs_leaf = z["logp"].clone().requires_grad_()
    rtheta = BETA * ((theirs_leaf * z["mask"]).sum(-1) - (z["old"] * z["mask"]).sum(-1))
    pooled = (torch.cat([rtheta[r].detach() for r in ranks]), torch.cat([z["uid"][r] for r in ranks]))
    theirs = sum(
        authors_micro_loss(z["old"][r], theirs_leaf[r], z["adv"][r], z["mask"][r], z["uid"][r], 4, pooled=pooled)
        for r in ranks
    )
    theirs.backward()

    peers = two_rank_peers()
    normalizer = lossplug.Normalizer.for_masks([x["mask"]])
    leaves = [x["logp"].clone().requires_grad_() for _ in ranks]
    losses = [None, None]

    def run(k):
        losses[k] = lossplug_loss(x, ranks[k], leaves[k], normalizer, peers=peers[k], group_size=4)
        losses[k].backward()

    run_on_two_ranks(run)
    B = x["mask"].shape[0]
    torch.testing.assert_close((losses[0] + losses[1]) * B, theirs, rtol=1e-12, atol=1e-12)
    grad = leaves[0].grad + leaves[1].grad
    torch.testing.assert_close(grad * B, torch.where(x["mask"], theirs_leaf.grad, 0), rtol=1e-12, atol=0)


def test_gradient_is_beta_times_the_error_over_n_minus_one_and_the_detached_mean_changes_nothing():
    x = step(seed=4)
    leaf = x["logp"].clone().requires_grad_()
    lossplug_loss(x, slice(None), leaf, group_size=4).backward()
    mask, old, B, n = x["mask"], torch.nan_to_num(x["old"]), x["mask"].shape[0], x["n"]
    logp = torch.nan_to_num(x["logp"]).clone().requires_grad_()
    r = BETA * torch.where(mask, logp - old, 0).sum(-1)
    a = torch.nan_to_num(x["adv"])[:, 0]
    attached = r - r.view(-1, n).mean(-1).repeat_interleave(n)  # the mean carrying its gradient
    error = attached - a
    (0.5 * error.square() / (n - 1)).sum().div(B).backward()
    # ∂ℓ_i/∂logp_it = β(c_i − a_i)/(n − 1): the attached mean's extra term Σ_j (c_j − a_j) vanishes for centred A
    expected = torch.where(mask, (BETA * error.detach() / (n - 1) / B).unsqueeze(-1), 0)
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-10, atol=1e-15)


def test_a_group_not_whole_in_the_micro_batch_is_refused_with_the_setting_to_change():
    x = step(seed=5)
    leaf = x["logp"].clone().requires_grad_()
    with pytest.raises(lossplug.LossplugError, match=r"group_id 1 has 2 row\(s\).*exactly group_size=4.*whole groups"):
        lossplug_loss(x, slice(0, 6), leaf, group_size=4)
    with pytest.raises(lossplug.LossplugError, match=r"group_id 1 has 1 row\(s\).*at least 2"):
        lossplug_loss(x, slice(0, 5), leaf)


def test_extreme_log_ratios_stay_finite():
    x = step(seed=6)
    x["logp"] = torch.where(x["mask"], x["old"] - 100.0, x["logp"])
    leaf = x["logp"].clone().requires_grad_()
    loss = lossplug_loss(x, slice(None), leaf, group_size=4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()

"""tpo against an independent float64 transcription of the author's TPO (arXiv:2604.06159; JeanKaddour/tpo@73473b9
``tpo_skill``, ``tpo_target``, ``anchored_tpo_cross_entropy_loss``): group by group in plain Python floats — the
population z-score (zero variance → 0, the paper's Appendix A), the target softmax(log_softmax(ℓ_old) + u/η), the
cross-entropy −Σ q·log_softmax(ℓ) averaged over groups — and the gradient (p − q)/G of the paper's Proposition 1
spread over each response's action tokens; the score from lossplug's ``grpo`` advantage in its population/threshold
form; the paper's standardisation example; invariants; peers; the whole-group rule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug import LossplugError

from ._two_ranks import run_on_two_ranks, two_rank_peers

F64 = torch.float64
#: the paper's standardisation (Appendix A) as lossplug's grpo advantage
SCORE = {"name": "grpo", "std": "population", "eps": 1e-6, "eps_mode": "threshold"}


def recipe(**params):
    return {"advantage": SCORE, "gates": [{"name": "tpo", **params}], "reduction": "response"}


def author_tpo(logp, old, mask, rewards, groups, eta=1.0):
    """The author's loss and its gradient on every token, from nested lists: per group the whitened skill, the
    anchored target, the cross-entropy; averaged over groups. Returns (loss, gradient rows)."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    seq = [sum(v for v, m in zip(logp[i], mask[i], strict=True) if m) for i in range(len(logp))]
    seq_old = [sum(v for v, m in zip(old[i], mask[i], strict=True) if m) for i in range(len(old))]
    total, grad = 0.0, [[0.0] * len(logp[0]) for _ in logp]
    for rows in members.values():
        s = [rewards[i] for i in rows]
        mean = sum(s) / len(s)
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / len(s))
        u = [(x - mean) / std if std > 1e-6 else 0.0 for x in s]
        # log_softmax(ℓ_old) + u/η, then softmax
        top = max(seq_old[i] for i in rows)
        lse_old = top + math.log(sum(math.exp(seq_old[i] - top) for i in rows))
        z = [seq_old[i] - lse_old + u[k] / eta for k, i in enumerate(rows)]
        zmax = max(z)
        norm = sum(math.exp(v - zmax) for v in z)
        q = [math.exp(v - zmax) / norm for v in z]
        top = max(seq[i] for i in rows)
        lse = top + math.log(sum(math.exp(seq[i] - top) for i in rows))
        log_p = [seq[i] - lse for i in rows]
        total += -sum(qk * lp for qk, lp in zip(q, log_p, strict=True))
        for k, i in enumerate(rows):
            for t, m in enumerate(mask[i]):
                if m:
                    grad[i][t] = math.exp(log_p[k]) - q[k]  # ∂L/∂ℓ_i, and ∂ℓ_i/∂logp_it = 1
    n_groups = len(members)
    return total / n_groups, [[g / n_groups for g in row] for row in grad]


def step(seed, groups=3, n=4, T=6, noise=0.3):
    """A step of ``groups`` prompt groups of ``n`` rollouts, scattered over the rows, binary-ish rewards (one group
    of equal rewards), log-probs off the mask set to garbage."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    uid = torch.arange(groups).repeat_interleave(n)[torch.randperm(B, generator=g)]
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    logp = (old + noise * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    reward = (torch.rand(B, generator=g, dtype=F64) > 0.5).to(F64) + 0.1 * torch.randn(B, generator=g, dtype=F64)
    reward[uid == 0] = 1.0  # a zero-variance group: u = 0
    return {
        "logp": torch.where(mask, logp, 7.0),
        "old": torch.where(mask, old, -9.0),
        "mask": mask,
        "reward": reward,
        "uid": uid,
        "clean": (logp, old),
    }


def lossplug_tpo(x, rows=None, leaf=None, normalizer=None, peers=None, **params):
    rows = torch.arange(x["mask"].shape[0]) if rows is None else rows
    full = lossplug.PolicyBatch(
        logp=x["logp"], old_logp=x["old"], action_mask=x["mask"], reward=x["reward"], group_id=x["uid"]
    )
    advantage = lossplug.compute_advantages(full, recipe(**params))  # the score over the whole step
    leaf = x["logp"].clone().requires_grad_() if leaf is None else leaf
    batch = lossplug.PolicyBatch(
        logp=leaf[rows],
        old_logp=x["old"][rows],
        advantage=advantage[rows],
        action_mask=x["mask"][rows],
        group_id=x["uid"][rows],
    )
    result = lossplug.policy_loss(batch, recipe(**params), normalizer, peers=peers)
    return result, leaf


@pytest.mark.parametrize("eta", [1.0, 0.25, 4.0])
@pytest.mark.parametrize("group_size", [4, None])
def test_loss_and_gradient_equal_the_authors_tpo_in_float64(eta, group_size):
    x = step(seed=int(eta * 8) + (group_size is None))
    result, leaf = lossplug_tpo(x, eta=eta, group_size=group_size)
    result.loss.backward()
    logp, old = x["clean"]
    expected, expected_grad = author_tpo(
        logp.tolist(), old.tolist(), x["mask"].tolist(), x["reward"].tolist(), x["uid"].tolist(), eta
    )
    assert result.loss.dtype == F64
    assert abs(result.loss.item() - expected) <= 1e-13
    torch.testing.assert_close(leaf.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-11, atol=1e-15)


def test_a_step_of_whole_group_micro_batches_is_the_authors_over_the_step():
    # two micro-batches of whole groups under the step's normalizer: their losses add up to the step's mean_g L_g
    x = step(seed=5, groups=4)
    normalizer = lossplug.Normalizer.for_masks([x["mask"]])
    leaf = x["logp"].clone().requires_grad_()
    total = sum(
        lossplug_tpo(x, torch.nonzero(torch.isin(x["uid"], ids)).squeeze(-1), leaf, normalizer, group_size=4)[0].loss
        for ids in (torch.tensor([0, 2]), torch.tensor([1, 3]))
    )
    total.backward()
    logp, old = x["clean"]
    expected, expected_grad = author_tpo(
        logp.tolist(), old.tolist(), x["mask"].tolist(), x["reward"].tolist(), x["uid"].tolist()
    )
    assert abs(total.item() - expected) <= 1e-13
    torch.testing.assert_close(leaf.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-11, atol=1e-15)


def test_scores_of_the_same_ranking_give_the_same_target():
    # the paper's "why standardize": (1, 0, −1) and (100, 0, −100) express the same ordering, and after the
    # within-group z-score they give the same target and the same loss and gradient
    base = step(seed=2, groups=1, n=3)
    outcomes = []
    for scale in (1.0, 100.0):
        x = {**base, "reward": torch.tensor([1.0, 0.0, -1.0], dtype=F64) * scale}
        result, leaf = lossplug_tpo(x, group_size=3)
        result.loss.backward()
        outcomes.append((result.loss.detach(), leaf.grad))
    torch.testing.assert_close(outcomes[0][0], outcomes[1][0], rtol=1e-14, atol=0)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], rtol=1e-12, atol=1e-16)


def test_on_the_rollout_snapshot_equal_scores_give_no_gradient():
    # the paper's §4.2: zero score variance ⇒ u = 0 ⇒ q = p_old, and with p = p_old the group contributes nothing
    x = step(seed=4)
    x["logp"] = x["old"].clone()
    result, leaf = lossplug_tpo(x, group_size=4)
    result.loss.backward()
    zero_var = x["uid"] == 0
    assert torch.equal(leaf.grad[zero_var], torch.zeros_like(leaf.grad[zero_var]))
    assert leaf.grad[~zero_var][x["mask"][~zero_var]].abs().min() > 0


# -- invariants -------------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.0, 1e-3, 0.3, 2.0]), eta=st.sampled_from([0.5, 1.0]))
def test_the_gradient_is_p_minus_q_constant_over_a_response_and_sums_to_zero_per_group(seed, noise, eta):
    x = step(seed, groups=2, n=3, T=4, noise=noise)
    result, leaf = lossplug_tpo(x, eta=eta, group_size=3)
    result.loss.backward()
    assert torch.isfinite(result.loss)
    grad, mask = leaf.grad, x["mask"]
    per_response = grad[:, 0]  # every action token of a response carries ∂L/∂ℓ_i
    assert torch.equal(grad, torch.where(mask, per_response.unsqueeze(-1), 0.0))
    for gid in (0, 1):
        assert abs(per_response[x["uid"] == gid].sum().item()) <= 1e-14
    assert result.loss >= -1e-12  # a cross-entropy of distributions: ≥ 0


def test_extreme_log_probs_stay_finite():
    x = step(seed=6)
    x["logp"] = torch.where(x["mask"], x["logp"] - 2000.0, 7.0)
    result, leaf = lossplug_tpo(x, group_size=4)
    result.loss.backward()
    assert torch.isfinite(result.loss) and torch.isfinite(leaf.grad).all()


# -- peers and the whole-group rule -----------------------------------------------------------------------------------


def test_a_group_split_over_two_peer_ranks_is_pooled():
    x = step(seed=8, groups=2)
    order = torch.argsort(x["uid"], stable=True)
    ranks = (order[[0, 1, 4, 5]], order[[2, 3, 6, 7]])  # each group of 4: two rollouts on each rank
    peers = two_rank_peers()
    normalizer = lossplug.Normalizer.for_masks([x["mask"]])
    leaf = x["logp"].clone().requires_grad_()
    losses = [None, None]

    def run(k):
        losses[k] = lossplug_tpo(x, ranks[k], leaf, normalizer, peers=peers[k], group_size=4)[0].loss

    run_on_two_ranks(run)
    (losses[0] + losses[1]).backward()
    logp, old = x["clean"]
    expected, expected_grad = author_tpo(
        logp.tolist(), old.tolist(), x["mask"].tolist(), x["reward"].tolist(), x["uid"].tolist()
    )
    assert abs((losses[0] + losses[1]).item() - expected) <= 1e-13
    torch.testing.assert_close(leaf.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-11, atol=1e-15)


def test_a_group_not_whole_in_the_micro_batch_is_refused_with_the_setting_to_change():
    x = step(seed=9, groups=2)
    rows = torch.nonzero(x["uid"] == 1).squeeze(-1)[:3]
    with pytest.raises(LossplugError, match=r"gate 'tpo': group_id 1 has 3 row\(s\).*exactly group_size=4"):
        lossplug_tpo(x, rows, group_size=4)


@pytest.mark.parametrize(("params", "words"), [({"eta": 0.0}, "eta"), ({"group_size": 1}, "group_size")])
def test_bad_parameters_are_refused_naming_the_field(params, words):
    with pytest.raises(Exception, match=words):
        lossplug.registry().plugins["gate"]["tpo"].params(**params)


def test_a_batch_without_group_ids_is_refused():
    with pytest.raises(lossplug.BatchValidationError, match="group_id"):
        lossplug.policy_loss(
            lossplug.PolicyBatch(
                logp=torch.full((2, 1), -1.0),
                old_logp=torch.full((2, 1), -1.0),
                advantage=torch.ones(2),
                action_mask=torch.ones(2, 1, dtype=torch.bool),
            ),
            {"gates": ["tpo"], "reduction": "response"},
        )


def test_gradient_flows_only_through_logp():
    # old_logp and the advantage handed in as leaves that require grad (a caller who forgot .detach()): the target
    # and the group statistics are constants, nothing reaches them
    x = step(seed=10)
    old = x["old"].clone().requires_grad_()
    advantage = torch.randn(x["mask"].shape[0], dtype=F64, requires_grad=True)
    logp = x["logp"].clone().requires_grad_()
    batch = lossplug.PolicyBatch(logp=logp, old_logp=old, advantage=advantage, action_mask=x["mask"], group_id=x["uid"])
    loss = lossplug.policy_loss(batch, {"gates": [{"name": "tpo", "group_size": 4}], "reduction": "response"}).loss
    grads = torch.autograd.grad(loss, [logp, old, advantage], allow_unused=True)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    assert all(g is None or (g == 0).all() for g in grads[1:])

"""treepo against TreePO's estimator (multimodal-art-projection/TreePO at f05552394e73,
``verl/trainer/ppo/core_algos.py`` ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``), transcribed
below with the rollouts' ``prompt#b1#b2…`` uid strings cut at each depth, Python dictionaries and numpy float64, on
explicit random trees whose leaves become the batch's rows; loss and gradient through ppo_clip; hand-derived
values; invariants (chains that never share a node are REINFORCE++-baseline, the code's depth-0 group alone; row
order; segment ids relabelled); bad segment ids named by row and position."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug

F64 = torch.float64
RECIPE = {"gates": ["ppo_clip"], "reduction": "token"}


def advantage(batch, **params):
    return lossplug.estimate_advantages(batch, {"advantage": {"name": "treepo", **params}, **RECIPE}).advantage


# -- explicit trees ---------------------------------------------------------------------------------------------------


def random_forest(seed, groups=2, max_depth=3):
    """Leaves of random sampling trees: per leaf its group, its ``tree_idx`` ``root/1-a/2-b/…`` (TreePO's rollout:
    step-index per segment) and its path of ``(segment id, length)``; ids restart in every group (unique within a
    group only)."""
    rng = random.Random(seed)
    leaves = []
    for g in range(groups):
        counter = [rng.randint(0, 5)]

        def grow(tree_idx, path, depth, rng=rng, counter=counter, g=g):
            node = (counter[0], rng.randint(1, 2))
            counter[0] += 1
            tree_idx = f"{tree_idx}/{depth}-{node[0]}"
            path = [*path, node]
            children = 0 if depth == max_depth else rng.choice([0, 1, 2, 2, 3])
            if children == 0:
                leaves.append((g, tree_idx, path))
            for _ in range(children):
                grow(tree_idx, path, depth + 1)

        for _ in range(rng.randint(1, 3)):  # the prompt's first segments
            grow(str(g), [], 1)
    return leaves


def batch_of(leaves, rewards, seed=0, observations=True):
    """PolicyBatch rows from the leaves: each segment's tokens carry its id; a non-action token with a stray id may
    sit between two segments (never read); padding carries garbage ids."""
    rng = random.Random(seed + 1)
    rows = []
    for _, _, path in leaves:
        ids, acts = [], []
        for n, (segment, length) in enumerate(path):
            if observations and n and rng.random() < 0.3:
                ids.append(rng.randint(-9, 99))
                acts.append(False)
            ids += [segment] * length
            acts += [True] * length
        rows.append((ids, acts))
    T = max(len(ids) for ids, _ in rows) + 1
    segment_id = torch.full((len(rows), T), -3, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (ids, acts) in enumerate(rows):
        segment_id[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(acts)] = torch.tensor(acts)
    group = torch.tensor([g for g, _, _ in leaves])
    return lossplug.PolicyBatch(
        logp=torch.zeros(mask.shape, dtype=F64),
        action_mask=mask,
        reward=torch.as_tensor(rewards, dtype=F64),
        group_id=group,
        segment_id=segment_id,
    )


# -- TreePO's estimator, transcribed ----------------------------------------------------------------------------------


def treepo_uids(leaves, first_subgroup="prompt"):
    """The uids TreePO's trainer builds (``ray_trainer.py``: ``prompt_uid + "#".join(tree_idx.split('/')[1:depth+1])``,
    with no ``#`` after the prompt: ``first_segment``), or with one (the paper's query group first: ``prompt``)."""
    joint = "#" if first_subgroup == "prompt" else ""
    return [f"prompt-{g}" + joint + "#".join(tree_idx.split("/")[1:]) for g, tree_idx, _ in leaves]


def treepo_reference(uids, scores, tokens, weighting="average", skip_constant=False, whiten=True):
    """Their depth loop over uid prefixes, then verl's masked_whiten (float32 count arithmetic, as verl's int mask)."""
    scores = [float(s) for s in scores]
    adv_lists = {i: [] for i in range(len(uids))}
    max_depth = max(len(u.split("#")) - 1 for u in uids)
    for depth in range(max_depth):
        keys = ["#".join(u.split("#")[: depth + 1]) for u in uids]
        members = {}
        for i, key in enumerate(keys):
            members.setdefault(key, []).append(scores[i])
        mean = {k: (0.0 if len(v) == 1 else float(np.mean(v))) for k, v in members.items()}
        std = {k: (0.0 if len(v) == 1 else float(np.std(v, ddof=1))) for k, v in members.items()}
        for i, key in enumerate(keys):
            size = len(members[key])
            if depth == 0 or (size > 1 and not (skip_constant and std[key] == 0.0)):
                adv_lists[i].append((scores[i] - mean[key], size))
    out = []
    for i in range(len(uids)):
        if weighting == "group_size":
            total = sum(n for _, n in adv_lists[i])
            out.append(sum(a * n / total for a, n in adv_lists[i]))
        else:
            out.append(float(np.mean([a for a, _ in adv_lists[i]])))
    out = np.array(out)
    if not whiten:
        return out
    x = np.repeat(out, tokens)
    n = len(x)
    denom = float(np.float32(n) + np.float32(1e-8))
    mu = x.sum() / denom
    var = ((x - mu) ** 2).sum() / denom * float(np.float32(n) / np.float32(n - 1))
    return (out - mu) / np.sqrt(var + 1e-8)


CASES = [
    {},
    {"weighting": "group_size"},
    {"skip_constant_subgroups": True},
    {"weighting": "group_size", "skip_constant_subgroups": True, "whiten": False},
    {"first_subgroup": "first_segment"},
    {"first_subgroup": "first_segment", "weighting": "group_size", "skip_constant_subgroups": True},
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
@pytest.mark.parametrize("seed", range(6))
def test_matches_treepos_estimator(seed, params):
    leaves = random_forest(seed, groups=1 + seed % 3)
    rng = random.Random(seed)
    rewards = [float(rng.choice([0, 1])) if seed % 2 else rng.choice([0.0, 1.0, 0.5, -1.25]) for _ in leaves]
    batch = batch_of(leaves, rewards, seed)
    expected = treepo_reference(
        treepo_uids(leaves, params.get("first_subgroup", "prompt")),
        rewards,
        batch.action_mask.sum(-1).numpy(),
        weighting=params.get("weighting", "average"),
        skip_constant=params.get("skip_constant_subgroups", False),
        whiten=params.get("whiten", True),
    )
    ours = advantage(batch, **params)
    assert ours.shape == (len(leaves),)
    torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


def test_hand_derived_values():
    # one prompt; rows 0, 1 share segment 1, rows 2, 3 share segment 2; R = 1, 0, 0, 0 (mean 0.25)
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(4, 2, dtype=F64),
        action_mask=torch.ones(4, 2, dtype=torch.bool),
        reward=torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64),
        group_id=torch.zeros(4, dtype=torch.long),
        segment_id=torch.tensor([[1, 3], [1, 4], [2, 5], [2, 6]]),
    )
    # average: row 0 (0.75 + 0.5)/2, row 1 (−0.25 − 0.5)/2, rows 2, 3 (−0.25 + 0)/2
    assert advantage(batch, whiten=False).tolist() == [0.625, -0.375, -0.125, -0.125]
    # group_size: both subgroups weigh 4 and 2 → (4·0.75 + 2·0.5)/6, …
    torch.testing.assert_close(
        advantage(batch, whiten=False, weighting="group_size"),
        torch.tensor([4 / 6, -2 / 6, -1 / 6, -1 / 6], dtype=F64),
        rtol=0,
        atol=1e-15,
    )
    # skip_constant_subgroups: segment 2's rewards are equal, rows 2, 3 keep the prompt's term alone
    assert advantage(batch, whiten=False, skip_constant_subgroups=True).tolist() == [0.625, -0.375, -0.25, -0.25]
    # first_subgroup first_segment (the released trainer): segment 1's and 2's subgroups replace the prompt's
    assert advantage(batch, whiten=False, first_subgroup="first_segment").tolist() == [0.5, -0.5, 0.0, 0.0]
    # … and a first segment of one row gives its score itself (the code's mean 0 for a subgroup of one)
    alone = batch.replace(segment_id=torch.tensor([[1, 3], [1, 4], [2, 5], [7, 6]]), reward=batch.reward + 1)
    assert advantage(alone, whiten=False, first_subgroup="first_segment").tolist() == [0.5, -0.5, 1.0, 1.0]
    # whitened over the 8 action tokens (each row twice): mean 0, unbiased variance 1 (up to verl's 1e-8)
    whitened = advantage(batch)
    raw = torch.tensor([0.625, -0.375, -0.125, -0.125], dtype=F64)
    tokens = raw.repeat_interleave(2)
    expected = (raw - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    torch.testing.assert_close(whitened, expected, rtol=1e-7, atol=0)


def test_loss_and_gradient_through_ppo_clip():
    leaves = random_forest(3, groups=2)
    rng = random.Random(3)
    rewards = [float(rng.choice([0, 1])) for _ in leaves]
    batch = batch_of(leaves, rewards, 3)
    mask = batch.action_mask
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g, dtype=F64) - 0.1
    logp = (old + 0.3 * torch.randn(mask.shape, generator=g, dtype=F64)).clamp(max=0).requires_grad_()
    recipe = {"advantage": "treepo", **RECIPE}
    adv = lossplug.estimate_advantages(batch.replace(old_logp=old), recipe).advantage
    loss = lossplug.policy_loss(batch.replace(logp=logp, old_logp=old, advantage=adv), recipe).loss
    loss.backward()
    ours_grad = logp.grad.clone()
    # the oracle: TreePO's advantage, PPO's clipped surrogate (0.2) averaged over the action tokens, by hand
    a = torch.from_numpy(treepo_reference(treepo_uids(leaves), rewards, mask.sum(-1).numpy()))
    x = logp.detach().clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(x[i, t] - old[i, t])
                total = total - torch.minimum(ratio * a[i], ratio.clamp(0.8, 1.2) * a[i])
    expected = total / mask.sum()
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, x.grad, rtol=1e-12, atol=1e-14)


# -- invariants -------------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 3), size=st.integers(1, 5))
def test_chains_that_share_no_node_are_reinforce_plus_plus_baseline(seed, groups, size):
    # one leaf per branch from the prompt (independent rollouts): only the prompt group is left, verl's
    # REINFORCE++-baseline (its constant groups zeroed exactly; here the mean's rounding, < 1e-15)
    rng = random.Random(seed)
    leaves = [(g, "", [(10 * k + rng.randint(0, 9), rng.randint(1, 3))]) for g in range(groups) for k in range(size)]
    leaves = [(g, u, path + [(path[0][0] + 500, 1)] * rng.randint(0, 1)) for g, u, path in leaves]
    rewards = [rng.choice([0.0, 1.0, 0.3]) for _ in leaves]
    batch = batch_of(leaves, rewards, seed)
    base = lossplug.estimate_advantages(batch, {"advantage": "reinforce_plus_plus_baseline", **RECIPE}).advantage
    torch.testing.assert_close(advantage(batch), base, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(advantage(batch, whiten=False), advantage(batch, whiten=False, weighting="group_size"))


@given(seed=st.integers(0, 2**16), data=st.data())
def test_row_order_and_segment_labels_do_not_matter(seed, data):
    leaves = random_forest(seed, groups=2)
    rng = random.Random(seed)
    rewards = [rng.choice([0.0, 1.0, 0.5]) for _ in leaves]
    batch = batch_of(leaves, rewards, seed)
    base = advantage(batch, whiten=False)
    perm = torch.tensor(data.draw(st.permutations(range(len(leaves)))))
    shuffled = batch.replace(
        **{k: batch.fields()[k][perm] for k in ("logp", "action_mask", "reward", "group_id", "segment_id")}
    )
    torch.testing.assert_close(advantage(shuffled, whiten=False), base[perm], rtol=0, atol=1e-15)
    relabelled = batch.replace(segment_id=batch.segment_id * 7 + 1000 * batch.group_id.unsqueeze(-1) - 13)
    torch.testing.assert_close(advantage(relabelled, whiten=False), base, rtol=0, atol=0)


def test_only_action_positions_are_read():
    leaves = random_forest(5, groups=2)
    batch = batch_of(leaves, [float(i % 2) for i in range(len(leaves))], 5)
    poisoned = batch.replace(segment_id=torch.where(batch.action_mask, batch.segment_id, 12345))
    torch.testing.assert_close(advantage(poisoned), advantage(batch), rtol=0, atol=0)


# -- bad input --------------------------------------------------------------------------------------------------------


def _batch(segment_id, group=None):
    segment_id = torch.tensor(segment_id)
    B, T = segment_id.shape
    return lossplug.PolicyBatch(
        logp=torch.zeros(B, T),
        action_mask=torch.ones(B, T, dtype=torch.bool),
        reward=torch.arange(B, dtype=torch.float32),
        group_id=torch.zeros(B, dtype=torch.long) if group is None else torch.tensor(group),
        segment_id=segment_id,
    )


def test_one_id_under_two_prefixes_is_refused_by_row_and_position():
    with pytest.raises(
        lossplug.LossplugError,
        match=r"segment_id must give a node the same prefix.*segment 3 of group 0 follows segment 1 in row 0 "
        r"\(pos 1\) but segment 2 in row 1 \(pos 2\)",
    ):
        advantage(_batch([[1, 3, 4], [2, 2, 3]]))
    with pytest.raises(lossplug.LossplugError, match=r"segment 1 of group 0 follows the start in row 0"):
        advantage(_batch([[1, 1, 5], [0, 1, 6]]))
    # the same ids in two prompts' trees are two nodes
    advantage(_batch([[1, 3], [2, 3]], group=[0, 1]))


def test_a_row_coming_back_to_a_segment_is_refused():
    with pytest.raises(
        lossplug.LossplugError,
        match=r"one run of a row's action tokens; row 1 is in segment 4 at pos 0 and again at pos 2",
    ):
        advantage(_batch([[1, 2, 3], [4, 5, 4]]))


def test_without_segment_ids_the_recipe_says_what_is_missing():
    batch = _batch([[1, 2], [1, 3]]).replace(segment_id=None)
    with pytest.raises(lossplug.LossplugError, match="segment_id"):
        advantage(batch)

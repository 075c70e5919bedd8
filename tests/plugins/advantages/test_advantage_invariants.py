"""Property tests of the advantage estimators (terminals never bootstrap and truncations end the trace;
an all-equal group gets no advantage; the contract's NaN rule).

* terminals never bootstrap: what ``next_value`` / ``final_value`` hold where terminated changes nothing;
* boundaries stop the trace: nothing after a boundary changes an advantage before it;
* groups of equal rewards get exactly zero advantage, for every group estimator and every std convention;
* group results do not depend on the order of the rows (groups scattered anywhere in the batch);
* NaN/inf on non-action positions changes nothing (a token reward there is the contract's to refuse; the estimators
  ignore it all the same).

Sized for a 2-core CI (the 'ci' profile: 40 examples, tensors of a few dozen elements).
"""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.tools.kl import kl_shaped_rewards

F64 = torch.float64
finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)
junk = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30, -7.0])

GROUP_ADVANTAGES = [{"name": "rloo"}] + [
    {"name": "grpo", "scale": scale, "std": std, "eps": eps, "eps_mode": mode}
    for scale, std, eps, mode in itertools.product(
        ("group", "batch", "none"), ("sample", "population"), (0.0, 1e-6, 1e-4), ("add", "threshold")
    )
    if not (eps == 0.0 and mode == "add" and scale != "none")  # c / (std + 0) is inf when a std underflows to 0
]
GAE_ADVANTAGES = [
    {"name": "gae", "gamma": 0.97, "lam": 0.9, "whiten": False},
    {"name": "gae", "gamma": 0.9, "lam": 0.5, "critic_lam": 1.0, "whiten": False},
    {"name": "length_adaptive_gae", "alpha": 0.3, "gamma": 0.95, "whiten": False},
]


def recipe(advantage):
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


def same(a, b):
    assert a.shape == b.shape and torch.equal(a, b), (a, b)


# ---------------------------------------------------------------------------------------------------------------------
# Packed layout


@st.composite
def packed(draw, max_n=12):
    n = draw(st.integers(1, max_n))
    boundary = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    boundary[-1] = True
    terminated = [b and draw(st.booleans()) for b in boundary]
    vec = lambda: torch.tensor(draw(st.lists(finite, min_size=n, max_size=n)), dtype=F64)
    return dict(
        reward=vec(),
        value=vec(),
        next_value=vec(),
        terminated=torch.tensor(terminated),
        boundary=torch.tensor(boundary),
    )


def run_packed(kw, advantage):
    return lossplug.estimate_advantages(lossplug.PackedTransitions(**kw), recipe(advantage))


@given(packed(), junk, st.sampled_from(GAE_ADVANTAGES))
def test_packed_terminals_never_bootstrap(kw, value, advantage):
    base = run_packed(kw, advantage)
    other = run_packed({**kw, "next_value": kw["next_value"].masked_fill(kw["terminated"], value)}, advantage)
    same(base.advantage, other.advantage)
    same(base.returns, other.returns)


@given(packed(), st.data(), st.sampled_from(GAE_ADVANTAGES[:2]))
def test_packed_boundaries_stop_the_trace(kw, data, advantage):
    cuts = kw["boundary"].nonzero().squeeze(-1).tolist()
    cut = data.draw(st.sampled_from(cuts))
    n = kw["reward"].numel()
    changed = dict(kw)
    for name in ("reward", "value", "next_value"):
        tail = torch.tensor(data.draw(st.lists(finite, min_size=n, max_size=n)), dtype=F64)
        changed[name] = torch.cat((kw[name][: cut + 1], tail[cut + 1 :]))
    tail_term = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    changed["terminated"] = torch.cat((kw["terminated"][: cut + 1], tail_term[cut + 1 :] & kw["boundary"][cut + 1 :]))
    base, other = run_packed(kw, advantage), run_packed(changed, advantage)
    same(base.advantage[: cut + 1], other.advantage[: cut + 1])
    same(base.returns[: cut + 1], other.returns[: cut + 1])


# ---------------------------------------------------------------------------------------------------------------------
# Padded layout


@st.composite
def padded(draw, max_b=4, max_t=7):
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)))
    for b in range(B):
        if not mask[b].any():
            mask[b, draw(st.integers(0, T - 1))] = True
    mat = lambda: torch.tensor(
        draw(st.lists(st.lists(finite, min_size=T, max_size=T), min_size=B, max_size=B)), dtype=F64
    ).view(B, T)
    row = lambda: torch.tensor(draw(st.lists(finite, min_size=B, max_size=B)), dtype=F64)
    reward = torch.where(mask, mat(), 0) if draw(st.booleans()) else row()  # token rewards: 0 off the actions
    terminated = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    return dict(
        logp=-mat().abs(),
        old_logp=-mat().abs(),
        ref_logp=-mat().abs(),
        action_mask=mask,
        value=mat(),
        reward=reward,
        terminated=terminated,
        final_value=row(),
    )


def run_padded(kw, advantage):
    return lossplug.estimate_advantages(lossplug.PolicyBatch(**kw), recipe(advantage))


@given(padded(), junk, st.sampled_from(GAE_ADVANTAGES))
def test_padded_terminals_never_bootstrap(kw, value, advantage):
    base = run_padded(kw, advantage)
    other = run_padded({**kw, "final_value": kw["final_value"].masked_fill(kw["terminated"], value)}, advantage)
    same(base.advantage, other.advantage)
    same(base.returns, other.returns)


@given(padded(), st.data(), st.sampled_from(GAE_ADVANTAGES))
def test_padded_rows_are_independent_fragments(kw, data, advantage):
    B, T = kw["action_mask"].shape
    keep = data.draw(st.integers(0, B - 1))
    changed = dict(kw)
    for name in ("value", "reward", "final_value"):
        noise = torch.tensor(
            data.draw(st.lists(finite, min_size=kw[name].numel(), max_size=kw[name].numel())), dtype=F64
        ).view(kw[name].shape)
        noise[keep] = kw[name][keep]
        changed[name] = torch.where(kw["action_mask"], noise, 0) if name == "reward" and noise.ndim == 2 else noise
    base, other = run_padded(kw, advantage), run_padded(changed, advantage)
    same(base.advantage[keep], other.advantage[keep])
    same(base.returns[keep], other.returns[keep])


@given(
    padded(),
    junk,
    st.sampled_from(
        GAE_ADVANTAGES
        + [{"name": "gae", "whiten": True, "kl_coef": 0.1}, {"name": "length_adaptive_gae", "whiten": True}]
    ),
)
def test_padded_nan_on_non_action_positions_changes_nothing(kw, value, advantage):
    off = ~kw["action_mask"]
    poisoned = {**kw, **{name: kw[name].masked_fill(off, value) for name in ("value", "old_logp", "ref_logp")}}
    base = run_padded(kw, advantage)
    if kw["reward"].ndim == 2 and off.any():  # refused by the contract; ignored by the estimators all the same
        poisoned["reward"] = kw["reward"].masked_fill(off, value)
        with pytest.raises(lossplug.BatchValidationError, match="token rewards"):
            lossplug.PolicyBatch(**poisoned)
        other = lossplug.estimate_advantages(
            lossplug.PolicyBatch.unchecked(**poisoned), recipe(advantage), validate="off"
        )
    else:
        other = run_padded(poisoned, advantage)
    same(base.advantage, other.advantage)
    same(base.returns, other.returns)
    assert torch.isfinite(other.advantage).all() and (other.advantage[off] == 0).all()


@given(padded(), junk)
def test_kl_shaped_rewards_ignore_non_action_positions(kw, value):
    off = ~kw["action_mask"]
    score = torch.zeros(kw["value"].shape[0], dtype=F64)
    base = kl_shaped_rewards(score, kw["old_logp"], kw["ref_logp"], kw["action_mask"], kl_coef=0.2)
    other = kl_shaped_rewards(
        score,
        kw["old_logp"].masked_fill(off, value),
        kw["ref_logp"].masked_fill(off, value),
        kw["action_mask"],
        kl_coef=0.2,
    )
    for a, b in ((base.rewards, other.rewards), (base.non_score_rewards, other.non_score_rewards), (base.kl, other.kl)):
        same(a, b)
        assert (b[off] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# Group estimators


@st.composite
def groups(draw, max_groups=4, max_size=4):
    sizes = draw(st.lists(st.integers(2, max_size), min_size=1, max_size=max_groups))
    constant = [draw(st.booleans()) for _ in sizes]
    rewards, ids = [], []
    for g, (n, const) in enumerate(zip(sizes, constant)):
        if const:
            rewards += [draw(finite)] * n
        else:
            rewards += draw(st.lists(finite, min_size=n, max_size=n))
        ids += [g] * n
    perm = draw(st.permutations(range(len(ids))))
    reward = torch.tensor(rewards, dtype=F64)[list(perm)]
    group = torch.tensor(ids)[list(perm)]
    return reward, group, torch.tensor(constant)[group]


def group_batch(reward, group, token=False):
    B = reward.numel()
    mask = torch.tensor([[True, False, True]]).repeat(B, 1)
    r = reward
    if token:  # the same scores as token rewards split over the action positions, junk elsewhere (unchecked: the
        # contract refuses a token reward off the actions)
        r = torch.stack((reward / 2, torch.full_like(reward, float("nan")), reward / 2), -1)
        return lossplug.PolicyBatch.unchecked(
            logp=-torch.ones(B, 3, dtype=F64), action_mask=mask, reward=r, group_id=group
        )
    return lossplug.PolicyBatch(logp=-torch.ones(B, 3, dtype=F64), action_mask=mask, reward=r, group_id=group)


@given(groups(), st.sampled_from(GROUP_ADVANTAGES))
def test_equal_reward_groups_get_exactly_zero(data, advantage):
    reward, group, constant = data
    adv = lossplug.compute_advantages(group_batch(reward, group), recipe(advantage))
    assert (adv[constant] == 0).all(), adv
    assert torch.isfinite(adv).all()


@given(groups(), st.sampled_from(GROUP_ADVANTAGES), st.randoms(use_true_random=False))
def test_group_advantages_do_not_depend_on_row_order(data, advantage, rnd):
    reward, group, _ = data
    perm = list(range(reward.numel()))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    base = lossplug.compute_advantages(group_batch(reward, group), recipe(advantage))
    shuffled = lossplug.compute_advantages(group_batch(reward[perm], group[perm]), recipe(advantage))
    torch.testing.assert_close(shuffled, base[perm], rtol=1e-9, atol=1e-9)


@given(groups(), st.sampled_from(GROUP_ADVANTAGES))
def test_group_token_rewards_ignore_non_action_positions(data, advantage):
    reward, group, constant = data
    seq = lossplug.compute_advantages(group_batch(reward, group), recipe(advantage))
    token_batch = group_batch(reward, group, token=True)
    with pytest.raises(lossplug.BatchValidationError, match="token rewards"):
        lossplug.compute_advantages(token_batch, recipe(advantage))
    tok = lossplug.compute_advantages(token_batch, recipe(advantage), validate="off")
    assert torch.isfinite(tok).all()
    assert (tok[constant] == 0).all()
    torch.testing.assert_close(tok, seq, rtol=1e-9, atol=1e-9)

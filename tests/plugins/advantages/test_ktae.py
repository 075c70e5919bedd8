"""ktae against the authors' estimator (github.com/xiaolizh1/KTAE at ea9fb77: ``compute_key_tokens.py`` and
``compute_ktae_outcome_advantage_and_keytokens``), transcribed below token by token with dictionaries, Python floats
and exact rational Fisher tests (the paper's factorial formula), in float64; a hand-derived score; the options; bad
token ids."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.plugins.advantages.ktae import fisher_weight

RECIPE = {"gates": ["ppo_clip"], "reduction": "token"}


def advantage(batch, **params):
    return lossplug.estimate_advantages(batch, {"advantage": {"name": "ktae", **params}, **RECIPE}).advantage


# -- the authors' estimator, transcribed ------------------------------------------------------------------------------


def _hypergeometric(a, b, c, d):
    """P(table) = (a+b)!(c+d)!(a+c)!(b+d)! / (a! b! c! d! N!) (the paper's formula), exactly."""
    f = math.factorial
    return Fraction(f(a + b) * f(c + d) * f(a + c) * f(b + d), f(a) * f(b) * f(c) * f(d) * f(a + b + c + d))


def fisher_two_sided(a, b, c, d):
    """The authors' fisher_exact_test: Σ of the tables with the same margins at most as probable as the observed."""
    row1, col1, n = a + b, a + c, a + b + c + d
    observed = _hypergeometric(a, b, c, d)
    total = Fraction(0)
    for k in range(max(0, row1 + col1 - n), min(row1, col1) + 1):
        pk = _hypergeometric(k, row1 - k, col1 - k, n - row1 - col1 + k)
        if pk <= observed:
            total += pk
    return total


def entropy_bits(p):
    return -p * math.log2(p) if p > 0 else 0.0


def authors_key_tokens(ids, mask, rewards, *, alpha=1.0, beta_ig=1.0, gamma_tf=1.0, top=1.0, zero_at_one=True):
    """ComputeKeyTokens.get_key_tokens for one group: {token id: score} (ids/mask lists of rows, rewards floats)."""
    correct = [i for i, r in enumerate(rewards) if r > 0.0]
    wrong = [i for i, r in enumerate(rewards) if r <= 0.0]
    vocab = {t for row, m in zip(ids, mask) for t, keep in zip(row, m) if keep}
    if not correct or not wrong:
        return dict.fromkeys(vocab, 0.0)

    def rollouts_with(rows, t):  # get_distribution: rows where t sits on an action position
        return sum(any(tok == t and keep for tok, keep in zip(ids[i], mask[i])) for i in rows)

    def occurrences(rows):
        counts, total = {}, 0
        for i in rows:
            for tok, keep in zip(ids[i], mask[i]):
                if keep:
                    counts[tok] = counts.get(tok, 0) + 1
                    total += 1
        return counts, total

    (occ_c, len_c), (occ_w, len_w) = occurrences(correct), occurrences(wrong)
    avg = (len_c + len_w) / 2
    k1, b_ = 2.0, 0.5
    out = {}
    for t in vocab:
        a, b = rollouts_with(correct, t), rollouts_with(wrong, t)
        c, d = len(correct) - a, len(wrong) - b
        n = a + b + c + d
        # calculate_ig
        h_y = entropy_bits((a + c) / n) + entropy_bits((b + d) / n)
        cond1 = entropy_bits(a / (a + b)) + entropy_bits(b / (a + b)) if a + b > 0 else 0.0
        cond2 = entropy_bits(c / (c + d)) + entropy_bits(d / (c + d)) if c + d > 0 else 0.0
        ig = h_y - ((a + b) / n * cond1 + (c + d) / n * cond2)
        # fisher_exact_test and its transform
        p = fisher_two_sided(a, b, c, d)
        fisher = 0.0 if (p == 1 and zero_at_one) else math.exp(-2 * float(p))
        # compute_Cohen (+ compute_tf)
        x = math.asin(math.sqrt(min(max(a / (a + c + 1e-10), 0), 1))) - math.asin(
            math.sqrt(min(max(b / (b + d + 1e-10), 0), 1))
        )
        if gamma_tf:
            fc, fw = occ_c.get(t, 0) / len_c, occ_w.get(t, 0) / len_w
            tf_c = fc * (k1 + 1) / (fc + k1 * (1 - b_ + b_ * len_c / avg))
            tf_w = fw * (k1 + 1) / (fw + k1 * (1 - b_ + b_ * len_w / avg))
            x += tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)
        key = (alpha * fisher + beta_ig * ig) * x / (alpha + beta_ig)
        sigmoid = 1 / (1 + math.exp(-key)) if key >= 0 else math.exp(key) / (1 + math.exp(key))
        out[t] = (sigmoid - 0.5) * 2 * top
        if t == 151643:  # their Qwen2.5 <|endoftext|>
            out[t] = 0.0
    return out


def authors_advantages(ids, mask, rewards, uid, **kw):
    """compute_ktae_outcome_advantage_and_keytokens: (R − mean_uid)/(std_uid + 1e-6) + key[token] on the mask."""
    by_uid = {}
    for i, u in enumerate(uid):
        by_uid.setdefault(u, []).append(i)
    adv = []
    for i, u in enumerate(uid):
        rows = by_uid[u]
        scores = [rewards[j] for j in rows]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1))
        keys = authors_key_tokens([ids[j] for j in rows], [mask[j] for j in rows], scores, **kw)
        base = (rewards[i] - mean) / (std + 1e-6)
        adv.append([base + keys[t] if keep else 0.0 for t, keep in zip(ids[i], mask[i])])
    return adv


def random_groups(seed, groups=5, n=6, T=9, vocab=7):
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    ids = torch.randint(0, vocab, (B, T), generator=g)
    ids = torch.where(mask, ids, -(2**31))  # garbage off the actions is never read
    reward = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    reward[:n] = 1.0  # a group without a wrong rollout: scores 0
    reward[n : 2 * n] = torch.linspace(-1, 1, n, dtype=torch.float64)  # continuous scores, "correct" iff > 0
    uid = torch.randperm(B, generator=g) % groups  # scattered groups
    return ids, mask, reward, uid


def batch_of(ids, mask, reward, uid):
    return lossplug.PolicyBatch(
        logp=torch.zeros(mask.shape, dtype=torch.float64), action_mask=mask, reward=reward, group_id=uid, token_ids=ids
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "params, authors",
    [
        ({}, {}),
        ({"zero_at_p_one": False}, {"zero_at_one": False}),
        ({"term_frequency": False, "alpha": 0.5, "scale": 2.0}, {"gamma_tf": 0.0, "alpha": 0.5, "top": 2.0}),
        ({"beta": 0.0}, {"beta_ig": 0.0}),
    ],
)
def test_matches_the_authors_estimator(seed, params, authors):
    ids, mask, reward, uid = random_groups(seed)
    ours = advantage(batch_of(ids, mask, reward, uid), **params)
    theirs = authors_advantages(ids.tolist(), mask.tolist(), reward.tolist(), uid.tolist(), **authors)
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_the_authors_qwen_eos_is_neutral_when_named():
    ids, mask, reward, uid = random_groups(7, vocab=3)
    ids = torch.where(mask & (ids == 2), 151643, ids)
    ours = advantage(batch_of(ids, mask, reward, uid), neutral_token_ids=[151643])
    theirs = authors_advantages(ids.tolist(), mask.tolist(), reward.tolist(), uid.tolist())
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # without it the EOS token scores like any other
    assert not torch.equal(advantage(batch_of(ids, mask, reward, uid)), ours)


def test_a_hand_derived_score():
    # 2 correct rollouts [7, 5], 2 wrong [9, 5]; without the tf term token 7 has a = 2, b = 0: Fisher p = 2/6,
    # IG = 1 bit, h = asin(1) − asin(0) = π/2 → key = (exp(−2/3) + 1)·(π/2)/2, score = 2σ(key) − 1 = tanh(key/2)
    ids = torch.tensor([[7, 5], [7, 5], [9, 5], [9, 5]])
    batch = batch_of(
        ids,
        torch.ones(4, 2, dtype=torch.bool),
        torch.tensor([1.0, 1, 0, 0], dtype=torch.float64),
        torch.zeros(4).long(),
    )
    adv = advantage(batch, term_frequency=False)
    # (with the code's epsilons: the std's 1e-6, and the rate's 1e-10, which moves asin(√·) near 1 by 7e-6)
    grpo = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    h = math.asin(math.sqrt(2 / (2 + 1e-10)))
    assert h == pytest.approx(math.pi / 2, abs=1e-5)
    key = (math.exp(-2 / 3) + 1) * h / 2
    assert adv[0, 0].item() == pytest.approx(grpo + math.tanh(key / 2), abs=1e-12)
    assert adv[2, 0].item() == pytest.approx(-grpo - math.tanh(key / 2), abs=1e-12)
    # token 5 is in every rollout: p = 1, IG = 0, h = 0 → score 0
    assert adv[0, 1].item() == pytest.approx(grpo, abs=1e-12)


def test_fisher_weight_is_exact_on_ties_and_at_p_one():
    # N_c = N_w = 2, a token in one rollout of each: tables 1, 4, 1 (/6), the observed is the most probable → p = 1
    assert fisher_weight(1, 1, 2, 2) == 0.0
    assert fisher_weight(1, 1, 2, 2, False) == pytest.approx(math.exp(-2.0))
    # a = 1, b = 0: both tables of the margins are equally probable (2 and 2) → the tie counts, p = 1
    assert fisher_weight(1, 0, 2, 2) == 0.0
    assert fisher_weight(2, 0, 2, 2) == pytest.approx(math.exp(-2 / 3))
    for a, b, nc, nw in [(3, 1, 5, 4), (0, 4, 3, 6), (2, 2, 2, 6)]:
        p = fisher_two_sided(a, b, nc - a, nw - b)
        assert fisher_weight(a, b, nc, nw, False) == pytest.approx(math.exp(-2 * float(p)), rel=1e-15)


def test_singletons_and_constant_groups_get_zero_and_the_advantage_is_zero_off_the_actions():
    ids, mask, reward, uid = random_groups(8)
    uid = uid.clone()
    uid[0] = 99  # a group of one
    adv = advantage(batch_of(ids, mask, reward, uid))
    assert (adv[0] == 0).all()
    assert (adv[~mask] == 0).all() and torch.isfinite(adv).all()
    same = uid == uid[1]
    constant = advantage(batch_of(ids, mask, torch.where(same, 1.0, reward), uid))
    assert (constant[same] == 0).all()


def test_negative_token_ids_on_the_actions_are_refused_by_position():
    ids, mask, reward, uid = random_groups(9)
    ids = ids.clone()
    ids[3, 0] = -5
    with pytest.raises(lossplug.LossplugError, match=r"token_ids must be vocabulary ids ≥ 0.*-5 at \(row 3, pos 0\)"):
        advantage(batch_of(ids, mask, reward, uid))


def test_without_token_ids_the_recipe_says_what_is_missing():
    ids, mask, reward, uid = random_groups(10)
    batch = lossplug.PolicyBatch(logp=torch.zeros(mask.shape), action_mask=mask, reward=reward, group_id=uid)
    with pytest.raises(lossplug.LossplugError, match="token_ids"):
        advantage(batch)


def test_weights_must_not_both_be_zero():
    with pytest.raises(lossplug.RecipeError, match="alpha \\+ beta must be > 0"):
        lossplug.Recipe.load({"advantage": {"name": "ktae", "alpha": 0, "beta": 0}, **RECIPE})


@given(seed=st.integers(0, 2**16), n=st.integers(2, 8), vocab=st.integers(1, 6))
def test_flipping_which_rollouts_are_correct_flips_the_advantage(seed, n, vocab):
    # binary rewards R → 1 − R swap the table's columns: F and IG are symmetric, h and the tf contrast change sign,
    # and so does the GRPO part
    ids, mask, reward, uid = random_groups(seed, groups=3, n=n, vocab=vocab)
    binary = (reward > 0).to(torch.float64)
    ours = advantage(batch_of(ids, mask, binary, uid))
    flipped = advantage(batch_of(ids, mask, 1 - binary, uid))
    torch.testing.assert_close(flipped, -ours, rtol=1e-12, atol=1e-12)

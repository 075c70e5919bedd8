"""gtpo against a float64 transcription of the authors' code (winstonsmith1897/GTPO, commit 5d33811,
``gtpo/gtpo_training.py``), written in its own coordinates: right-padded rows with a pad id, ``bincount`` keys
``position · V + id`` over the positive and the negative completions, the ``cumprod`` runs, the reversal by
flip-and-rotate, ``n_conflict`` from the OR of the forward run and the (unrotated) reversed run, the entropy from
the logits with the code's ``clamp_min(EPS)``, and the sum over completions of ``−Σ ratio·A·δ / n_tok / n_conflict``
— loss and gradient; then the gate's own rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.contracts import LossplugError

PAD, V, EPS = 99, 4, 1e-6
W_RAW, ENT_THRESHOLD, ENT_SCALE = 2.0, 0.7, 0.1


def authors_conflict(ids: list[list[int]], lengths: list[int], adv: list[float], pad: int = PAD) -> tuple[list, list]:
    """``build_conflict_mask`` for one group, loop by loop: (delta [G][L], n_conflict [G])."""
    G, L = len(ids), len(ids[0])
    pos = [a > 0 for a in adv]
    neg = [a < 0 for a in adv]
    active = [i for i in range(G) if pos[i] or neg[i]]
    delta = [[1.0 if t < lengths[i] else 0.0 for t in range(L)] for i in range(G)]
    n_conflict = [0] * G
    if not active:
        return delta, n_conflict

    def runs(rows: list[list[int]], step_of) -> dict[int, list[bool]]:
        keys_pos = {(step_of(t), rows[i][t]) for i in active if pos[i] for t in range(L)}
        keys_neg = {(step_of(t), rows[i][t]) for i in active if neg[i] for t in range(L)}
        out = {}
        for i in active:
            raw = [((step_of(t), rows[i][t])) in keys_pos and ((step_of(t), rows[i][t])) in keys_neg for t in range(L)]
            run, alive = [], True
            for t in range(L):
                alive = alive and raw[t]
                run.append(alive and ids[i][t] != pad)  # the code's valid_mask, on the forward ids
            out[i] = run
        return out

    forward = runs(ids, lambda t: t)
    # the reversal: flip, then rotate by the padding so the last real token sits at 0 (pads wrap to the end)
    reversed_ids = {}
    for i in range(G):
        flipped = ids[i][::-1]
        pad_len = L - lengths[i]
        reversed_ids[i] = [flipped[(t + pad_len) % L] for t in range(L)]
    backward = runs([reversed_ids[i] for i in range(G)], lambda t: L - 1 - t)
    for i in active:
        w_fwd = [(W_RAW if pos[i] else 0.0) if forward[i][t] else 1.0 for t in range(L)]
        w_rev = [(W_RAW if pos[i] else 0.0) if backward[i][j] else 1.0 for j in range(L)]
        pad_len = L - lengths[i]
        rotated = [w_rev[(m - pad_len) % L] for m in range(L)]
        w_bwd = rotated[::-1]
        mask = [1.0 if t < lengths[i] else 0.0 for t in range(L)]
        delta[i] = [w_fwd[t] * mask[t] * w_bwd[t] * mask[t] for t in range(L)]
        # total_conflict_use = (conflict_fwd | conflict_rev) & mask, conflict_rev still reversed
        n_conflict[i] = max(1, sum(1 for t in range(L) if (forward[i][t] or backward[i][t]) and mask[t]))
    return delta, n_conflict


def authors_loss(logits, ids, lengths, adv, group) -> tuple[float, torch.Tensor]:
    """``UnslothEfficientGTPO.forward``'s accumulated loss and its gradient in the per-token log-probs."""
    B, L, _ = logits.shape
    entropy = code_entropy(logits)
    mean_entropy = [float(entropy[i, : lengths[i]].sum()) / max(lengths[i], 1) for i in range(B)]
    delta, n_conflict = [None] * B, [0] * B
    for g in sorted(set(group)):
        rows = [i for i in range(B) if group[i] == g]
        d, n = authors_conflict([ids[i] for i in rows], [lengths[i] for i in rows], [adv[i] for i in rows])
        for k, i in enumerate(rows):
            delta[i], n_conflict[i] = d[k], n[k]
    total, grad = 0.0, torch.zeros(B, L, dtype=torch.float64)
    for i in range(B):
        shaped = adv[i] - ENT_SCALE * mean_entropy[i] if mean_entropy[i] <= ENT_THRESHOLD else 0.0
        n_tok = max(lengths[i], 1)
        for t in range(lengths[i]):
            # ratio = exp(new − new.detach()) = 1: loss −A·δ/n_tok/n_conflict per token, d/dlogp the same
            total += -(shaped * delta[i][t]) / n_tok / max(n_conflict[i], 1)
            grad[i, t] = -(shaped * delta[i][t]) / n_tok / max(n_conflict[i], 1)
    return total, grad


def group_batch(seed: int, groups: int = 3, G: int = 4, L: int = 7):
    """Right-padded completions of ``groups`` prompt groups from a vocabulary of V tokens (so that the completions of
    a group share leading and trailing tokens), rewards with ties (zero advantages) and rows of low and of high
    entropy (peaked and flat logits)."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    lengths = torch.randint(2, L + 1, (B,), generator=g).tolist()
    common_head = torch.randint(0, V, (groups, L), generator=g)
    ids = []
    for i in range(B):
        row = torch.where(torch.rand(L, generator=g) < 0.6, common_head[i // G], torch.randint(0, V, (L,), generator=g))
        row[lengths[i] - 1] = 3  # an end-of-sequence token every completion shares
        ids.append([int(v) if t < lengths[i] else PAD for t, v in enumerate(row)])
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    adv = (rewards - rewards.view(groups, G).mean(-1).repeat_interleave(G)).tolist()  # r − mean, no std
    sharpness = torch.where(torch.rand(B, generator=g) < 0.7, 6.0, 0.3)  # most rows confident, some flat
    logits = torch.randn(B, L, V, generator=g, dtype=torch.float64) * sharpness[:, None, None]
    group = [i // G for i in range(B)]
    return logits, ids, lengths, adv, group


def code_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The code's per-token entropy ``−Σ p·log max(p, EPS)`` (``compute_completion_stats``)."""
    probs = torch.softmax(logits, -1)
    return -(probs * torch.log(probs.clamp_min(EPS))).sum(-1)


def lossplug_gtpo(logits, ids, lengths, adv, group, reduction: str = "response", entropy=None):
    B, L, _ = logits.shape
    mask = torch.arange(L) < torch.tensor(lengths)[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).clamp(max=V - 1)[..., None])[..., 0]
    logp = logp.detach().clone().requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp,
        action_mask=mask,
        advantage=torch.tensor(adv, dtype=torch.float64),
        group_id=torch.tensor(group),
        token_ids=torch.tensor(ids),
        entropy=code_entropy(logits) if entropy is None else entropy,
    )
    result = lossplug.policy_loss(batch, {"gates": ["gtpo"], "reduction": reduction}, metrics="full")
    result.loss.backward()
    return result, logp.grad, mask


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_authors_code_loss_and_gradient(seed):
    logits, ids, lengths, adv, group = group_batch(seed)
    expected_loss, expected_grad = authors_loss(logits, ids, lengths, adv, group)
    result, grad, _ = lossplug_gtpo(logits, ids, lengths, adv, group)
    B = len(lengths)
    # the code sums its completions' losses; the response reduction averages them
    assert abs(B * result.loss.item() - expected_loss) < 1e-12, (B * result.loss.item(), expected_loss)
    torch.testing.assert_close(B * grad, expected_grad, rtol=0, atol=1e-12)


def test_with_the_exact_entropy_the_difference_is_the_codes_clamp_alone():
    """The batch's entropy is the exact one (TRL's); the code's clamps p at 1e-6: a few 1e-8 apart here."""
    logits, ids, lengths, adv, group = group_batch(0)
    probs = torch.softmax(logits, -1)
    exact = -(probs * torch.log(probs)).sum(-1)
    assert 0 < float((code_entropy(logits) - exact).abs().max()) < 1e-5
    result, _, _ = lossplug_gtpo(logits, ids, lengths, adv, group, entropy=exact)
    expected_loss, _ = authors_loss(logits, ids, lengths, adv, group)
    assert 0 < abs(len(lengths) * result.loss.item() - expected_loss) < 1e-6


def test_the_batches_exercise_every_branch():
    seen = {"conflict": 0, "filtered": 0, "zero_advantage": 0, "n_from_max": 0}
    for seed in range(6):
        logits, ids, lengths, adv, group = group_batch(seed)
        result, _, _ = lossplug_gtpo(logits, ids, lengths, adv, group)
        seen["conflict"] += result.metric_tensors["gtpo/conflict_frac"].item() > 0
        seen["filtered"] += result.metric_tensors["gtpo/entropy_filtered_frac"].item() > 0
        seen["zero_advantage"] += any(a == 0 for a in adv)
        for g in set(group):
            rows = [i for i in range(len(group)) if group[i] == g]
            _, n = authors_conflict([ids[i] for i in rows], [lengths[i] for i in rows], [adv[i] for i in rows])
            seen["n_from_max"] += any(k > 1 for k in n)
    assert all(v > 0 for v in seen.values()), seen


def test_the_authors_n_conflict_is_the_longer_run_not_the_union():
    # leading run (7, 8) of 2, trailing run (5) of 1: the code divides by max(2, 1) = 2, not by the 3 tokens
    ids = [[7, 8, 1, 5], [7, 8, 2, 5]]
    _, n = authors_conflict(ids, [4, 4], [1.0, -1.0])
    assert n == [2, 2]
    batch = lossplug.PolicyBatch(
        logp=torch.full((2, 4), -1.0, dtype=torch.float64),
        action_mask=torch.ones(2, 4, dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0], dtype=torch.float64),
        group_id=torch.tensor([0, 0]),
        token_ids=torch.tensor(ids),
        entropy=torch.zeros(2, 4, dtype=torch.float64),
    )
    plugin = lossplug.registry().plugins["gate"]["gtpo"]
    out = plugin(lossplug.GateInput.from_batch(batch), plugin.params())
    assert out.objective.tolist() == [[1.0, 1.0, 0.5, 1.0], [0.0, 0.0, -0.5, 0.0]]


def test_positions_count_action_tokens_so_masked_columns_change_nothing():
    """Tool-output columns inside a response (not actions): the k-th action token is compared, as in the compacted
    batch the authors' code would see."""
    logits, ids, lengths, adv, group = group_batch(7)
    compact, compact_grad, mask = lossplug_gtpo(logits, ids, lengths, adv, group)
    B, L, _ = logits.shape
    spread = torch.zeros(B, L + 2, dtype=torch.bool)
    cols = torch.tensor([0, 1, 4, 5, 6, 7, 8])  # columns 2 and 3 are an observation block
    spread[:, cols] = mask
    logp = torch.full((B, L + 2), -7.0, dtype=torch.float64)
    logp[:, cols] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).clamp(max=V - 1)[..., None])[..., 0]
    token_ids = torch.full((B, L + 2), 1, dtype=torch.int64)
    token_ids[:, cols] = torch.tensor(ids)
    entropy = torch.full((B, L + 2), 5.0, dtype=torch.float64)
    entropy[:, cols] = code_entropy(logits)
    logp.requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp,
        action_mask=spread,
        advantage=torch.tensor(adv, dtype=torch.float64),
        group_id=torch.tensor(group),
        token_ids=token_ids,
        entropy=entropy,
    )
    result = lossplug.policy_loss(batch, {"gates": ["gtpo"], "reduction": "response"})
    result.loss.backward()
    torch.testing.assert_close(result.loss, compact.loss, rtol=0, atol=1e-14)
    torch.testing.assert_close(logp.grad[:, cols], compact_grad, rtol=0, atol=1e-14)
    assert bool((logp.grad[:, 2:4] == 0).all())


def test_gradient_flows_through_logp_only():
    logits, ids, lengths, adv, group = group_batch(8)
    L = logits.shape[1]
    probs = torch.softmax(logits, -1)
    entropy = (-(probs * torch.log(probs)).sum(-1)).requires_grad_()
    logp = torch.full((len(ids), L), -1.0, dtype=torch.float64, requires_grad=True)
    batch = lossplug.PolicyBatch(
        logp=logp,
        action_mask=torch.arange(L) < torch.tensor(lengths)[:, None],
        advantage=torch.tensor(adv, dtype=torch.float64),
        group_id=torch.tensor(group),
        token_ids=torch.tensor(ids),
        entropy=entropy,
    )
    out = lossplug.policy_loss(batch, {"gates": ["gtpo"], "reduction": "response"})
    out.loss.backward()
    assert entropy.grad is None and logp.grad.abs().sum() > 0


def _tiny_batch(**overrides):
    fields = dict(
        logp=torch.full((3, 2), -1.0, dtype=torch.float64),
        action_mask=torch.ones(3, 2, dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64),
        group_id=torch.tensor([0, 0, 1]),
        token_ids=torch.tensor([[1, 2], [1, 3], [1, 2]]),
        entropy=torch.zeros(3, 2, dtype=torch.float64),
    )
    fields.update(overrides)
    return lossplug.PolicyBatch(**fields)


def test_a_partial_group_is_refused_naming_the_group_and_the_rule():
    recipe = {"gates": [{"name": "gtpo", "group_size": 2}], "reduction": "response"}
    with pytest.raises(LossplugError) as err:
        lossplug.policy_loss(_tiny_batch(), recipe)
    for words in ("group_size=2", "group 1 has 1 rows", "row 2", "steps_per_generation=1"):
        assert words in str(err.value), str(err.value)


def test_a_per_token_advantage_constant_along_each_response_is_the_per_response_one():
    """verl broadcasts GRPO's advantage over the response: the same loss and gradient as the [B] advantage."""
    logits, ids, lengths, adv, group = group_batch(9)
    per_response, grad, mask = lossplug_gtpo(logits, ids, lengths, adv, group)
    per_token = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(mask).clone()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).clamp(max=V - 1)[..., None])[..., 0]
    logp = logp.detach().clone().requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp,
        action_mask=mask,
        advantage=per_token,
        group_id=torch.tensor(group),
        token_ids=torch.tensor(ids),
        entropy=code_entropy(logits),
    )
    result = lossplug.policy_loss(batch, {"gates": ["gtpo"], "reduction": "response"})
    result.loss.backward()
    torch.testing.assert_close(result.loss, per_response.loss, rtol=0, atol=1e-15)
    torch.testing.assert_close(logp.grad, grad, rtol=0, atol=1e-15)


def test_a_batch_without_token_ids_is_refused_naming_the_field():
    batch = _tiny_batch(token_ids=None)
    with pytest.raises(LossplugError, match="token_ids"):
        lossplug.policy_loss(batch, {"gates": ["gtpo"], "reduction": "response"})


@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000))
def test_groups_may_be_scattered_the_rows_order_changes_nothing(seed, order_seed):
    """The rows of a group need not be adjacent (TRL shuffles its batch): shuffled rows give the same loss and the
    same gradient, shuffled; both equal the authors' code on the groups laid out one after the other."""
    logits, ids, lengths, adv, group = group_batch(seed % 50, groups=2, G=3, L=5)
    expected_loss, expected_grad = authors_loss(logits, ids, lengths, adv, group)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(order_seed)).tolist()
    result, grad, _ = lossplug_gtpo(
        logits[order],
        [ids[i] for i in order],
        [lengths[i] for i in order],
        [adv[i] for i in order],
        [group[i] for i in order],
    )
    assert abs(len(ids) * result.loss.item() - expected_loss) < 1e-12
    torch.testing.assert_close(len(ids) * grad, expected_grad[order], rtol=0, atol=1e-12)

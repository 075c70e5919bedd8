"""Pairwise reward-model loss on the last non-padding token: left/right padding, LLaMA-Factory equivalence, errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lossplug import LossplugError
from lossplug.tools.reward_model import last_token_index, last_token_scores, pairwise_reward_loss


def _llamafactory_compute_loss(values, attention_mask):
    """LLaMA-Factory's ``PairwiseTrainer.compute_loss`` (``src/llamafactory/train/rm/trainer.py``) after the forward
    pass, transcribed: gathers at mask.sum() − 1."""
    batch_size = values.size(0) // 2
    chosen_masks, rejected_masks = torch.split(attention_mask, batch_size, dim=0)
    chosen_rewards, rejected_rewards = torch.split(values, batch_size, dim=0)
    chosen_scores = chosen_rewards.gather(dim=-1, index=(chosen_masks.sum(dim=-1, keepdim=True) - 1))
    rejected_scores = rejected_rewards.gather(dim=-1, index=(rejected_masks.sum(dim=-1, keepdim=True) - 1))
    chosen_scores, rejected_scores = chosen_scores.squeeze(), rejected_scores.squeeze()
    loss = -torch.nn.functional.logsigmoid(chosen_scores.float() - rejected_scores.float()).mean()
    return loss, chosen_scores, rejected_scores


def _pad(seqs, T, side):
    """[N, T] values and bool mask from variable-length 1-D score sequences, padded on ``side``."""
    values = torch.full((len(seqs), T), float("nan"), dtype=torch.float64)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s)
        sl = slice(0, n) if side == "right" else slice(T - n, T)
        values[i, sl] = torch.as_tensor(s, dtype=torch.float64)
        mask[i, sl] = True
    return values, mask


def _random_seqs(P, T, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (2 * P,), generator=g).tolist()
    return [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]


def test_last_token_index_both_padding_sides():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert last_token_index(mask).tolist() == [2, 4, 0, 4]


def test_equals_llamafactory_on_right_padding():
    seqs = _random_seqs(P=5, T=8, seed=0)
    values, mask = _pad(seqs, 8, "right")
    values = torch.nan_to_num(values)  # LLaMA-Factory's gather is fine with any padding value; keep it finite for it
    ours = pairwise_reward_loss(values, mask)
    loss, chosen, rejected = _llamafactory_compute_loss(values, mask.long())
    torch.testing.assert_close(ours.loss, loss.to(ours.loss.dtype))
    torch.testing.assert_close(ours.chosen_scores, chosen)
    torch.testing.assert_close(ours.rejected_scores, rejected)


def test_llamafactory_is_wrong_on_left_padding_and_we_are_right():
    seqs = [[0.1, 0.2, 3.0], [5.0], [0.0, 1.0, -2.0], [2.0, 0.5]]  # chosen: rows 0,1; rejected: rows 2,3
    values, mask = _pad(seqs, 4, "left")
    values = torch.nan_to_num(values)
    truth_c = torch.tensor([3.0, 5.0], dtype=torch.float64)
    truth_r = torch.tensor([-2.0, 0.5], dtype=torch.float64)
    ours = pairwise_reward_loss(values, mask)
    torch.testing.assert_close(ours.chosen_scores, truth_c)
    torch.testing.assert_close(ours.rejected_scores, truth_r)
    torch.testing.assert_close(ours.loss, -F.logsigmoid(truth_c - truth_r).mean())
    _, theirs_c, theirs_r = _llamafactory_compute_loss(values, mask.long())
    assert not torch.equal(theirs_c, truth_c) and not torch.equal(theirs_r, truth_r)  # mask.sum()−1 is inside/padding


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 10_000))
def test_property_invariant_to_padding_side_and_layout(P, T, seed):
    seqs = _random_seqs(P, T, seed)
    right_v, right_m = _pad(seqs, T, "right")
    left_v, left_m = _pad(seqs, T + 2, "left")  # other padding side and extra padding width
    a = pairwise_reward_loss(right_v, right_m)
    b = pairwise_reward_loss(left_v, left_m)
    c = pairwise_reward_loss(
        chosen_values=right_v[:P], chosen_mask=right_m[:P], rejected_values=left_v[P:], rejected_mask=left_m[P:]
    )
    d = pairwise_reward_loss(right_v.unsqueeze(-1), right_m)  # [2P, T, 1] value-head output
    for other in (b, c, d):
        torch.testing.assert_close(other.loss, a.loss)
        torch.testing.assert_close(other.chosen_scores, a.chosen_scores)
    assert torch.isfinite(a.loss)  # NaN padding never reaches the loss


def test_gradient_only_at_last_tokens():
    seqs = _random_seqs(P=3, T=6, seed=1)
    values, mask = _pad(seqs, 6, "left")
    v = values.clone().requires_grad_()
    out = pairwise_reward_loss(v, mask)
    out.loss.backward()
    assert torch.isfinite(v.grad).all()
    idx = last_token_index(mask)
    hit = torch.zeros_like(mask)
    hit[torch.arange(6), idx] = True
    assert (v.grad[~hit] == 0).all()
    margin = (out.chosen_scores - out.rejected_scores).detach()
    expected = -torch.sigmoid(-margin) / 3
    torch.testing.assert_close(v.grad[torch.arange(3), idx[:3]], expected)
    torch.testing.assert_close(v.grad[torch.arange(3, 6), idx[3:]], -expected)


def test_gradcheck_float64():
    seqs = _random_seqs(P=2, T=4, seed=2)
    values, mask = _pad(seqs, 4, "right")
    v = torch.nan_to_num(values).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: pairwise_reward_loss(x, mask).loss, (v,))


def test_large_margins_are_stable_and_metrics():
    chosen = torch.tensor([[1000.0], [-1000.0]])
    rejected = torch.tensor([[-1000.0], [1000.0]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    out = pairwise_reward_loss(chosen_values=chosen, chosen_mask=mask, rejected_values=rejected, rejected_mask=mask)
    assert out.loss.item() == pytest.approx(1000.0)  # (0 + 2000) / 2
    assert out.metrics["reward_model/accuracy"].item() == 0.5
    assert out.metrics["reward_model/margin"].item() == 0.0


def test_bfloat16_scores_are_reduced_in_float32():
    values = torch.randn(4, 3).to(torch.bfloat16)
    out = pairwise_reward_loss(values, torch.ones(4, 3, dtype=torch.bool))
    assert out.loss.dtype == torch.float32


def test_num_pairs_makes_micro_batches_add_up():
    seqs = _random_seqs(P=4, T=5, seed=3)
    values, mask = _pad(seqs, 5, "right")
    full = pairwise_reward_loss(values, mask)
    parts = [(slice(0, 1), slice(4, 5)), (slice(1, 4), slice(5, 8))]
    total = sum(
        pairwise_reward_loss(
            chosen_values=values[c], chosen_mask=mask[c], rejected_values=values[r], rejected_mask=mask[r], num_pairs=4
        ).loss
        for c, r in parts
    )
    torch.testing.assert_close(total, full.loss)


def test_last_token_scores():
    values, mask = _pad([[1.0, 2.0], [3.0]], 3, "left")
    assert last_token_scores(values, mask).tolist() == [2.0, 3.0]


# ---------------------------------------------------------------------------------------------------------------------
# errors


def test_errors_name_field_rule_and_place():
    values = torch.randn(4, 3)
    mask = torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(LossplugError, match="attention_mask: must be a bool tensor, got torch.int64"):
        pairwise_reward_loss(values, mask.long())
    with pytest.raises(LossplugError, match="even number of rows"):
        pairwise_reward_loss(values[:3], mask[:3])
    empty = mask.clone()
    empty[2] = False
    with pytest.raises(
        LossplugError,
        match=r"attention_mask: every sequence needs at least one non-padding token "
        r"— row \[2\]",
    ):
        pairwise_reward_loss(values, empty)
    with pytest.raises(LossplugError, match=r"attention_mask: shape must match values \[N, T\] \[4, 3\], got \[4, 2\]"):
        pairwise_reward_loss(values, mask[:, :2])
    with pytest.raises(LossplugError, match=r"values: must be \[N, T\] or \[N, T, 1\]"):
        pairwise_reward_loss(torch.randn(4, 3, 2), mask)
    with pytest.raises(LossplugError, match="give either values"):
        pairwise_reward_loss(values, mask, chosen_values=values)
    with pytest.raises(LossplugError, match="give either values"):
        pairwise_reward_loss()
    with pytest.raises(LossplugError, match="rejected_mask: is required"):
        pairwise_reward_loss(chosen_values=values, chosen_mask=mask, rejected_values=values)
    with pytest.raises(LossplugError, match="rejected_values: must have one row per chosen row: 4 chosen, 2 rejected"):
        pairwise_reward_loss(chosen_values=values, chosen_mask=mask, rejected_values=values[:2], rejected_mask=mask[:2])
    bad = values.clone()
    bad[3, 2] = float("inf")
    with pytest.raises(
        LossplugError, match=r"values: the score at the last non-padding token must be finite — row \[3\]"
    ):
        pairwise_reward_loss(bad, mask)
    with pytest.raises(LossplugError, match="num_pairs: the global population"):
        pairwise_reward_loss(values, mask, num_pairs=1)
    with pytest.raises(LossplugError, match="needs at least one preference pair"):
        pairwise_reward_loss(values[:0], mask[:0])
    bad_mid = values.clone()
    bad_mid[0, 0] = float("nan")  # not the last token: fine
    assert math.isfinite(pairwise_reward_loss(bad_mid, mask).loss.item())

"""The ``zero_variance`` filter against verl 0.9.1: filtering equals dropping the rows before verl's own advantage and
loss (issue 28, "Done when"), under ``token-mean`` and ``seq-mean-token-mean``.

Path A, lossplug: ``estimate_advantages(batch, recipe)`` with ``filters: [zero_variance]`` narrows the action mask
(the zero-variance groups' rows keep their place, with no action token and advantage 0); then, as the verl adapter
does (``adapters/verl/policy_loss.compute_policy_loss_lossplug``), the rows without an action token are left out
(``ActionRows``), the step's population comes from ``verl_normalizer(global_batch_info, mask)`` and the loss is
multiplied by ``dp_size``. The counts handed in are those of the filtered batch: what verl's engine counts when the
rows are gone (``batch_num_tokens``: the loss mask's tokens; ``global_batch_size``: the responses). Inside verl's
trainer, where the filtered rows stay in the batch, verl hands the adapter ``global_batch_size = ppo_mini_batch_size ×
rollout.n``, which still counts them: there the sequence-normalised modes need the adapter to count the responses
left (``token-mean``'s ``batch_num_tokens`` comes from the narrowed loss mask and is right as it is).

Path B, verl: DAPO's rule drops the groups first (``keep ⇔ np.std(scores) > 0 or len == 1``, scores the responses'
summed token rewards — verl 0.9.1 ``verl/trainer/ppo/v1/replay_buffer.py`` ``_dapo_filtered_keys`` and the DAPO
recipe's ``filter_groups``), then ``core_algos.compute_grpo_outcome_advantage`` on the kept rows, then
``compute_policy_loss_vanilla`` (which aggregates with ``agg_loss``).

The recipe is what ``verl_equivalent`` writes for verl's defaults: ``vanilla`` (``ppo_clip`` 0.2 / 0.2, dual clip 3,
log-ratio clamp 20) with ``loss_agg_mode`` → ``token`` / ``response``, and ``adv_estimator: grpo`` with
``norm_adv_by_std_in_grpo: true`` → ``grpo`` (sample std, ``/(std + 1e-6)``). The batch: six prompt groups of four
(three with all-equal rewards: 1, 0 and 0.25) and one group of one (kept by verl's rule; its reward is 0, where
lossplug's ``grpo`` and verl's agree — verl gives a singleton ``R / (1 + 1e-6)``, lossplug 0, a documented
difference of the advantage, not of the filter), rows scattered, of different lengths with a masked token inside
some, three masked prompt columns in front (junk log-probs there) that verl's response-only tensors do not have.

verl's ``response_mask`` is int64, as in its trainer (``compute_response_mask``): ``seq-mean-token-mean``'s
``/ (|o_i| + 1e-8)`` then adds 1e-8 to an int64 count in float32, where it vanishes — verl divides by the exact
count, as lossplug does.

Measured by these comparisons (CPU, torch 2.13, float64; seeds 0–5, both reward layouts, both splits, both dp
sizes): the kept rows' advantages are within 1.1e-16 of verl's; the loss within 1.7e-15 relative of verl's (2.5e-15
for the micro-batches' sum: the sums run in another order); the gradient w.r.t. the log-probs bit-identical. ``TOL``
allows 1e-13 relative.

Also here: gradient accumulation and data parallelism (two micro-batches, one of which holds only dropped rows and is
skipped as the adapter skips it), every group dropped, singletons, token rewards, the metric, and that the filter
runs ``lossplug.tools.dynamic_sampling.mixed_group_rows`` (``keep_mixed_groups``' rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import lossplug
from lossplug import PolicyBatch
from lossplug.adapters.common import ActionRows, zero_loss
from lossplug.peers import LOCAL
from lossplug.pipeline import join_peers
from lossplug.tools import dynamic_sampling

pytest.importorskip("verl")

from verl.trainer.ppo import core_algos
from verl.workers.config.actor import ActorConfig

from lossplug.adapters.verl.equivalent import LOSS_AGG_REDUCTIONS, verl_equivalent
from lossplug.adapters.verl.equivalent.advantages import advantage_stage
from lossplug.adapters.verl.policy_loss import verl_normalizer
from lossplug.plugins.filters import zero_variance as zero_variance_module

PROMPT, RESPONSE = 3, 8
T = PROMPT + RESPONSE
#: per group, its rewards (groups 1, 3 and 5 have none of the variance GRPO learns from); the last group is a singleton
GROUP_REWARDS = [
    [1.0, 0.0, 0.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
    [0.5, 0.2, 0.9, 0.2],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 1.0],
    [0.25, 0.25, 0.25, 0.25],
    [0.0],
]
MODES = ["token-mean", "seq-mean-token-mean"]
#: float64; measured ≤ 1.1e-16 (advantages), ≤ 2.5e-15 relative (losses), 0 (gradients): see the module docstring
ADV_TOL = dict(rtol=1e-13, atol=1e-15)
TOL = dict(rtol=1e-13, atol=1e-15)


@dataclass(frozen=True)
class Rollout:
    """One rollout batch in both layouts: lossplug's (prompt + response columns) and verl's (response columns)."""

    logp: torch.Tensor  # [B, T], junk in the prompt columns
    old_logp: torch.Tensor
    action_mask: torch.Tensor  # [B, T] bool, False on the prompt columns
    score: torch.Tensor  # [B]
    token_reward: torch.Tensor  # [B, T]: the score on each response's last action token
    group_id: torch.Tensor  # [B] int, scattered, not 0..G-1

    @property
    def B(self) -> int:
        return self.logp.shape[0]

    def policy_batch(self, reward_layout: str, **over: Any) -> PolicyBatch:
        reward = self.score if reward_layout == "sequence" else self.token_reward
        fields = dict(
            logp=self.logp,
            old_logp=self.old_logp,
            action_mask=self.action_mask,
            reward=reward,
            group_id=self.group_id,
        )
        return PolicyBatch(**{**fields, **over})

    # verl's tensors: the response columns only
    def verl_response_mask(self) -> torch.Tensor:
        return self.action_mask[:, PROMPT:].to(torch.int64)

    def verl_token_rewards(self) -> torch.Tensor:
        return self.token_reward[:, PROMPT:]

    def verl_uid(self) -> np.ndarray:
        return np.array([f"prompt-{int(g)}" for g in self.group_id], dtype=object)


def rollout(group_rewards: list[list[float]] = GROUP_REWARDS, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    scores = [r for rewards in group_rewards for r in rewards]
    ids = [7 * k + 3 for k, rewards in enumerate(group_rewards) for _ in rewards]
    B = len(scores)
    order = torch.randperm(B, generator=g)  # the groups' rows scattered through the batch
    score = torch.tensor(scores, dtype=torch.float64)[order]
    group_id = torch.tensor(ids)[order]
    length = torch.randint(1, RESPONSE + 1, (B,), generator=g)
    response = torch.arange(RESPONSE) < length.unsqueeze(-1)
    hole = (torch.rand(B, RESPONSE, generator=g) < 0.2) & (torch.arange(RESPONSE) > 0)
    response &= ~hole | (torch.arange(RESPONSE) == (length - 1).unsqueeze(-1))  # the last token stays an action
    mask = torch.cat([torch.zeros(B, PROMPT, dtype=torch.bool), response], dim=1)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.05)
    delta = (torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5).clamp(-1.5, 1.5)
    logp = (old + delta).clamp(max=-1e-4)
    logp[:, :PROMPT] = -40.0 - torch.rand(B, PROMPT, generator=g, dtype=torch.float64)  # junk, masked
    last = PROMPT + length - 1
    token_reward = torch.zeros(B, T, dtype=torch.float64)
    token_reward[torch.arange(B), last] = score
    return Rollout(logp, old, mask, score, token_reward, group_id)


def recipe(loss_agg_mode: str, **filter_params: Any) -> lossplug.Recipe:
    """verl's defaults as ``verl_equivalent`` writes them (actor: vanilla; algorithm: grpo), plus the filter."""
    actor = verl_equivalent(actor_config={"loss_agg_mode": loss_agg_mode})
    assert actor.reduction.name == LOSS_AGG_REDUCTIONS[loss_agg_mode]
    return lossplug.Recipe.load(
        {
            "filters": [{"name": "zero_variance", **filter_params}],
            "advantage": advantage_stage({"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True}),
            "gates": [gate.model_dump(exclude_none=True) for gate in actor.gates],
            "reduction": actor.reduction.model_dump(exclude_none=True),
        }
    )


def verl_config(**global_batch_info: Any) -> ActorConfig:
    config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4)
    config.global_batch_info.update(global_batch_info)
    return config


def dapo_kept_rows(scores: torch.Tensor, uid: np.ndarray) -> list[int]:
    """verl's rule, as its DAPO trainer writes it: keep a prompt's trajectories iff ``np.std`` of their scores is
    > 0 or the prompt has one trajectory."""
    by_uid: dict[str, list[float]] = {}
    for u, s in zip(uid, scores.tolist(), strict=True):
        by_uid.setdefault(u, []).append(s)
    kept = {u for u, vals in by_uid.items() if np.std(vals) > 0 or len(vals) == 1}
    return [i for i, u in enumerate(uid) if u in kept]


@dataclass(frozen=True)
class VerlStep:
    kept: list[int]
    advantages: torch.Tensor  # [kept, RESPONSE]
    loss: torch.Tensor
    grad: torch.Tensor  # d loss / d log_prob, [kept, RESPONSE]


def verl_step(r: Rollout, mode: str) -> VerlStep:
    """Path B: drop the zero-variance groups, then verl's own advantage and loss on the rows left."""
    uid = r.verl_uid()
    rewards = r.verl_token_rewards()
    kept = dapo_kept_rows(rewards.sum(-1), uid)
    mask = r.verl_response_mask()[kept]
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards[kept].clone(),
        response_mask=mask,
        index=uid[kept],
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
    )
    log_prob = r.logp[kept][:, PROMPT:].clone().requires_grad_()
    config = verl_config(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(kept))
    loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=r.old_logp[kept][:, PROMPT:],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
    )
    loss.backward()
    assert log_prob.grad is not None
    return VerlStep(kept, advantages, loss.detach(), log_prob.grad)


def adapter_loss(
    rec: lossplug.Recipe,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantage: torch.Tensor,
    action_mask: torch.Tensor,
    info: dict[str, int],
) -> torch.Tensor:
    """What the verl adapter does with one micro-batch: rows without an action token left out (a micro-batch with
    none gives a zero loss and joins its peers), the step's population from ``global_batch_info``, × dp_size."""
    rows = ActionRows(action_mask)
    if rows.none:
        join_peers(rec, LOCAL, logp)
        return zero_loss(logp, action_mask)
    normalizer, dp_size = verl_normalizer(info, rows.take(action_mask))
    batch = PolicyBatch(
        logp=rows.take(logp),
        old_logp=rows.take(old_logp),
        advantage=rows.take(advantage),
        action_mask=rows.take(action_mask),
    )
    return lossplug.policy_loss(batch, rec, normalizer).loss * dp_size


# ---------------------------------------------------------------------------------------------------------------------
# Filtering equals dropping the rows before verl's advantage and loss


@pytest.mark.parametrize("reward_layout", ["sequence", "token"])
@pytest.mark.parametrize("mode", MODES)
def test_filtering_equals_dropping_the_rows_before_verls_advantage_and_loss(mode, reward_layout):
    r = rollout()
    rec = recipe(mode)
    res = lossplug.estimate_advantages(r.policy_batch(reward_layout), rec)
    verl = verl_step(r, mode)

    kept = torch.zeros(r.B, dtype=torch.bool)
    kept[verl.kept] = True
    assert 0 < int(kept.sum()) < r.B  # the batch has groups of both kinds
    assert res.action_mask is not None
    # kept rows: their mask as it was, their advantage verl's; dropped rows: no action token, advantage exactly 0
    assert torch.equal(res.action_mask[kept], r.action_mask[kept])
    assert not bool(res.action_mask[~kept].any())
    assert torch.equal(res.advantage[~kept], torch.zeros(int((~kept).sum()), dtype=torch.float64))
    verl_adv = verl.advantages.sum(-1) / r.verl_response_mask()[verl.kept].sum(-1)  # [B, T] constant per response
    torch.testing.assert_close(res.advantage[kept], verl_adv, **ADV_TOL)

    logp = r.logp.clone().requires_grad_()
    info = dict(dp_size=1, batch_num_tokens=int(res.action_mask.sum()), global_batch_size=int(kept.sum()))
    loss = adapter_loss(rec, logp, r.old_logp, res.advantage, res.action_mask, info)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(loss.detach(), verl.loss, **TOL)
    torch.testing.assert_close(logp.grad[kept][:, PROMPT:], verl.grad, **TOL)
    assert bool(verl.grad.abs().sum() > 0)
    assert not bool(logp.grad[~kept].any())  # the dropped rows learn nothing
    assert not bool(logp.grad[:, :PROMPT].any())


def test_without_the_filter_the_zero_variance_groups_dilute_the_loss():
    """The comparison above can fail: keeping the zero-variance rows (advantage 0, tokens counted) gives another
    loss under both reductions — so the equality is the filter's doing."""
    r = rollout()
    for mode in MODES:
        plain = lossplug.Recipe.load({**recipe(mode).model_dump(exclude_none=True), "filters": []})
        res = lossplug.estimate_advantages(r.policy_batch("sequence"), plain)
        info = dict(dp_size=1, batch_num_tokens=int(r.action_mask.sum()), global_batch_size=r.B)
        loss = adapter_loss(plain, r.logp, r.old_logp, res.advantage, r.action_mask, info)
        verl = verl_step(r, mode)
        ratio = float(loss / verl.loss)
        assert 0.2 < ratio < 0.9, (mode, ratio)


# ---------------------------------------------------------------------------------------------------------------------
# Gradient accumulation and data parallelism


def micro_batches(r: Rollout, kept: torch.Tensor, split: str) -> list[torch.Tensor]:
    """Two micro-batches of row indices: ``dropped_first`` puts every dropped row in the first (which then has no
    action token at all); ``halves`` splits the scattered batch in two."""
    if split == "dropped_first":
        return [torch.nonzero(~kept).squeeze(-1), torch.nonzero(kept).squeeze(-1)]
    rows = torch.arange(r.B)
    return [rows[: r.B // 2], rows[r.B // 2 :]]


@pytest.mark.parametrize("dp_size", [1, 2], ids=["accumulation", "data_parallel"])
@pytest.mark.parametrize("split", ["dropped_first", "halves"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_the_step_population_add_up_to_the_dropped_batch(mode, split, dp_size):
    """Two micro-batches (accumulated on one rank, or one on each of two ranks whose gradients verl averages), each
    reduced over the filtered step's population: their losses add up to verl's loss of the batch without the
    dropped rows, their gradients are verl's, and each micro-batch that holds kept rows equals verl's loss of those
    rows (``agg_loss`` with the same ``global_batch_info``). A micro-batch of dropped rows only is skipped: zero
    loss, zero gradient, no collective left waiting."""
    r = rollout(seed=1)
    rec = recipe(mode)
    res = lossplug.estimate_advantages(r.policy_batch("sequence"), rec)
    assert res.action_mask is not None
    full = verl_step(r, mode)
    kept = torch.zeros(r.B, dtype=torch.bool)
    kept[full.kept] = True
    info = dict(dp_size=dp_size, batch_num_tokens=int(res.action_mask.sum()), global_batch_size=int(kept.sum()))
    verl_mask = r.verl_response_mask()

    total = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(r.logp)
    parts = micro_batches(r, kept, split)
    assert all(len(p) for p in parts)
    for part in parts:
        logp = r.logp[part].clone().requires_grad_()
        loss = adapter_loss(rec, logp, r.old_logp[part], res.advantage[part], res.action_mask[part], info)
        loss.backward()
        assert logp.grad is not None
        total, grad[part] = total + loss.detach() / dp_size, logp.grad / dp_size  # verl averages the ranks' grads
        own = part[kept[part]]  # the rows of this micro-batch verl would have, dropping the others first
        if len(own) == 0:
            assert float(loss.detach()) == 0.0 and not bool(logp.grad.any())
            continue
        where = [full.kept.index(int(i)) for i in own]  # verl's advantages of these rows, from the full step
        verl_log_prob = r.logp[own][:, PROMPT:].clone().requires_grad_()
        verl_loss, _ = core_algos.compute_policy_loss_vanilla(
            old_log_prob=r.old_logp[own][:, PROMPT:],
            log_prob=verl_log_prob,
            advantages=full.advantages[where],
            response_mask=verl_mask[own],
            loss_agg_mode=mode,
            config=verl_config(**info),
        )
        torch.testing.assert_close(loss.detach(), verl_loss.detach(), **TOL)
    if split == "dropped_first":
        assert not bool(res.action_mask[parts[0]].any())  # the first micro-batch is all dropped rows
    torch.testing.assert_close(total, full.loss, **TOL)
    torch.testing.assert_close(grad[kept][:, PROMPT:], full.grad, **TOL)
    assert not bool(grad[~kept].any())


# ---------------------------------------------------------------------------------------------------------------------
# Edge cases


def test_every_group_without_variance_drops_every_row_without_an_error():
    r = rollout([[1.0] * 4, [0.0] * 4, [0.5] * 4])
    res = lossplug.estimate_advantages(r.policy_batch("sequence"), recipe("token-mean"))
    assert res.action_mask is not None
    assert not bool(res.action_mask.any())
    assert torch.equal(res.advantage, torch.zeros(r.B, dtype=torch.float64))
    assert float(res.metric_tensors["filter/zero_variance/dropped_responses"]) == 1.0
    assert float(res.metric_tensors["filter/zero_variance/dropped_tokens"]) == 1.0
    assert dapo_kept_rows(r.score, r.verl_uid()) == []  # verl drops them all too
    # the adapter's micro-batch of such rows: a zero loss whose gradient is zero, the graph still connected
    logp = r.logp.clone().requires_grad_()
    loss = adapter_loss(recipe("token-mean"), logp, r.old_logp, res.advantage, res.action_mask, {})
    loss.backward()
    assert float(loss.detach()) == 0.0 and logp.grad is not None and not bool(logp.grad.any())


def test_a_singleton_group_is_kept_as_verl_keeps_it_unless_drop_singletons():
    r = rollout([[1.0, 0.0, 1.0, 1.0], [1.0] * 4, [3.0]])
    singleton = r.score == 3.0
    assert dapo_kept_rows(r.score, r.verl_uid()) == torch.nonzero(r.group_id != 10).squeeze(-1).tolist()
    kept = lossplug.estimate_advantages(r.policy_batch("sequence"), recipe("token-mean")).action_mask
    assert kept is not None
    assert torch.equal(kept[singleton], r.action_mask[singleton])
    dropped = lossplug.estimate_advantages(
        r.policy_batch("sequence"), recipe("token-mean", drop_singletons=True)
    ).action_mask
    assert dropped is not None
    assert not bool(dropped[singleton].any())
    assert torch.equal(dropped[~singleton], kept[~singleton])  # the other groups are decided as before


def test_a_token_reward_is_summed_over_the_response_before_the_test():
    """Group 0's responses spread their reward over their tokens differently but sum to the same 1.0: dropped.
    Group 1's token rewards are all 0.5 but the responses' sums differ: kept. The same as the ``[B]`` sums."""
    B, T_ = 8, 4
    mask = torch.ones(B, T_, dtype=torch.bool)
    mask[1, 2:] = mask[5, 1:] = False
    token = torch.zeros(B, T_, dtype=torch.float64)
    token[0, 3] = token[2, 0] = token[3, 1] = 1.0  # group 0: each row sums to 1.0, on different tokens
    token[1, 0] = token[1, 1] = 0.5
    token[4:] = torch.where(mask[4:], 0.5, 0.0)  # group 1: 2.0, 0.5, 2.0, 2.0
    group_id = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    g = torch.Generator().manual_seed(3)
    fields = dict(
        logp=-torch.rand(B, T_, generator=g, dtype=torch.float64),
        old_logp=-torch.rand(B, T_, generator=g, dtype=torch.float64),
        action_mask=mask,
        group_id=group_id,
    )
    rec = recipe("token-mean")
    by_token = lossplug.estimate_advantages(PolicyBatch(**fields, reward=token), rec).action_mask
    by_sum = lossplug.estimate_advantages(PolicyBatch(**fields, reward=token.sum(-1)), rec).action_mask
    assert by_token is not None and by_sum is not None
    assert torch.equal(by_token, by_sum)
    assert not bool(by_token[:4].any())
    assert torch.equal(by_token[4:], mask[4:])


def test_the_dropped_responses_metric_is_the_share_of_rows_dropped():
    r = rollout()
    res = lossplug.estimate_advantages(r.policy_batch("sequence"), recipe("token-mean"))
    assert res.action_mask is not None
    dropped_rows = ~res.action_mask.any(-1)
    assert float(res.metric_tensors["filter/zero_variance/dropped_responses"]) == pytest.approx(
        int(dropped_rows.sum()) / r.B, rel=1e-6
    )  # (a float32 metric)
    assert int(dropped_rows.sum()) == 12  # groups 1, 3 and 5
    dropped_tokens = 1 - int(res.action_mask.sum()) / int(r.action_mask.sum())
    assert float(res.metric_tensors["filter/zero_variance/dropped_tokens"]) == pytest.approx(dropped_tokens, rel=1e-6)


def test_the_filter_runs_the_dynamic_sampling_rule(monkeypatch):
    """One implementation: the filter's groups test is ``lossplug.tools.dynamic_sampling.mixed_group_rows``, the
    rule of ``keep_mixed_groups`` without its cost report."""
    assert zero_variance_module.mixed_group_rows is dynamic_sampling.mixed_group_rows
    calls = []

    def spy(*args, **kwargs):
        out = dynamic_sampling.mixed_group_rows(*args, **kwargs)
        calls.append((args, out))
        assert torch.equal(out, dynamic_sampling.keep_mixed_groups(*args, validate=False).keep)
        return out

    monkeypatch.setattr(zero_variance_module, "mixed_group_rows", spy)
    r = rollout()
    res = lossplug.estimate_advantages(r.policy_batch("sequence"), recipe("token-mean"))
    assert len(calls) == 1
    (score, group_id), keep = calls[0]
    assert torch.equal(score, r.score) and torch.equal(group_id, r.group_id)
    assert res.action_mask is not None
    singleton = r.group_id == 7 * 6 + 3
    assert torch.equal(res.action_mask.any(-1), keep | singleton)  # keep_mixed_groups drops singletons; verl does not


def test_equal_rewards_are_dropped_even_where_numpys_std_rounds_above_zero():
    """The one place verl's rule and the filter part: three rewards of 0.1 have ``np.std`` ≈ 1.4e-17 (their float
    mean is not exactly 0.1), so verl's ``std > 0`` keeps the group — with advantages of rounding noise
    (``~1e-17 / (std + 1e-6)``); the filter tests exact equality and drops it, as DAPO means."""
    assert np.std([0.1, 0.1, 0.1]) > 0
    r = rollout([[0.1, 0.1, 0.1], [0.0, 1.0, 1.0]])
    res = lossplug.estimate_advantages(r.policy_batch("sequence"), recipe("token-mean"))
    assert res.action_mask is not None
    assert torch.equal(res.action_mask.any(-1), r.score != 0.1)
    assert len(dapo_kept_rows(r.score, r.verl_uid())) == r.B  # verl keeps both groups

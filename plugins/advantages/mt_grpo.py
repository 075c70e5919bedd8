"""MT-GRPO (arXiv:2505.11821; SiliangZeng/Multi-Turn-RL-Agent): A = Â_O + λ·Â_T on the first turn, Â_O on the
later turns, Â_C on a one-turn row, each Â a reward normalised in the prompt group::

    A_i,t = Â_O,i + λ·Â_T,i   on the action tokens of row i's first turn, when the row has at least two turns
    A_i,t = Â_O,i             on the action tokens of its later turns
    A_i,t = Â_C,i             on every action token of a row of one turn                       (0 off the actions)
    Â_X,i = (R_X,i − mean_g(R_X)) / (std_g(R_X) + eps)   over the rows of i's group g, for X = T, O, C

A **turn** is a maximal run of consecutive action tokens of a row (the observation tokens the environment answered
with lie between them, masked out), as in ``agentic_reinforce`` (:func:`.agentic_reinforce.turns_after`). The
fields are the ones a multi-turn batch has: ``reward`` as token rewards ``[B, T]`` with each turn's reward on its
tokens (by convention its last action token; a turn's reward is the sum over its tokens), ``action_mask`` and
``group_id``. A per-row ``reward`` ``[B]`` is read as the outcome on the row's last action token: no turn has a
reward of its own, ``Â_T`` is 0, and the advantage is GRPO's (``(R − mean) / (std + eps)`` on every action token),
which is also what a batch of one-turn rows gets. From the fields, per row::

    R_T = the reward of the first turn, when a later turn follows it; else 0     (the turn-level reward)
    R_O = the reward of every other turn                                        (the outcome reward)
    R_C = R_T + R_O, the row's whole reward                                     (the reference's combined reward)

How the reference computes it, and how this plugin reads it: ``MTGRPOEnvTrainer`` scores every completion twice,
with turn-level reward functions (tool execution, the answer in the search results) and outcome ones (exact match,
format), normalises the two sums and their total (``combined``) in the group by ``_compute_normalized_advantages``
— ``(r − mean) / (std + 1e-4)``, torch's sample std, so this plugin's ``eps`` defaults to ``1e-4`` — and then
(``_assign_advantages``) gives every token of a completion the outcome advantage plus ``turn_advantage_coef`` (λ,
default 1) times the turn advantage on the tokens before the first tool result (the first turn), or, when the
completion holds no tool result, the combined advantage everywhere. The turn rewards of a completion that never
called a tool are 0 there (``tool_execution_reward_func`` gives 0 without a tool attempt, and there are no search
results to hold the answer), which is why a one-turn row here has ``R_T = 0`` and its whole reward as ``R_O``: a
trajectory handed to the environment once is the paper's two-turn case (tool call, then answer). Two differences:
the reference splits at the first observation that holds a ``<result>`` tag (when the first tool call gets an
answer without one, the turn advantage there covers every turn up to the first result); a batch of tokens cannot
read tags, so the split here is the first observation. And a group of one row (a prompt sampled once) has advantage 0 here,
where the reference's std of one element is NaN; a group whose rewards are all equal gets 0 (the reference's
``0 / (0 + 1e-4)``). Advantages are ``[B, T]``, at least float32, and carry no gradient.

Bias (verl RFC #7244, "a turn-level baseline that stays unbiased under variable turn counts"): the RFC warns that
a baseline assembled per turn index is action-dependent when the policy chooses how many turns to take. MT-GRPO has
that property: whether the first turn calls a tool (hands the turn to the environment) or answers is the policy's
action, and it selects which baseline the first turn's tokens get — ``mean_g(R_O)/(std_g(R_O)+eps) +
λ·mean_g(R_T)/(std_g(R_T)+eps)`` after a tool call, ``mean_g(R_C)/(std_g(R_C)+eps)`` after an answer. The expected
gradient therefore carries a term in the difference of the two baselines on the stop/continue decision (zero only
when they agree). This plugin computes the paper's estimator as its code does, bias included;
``tests/plugins/advantages/test_mt_grpo.py`` exhibits the two baselines. The unbiased variant the RFC proposes is
not implemented here.

In the trainers: verl's ``token_level_rewards`` and ``response_mask`` carry the turns
(``lossplug.adapters.verl.compute_advantage(data, recipe)`` or ``adv_estimator=lossplug``); TRL's advantage seam has
one position per completion, so there every completion is one turn and the advantage is GRPO's with eps 1e-4.

Paper: Zeng, Wei, Brown, Frunza, Nevmyvaka and Hong, 2025, *Reinforcing Multi-Turn Reasoning in LLM Agents via
Turn-Level Credit Assignment*, arXiv:2505.11821 (MT-GRPO).

Reference: SiliangZeng/Multi-Turn-RL-Agent (commit 7dbdd08bdb27810019bc1511dbd0af3c7cfaac7a)
``verifiers/trainers/mt_grpo_env_trainer.py`` (``_find_result_positions``, ``_assign_advantages``, λ
``turn_advantage_coef`` default 1.0), ``verifiers/trainers/grpo_env_trainer.py`` (``_compute_normalized_advantages``,
``combined_reward_funcs`` = turn + outcome functions), ``verifiers/rubrics/tool_rubric.py`` and
``verifiers/rubrics/triviaqa_rubric.py`` (the turn rewards). The reference runs inside a patched TRL trainer and is on
no package index, so the tests' oracle is that code transcribed loop by loop, in float64.

Examples (one group of two rows: a tool call rewarded 0.2, then a right answer rewarded 1; a one-turn answer
rewarded 0):

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.zeros(2, 5), action_mask=torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool),
...     reward=torch.tensor([[0.0, 0.2, 0.0, 1.0, 0.0], [0.0] * 5]), group_id=torch.zeros(2, dtype=torch.long))
>>> recipe = {"advantage": "mt_grpo", "gates": ["ppo_clip"], "reduction": "token"}
>>> adv = lossplug.estimate_advantages(batch, recipe).advantage  # Â_O + Â_T on turn 1, then Â_O; Â_C
>>> [round(v, 4) for v in adv[0].tolist()], [round(v, 4) for v in adv[1].tolist()]
([1.4136, 1.4136, 0.0, 0.707, 0.0], [-0.707, -0.707, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .agentic_reinforce import turns_after

Tensor = torch.Tensor


class MTGRPOParams(lossplug.Params):
    turn_coef: float = Field(
        1.0, ge=0, description="λ: the turn advantage's weight on the first turn (reference: turn_advantage_coef, 1)"
    )
    eps: float = Field(1e-4, ge=0, description="added to the group's sample std (reference: 1e-4)")


def _normalised_in_groups(x: Tensor, groups: Groups, eps: float) -> Tensor:
    """``(x − mean_g) / (sample std_g + eps)`` per row; 0 for a group of equal values or of one row."""
    centred = x - groups.mean(x)[groups.inverse]
    denom = groups.std(x, unbiased=True)[groups.inverse] + eps  # NaN for a row alone
    adv = torch.where(denom > 0, centred / denom, torch.zeros_like(centred))
    return torch.where(groups.constant(x)[groups.inverse], torch.zeros_like(adv), adv)


def _later_action(mask: Tensor) -> Tensor:
    """``[B, T]``: whether an action token of the row follows the position."""
    return mask.flip(-1).cumsum(-1).flip(-1) - mask.to(torch.long) > 0


@lossplug.advantage("mt_grpo", params=MTGRPOParams, requires=("reward", "group_id"))
def mt_grpo(batch: lossplug.PolicyBatch, p: MTGRPOParams) -> Tensor:
    """MT-GRPO: A = Â_O + λ·Â_T on the first turn, Â_O on later turns, Â_C on a one-turn row (group-normalised).

    Paper: Zeng et al., 2025, arXiv:2505.11821 (MT-GRPO).

    Reference: SiliangZeng/Multi-Turn-RL-Agent ``verifiers/trainers/mt_grpo_env_trainer.py`` (``_assign_advantages``).
    """
    reward = at_least_float32(cast(Tensor, batch.reward))  # required
    mask = batch.action_mask
    if reward.ndim == 1:  # one score per row: the outcome, on the row's last action token (no turn reward)
        reward = torch.where(mask & ~_later_action(mask), reward.unsqueeze(-1), 0)
    after = turns_after(mask)  # on a token of turn k of a row of K turns: K − 1 − k
    turns = torch.where(mask, after + 1, torch.zeros_like(after)).amax(-1)  # K per row
    first_turn = mask & (after == (turns - 1).unsqueeze(-1))
    several = turns >= 2
    on_actions = torch.where(mask, reward, torch.zeros_like(reward))
    total = on_actions.sum(-1)
    turn_reward = torch.where(several, torch.where(first_turn, on_actions, 0).sum(-1), torch.zeros_like(total))
    outcome_reward = total - turn_reward

    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    a_turn = _normalised_in_groups(turn_reward, groups, p.eps)
    a_outcome = _normalised_in_groups(outcome_reward, groups, p.eps)
    a_combined = _normalised_in_groups(total, groups, p.eps)

    split = a_outcome.unsqueeze(-1) + p.turn_coef * a_turn.unsqueeze(-1) * first_turn
    adv = torch.where(several.unsqueeze(-1), split, a_combined.unsqueeze(-1))
    return torch.where(mask, adv, torch.zeros_like(adv))

"""IGPO (arXiv:2510.14967; GuoqingWang1/IGPO at fork debajoycs98/IGPO commit 745078b5): every turn reward of the group
z-normalised together, then summed over the turn and the later turns of its row, discounted by γ per turn::

    r̂_i,k = (r_i,k − mean_g) / (std_g + eps)     for each rewarded turn k of row i in group g (0 for an unrewarded one)
    A_i,t = Σ_{j ≥ k(t)} γ^{j − k(t)} · r̂_i,j    on the action tokens of turn k(t) of row i               (0 off them)
    mean_g, std_g: the mean and the population std (``sqrt(var + 1e-8)``; 1 for a population of one) of the
    rewarded turns of every row of the group — all turns of the group together (``norm: joint``, the paper's and the
    code's default), or the outcomes and the information gains each among themselves (``norm: separate``)

A **turn** is a maximal run of consecutive action tokens of a row, the observation tokens the environment answered
with between them masked out — the segmentation of ``agentic_reinforce`` and ``mt_grpo``
(:func:`.agentic_reinforce.turns_after`). ``reward`` is the token rewards ``[B, T]`` with each turn's reward on its
tokens (by convention its last action token; a turn's reward is the sum over its action tokens): the **last** turn
of a row holds the outcome reward, every earlier turn its information gain. A per-row ``reward`` ``[B]`` is read as
the outcome on the row's last action token (no information gain: GRPO-like, over the group's outcomes).

The turn rewards are the rollout's job, not this plugin's. IGPO's turn reward is the gain, after the turn's
observation, in the policy's probability of the ground-truth answer ``a = (a_1 … a_L)``, which needs a forward pass
of the policy over ``a`` after every turn (the generation loop's work; the reference does it in
``scrl/llm_agent/generation.py``)::

    π_θ(a | q, o_≤k) = exp( (1/L) Σ_j log π_θ(a_j | q, o_≤k, a_<j) )
    r_i,k = π_θ(a | q, o_≤k) − π_θ(a | q, o_≤k−1)                  for the turns k < K_i of row i (paper, eq. 2)
    r_i,K = F1(predicted answer, a)                                  for the last turn (the outcome)

(the code's ``info_gain_type: log_prob_diff`` takes the difference of the mean log-probabilities instead). A rollout
feeding this plugin puts ``r_i,k`` on the last action token of turn ``k`` of row ``i`` in ``reward`` (verl:
``token_level_rewards``) and the outcome on the row's last action token, with ``action_mask`` (verl:
``response_mask``) 0 on the observation tokens, and ``group_id`` (verl: ``uid``) the prompt.

How the reference computes it (``verl/trainer/ppo/core_algos.py`` ``compute_grpo_outcome_advantage`` and
``_compute_turn_level_advantage``), and how this plugin reads it: the outcome is the reward at the row's last mask
position (``f1_mask``) and the information gains are the other mask positions with a nonzero reward (``ig_mask``);
the mean and std are taken over the group's positions of ``f1_mask | ig_mask`` (``joint``) or of each mask alone
(``separate``; ``train.sh`` sets it), population std ``sqrt(var + 1e-8)``, 1 for a population of one, and the
reward becomes ``(r − mean) / (std + 1e-6)`` (``norm_adv_by_std_in_grpo``; ``std: false`` here: ``r − mean``). The
turns are then read off the **nonzero normalised rewards**, each the tokens after the previous one up to it; the
value of each is its normalised reward plus γ times the next one's (``gamma``, verl's ``algorithm.gamma``, 1 by
default), and it is broadcast to the turn's mask positions. Choices kept: a turn whose information gain is exactly 0
is left out of the statistics (normalised to 0, as there); the outcome always counts, 0 or not. Three differences,
where the reference's reading of positions does not hold for a batch of turns: (1) a turn whose normalised reward
is exactly 0 is its own turn here (value ``γ·A_next``); the reference merges it into the next turn (value
``A_next``) — the same at γ = 1; (2) the reference's outcome position is the mask's count minus 1, the last mask
position only when the mask has no observation holes; here it is the last action token; (3) its curriculum weights
(``curriculum_f1_weight``, ``curriculum_ig_weight``: a schedule of the trainer, 1 when off) have no counterpart.
Advantages are ``[B, T]``, at least float32, and carry no gradient.

In the trainers: verl's ``token_level_rewards`` and ``response_mask`` carry the turns
(``lossplug.adapters.verl.compute_advantage(data, recipe)`` or ``adv_estimator=lossplug``); TRL's advantage seam has
one position per completion, so there every completion is one turn (its outcome) and the advantage is
``(R − mean) / (sqrt(var + 1e-8) + 1e-6)`` over the group.

Paper: Wang, Dai, Ye, Gan, Yao, Deng, Wu and Ying, 2025, *Information Gain-based Policy Optimization: A Simple and
Effective Approach for Multi-Turn LLM Agents*, arXiv:2510.14967 (IGPO; ICLR 2026).

Reference: the authors' code, GuoqingWang1/IGPO, as updated on 2026-02-01 (commit
745078b5a35d0b84d3d9184e0f0de05ed04e11ad, held in the fork debajoycs98/IGPO, whose later commits leave the files
below unchanged): ``verl/trainer/ppo/core_algos.py`` (``compute_grpo_outcome_advantage``: ``info_gain_norm_mode``
default ``joint``, ``epsilon`` 1e-6; ``_compute_turn_level_advantage``), ``verl/trainer/ppo/ray_trainer.py``
(``compute_advantage``), ``resources/CHANGELOG_20260201.md``; the rewards' placement in
``verl/utils/reward_score/info_gain.py`` (GuoqingWang1/IGPO commit bff163b72718a8b8f9175ce019ec7114ad6bd59a). The
reference is on no package index, so the tests' oracle is that code transcribed loop by loop, in float64.

Examples (one group of two rows: a search that raised the answer's probability by 0.3, then a right answer
rewarded 1; a direct wrong answer, 0):

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.zeros(2, 5), action_mask=torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool),
...     reward=torch.tensor([[0.0, 0.3, 0.0, 1.0, 0.0], [0.0] * 5]), group_id=torch.zeros(2, dtype=torch.long))
>>> recipe = {"advantage": "igpo", "gates": ["ppo_clip"], "reduction": "token"}
>>> adv = lossplug.estimate_advantages(batch, recipe).advantage  # r 0.3, 1 | 0: mean 0.4333, std 0.4190
>>> [round(v, 4) for v in adv[0].tolist()], [round(v, 4) for v in adv[1].tolist()]
([1.0342, 1.0342, 0.0, 1.3524, 0.0], [-1.0342, -1.0342, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .agentic_reinforce import turns_after

Tensor = torch.Tensor

#: the reference's floor inside the std's square root (``sqrt(var + 1e-8)``)
VAR_FLOOR = 1e-8


class IGPOParams(lossplug.Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount per later turn (reference: algorithm.gamma, 1)")
    norm: Literal["joint", "separate"] = Field(
        "joint",
        description="normalise every turn reward of the group together (joint: the paper and the code's default), "
        "or the outcomes and the information gains each among themselves (separate; the reference's train.sh)",
    )
    std: bool = Field(True, description="divide by the std + eps (reference: norm_adv_by_std_in_grpo, true)")
    eps: float = Field(1e-6, ge=0, description="added to the group's std (reference: epsilon, 1e-6)")


def _normalised(x: Tensor, counted: Tensor, groups: Groups, p: IGPOParams) -> Tensor:
    """``[B, K]``: ``(x − mean_g) / (std_g + eps)`` on the ``counted`` slots, the statistics over the counted slots
    of every row of the group (population std, ``sqrt(var + 1e-8)``, 1 for one slot); 0 elsewhere."""
    w = counted.to(x.dtype)
    count = groups.sum(w.sum(-1))
    mean = groups.sum((x * w).sum(-1)) / count.clamp(min=1)
    centred = x - mean[groups.inverse].unsqueeze(-1)
    var = groups.sum((centred * centred * w).sum(-1)) / count.clamp(min=1)
    std = torch.where(count <= 1, torch.ones_like(var), (var + VAR_FLOOR).sqrt())
    out = centred / (std[groups.inverse].unsqueeze(-1) + p.eps) if p.std else centred
    return torch.where(counted, out, torch.zeros_like(out))


@lossplug.advantage("igpo", params=IGPOParams, requires=("reward", "group_id"))
def igpo(batch: lossplug.PolicyBatch, p: IGPOParams) -> Tensor:
    """IGPO: A = Σ_{later turns} γ^Δ · (r − mean_g) / (std_g + eps), r the turn's information gain or the outcome.

    Paper: Wang et al., 2025, arXiv:2510.14967 (IGPO).

    Reference: GuoqingWang1/IGPO ``verl/trainer/ppo/core_algos.py`` (``compute_grpo_outcome_advantage``).
    """
    reward = at_least_float32(cast(Tensor, batch.reward))  # required
    mask = batch.action_mask
    after = turns_after(mask)  # on a token of turn k of a row of K turns: K − 1 − k
    turns = torch.where(mask, after + 1, torch.zeros_like(after)).amax(-1)  # K per row
    if reward.ndim == 1:  # one score per row: the outcome, on the row's last action token
        reward = torch.where(mask & (after == 0) & ~_later_action(mask), reward.unsqueeze(-1), 0)
    index = torch.where(mask, turns.unsqueeze(-1) - 1 - after, torch.zeros_like(after))  # k(t)
    width = max(int(turns.max()), 1)
    per_turn = torch.zeros(mask.shape[0], width, dtype=reward.dtype, device=reward.device)
    per_turn.scatter_add_(1, index, torch.where(mask, reward, torch.zeros_like(reward)))  # r_i,k summed over turn k
    slot = torch.arange(width, device=mask.device)
    outcome = slot == (turns - 1).unsqueeze(-1)  # the last turn of each row
    gain = (slot < (turns - 1).unsqueeze(-1)) & (per_turn != 0)  # an earlier turn with a reward

    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    if p.norm == "joint":
        normalised = _normalised(per_turn, outcome | gain, groups, p)
    else:
        normalised = _normalised(per_turn, outcome, groups, p) + _normalised(per_turn, gain, groups, p)

    value = torch.zeros_like(normalised)  # A_i,k = r̂_i,k + γ·A_i,k+1, backwards over the turns
    running = torch.zeros_like(normalised[:, 0])
    for k in range(width - 1, -1, -1):
        running = normalised[:, k] + p.gamma * running
        value[:, k] = running
    adv = value.gather(1, index)
    return torch.where(mask, adv, torch.zeros_like(adv))


def _later_action(mask: Tensor) -> Tensor:
    """``[B, T]``: whether an action token of the row follows the position."""
    return mask.flip(-1).cumsum(-1).flip(-1) - mask.to(torch.long) > 0

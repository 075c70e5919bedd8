"""prime-rl's GRPO ``length_penalty`` (``linear``): each response loses a share of its group's pass rate that grows
with its output tokens, input tokens and turns, each relative to the group's largest::

    frac_i  = w_out · out_i / max(max_g out, 1) + w_in · in_i / max(max_g in, 1) + w_turns · turns_i / max(max_g turns, 1)
    R_i    ← R_i − mean_g(R) · frac_i

before the advantage (prime-rl's GRPO then subtracts the group mean of the shaped reward: ``advantage: {name: grpo,
scale: none}``). Every response is penalised, correct or not, by the same pass-rate-scaled amount per unit of
length; a group of equal lengths and turns takes a constant penalty, which the group mean removes.

Reference: PrimeIntellect-ai/prime-rl ``559b44772e471d1538537b8805cc77f3824a5e64``,
``src/prime_rl/orchestrator/algo/grpo.py`` (``GRPOAlgorithm.score_group``) and
``packages/prime-rl-configs/src/prime_rl/configs/algorithm.py`` (``LinearLengthPenaltyConfig``: weights 0.25, 0.1,
0.1; here 0.25, 0, 0.1, for the input term below); no paper. prime-rl computes in float32; this shaper in the reward's dtype (at least float32).

The lengths, from the action mask (one row a whole rollout, as prime-rl's trace): ``out`` its action tokens
(verifiers' ``num_output_tokens``, the model-generated tokens of all turns), ``turns`` its runs of action tokens
(``num_turns``, the sampled turns). prime-rl's ``in`` (``num_total_tokens − num_output_tokens``: the prompt and every
tool or user message) includes the prompt, which the batch does not carry: with ``in_i = P + obs_i``, ``obs`` the
non-action tokens between a row's first and last action (after the last one, a batch has padding), the term is computed where it needs no ``P`` — a group whose
rows have equal ``obs`` (every single-turn group) has ``in_i / max in = 1`` (a prompt of at least one token) — and a
group whose ``obs`` differ is refused, unless ``num_input_tokens_weight`` is 0, its default here. On equal ``obs`` the
term is the constant ``w_in · mean_g(R)``, which changes no group-centred advantage: 0 gives prime-rl's advantages
wherever 0.1 can be computed, and 0.1 prime-rl's shaped reward itself. A per-token reward (verl's) is
summed over the actions for the pass rate and gains the penalty on the last action token, beside the score.

An earlier prime-rl (``039b4009``, ``orchestrator/algo/advantage.py``, ``_efficiency_shaping``) shaped only the
rollouts with the group's top reward, by a bounded efficiency bonus; prime-rl replaced it with this formula.

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.zeros(3, 4), reward=torch.tensor([1.0, 1.0, 0.0]), group_id=torch.tensor([0, 0, 0]),
...     action_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool))
>>> recipe = {"shapers": [{"name": "length_penalty", "num_output_tokens_weight": 0.25}],
...           "advantage": {"name": "grpo", "scale": "none"}, "gates": ["ppo_clip"], "reduction": "token"}
>>> lossplug.estimate_advantages(batch, recipe).reward  # R − (2/3) · (0.25 · out / 4 + 0.1 · turns / 1)
tensor([ 0.8500,  0.7667, -0.1917])
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.contracts.errors import describe_positions
from lossplug.ops import Groups, last_true

Tensor = torch.Tensor


class LengthPenaltyParams(lossplug.Params):
    num_output_tokens_weight: float = Field(
        0.25, ge=0, allow_inf_nan=False, description="weight of the output tokens over the group's max (0 disables)"
    )
    # prime-rl's default is 0.1; 0 here, because the term is known only where it is constant in each group (see the
    # module docstring), where it changes the reward by a constant per group and no group-centred advantage
    num_input_tokens_weight: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="weight of the input tokens (prompt, tool and user messages) over the group's max (prime-rl: "
        "0.1); > 0 needs equal observation tokens within each group",
    )
    num_turns_weight: float = Field(
        0.1, ge=0, allow_inf_nan=False, description="weight of the sampled turns over the group's max (0 disables)"
    )


def _relative(x: Tensor, groups: Groups) -> Tensor:
    """x / max(max_g x, 1), prime-rl's ``x / x.max().clamp(min=1)`` per group."""
    return x / groups.amax(x).clamp(min=1)[groups.inverse]


@lossplug.shaper("length_penalty", params=LengthPenaltyParams, requires=("group_id",))
def length_penalty(inp: lossplug.RolloutInput, p: LengthPenaltyParams) -> lossplug.ShaperOutput:
    """R ← R − mean_group(R) · Σ w · x / max_group(x), x: output tokens, input tokens, turns (prime-rl's linear
    length_penalty)."""
    batch = inp.batch
    reward, group_id, mask = batch.reward, batch.group_id, batch.action_mask
    assert reward is not None and group_id is not None
    trajectory = batch.trajectory_id
    if trajectory is not None and torch.unique(trajectory).numel() < trajectory.numel():
        # prime-rl measures a whole rollout; a row that is one turn of it would be measured alone
        repeated = (trajectory.unsqueeze(0) == trajectory.unsqueeze(1)).sum(0) > 1
        raise lossplug.LossplugError(
            "shapers (length_penalty): a rollout's lengths and turns are measured over its whole trajectory, and "
            f"several rows share a trajectory_id ({describe_positions(repeated)}): give one row per rollout"
        )
    dtype = torch.promote_types(reward.dtype, torch.float32)
    groups = Groups.from_ids(group_id)
    score = (torch.where(mask, reward, 0).sum(-1) if reward.ndim == 2 else reward).to(dtype)
    output = mask.sum(-1).to(dtype)
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    turns = starts.sum(-1).to(dtype)
    # non-action tokens between the first and the last action: the tool and user messages inside the rollout
    span = torch.where(mask.any(-1), last_true(mask) - mask.int().argmax(-1) + 1, 0)
    observed = span - mask.sum(-1)
    uneven = ~groups.constant(observed)
    if p.num_input_tokens_weight > 0 and bool(uneven.any()):
        rows = uneven[groups.inverse]
        raise lossplug.LossplugError(
            "shapers (length_penalty): num_input_tokens_weight > 0 needs each rollout's input tokens, prompt "
            "included, which the batch does not carry; they are known only where a group's rollouts have equal "
            f"observation tokens, and these differ within the groups of {describe_positions(rows)}: set "
            "num_input_tokens_weight: 0, or give these rollouts equal observations"
        )
    # equal observations within the group: in_i = P + obs is the group's max, and its ratio 1 (P ≥ 1)
    inputs = torch.ones_like(output)
    fraction = (
        p.num_output_tokens_weight * _relative(output, groups)
        + p.num_input_tokens_weight * inputs
        + p.num_turns_weight * _relative(turns, groups)
    )
    penalty = groups.mean(score)[groups.inverse] * fraction
    if reward.ndim == 1:
        shaped = (score - penalty).to(reward.dtype)
    else:  # on the last action token, beside the score
        on_last = torch.where(mask.any(-1), -penalty, 0).to(reward.dtype)  # a row with no action has no last one
        shaped = reward.scatter_add(-1, last_true(mask).unsqueeze(-1), on_last.unsqueeze(-1))
    return lossplug.ShaperOutput(reward=shaped, metrics={"penalty": lambda: penalty.mean()})

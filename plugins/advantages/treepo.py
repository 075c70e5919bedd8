"""TreePO's tree advantage: A_i = whiten(mean over the subgroups S ∋ i of (R_i − mean_S R)), the subgroups being the
prompt group and every node of the sampling tree on row i's path that more than one leaf shares.

Paper: Li et al., 2025, *TreePO: Bridging the Gap of Policy Optimization and Efficacy and Inference Efficiency with
Heuristic Tree-based Modeling*, arXiv:2508.17445 (§ tree-based advantage estimation, Figure 3).

Reference: multimodal-art-projection/TreePO at f05552394e734ea2838cf9e3b8191f5093319dcf,
``verl/trainer/ppo/core_algos.py`` ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage`` (called for
``adv_estimator=tree_reinforce_plus_plus_baseline``, ``verl/trainer/ppo/ray_trainer.py``), run by
``recipe/treepo/run_treepo_train.sh`` with ``adv_weight_strategy="average"`` and ``subtree_std_ds=False``.

The rows are the tree's leaves (complete responses) and ``group_id`` its prompt. ``segment_id`` ``[B, T]`` names
the tree node (a segment of the rollout) each action token belongs to: a prefix several rows share carries the same
ids in each of them. A row's path is the sequence of its segment ids in order over its action tokens; a node's
subgroup is every row of the same ``group_id`` whose path contains it. For each row ``i`` with score ``R_i``::

    terms_i = [R_i − mean_g R]                         the prompt group g (a group of one: R_i, verl's mean 0)
            + [R_i − mean_S R  for S on i's path with |S| > 1]
    a_i     = mean(terms_i)                            weighting "average" (the recipe's)
            | Σ_S |S|·term_S / Σ_S |S|                weighting "group_size" (the code's default)
    A_i     = whiten(a_i)                              verl's masked_whiten over every action token of the batch

TreePO's code keys the subgroups by a uid cut at each ``#`` (``…#bd`` for depth d below the tree's deepest leaf); a
segment id here is that node, and ``R_i − mean_S R`` is skipped for a subgroup of one in both. ``first_subgroup``:
the paper's Figure 3 counts the query's group (q) first, and so does the code's comment ("depth==0 … root node"),
but its trainer (``ray_trainer.py``, ``tree_subgroup_opt``) builds the uid as ``prompt_uid + "#".join(b1, b2, …)``,
with no ``#`` after the prompt, so its depth-0 subgroup is the first segment's node: ``"prompt"`` (default) is the
paper's, ``"first_segment"`` the released run's (that node's term always counted, ``R_i`` when it holds one row; the
prompt group never enters). A node that does not branch gives a subgroup equal to its child's, counted twice, as in the
code. ``skip_constant_subgroups`` is its ``subtree_std_ds`` (``remove_no_std_subgroup``): below the prompt, a
subgroup whose scores are all equal adds no term (the code tests ``torch.std == 0.0``; here the scores' equality,
which is the same up to the rounding of a float mean). The score is the row's reward (a ``[B, T]`` reward is summed
over the action tokens, as the code sums ``token_level_rewards``). TreeRL (arXiv:2506.11902) was not chosen: its
public code (THUDM/TreeRL ``openrlhf/trainer/ppo_utils/tree_node.py``) normalises leaves leave-one-out and then steps
by a token-weighted mean, departing from the paper's ``(G_A + L_A)/√|L(s)|``, so neither is a single specification.

Segment ids are read on the action positions only and need only be unique within a group. A row must visit each of
its segments in one run, and every row containing a node must reach it through the same parent (the segment before
it), else the batch is refused naming the rows and positions. The advantage is ``[B]`` (one per response) and carries
no gradient. Cost: one pass over each row's action tokens on the host, then ``[nodes, B]`` incidence sums.

Examples:

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(                      # rows 0, 1 share segment 1; rows 2, 3 share segment 2
...     logp=torch.zeros(4, 2), action_mask=torch.ones(4, 2, dtype=torch.bool),
...     reward=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_id=torch.zeros(4, dtype=torch.long),
...     segment_id=torch.tensor([[1, 3], [1, 4], [2, 5], [2, 6]]))
>>> recipe = {"advantage": {"name": "treepo", "whiten": False}, "gates": ["ppo_clip"], "reduction": "token"}
>>> lossplug.estimate_advantages(batch, recipe).advantage.tolist()  # row 0: mean(1 − 0.25, 1 − 0.5)
[0.625, -0.375, -0.125, -0.125]
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32, center_rows, group_mean_or_zero, whiten_rows
from .gae import Whiten
from .group_relative import sequence_scores
from .reinforce_plus_plus import WHITEN_DESCRIPTION

Tensor = torch.Tensor


class TreePOParams(lossplug.Params):
    first_subgroup: Literal["prompt", "first_segment"] = Field(
        "prompt",
        description="prompt: the query's group first (the paper's Figure 3); first_segment: the first segment's node "
        "instead (TreePO's released trainer, whose uid has no '#' after the prompt)",
    )
    weighting: Literal["average", "group_size"] = Field(
        "average",
        description="average: the mean of the subgroup terms (TreePO's recipe); group_size: weighted by subgroup "
        "size (its code's default)",
    )
    skip_constant_subgroups: bool = Field(
        False, description="below the prompt, drop the terms of subgroups whose scores are all equal (subtree_std_ds)"
    )
    whiten: Whiten = Field(True, description=WHITEN_DESCRIPTION)


def _after(parent: int | None) -> str:
    return "the start" if parent is None else f"segment {parent}"


def tree_membership(segment_id: Tensor, mask: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor]:
    """``[nodes, B]`` bool: which rows contain each tree node, after checking the ids describe a tree; and ``[B]``
    the node of each row's first segment (−1 for a row without actions).

    A node is a ``(group_id, segment_id)`` pair; each row's path is its distinct segment ids in order over its action
    tokens. Refused: a row that leaves a segment and comes back to it; a node reached through different parents.
    """
    rows = segment_id.shape[0]
    nodes: dict[tuple[int, int], tuple[int, int | None, int, int]] = {}  # (group, segment) -> (index, parent, row, pos)
    members: list[list[int]] = []
    first = [-1] * rows
    for row in range(rows):
        positions = mask[row].nonzero().flatten()
        ids = segment_id[row, positions]
        ids, counts = torch.unique_consecutive(ids, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        group = int(group_id[row])
        seen: dict[int, int] = {}
        parent: int | None = None
        for segment, start in zip(ids.tolist(), starts.tolist(), strict=True):
            pos = int(positions[start])
            if segment in seen:
                raise LossplugError(
                    f"advantage 'treepo': segment_id must name each tree node in one run of a row's action tokens; "
                    f"row {row} is in segment {segment} at pos {seen[segment]} and again at pos {pos}"
                )
            seen[segment] = pos
            known = nodes.get((group, segment))
            if known is None:
                nodes[(group, segment)] = (len(members), parent, row, pos)
                members.append([row])
            elif known[1] != parent:
                raise LossplugError(
                    f"advantage 'treepo': segment_id must give a node the same prefix in every row containing it "
                    f"(ids are unique within a group_id); segment {segment} of group {group} follows "
                    f"{_after(known[1])} in row {known[2]} (pos {known[3]}) but {_after(parent)} in row {row} "
                    f"(pos {pos})"
                )
            else:
                members[known[0]].append(row)
            if parent is None:
                first[row] = nodes[(group, segment)][0]
            parent = segment
    incidence = torch.zeros(len(members), rows, dtype=torch.bool, device=mask.device)
    for index, node_rows in enumerate(members):
        incidence[index, node_rows] = True
    return incidence, torch.tensor(first, dtype=torch.long, device=mask.device)


@lossplug.advantage("treepo", params=TreePOParams, requires=("reward", "group_id", "segment_id"))
def treepo(batch: lossplug.PolicyBatch, p: TreePOParams) -> Tensor:
    """TreePO: A_i = whiten(mean of R_i − mean_S R over the prompt group and the shared tree nodes on i's path)."""
    mask = batch.action_mask
    score = at_least_float32(sequence_scores(batch))
    group_id = cast(Tensor, batch.group_id)  # required
    groups = Groups.from_ids(group_id)
    incidence, first = tree_membership(cast(Tensor, batch.segment_id), mask, group_id)  # [N, B], [B]
    member = incidence.to(score.dtype)
    size = member.sum(-1)  # [N]
    mean = (member @ score) / size
    counted = incidence & (size > 1).unsqueeze(-1)  # a subgroup of one adds nothing
    if p.first_subgroup == "prompt":
        # the prompt group's term: verl's baseline, R_i for a group of one
        root = score - group_mean_or_zero(groups, score)
        root_size = groups.counts[groups.inverse].to(score.dtype)
    else:
        # the first segment's node takes the prompt's place (always counted, mean 0 for one row) and leaves the rest
        has_first = first >= 0
        at = first.clamp(min=0)
        root_size = torch.where(has_first, size[at], 1)
        root = score - torch.where(has_first & (root_size > 1), mean[at], 0)
        rows = torch.arange(score.shape[0], device=score.device)
        counted = counted.index_put((at, rows), torch.zeros_like(has_first))  # (a row without actions: none)
    if p.skip_constant_subgroups:
        inf = torch.tensor(torch.inf, dtype=score.dtype, device=score.device)
        high = torch.where(incidence, score, -inf).amax(-1)
        low = torch.where(incidence, score, inf).amin(-1)
        counted = counted & (high != low).unsqueeze(-1)
    terms = torch.where(counted, score.unsqueeze(0) - mean.unsqueeze(-1), 0)  # [N, B]
    if p.weighting == "average":
        advantage = (root + terms.sum(0)) / (1 + counted.sum(0)).to(score.dtype)
    else:
        weight = torch.where(counted, size.unsqueeze(-1), 0)
        advantage = (root * root_size + (terms * weight).sum(0)) / (root_size + weight.sum(0))
    if p.whiten == "center":
        return center_rows(advantage, mask)
    return whiten_rows(advantage, mask) if p.whiten else advantage

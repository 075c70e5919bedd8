"""ROLL's agentic reward normalisation and advantage whitening, shared by ``step_reinforce`` and ``agentic_reinforce``
(helpers, no plugin).

* :func:`roll_reward_norm` — ROLL's ``agentic_reward_norm``: one score per row, normalised within ``grouping``
  (``batch``: the whole batch; ``group``: the rows of one ``group_id``, ROLL's ``grouping: traj_group_id``)::

      m = mean over the batch (mean: batch), over the row's grouping (group), or 0 (none)
      s = torch's sample std over the batch (std: batch) or over the row's grouping (group)
      x̂ = (x − m) / (s + 1e-6)   where the grouping has more than one row and |s| > 1e-6, else 0     (std set)
      x̂ =  x − m                                                                                     (std: none)

  The threshold is ROLL's: a spread of at most 1e-6 (not only an exactly equal group) gives 0, and so does a
  grouping of one row, even with ``std: batch``.
* :class:`RollNormParams` — the switches of that normalisation and of the whitening (ROLL's
  ``reward_normalization`` and ``whiten_advantages``), the params both plugins share; each adds its own ``gamma``.
* :func:`roll_whiten` — ROLL's ``whiten_advantages`` (``masked_whiten`` over the batch's action tokens, the same
  arithmetic as verl's: :func:`._verl_statistics.masked_whiten`), skipped as ROLL skips it when the batch holds at
  most one action token.

Reference: ROLL (alibaba/ROLL, commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a) ``roll/pipeline/agentic/utils.py``
``agentic_reward_norm`` and ``agentic_compute_advantage``; ``roll/utils/functionals.py`` ``masked_whiten``.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import masked_whiten

Tensor = torch.Tensor

Grouping = Literal["batch", "group"]
Statistic = Literal["none", "batch", "group"]
#: ROLL's epsilon and threshold of the std division (agentic_reward_norm)
ROLL_EPS = 1e-6


class RollNormParams(lossplug.Params):
    """ROLL's ``reward_normalization`` (``grouping``, ``mean``, ``std``) and ``whiten_advantages`` switches, with
    ROLL's defaults; ``step_reinforce`` and ``agentic_reinforce`` add their own ``gamma``."""

    grouping: Grouping = Field(
        "batch",
        description="where group statistics are taken: the whole batch (ROLL's default) or the prompt group "
        "(ROLL's grouping: traj_group_id)",
    )
    mean: Statistic = Field(
        "none",
        description="subtract the batch's or the grouping's mean, or nothing (ROLL: norm_mean_type, default none)",
    )
    std: Statistic = Field(
        "none",
        description="divide by the batch's or the grouping's sample std + 1e-6, 0 where it is ≤ 1e-6 (ROLL: "
        "norm_std_type, default none)",
    )
    whiten: bool = Field(
        False, description="whiten the advantages over the batch's action tokens (ROLL: whiten_advantages)"
    )


def roll_group_id(batch: lossplug.PolicyBatch, p: RollNormParams) -> Tensor | None:
    """The batch's ``group_id`` where ``p`` groups by prompt (the plugins require it then), else ``None``."""
    return cast(Tensor, batch.group_id) if p.grouping == "group" else None


def roll_reward_norm(x: Tensor, group_id: Tensor | None, grouping: Grouping, mean: Statistic, std: Statistic) -> Tensor:
    """``[B]`` ROLL's ``agentic_reward_norm`` of the ``[B]`` scores ``x`` (``group_id`` needed for ``grouping:
    group``)."""
    if grouping == "group":
        assert group_id is not None  # the plugins require it with grouping: group
        groups = Groups.from_ids(group_id)
    else:
        groups = Groups.from_ids(torch.zeros_like(x, dtype=torch.long))
    n = groups.counts[groups.inverse]
    if mean == "batch":
        m = x.mean().expand_as(x)
    elif mean == "group":
        m = groups.mean(x)[groups.inverse]
    else:
        m = torch.zeros_like(x)
    if std == "none":
        return x - m
    if std == "batch":
        s = (x.std() if x.numel() > 1 else x.new_full((), float("nan"))).expand_as(x)
    else:
        s = groups.std(x, unbiased=True)[groups.inverse]  # NaN for a row alone: never > 1e-6
    spread = (n > 1) & (s.abs() > ROLL_EPS)
    return torch.where(spread, (x - m) / (s + ROLL_EPS), torch.zeros_like(x))


def roll_whiten(advantage: Tensor, mask: Tensor) -> Tensor:
    """ROLL's ``masked_whiten`` of a ``[B, T]`` advantage over the action tokens, unless there are fewer than two."""
    if int(mask.sum()) <= 1:
        return advantage
    return masked_whiten(advantage, mask)

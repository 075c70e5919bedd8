"""The shapers' and filters' own checks (the rollout side): what they return, that masked positions and masked
columns change nothing, and that they follow row shuffles. They run through the pipeline's own
:func:`lossplug.apply_rollout_stages`, on a fresh compile of the subject's recipe each time (a stateful shaper
starts from its initial state in every run)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

import lossplug
from lossplug.contracts import PolicyBatch, RolloutResult

from .. import batches
from ._common import CheckFailed, Subject, advantage_fields, check, first_diff, without_observations

Tensor = torch.Tensor
ROLLOUT_KINDS = ("shaper", "filter")


def rollout_of(s: Subject, fields: Mapping[str, Tensor]) -> RolloutResult:
    """What the subject's stage leaves of a batch of ``fields`` (a fresh compile: a controller in its initial state)."""
    return lossplug.apply_rollout_stages(PolicyBatch(**fields), lossplug.compile_recipe(s.recipe()))


def _result(s: Subject, out: RolloutResult) -> Tensor:
    """The part of the stage's result a check compares: the reward of a shaper, the action mask of a filter."""
    return out.reward if s.kind == "shaper" else out.action_mask


def rollout_fields(s: Subject, token_reward: bool = False) -> dict[str, Tensor]:
    return advantage_fields(s, token_reward=token_reward)


def _reward_layouts(s: Subject) -> tuple[bool, ...]:
    """Whether to test with a per-token reward, for each reward layout the stage takes (a filter: both)."""
    layouts = getattr(s.plugin, "rewards", ("response", "token"))
    return tuple(layout == "token" for layout in layouts)


def rollout_output_contract(s: Subject) -> None:
    """A shaper's reward: a float tensor of the batch reward's shape (or ``[B, T]`` from ``[B]``), without gradient,
    finite; a filter's keep mask: bool ``[B]`` or ``[B, T]``. The pipeline's own checks name the plugin when it
    does not; here the kit says what the kind promises."""
    for token_reward in _reward_layouts(s):
        f = rollout_fields(s, token_reward=token_reward)
        f["logp"] = f["logp"].clone().requires_grad_(True)
        try:
            out = rollout_of(s, f)
        except lossplug.PluginError as err:
            raise CheckFailed(f"with a {'[B, T]' if token_reward else '[B]'} reward: {err}") from None
        result = _result(s, out)
        if result.requires_grad:
            raise CheckFailed(f"the {s.kind}'s output carries gradient: rewards and masks are data of the rollout")
        if s.kind == "filter" and bool((out.action_mask & ~f["action_mask"]).any()):
            raise CheckFailed("the filter put back action tokens the batch did not have (keep must only narrow)")


def rollout_masked_poison(s: Subject) -> None:
    """Poisoning the per-token fields off the actions changes neither the reward nor the mask on the actions."""
    for token_reward in _reward_layouts(s):
        clean = without_observations(s, rollout_fields(s, token_reward=token_reward))
        mask = clean["action_mask"]
        dirty = dict(clean)
        for name in batches.TOKEN_FIELDS:
            if name in dirty:
                dirty[name] = batches.poison(clean[name], ~mask, seed=zlib.crc32(name.encode()) % 1000)
        a, b = _result(s, rollout_of(s, clean)), _result(s, rollout_of(s, dirty))
        where = mask if a.ndim == 2 else None
        diff = first_diff(b.double(), a.double(), where)
        if diff:
            raise CheckFailed(
                f"poisoning non-action positions changed the {s.kind}'s output {diff}: read token inputs only where "
                "action_mask is True (torch.where(mask, x, 0), not x * mask)"
            )


def rollout_masked_layout(s: Subject) -> None:
    """Masked columns in front and behind change nothing on the action tokens."""
    before, after = 2, 3
    clean = rollout_fields(s, token_reward=True in _reward_layouts(s))
    wide = batches.insert_masked_columns(clean, before, after)
    if clean["reward"].ndim == 2:  # a per-token reward stays 0 off the actions (the contract's rule)
        wide["reward"] = batches.insert_masked_columns(
            {"reward": clean["reward"], "action_mask": clean["action_mask"]}, before, after, fill=0.0
        )["reward"]
    a, b = _result(s, rollout_of(s, clean)), _result(s, rollout_of(s, wide))
    if a.ndim == 2:
        b = b[:, before : before + a.shape[1]]
    diff = first_diff(b.double(), a.double(), clean["action_mask"] if a.ndim == 2 else None)
    if diff:
        raise CheckFailed(
            f"adding {before} masked columns in front and {after} behind changed the {s.kind}'s output {diff} — "
            "statistics must be taken over action tokens only"
        )


@check(
    "rollout_row_permutation",
    ROLLOUT_KINDS,
    "shuffling the rows (groups scattered differently) shuffles the output the same way",
    needs=("output_contract",),
)
def rollout_row_permutation(s: Subject) -> None:
    f = rollout_fields(s)
    B = f["logp"].shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    shuffled = {k: (v[perm] if v.ndim >= 1 and v.shape[0] == B else v) for k, v in f.items()}
    a, b = _result(s, rollout_of(s, f)), _result(s, rollout_of(s, shuffled))
    diff = first_diff(b.double(), a[perm].double(), f["action_mask"][perm] if a.ndim == 2 else None)
    if diff:
        raise CheckFailed(
            f"after shuffling the rows the output is not the shuffled output {diff} — group statistics must come "
            "from group_id, never from row order"
        )

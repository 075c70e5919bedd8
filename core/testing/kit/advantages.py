"""The advantage estimators' own checks: what an estimator returns, and that it follows row shuffles."""

from __future__ import annotations

import torch

import lossplug
from lossplug.contracts import PackedTransitions, PolicyBatch

from .. import batches
from ._common import CheckFailed, Subject, advantage_fields, advantage_of, check, first_diff, padded_only


def advantage_output_contract(s: Subject) -> None:
    """Layouts a non-empty subset of padded/packed, ``requires`` naming contract fields, advantages without
    gradient."""
    layouts = tuple(s.plugin.layouts)
    if not layouts or set(layouts) - {"padded", "packed"}:
        raise CheckFailed(f"layouts must be a non-empty subset of ('padded', 'packed'), got {layouts}")
    contract_fields = set()
    if "padded" in layouts:
        contract_fields |= set(PolicyBatch.FIELD_NAMES)
    if "packed" in layouts:
        contract_fields |= set(PackedTransitions.FIELD_NAMES)
    unknown = set(s.requires) - contract_fields
    if unknown:
        raise CheckFailed(f"requires names fields no batch contract has: {sorted(unknown)}")
    if "padded" in layouts:
        f = advantage_fields(s)
        for name in ("reward", "value"):
            f[name] = f[name].clone().requires_grad_(True)
        result = lossplug.estimate_advantages(PolicyBatch(**f), s.recipe())
    else:
        result = lossplug.estimate_advantages(PackedTransitions(**batches.packed_fields()), s.recipe())
    if result.advantage.requires_grad:
        raise CheckFailed("the advantages carry gradient: advantages are constants of the policy loss")


@check(
    "row_permutation",
    ("advantage",),
    "shuffling the rows (groups scattered differently) shuffles the advantages the same way",
    needs=("output_contract",),
)
def row_permutation(s: Subject) -> None:
    padded_only(s)
    f = advantage_fields(s)
    B = f["logp"].shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    shuffled = {k: (v[perm] if v.ndim >= 1 and v.shape[0] == B else v) for k, v in f.items()}
    a = advantage_of(s, PolicyBatch(**f))
    b = advantage_of(s, PolicyBatch(**shuffled))
    mask = f["action_mask"][perm] if a.ndim == 2 else None
    diff = first_diff(b, a[perm], mask)
    if diff:
        raise CheckFailed(
            f"after shuffling the rows the advantages are not the shuffled advantages {diff} — group "
            "statistics must come from group_id, never from row order"
        )

"""The reductions' own checks: what a reduction returns, and the sign of every action token's weight."""

from __future__ import annotations

import torch

from lossplug.plugin import Population

from ._common import BUDGET, CheckFailed, Subject, Tensor, check, check_fields, normalizer_for, run_loss, where_rows


def reduction_output_contract(s: Subject) -> None:
    """A reduction returns a 0-d float tensor."""
    f = check_fields()
    mask = f["action_mask"]
    objective = torch.where(mask, torch.randn(mask.shape, dtype=torch.float64), 0)
    groups = normalizer_for(f)  # the rows' prompt groups and their action tokens (a reduction over prompts reads them)
    pop = Population(
        int(mask.sum()), mask.shape[0], groups.groups, BUDGET, f["group_id"], groups.group_tokens, of_step=True
    )
    out = s.plugin(objective, mask, mask.sum(-1), pop, s.param_model())
    if not isinstance(out, Tensor) or out.ndim != 0 or not out.is_floating_point():
        raise CheckFailed(
            f"a reduction must return a 0-d float tensor, got "
            f"{type(out).__name__}{'' if not isinstance(out, Tensor) else list(out.shape)}"
        )


@check(
    "positive_weights",
    ("reduction",),
    "every action token gets a positive weight and nothing else any (the sign convention: objective, not loss)",
    needs=("masked_poison",),
)
def positive_weights(s: Subject) -> None:
    f = check_fields()
    run = run_loss(s, f, normalizer=normalizer_for(f))
    mask = f["action_mask"]
    adv = f["advantage"].unsqueeze(-1).expand_as(mask)
    weight = torch.where(mask, -run.logp_grad / adv, 0)  # reference gate J = A·logp; loss = −reduce(J)
    bad = mask & ~(weight > 0)
    if bool(bad.any()):
        hint = (
            " The sign is flipped: a reduction returns the reduced objective; the pipeline negates it."
            if bool((weight[mask] < 0).all())
            else ""
        )
        raise CheckFailed(
            f"action tokens at {where_rows(bad)} get a weight ≤ 0 (min {weight[mask].min().item():.3g}).{hint}"
        )
    off = ~mask & (run.logp_grad != 0)
    if bool(off.any()):
        raise CheckFailed(f"non-action positions get gradient at {where_rows(off)}")

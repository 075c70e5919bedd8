"""The checks every kind goes through: documentation, parameters, output, declared fields and masked positions."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Mapping

import torch

import lossplug
from lossplug.contracts import LossplugError, PolicyBatch
from lossplug.needs import required_fields
from lossplug.plugin import Params

from .. import batches
from ._common import (
    KINDS,
    TOKEN_FIELDS,
    CheckFailed,
    CheckSkipped,
    Subject,
    Tensor,
    advantage_fields,
    advantage_of,
    check,
    check_fields,
    first_diff,
    format_exception,
    normalizer_for,
    padded_only,
    reference_update_gate,
    run_loss,
    where_rows,
    without_observations,
)
from .advantages import advantage_output_contract
from .gates import gate_output_contract
from .reductions import reduction_output_contract
from .regularizers import regularizer_output_contract
from .rollout import ROLLOUT_KINDS, rollout_masked_layout, rollout_masked_poison, rollout_of, rollout_output_contract

#: each kind's output contract
OUTPUT_CONTRACTS: dict[str, Callable[[Subject], None]] = {
    "shaper": rollout_output_contract,
    "filter": rollout_output_contract,
    "advantage": advantage_output_contract,
    "gate": gate_output_contract,
    "reduction": reduction_output_contract,
    "regularizer": regularizer_output_contract,
}


@check("docstring", KINDS, "the plugin has a docstring (the formula `lossplug show` prints)")
def docstring(s: Subject) -> None:
    doc = (s.plugin.doc or "").strip()
    if not doc:
        raise CheckFailed(
            f"'{s.name}' has no docstring. Write one: its first line is the summary `lossplug list` "
            "shows, and the formula belongs there (or in the module docstring `lossplug show` prints)."
        )


@check("params_schema", KINDS, "parameters are a lossplug.Params model with a JSON schema, defaults and descriptions")
def params_schema(s: Subject) -> None:
    model = s.plugin.params
    if not (isinstance(model, type) and issubclass(model, Params)):
        raise CheckFailed(
            f"params is {model!r}: it must be a subclass of lossplug.Params (a pydantic model that "
            "rejects unknown parameter names and is immutable)",
            blocking=not _builds(s),
        )
    if model.model_config.get("extra") != "forbid":
        raise CheckFailed(
            f"{model.__name__} accepts unknown parameters (model_config extra="
            f"{model.model_config.get('extra')!r}); keep lossplug.Params' extra='forbid' so a typo "
            "in a recipe is an error"
        )
    problems = []
    try:
        json.dumps(model.model_json_schema())
    except Exception as err:
        problems.append(f"its JSON schema cannot be generated: {format_exception(err)}")
    required = [n for n, f in model.model_fields.items() if f.is_required()]
    if required:
        problems.append(
            f"parameter(s) {', '.join(required)} have no default: a recipe that names the plugin "
            f"without parameters ({{name: {s.name}}}) fails"
        )
    undocumented = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
    if undocumented:
        problems.append(
            f"parameter(s) {', '.join(undocumented)} have no description "
            "(Field(..., description=...)); `lossplug show` prints it"
        )
    if not required:
        try:
            model()
        except Exception as err:
            problems.append(f"the defaults do not validate: {format_exception(err)}")
    try:
        value = model.model_validate(s.params)
        if model.model_validate(value.model_dump()) != value:
            problems.append("parameters do not survive a dump/validate round trip (recipes are stored as data)")
    except Exception as err:
        problems.append(f"the parameters under test {s.params} do not validate: {format_exception(err)}")
    if problems:
        # the other checks need only the parameters under test; a documentation problem does not block them
        raise CheckFailed("; ".join(problems), blocking=not _builds(s))


def _builds(s: Subject) -> bool:
    """Whether the parameters under test build (every other check calls the plugin with them)."""
    try:
        s.param_model()
    except Exception:
        return False
    return True


@check(
    "output_contract",
    KINDS,
    "the plugin returns what its kind promises (shapes, dtypes, 0-d metrics)",
    needs=("params_schema",),
)
def output_contract(s: Subject) -> None:
    OUTPUT_CONTRACTS[s.kind](s)


@check(
    "requires_declared",
    ("gate", "advantage", "regularizer", *ROLLOUT_KINDS),
    "the plugin runs on a batch holding only the fields it declares in requires=",
    needs=("output_contract", "metric_levels"),
)
def requires_declared(s: Subject) -> None:
    full = advantage_fields(s) if s.kind in ("advantage", *ROLLOUT_KINDS) else check_fields()
    keep = {"logp", "action_mask", *s.requires}
    if s.kind in ("gate", "regularizer"):
        keep.add("advantage")
        if s.role == "correction" or s.kind == "regularizer":
            ref = lossplug.registry().plugins["gate"][reference_update_gate()]
            keep |= set(required_fields(ref))
    elif s.kind in ROLLOUT_KINDS:
        keep.add("reward")  # what the rollout stages rewrite and filter: always there
    elif s.plugin.min_group_size > 0:
        keep.add("group_id")
    minimal = {k: v for k, v in full.items() if k in keep}
    if s.kind == "advantage" and "padded" not in s.plugin.layouts:
        raise CheckSkipped("applies to padded-layout advantages (a packed batch has no optional fields)")

    def run(fields: Mapping[str, Tensor]) -> None:
        if s.kind in ("gate", "regularizer"):
            run_loss(s, fields)
        elif s.kind in ROLLOUT_KINDS:
            rollout_of(s, fields)
        else:
            advantage_of(s, PolicyBatch(**fields))

    try:
        run(minimal)
    except Exception as err:
        raise CheckFailed(_undeclared(run, minimal, full, err)) from None


def _undeclared(
    run: Callable[[Mapping[str, Tensor]], None], minimal: dict[str, Tensor], full: dict[str, Tensor], err: Exception
) -> str:
    """Why the plugin failed on the batch of its declared fields: the optional field(s) it reads without declaring
    them, found by adding each absent field alone — or, when it fails with every field present too, that the
    failure is not about ``requires`` at all."""
    what = f"with only the fields {sorted(minimal)} it raised {format_exception(err)}"
    try:
        run(full)
    except Exception as full_err:
        return (
            f"{what}, and with every field present it raises too ({format_exception(full_err)}), so the failure "
            "is not about undeclared fields"
        )
    enough = [name for name in sorted(set(full) - set(minimal)) if _runs(run, {**minimal, name: full[name]})]
    if enough:
        return (
            f"{what}; it runs once {' or '.join(enough)} is added, so it reads {enough[0]} without declaring it: add "
            f"it to requires=(...), so that a batch without it fails validation with a clear message instead"
        )
    return (
        f"{what}; it runs with every field present, but no single field added makes it run: it reads several optional "
        "PolicyBatch fields it does not declare — declare each in requires=(...)"
    )


def _runs(run: Callable[[Mapping[str, Tensor]], None], fields: Mapping[str, Tensor]) -> bool:
    try:
        run(fields)
    except Exception:
        return False
    return True


@check(
    "masked_poison",
    KINDS,
    "masked positions never influence the result or the gradient (they are poisoned with NaN/±inf/1e30)",
    needs=("output_contract", "detached", "metric_levels"),
)
def masked_poison(s: Subject) -> None:
    padded_only(s)
    if s.kind in ROLLOUT_KINDS:
        rollout_masked_poison(s)
        return
    if s.kind == "advantage":
        clean = without_observations(s, advantage_fields(s, token_reward=True))
        mask = clean["action_mask"]
        dirty = dict(clean)
        # a token-level reward stays 0 off the actions: the contract refuses anything else there
        for name in batches.TOKEN_FIELDS:
            # a seed from the name's bytes: str hashes differ per process (PYTHONHASHSEED), the poison must not
            dirty[name] = batches.poison(clean[name], ~mask, seed=zlib.crc32(name.encode()) % 1000)
        adv_a = advantage_of(s, PolicyBatch(**clean))
        try:
            adv_b = advantage_of(s, PolicyBatch(**dirty))
        except LossplugError as err:  # lossplug refused what it returned: most often advantages that are not finite
            raise CheckFailed(
                f"with NaN/±inf at masked positions {err} — the advantages are not finite, or not what lossplug "
                "accepts: read token inputs only where action_mask is True (torch.where(mask, x, 0), not x * mask)"
            ) from None
        where = mask if adv_a.ndim == 2 else None
        diff = first_diff(adv_b, adv_a, where)
        if diff:
            raise CheckFailed(
                f"poisoning non-action positions changed the advantages {diff}: read token inputs "
                "only where action_mask is True (torch.where(mask, x, 0), not x * mask)"
            )
        return
    for token_adv in (False, True):
        clean = without_observations(s, check_fields(token_advantage=token_adv))
        mask = clean["action_mask"]
        if "observation_mask" in clean:  # a term that trains the observation tokens reads them there (echo)
            mask = mask | clean["observation_mask"]
        dirty = dict(clean)
        for name in TOKEN_FIELDS + (("advantage",) if token_adv else ()):
            dirty[name] = batches.poison(clean[name], ~mask, seed=len(name))
        norm = normalizer_for(clean)
        a = run_loss(s, clean, normalizer=norm)
        b = run_loss(s, dirty, normalizer=norm)
        what = "token-level" if token_adv else "sequence-level"
        if not bool(torch.isfinite(b.loss)):
            raise CheckFailed(
                f"with NaN/±inf at masked positions (non-action tokens; {what} advantages) the loss "
                f"is {float(b.loss)} — something reads the raw batch (inp.batch.*) or masks by "
                "multiplication (0·NaN = NaN); read GateInput's tensors, which are zero off actions"
            )
        if first_diff(b.loss, a.loss) is not None:
            raise CheckFailed(
                f"poisoning masked positions changed the loss ({what} advantages): "
                f"{float(a.loss):.10g} → {float(b.loss):.10g}"
            )
        grad = b.logp_grad
        leak = ~mask & ((grad != 0) | ~torch.isfinite(grad))
        if bool(leak.any()):
            raise CheckFailed(
                f"the gradient reaches masked positions {where_rows(leak)} (it must be exactly 0 off actions)"
            )
        diff = first_diff(grad, a.logp_grad, mask)
        if diff:
            raise CheckFailed(f"poisoning masked positions changed the gradient on action tokens {diff}")


@check(
    "masked_layout",
    KINDS,
    "adding masked columns (a prompt in front, padding behind) changes neither the result nor the gradient",
    needs=("masked_poison",),
)
def masked_layout(s: Subject) -> None:
    padded_only(s)
    if s.kind in ROLLOUT_KINDS:
        rollout_masked_layout(s)
        return
    before, after = 2, 3
    if s.kind == "advantage":
        clean = advantage_fields(s, token_reward=True)
        wide = batches.insert_masked_columns(clean, before, after)
        # poison in every new column, but a token-level reward's, which the contract requires to be 0 off actions
        wide["reward"] = batches.insert_masked_columns(
            {"reward": clean["reward"], "action_mask": clean["action_mask"]}, before, after, fill=0.0
        )["reward"]
        adv_a = advantage_of(s, PolicyBatch(**clean))
        adv_b = advantage_of(s, PolicyBatch(**wide))
        if adv_a.ndim == 2:
            adv_b = adv_b[:, before : before + adv_a.shape[1]]
        diff = first_diff(adv_b, adv_a, clean["action_mask"] if adv_a.ndim == 2 else None)
        if diff:
            raise CheckFailed(
                f"adding {before} masked columns in front and {after} behind changed the advantages "
                f"{diff} — statistics must be taken over action tokens only"
            )
        return
    clean = check_fields()
    wide = batches.insert_masked_columns(clean, before, after)
    a = run_loss(s, clean, normalizer=normalizer_for(clean))
    b = run_loss(s, wide, normalizer=normalizer_for(wide))
    if first_diff(b.loss, a.loss) is not None:
        raise CheckFailed(
            f"adding {before} masked columns in front and {after} behind changed the loss "
            f"{float(a.loss):.10g} → {float(b.loss):.10g} — does it average over all T positions "
            "instead of the action tokens (use the mask / inp.lengths)?"
        )
    T = clean["logp"].shape[1]
    diff = first_diff(b.logp_grad[:, before : before + T], a.logp_grad, clean["action_mask"])
    if diff:
        raise CheckFailed(f"adding masked columns changed the gradient on action tokens {diff}")

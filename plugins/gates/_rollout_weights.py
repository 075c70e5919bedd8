"""Correction gates run once over a whole rollout batch — where verl's driver computes its rollout correction.

verl computes ``rollout_is_weights`` and the ``rollout_rs`` rejection once per rollout batch, in the driver, before
the batch is split into mini- and micro-batches; ``rollout_is_batch_normalize`` divides by a mean over that whole
batch. A gate in a recipe sees one micro-batch. For the population-dependent option, run the corrections here once
per rollout batch and hand each micro-batch its rows, as verl hands its loss ``rollout_is_weights``:

>>> import lossplug
>>> from lossplug.plugins.gates import whole_batch_weight
>>> from lossplug.testing.batches import policy_fields
>>> rollout = policy_fields(B=6, T=10, log_ratio_scale=0.25)   # one rollout batch's fields, as verl's driver has them
>>> corrected = whole_batch_weight(lossplug.PolicyBatch(**rollout),
...                                [{"name": "tis_seq", "cap": 2.0, "batch_normalize": True},
...                                 {"name": "rollout_rs", "options": "seq_mean_k3", "threshold": 0.01}])
>>> corrected.kept_mask.any(-1).tolist()                      # rollout_rs rejected responses 0 and 2
[False, True, False, True, True, True]
>>> normalizer = lossplug.Normalizer.for_masks([corrected.kept_mask])       # verl's counts after rejection
>>> recipe_without_corrections = lossplug.Recipe.model_validate({"gates": ["ppo_clip"], "reduction": "token"})
>>> for rows in ([1, 3], [4, 5]):          # each micro-batch: rows with a surviving token, action_mask = kept_mask
...     micro = lossplug.PolicyBatch(**{k: v[rows] for k, v in rollout.items()}
...                                  | {"action_mask": corrected.kept_mask[rows]})
...     result = lossplug.policy_loss(micro, recipe_without_corrections, normalizer, weight=corrected.weight[rows])
...     print(bool(result.loss.isfinite()))
True
True

``weight`` is the product of the gates' weights ``[B, T]`` (0 off the actions; a sequence-level weight repeated over
its response) and ``kept_mask`` the action mask with the ``rollout_rs`` rejections removed — verl's modified
``response_mask``, whose counts are verl's loss denominators (under every ``loss_agg_mode``: applying the rejection
to the batch is what verl does). IcePop's zero weights are not rejections: they stay in ``kept_mask``, as in verl.

Reference: verl 0.9.1 ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` (called by
``RayPPOTrainer.fit`` before ``compute_advantage``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import lossplug
from lossplug.contracts import LossplugError, PolicyBatch
from lossplug.contracts.recipe import PluginSpec, installed_catalogue
from lossplug.plugin import evaluate

Tensor = torch.Tensor

#: the gates whose zero weights are rejections (removed from the population), not weights
REJECTION_GATES = ("rollout_rs",)


@dataclass(frozen=True)
class WholeBatchCorrection:
    """The corrections of one rollout batch: ``weight`` ``[B, T]``, ``kept_mask`` ``[B, T]`` bool and the gates'
    metrics (``<gate>/<metric>``, at the ``full`` level)."""

    weight: Tensor
    kept_mask: Tensor
    metrics: dict[str, Tensor]


def whole_batch_weight(
    batch: PolicyBatch, gates: Sequence[str | Mapping[str, Any]], *, metrics: bool = True
) -> WholeBatchCorrection:
    """Run the correction ``gates`` (named as a recipe names them) on the whole ``batch`` once, under ``no_grad``."""
    if not isinstance(batch, PolicyBatch):
        raise LossplugError(f"whole_batch_weight: batch must be a lossplug.PolicyBatch, got {type(batch).__name__}")
    if not batch.validated:
        batch.check()
    catalogue = installed_catalogue()
    reg = lossplug.registry()
    inp = lossplug.GateInput.from_batch(batch)
    mask = inp.mask
    weight = torch.ones(mask.shape, dtype=inp.compute_dtype, device=mask.device)
    kept = mask.clone()
    found: dict[str, Tensor] = {}
    with torch.no_grad():
        for i, raw in enumerate(gates):
            where = f"whole_batch_weight gates[{i}]"
            spec = catalogue.check_stage("gate", PluginSpec.parse(raw, where), where)
            plugin = reg.lookup("gate", spec.name, where)
            if plugin.role != "correction":
                raise LossplugError(f"{where}: '{spec.name}' is an update gate; only corrections weigh a batch")
            missing = [
                f
                for f in plugin.required_fields(plugin.params.model_validate(spec.params))
                if getattr(batch, f, None) is None
            ]
            if missing:
                raise LossplugError(f"{where} ({spec.name}) needs {', '.join(missing)}, but the batch has none")
            out = plugin(inp, plugin.params.model_validate(spec.params))
            w = out.weight if out.weight is not None else torch.ones_like(weight)
            w = w if w.ndim == 2 else w.unsqueeze(-1).expand(mask.shape)
            weight = weight * w
            if spec.name in REJECTION_GATES:
                kept = kept & (w > 0)
            if metrics:
                for key, value in {**out.metrics, **out.details}.items():
                    found[f"{spec.name}/{key}"] = evaluate(value)
    return WholeBatchCorrection(torch.where(mask, weight, 0), kept, found)

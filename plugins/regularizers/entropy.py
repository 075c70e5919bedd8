"""Entropy bonus: ``term = −H`` per action token, so the loss gains ``−coef · reduce(H)`` — a positive ``coef``
rewards entropy (exploration); the gradient flows through the batch's ``entropy`` (computed from the logits).

Static: ``coef`` is the coefficient. Adaptive (``adaptive: true``, TRL's ``use_adaptive_entropy``, Skywork-OR1):
the stage gets an :class:`~lossplug.control.AdaptiveEntropyController` whose coefficient starts at ``coef``; it
observes ``[Σ H, tokens]`` over each micro-batch's action tokens, and at every optimizer step (``step()``, called by
the trainer) it measures the window's token-weighted mean entropy over all ranks ``H̄`` and moves the coefficient by
``coef_delta`` — up when ``H̄ ≤ target``, down otherwise, within ``[coef_min, coef_max]``. The bonus applies the
coefficient of the previous step, and only while the last ``H̄ ≤ target`` (none in the first window).

Reduction: by default the recipe's, over the step's population — verl's convention (``entropy_loss =
agg_loss(entropy, response_mask, loss_agg_mode)``, the policy loss's aggregation). TRL's bonus is instead the token
mean over each micro-batch (``Σ H·m / Σ m``, divided by the gradient-accumulation steps, whatever the ``loss_type``):
``reduction: token, population: micro_batch`` reproduces it.

Reference: TRL 1.16 ``GRPOTrainer._compute_loss`` (``trl/trainer/grpo_trainer.py`` 3186-3245: ``entropy_coef``,
``use_adaptive_entropy``, ``entropy_coef_min/max/delta``, ``entropy_target``); verl 0.9.1 ``dp_actor`` /
``ppo_loss`` (``entropy_coeff``: ``policy_loss −= entropy_coeff · agg_loss(entropy)``).

Paper: Skywork Open Reasoner 1 Technical Report (adaptive entropy control), He et al., 2025, arXiv:2505.22312.
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.control import AdaptiveEntropyController

Tensor = torch.Tensor


class EntropyParams(lossplug.RegularizerParams):
    coef: float = Field(
        0.0,
        allow_inf_nan=False,
        description="bonus coefficient: the loss gains −coef · reduce(H) (TRL's entropy_coef, verl's "
        "entropy_coeff); with adaptive, the initial coefficient",
    )
    adaptive: bool = Field(
        False, description="adapt the coefficient every optimizer step toward target (TRL's use_adaptive_entropy)"
    )
    coef_min: float = Field(0.0, ge=0, description="lower bound of the adaptive coefficient (entropy_coef_min)")
    coef_max: float = Field(1.0, ge=0, description="upper bound of the adaptive coefficient (entropy_coef_max)")
    coef_delta: float = Field(0.005, ge=0, description="step of the adaptive coefficient (entropy_coef_delta)")
    target: float = Field(
        0.2,
        ge=0,
        description="target mean per-token entropy in nats (entropy_target): the bonus applies only at or below it",
    )

    @model_validator(mode="after")
    def _bounds(self) -> EntropyParams:
        if self.coef_min > self.coef_max:
            raise ValueError(f"coef_min ({self.coef_min}) must be <= coef_max ({self.coef_max})")
        return self


def _controller(p: EntropyParams) -> AdaptiveEntropyController | None:
    if not p.adaptive:
        return None
    return AdaptiveEntropyController(
        p.coef, coef_min=p.coef_min, coef_max=p.coef_max, coef_delta=p.coef_delta, target=p.target
    )


@lossplug.regularizer("entropy", params=EntropyParams, requires=("entropy",), controller=_controller)
def entropy(inp: lossplug.GateInput, p: EntropyParams) -> lossplug.RegularizerOutput:
    """``−coef · reduce(H)``: an entropy bonus, static or with TRL's adaptive coefficient.

    Reference: TRL ``GRPOTrainer`` (entropy_coef, use_adaptive_entropy); verl ``ppo_loss`` (entropy_coeff).
    """
    h = cast(Tensor, inp.entropy)  # declared in requires=; zero off the actions
    observation = (
        torch.stack([h.detach().sum(), inp.lengths.sum().to(h.dtype)]) if p.adaptive else None
    )  # the window sums of the adaptive controller: Σ H over the actions, action tokens
    return lossplug.RegularizerOutput(
        term=-h, metrics={"entropy": lambda: inp.masked_mean(h.detach())}, observation=observation
    )

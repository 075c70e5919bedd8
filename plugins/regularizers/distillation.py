"""Loss-time distillation to a teacher: ``term = clamp(d(logp, teacher_logp), ±loss_max_clamp)`` back-propagated
(``supervised``), or the clipped policy-gradient loss with advantage ``−sg(that term)`` (``policy_gradient``), added
to the loss as ``coef · reduce(term)`` — verl 0.9.1's distillation loss (GKD, arXiv:2306.13649; Thinking Machines'
on-policy distillation), re-derived from ``verl/trainer/distillation/losses.py`` (verl 0.9.1).

``logp`` is the student's **current** log-prob of the sampled token (it carries the gradient) and ``teacher_logp``
(``PolicyBatch.teacher_logp``) the teacher's, detached. ``d`` is one of verl's single-sample estimators of the
reverse KL ``KL(π_student ‖ π_teacher)`` on the student's own samples — ``verl.trainer.ppo.core_algos.kl_penalty``
with ``logprob = logp``, ``ref_logprob = teacher_logp`` (``compute_distillation_loss_reverse_kl_estimator``), with
``δ = teacher − logp``::

    k1, kl            logp − teacher                             unbiased, may be negative
    abs               |logp − teacher|
    k2, mse           ½ (logp − teacher)²
    k3, low_var_kl    clamp(exp(δ') − δ' − 1, −10, 10),  δ' = clamp(δ, −20, 20)

``loss_max_clamp`` (verl's default 10; None: none) then clamps the per-token estimate to ``[−c, c]`` — verl's
``distillation_losses.clamp(min=-c, max=c)``, "clamping min is for k1 loss which can be negative" — before either
mode uses it (a clamped token has no gradient in ``supervised``; its advantage is the clamped value in
``policy_gradient``).

``mode``:

* ``supervised`` — the clamped estimate itself is the term (verl's ``use_policy_gradient: false``: "directly
  backpropagate distillation loss as a supervised loss", arXiv:2306.13649). ``k1`` / ``kl`` are refused here, as
  verl's ``DistillationLossConfig`` refuses ``k1``: ∂(logp − teacher)/∂logp = 1 — the gradient does not depend on
  the teacher at all (verl checks the name ``k1`` only and lets its alias ``kl`` through; the reason holds for both).
* ``policy_gradient`` (verl's default) — the Thinking Machines recipe, "use negative distillation loss as reward":
  verl calls its ``vanilla`` policy loss (``compute_policy_loss_vanilla``, the only one its config allows) with
  ``advantages = −clamp(d).detach()``, the ratio ``r = exp(clamp(logp − old_logp, −20, 20))`` against ``old_logp``
  (verl's ``old_log_probs``; the estimate itself is taken at the current ``logp``, detached), PPO's clip
  ``[1 − clip_ratio_low, 1 + clip_ratio_high]`` (verl's 0.2, 0.2) and the dual clip ``clip_ratio_c`` on negative
  advantages (the distillation config has no ``clip_ratio_c``: verl's ``config.get("clip_ratio_c", 3.0)`` gives 3)::

      l = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),  then min(l, −A·c) where A < 0.

  ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` set to None drop the clip / the dual clip: with
  ``estimator: k1``, ``loss_max_clamp: None`` and no clip this is **AReaL 1.0.4's pure KD**
  (``areal/trainer/ppo/actor.py`` ``grpo_loss_fn`` with ``rl_loss_weight == 0``: ``−w · Σ exp(logp − old) ·
  (teacher − sg(logp)) / #tokens``, ``w = distill_loss_weight`` as ``coef``; AReaL does not clamp the log-ratio, a
  difference only past ``exp(20)``).

Reduction, in verl's terms: verl aggregates the term with ``agg_loss(loss_mat, response_mask, loss_agg_mode,
**global_batch_info)`` — the actor's own ``loss_agg_mode`` and global token/sequence counts, like the policy loss —
which is lossplug's regularizer default: the recipe's reduction (the verl adapter maps ``loss_agg_mode`` to it) over
the step's population. ``reduction`` / ``population`` override it as for any regularizer (AReaL's micro-batch token
mean: ``reduction: {name: token, population: micro_batch}``).

Coefficient, in verl's terms: ``distillation_ppo_loss`` adds ``distillation_loss_coef · distill_loss`` to the task
policy loss when ``use_task_rewards`` (``coef`` = ``distillation_loss_coef``); without task rewards it drops the
task policy loss and uses coefficient 1 — in lossplug ``coef: 1`` and a policy term of zero (advantage 0: the update
gate then contributes 0 and no gradient), as AReaL's pure KD also replaces the RL loss.

What differs from verl: verl multiplies its rollout-correction weights (``rollout_is_weights``) into the
``policy_gradient`` term; a lossplug regularizer is never multiplied by correction weights, so the two agree where
rollout correction is off. Needs the trainer: verl's ``forward_kl_topk`` (forward KL over the teacher's top-k
tokens) needs the student's log-probs at the teacher's top-k ids, which a ``PolicyBatch`` does not hold (it holds
the sampled token's only) — not built here. AReaL's KDRL (``rl_loss_weight > 0``: the k1 term back-propagated) is
``supervised`` with ``k1``, which verl refuses and so does this plugin.

Paper: Agarwal et al., 2024, *On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes*
(GKD), arXiv:2306.13649; Lu and Thinking Machines Lab, 2025, *On-Policy Distillation*,
https://thinkingmachines.ai/blog/on-policy-distillation/.

Reference: verl 0.9.1 ``verl/trainer/distillation/losses.py`` (``distillation_ppo_loss``, ``distillation_loss``,
``compute_distillation_loss_reverse_kl_estimator``), ``verl/workers/config/distillation.py``
(``DistillationLossConfig``), ``verl/trainer/ppo/core_algos.py`` (``kl_penalty``, ``compute_policy_loss_vanilla``);
AReaL 1.0.4 ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``, pure KD).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field, model_validator

import lossplug

Tensor = torch.Tensor

Estimator = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
#: verl's clamp of the update log-ratio in ``compute_policy_loss_vanilla`` (and of k3's log-ratio)
MAX_LOG_RATIO = 20.0
#: verl's clamp of the k3 estimate in ``kl_penalty_forward``
MAX_K3 = 10.0


class DistillationParams(lossplug.RegularizerParams):
    coef: float = Field(
        1.0,
        allow_inf_nan=False,
        description="the loss gains coef · reduce(term): verl's distillation_loss_coef (default 1) with task rewards, "
        "1 without them; AReaL's distill_loss_weight",
    )
    estimator: Estimator = Field(
        "k3",
        description="verl's loss_mode among its single-sample reverse-KL estimators (kl_penalty): k1/kl, abs, "
        "k2/mse, k3/low_var_kl (verl's default k3)",
    )
    mode: Literal["policy_gradient", "supervised"] = Field(
        "policy_gradient",
        description="policy_gradient: the clipped PPO loss with advantage −sg(estimate) (verl's use_policy_gradient, "
        "the default; Thinking Machines); supervised: back-propagate the estimate (GKD); k1 is refused there",
    )
    loss_max_clamp: float | None = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="clamp the per-token estimate to [−c, c] before either mode uses it (verl's loss_max_clamp, "
        "default 10); None: no clamp",
    )
    clip_ratio_low: float | None = Field(
        0.2,
        ge=0,
        allow_inf_nan=False,
        description="policy_gradient: the ratio's lower clip 1 − ε_low (verl's distillation clip_ratio_low, 0.2); "
        "None with clip_ratio_high None: no clip (AReaL's pure KD)",
    )
    clip_ratio_high: float | None = Field(
        0.2,
        ge=0,
        allow_inf_nan=False,
        description="policy_gradient: the ratio's upper clip 1 + ε_high (verl's clip_ratio_high, 0.2)",
    )
    clip_ratio_c: float | None = Field(
        3.0,
        gt=1,
        allow_inf_nan=False,
        description="policy_gradient: the dual clip's bound on negative advantages, −A·c (verl's "
        "config.get('clip_ratio_c', 3.0)); None: no dual clip",
    )

    @model_validator(mode="after")
    def _k1_is_not_a_supervised_loss(self) -> DistillationParams:
        if self.mode == "supervised" and self.estimator in ("k1", "kl"):
            raise ValueError(
                f"distillation: estimator {self.estimator!r} cannot be back-propagated (mode: supervised): the "
                f"gradient of logp − teacher_logp with respect to the student is 1 and does not depend on the "
                f"teacher (verl's DistillationLossConfig refuses it too) — use k3 / k2 / abs, or mode: "
                f"policy_gradient"
            )
        if (self.clip_ratio_low is None) != (self.clip_ratio_high is None):
            raise ValueError(
                "distillation: clip_ratio_low and clip_ratio_high are both numbers (PPO's clip) or both None "
                f"(no clip), got {self.clip_ratio_low!r} and {self.clip_ratio_high!r}"
            )
        return self


def _requires(p: DistillationParams) -> tuple[str, ...]:
    return ("teacher_logp", "old_logp") if p.mode == "policy_gradient" else ("teacher_logp",)


def estimate(logp: Tensor, teacher: Tensor, estimator: str) -> Tensor:
    """verl's ``kl_penalty(logp, teacher, estimator)`` per token (its forward score: no ``+`` estimators here).

    >>> logp = torch.tensor([-1.0, -30.0], dtype=torch.float64)
    >>> teacher = torch.tensor([-2.0, -0.5], dtype=torch.float64)
    >>> estimate(logp, teacher, "k1"), estimate(logp, teacher, "k2")
    (tensor([ 1.0000, -29.5000], dtype=torch.float64), tensor([  0.5000, 435.1250], dtype=torch.float64))
    >>> estimate(logp, teacher, "k3")  # exp(−1) + 1 − 1; the second: δ = 29.5 → 20 → exp(20) − 21 → clamped to 10
    tensor([ 0.3679, 10.0000], dtype=torch.float64)
    """
    if estimator in ("k1", "kl"):
        return logp - teacher
    if estimator == "abs":
        return (logp - teacher).abs()
    if estimator in ("k2", "mse"):
        return 0.5 * (logp - teacher).square()
    # k3 / low_var_kl: verl's clamps, in verl's order
    delta = torch.clamp(teacher - logp, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)
    return torch.clamp(torch.exp(delta) - delta - 1, min=-MAX_K3, max=MAX_K3)


def clipped_policy_gradient(advantage: Tensor, log_ratio: Tensor, p: DistillationParams) -> Tensor:
    """verl's ``compute_policy_loss_vanilla`` per token (a loss, to minimise): ``max(−A·r, −A·clip(r))``, then
    ``min(·, −A·c)`` where ``A < 0``; ``r = exp(clamp(log_ratio, ±20))``. The clips are skipped when None."""
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    loss = -advantage * ratio
    if p.clip_ratio_low is not None and p.clip_ratio_high is not None:
        loss = torch.maximum(loss, -advantage * ratio.clamp(1 - p.clip_ratio_low, 1 + p.clip_ratio_high))
    if p.clip_ratio_c is not None:
        loss = torch.where(advantage < 0, torch.minimum(-advantage * p.clip_ratio_c, loss), loss)
    return loss


@lossplug.regularizer("distillation", params=DistillationParams, requires=_requires)
def distillation(inp: lossplug.GateInput, p: DistillationParams) -> lossplug.RegularizerOutput:
    """``coef · reduce(term)``: verl's distillation loss — a reverse-KL estimate to ``teacher_logp`` back-propagated
    (``supervised``) or its negation as the advantage of a clipped policy-gradient loss (``policy_gradient``).

    Paper: GKD, arXiv:2306.13649; Thinking Machines, 2025, *On-Policy Distillation*.

    Reference: verl 0.9.1 ``verl/trainer/distillation/losses.py`` (``distillation_loss``); AReaL 1.0.4 pure KD.
    """
    # the teacher is data: detached, and 0 off the actions like logp there, so that every estimate is 0 there and no
    # padding value (NaN included) reaches the gradient
    teacher = torch.where(inp.mask, cast(Tensor, inp.batch.teacher_logp).detach().to(inp.compute_dtype), 0)
    if p.mode == "supervised":
        term = estimate(inp.logp, teacher, p.estimator)
        if p.loss_max_clamp is not None:
            term = term.clamp(-p.loss_max_clamp, p.loss_max_clamp)
        divergence = term
    else:
        divergence = estimate(inp.logp.detach(), teacher, p.estimator)
        if p.loss_max_clamp is not None:
            divergence = divergence.clamp(-p.loss_max_clamp, p.loss_max_clamp)
        term = clipped_policy_gradient(-divergence, inp.update_log_ratio(), p)
    return lossplug.RegularizerOutput(
        term=term, metrics={"divergence_token_mean": lambda: inp.masked_mean(divergence.detach())}
    )

"""KL in the reward: every action token's reward gains ``−β · kl_t``, the classic RLHF reward of the PPO-for-LLMs
literature (Ziegler et al. 2019, arXiv:1909.08593; Stiennon et al. 2020), before the advantage::

    kl_t      = kl_penalty(old_logp_t, ref_logp_t, estimator)      on action tokens, 0 elsewhere
    reward_t  = score_t − β · kl_t                                   [B, T]

with ``score_t`` the batch's reward: a per-token ``[B, T]`` reward as it is (verl's ``token_level_scores``), a
per-response ``[B]`` score placed on the response's last action token (where verl's reward managers and TRL ≤ 0.11's
``compute_rewards`` put it). The estimator is taken on the log-probs of the policy that sampled the batch
(``old_logp``: verl's ``old_log_probs``) against the reference's — rewards are data, no gradient flows.

β is the stage's controller: ``fixed`` (verl's ``FixedKLController``) or ``adaptive`` (verl's and TRL's
``AdaptiveKLController``, Ziegler et al.): after the batch is shaped with the β in force,
``β ← β · (1 + clip(d / target − 1, −0.2, 0.2) · n / horizon)`` with ``d`` the batch's mean over responses of each
response's token-mean KL and ``n`` its number of responses — summed over ranks, so β is the same on every rank — and
saved with the trainer's checkpoint (``lossplug.controller_state``).

Reference: verl 0.9.1 ``verl.trainer.ppo.ray_trainer.apply_kl_penalty`` (``algorithm.use_kl_in_reward``,
``algorithm.kl_penalty``, ``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}``), ``core_algos.kl_penalty``,
``FixedKLController`` / ``AdaptiveKLController``; it runs :func:`lossplug.tools.kl.kl_shaped_rewards`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.control import WindowController
from lossplug.tools.kl import FixedKLController, ProportionalKLController, kl_shaped_rewards

Tensor = torch.Tensor

#: every mode verl 0.9.1's ``kl_penalty`` accepts (``lossplug.tools.kl.KL_PENALTY_MODES``)
Estimator = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"
]


class KLInRewardParams(lossplug.Params):
    estimator: Estimator = Field(
        "kl",
        description="verl's algorithm.kl_penalty: kl/k1, abs, mse/k2, low_var_kl/k3 (a '+' suffix changes only the "
        "gradient, and rewards carry none: the value is the mode's)",
    )
    coef: float = Field(
        0.001, ge=0, allow_inf_nan=False, description="β, or its initial value when adaptive (verl's kl_ctrl.kl_coef)"
    )
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="verl's kl_ctrl.type")
    target_kl: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="adaptive: the KL the controller steers to (kl_ctrl.target_kl)"
    )
    horizon: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="adaptive: responses over which β moves (kl_ctrl.horizon)"
    )

    @model_validator(mode="after")
    def _adaptive_needs_its_settings(self) -> KLInRewardParams:
        if self.controller == "adaptive":
            missing = [name for name in ("target_kl", "horizon") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"controller 'adaptive' needs {' and '.join(missing)} (verl's kl_ctrl)")
            if self.coef <= 0:
                raise ValueError("controller 'adaptive' needs coef > 0 (β multiplies itself)")
        return self


class KLRewardController(WindowController[tuple[float, float]]):
    """β of a KL-in-the-reward stage (a :class:`lossplug.StepController`): fed the batch's ``[n · d, n]`` (``d`` the
    mean over its ``n`` responses of each one's token-mean KL) and stepped once per rollout batch by the pipeline,
    the window summed over ranks first."""

    def __init__(self, p: KLInRewardParams):
        super().__init__()
        self.rule: FixedKLController | ProportionalKLController = (
            ProportionalKLController(p.coef, p.target_kl, p.horizon)  # type: ignore[arg-type]  # (validated)
            if p.controller == "adaptive"
            else FixedKLController(p.coef)
        )

    @property
    def coefficient(self) -> float:
        return self.rule.value

    def measure(self, window: Tensor) -> tuple[float, float]:
        total, responses = window.tolist()
        return total, responses

    def update(self, measured: tuple[float, float]) -> float:
        total, responses = measured
        if responses > 0:
            self.rule.update(current_kl=total / responses, n_steps=int(responses))
        return self.coefficient

    def state_dict(self) -> dict[str, Any]:
        return self.rule.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        value = state["value"]
        adaptive = isinstance(self.rule, ProportionalKLController)  # β multiplies itself: 0 would stay 0
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
            or (adaptive and value == 0)
        ):
            raise lossplug.LossplugError(
                f"'value' (β) must be a finite number {'> 0' if adaptive else '>= 0'}, got {value!r}"
            )
        self.rule.load_state_dict({"value": float(value)})
        self.reset_window()  # (what was observed before the checkpoint was loaded belongs to another run)


@lossplug.shaper(
    "kl_in_reward",
    params=KLInRewardParams,
    requires=("old_logp", "ref_logp"),
    controller=KLRewardController,
)
def kl_in_reward(inp: lossplug.RolloutInput, p: KLInRewardParams) -> lossplug.ShaperOutput:
    """Every action token's reward gains −β·KL(π_old ‖ π_ref)_t; β fixed or adaptive (verl's apply_kl_penalty)."""
    batch = inp.batch
    assert batch.reward is not None and batch.old_logp is not None and batch.ref_logp is not None
    beta = inp.coefficient
    assert beta is not None
    # (the batch's contract checked the inputs: finite log-probs on the actions, a finite reward, an action per row)
    shaped = kl_shaped_rewards(
        batch.reward,
        batch.old_logp,
        batch.ref_logp,
        batch.action_mask,
        kl_coef=beta,
        mode=p.estimator.removesuffix("+"),
        validate=False,
    )
    # the controller's window: [n · d, n] with d the mean over the n responses of each one's token-mean KL (verl's
    # current_kl, in the log-probs' dtype); n · d is exact in float64, so one process divides back to verl's d exactly
    responses = float(batch.batch_size)
    observation = torch.stack([shaped.kl_mean.to(torch.float64) * responses, torch.tensor(responses).double()])
    return lossplug.ShaperOutput(
        reward=shaped.rewards,
        metrics={"kl": shaped.kl_mean, "penalty": lambda: shaped.non_score_rewards.sum(-1).mean()},
        observation=observation,
    )

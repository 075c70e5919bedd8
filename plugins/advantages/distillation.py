"""On-policy distillation: the per-token reverse KL to a teacher, on the student's own samples, as the advantage::

    A_t = A_task,t − coef · (log π_student(a_t) − log π_teacher(a_t))        on action tokens, 0 elsewhere

``log π_student`` is ``old_logp`` (the training engine's log-prob before the update, what slime calls
``log_probs``) or, with ``student: behavior_logp``, the rollout engine's; ``log π_teacher`` is
``PolicyBatch.teacher_logp``. ``log π_s − log π_t`` is the single-sample estimate of the reverse KL
``KL(π_s ‖ π_t)`` at the visited state: the policy gradient with this advantage minimises the reverse KL of the
whole sampled sequence (mode-seeking), and a token the teacher finds likelier than the student gets a positive
advantage. The advantage is detached data, as any advantage: the gradient flows only through the gate's ratio.

``task``: an advantage estimator (a name or ``{name: …, params}``, e.g. ``grpo``) whose advantage is added — slime's
``--use-opd``, orthogonal to the estimator; its ``[B]`` advantage is broadcast over the response, its ``returns``
(for a critic) are passed on. Without it the distillation signal is the whole advantage (the blog's pure on-policy
distillation, prime-rl's ``opd`` algorithm). Advantages are ``[B, T]`` in the log-probs' dtype, at least float32.

Several teachers (MOPD, one teacher per domain) need nothing more: each row's ``teacher_logp`` is its own domain
teacher's log-probs, as verl's teacher loop routes each sample (``distillation.teacher_key``); MOPD's recipe is
``{advantage: {name: mix, components: [{name: opd, weight: 1.0}, {name: grpo, weight: α}]}, gates: [reinforce,
{name: icepop, …}], reduction: response}`` (``tests/plugins/advantages/test_mopd.py``).

Paper: Agarwal et al., 2024, *On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes*
(GKD), arXiv:2306.13649; Lu and Thinking Machines Lab, 2025, *On-Policy Distillation*,
https://thinkingmachines.ai/blog/on-policy-distillation/; Ma et al., 2026, *MOPD: Multi-Teacher On-Policy
Distillation for Capability Integration in LLM Post-Training*, arXiv:2606.30406 (its loss: Eqs. 7–9 of the
MiMo-V2-Flash Technical Report, arXiv:2601.02780, §4.4).

Reference: slime ``apply_opd_kl_to_advantages`` (``slime/backends/megatron_utils/loss.py``, THUDM/slime 624b824a:
``advantages[i] = adv − opd_kl_coef · (log_probs − teacher_log_probs)``, applied after the estimator, before any
whitening); prime-rl ``OPDAlgorithm`` (``src/prime_rl/orchestrator/algo/opd.py``: teacher log-probs from a prefill
of the student's sample). Neither is on a package index: the tests' oracle is slime's line above, transcribed.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from pydantic import Field, field_validator

import lossplug
from lossplug.contracts import LossplugError, PluginSpec
from lossplug.contracts.recipe import installed_catalogue
from lossplug.ops import Groups

Tensor = torch.Tensor


class OPDParams(lossplug.Params):
    coef: float = Field(
        1.0, allow_inf_nan=False, description="weight of the reverse-KL signal (slime's opd_kl_coef, default 1.0)"
    )
    student: Literal["old_logp", "behavior_logp"] = Field(
        "old_logp",
        description="the student's log-probs of the reverse KL: the training engine's before the update (slime) or "
        "the rollout engine's",
    )
    task: str | dict[str, Any] | None = Field(
        None,
        description="an advantage estimator (name or {name, params}) whose advantage the signal is added to, e.g. "
        "grpo; none: the distillation signal alone",
    )

    @field_validator("task")
    @classmethod
    def _known_estimator(cls, raw: str | dict[str, Any] | None) -> dict[str, Any] | None:
        if raw is None:
            return None
        spec = installed_catalogue().check_stage("advantage", PluginSpec.parse(raw, "opd.task"), "opd.task")
        if spec.name == "opd":
            raise ValueError("opd.task cannot be opd itself (the signal would be added twice)")
        return spec.to_dict()


def _task_plugin(p: OPDParams) -> tuple[lossplug.AdvantagePlugin, lossplug.Params] | None:
    if p.task is None:
        return None
    spec = PluginSpec.parse(p.task, "opd.task")
    plugin = lossplug.registry().lookup("advantage", spec.name, "opd.task")
    return plugin, plugin.params.model_validate(spec.params)


def _requires(p: OPDParams) -> tuple[str, ...]:
    task = _task_plugin(p)
    extra = () if task is None else tuple(f for f in task[0].required_fields(task[1]) if f not in ("teacher_logp",))
    return tuple(dict.fromkeys(("teacher_logp", p.student, *extra)))


def reverse_kl_signal(batch: lossplug.PolicyBatch, student: str, coef: float) -> Tensor:
    """``−coef · (student − teacher_logp)`` ``[B, T]`` on the actions, 0 elsewhere (NaN off the actions never read)."""
    student_logp = cast(Tensor, getattr(batch, student))  # required
    teacher = cast(Tensor, batch.teacher_logp)  # required
    dtype = torch.promote_types(torch.promote_types(student_logp.dtype, teacher.dtype), torch.float32)
    mask = batch.action_mask
    reverse_kl = torch.where(mask, student_logp.detach().to(dtype) - teacher.detach().to(dtype), 0)
    return torch.where(mask, -coef * reverse_kl, 0)


@lossplug.advantage("opd", params=OPDParams, requires=_requires)
def opd(batch: lossplug.PolicyBatch, p: OPDParams) -> lossplug.AdvantageResult:
    """On-policy distillation: A_t = A_task,t − coef · (logp_student,t − teacher_logp_t) on the actions.

    Paper: Agarwal et al., 2024, GKD, arXiv:2306.13649; Thinking Machines, 2025, *On-Policy Distillation*; with
    one teacher per domain (each row's ``teacher_logp`` its domain teacher's): MOPD, Ma et al., 2026,
    arXiv:2606.30406.

    Reference: slime ``apply_opd_kl_to_advantages``; prime-rl ``OPDAlgorithm``.
    """
    signal = reverse_kl_signal(batch, p.student, p.coef)
    task = _task_plugin(p)
    if task is None:
        return lossplug.AdvantageResult(advantage=signal)
    plugin, params = task
    if plugin.min_group_size > 1:
        counts = Groups.from_ids(cast(Tensor, batch.group_id)).counts  # min_group_size implies group_id required
        if bool((counts < plugin.min_group_size).any()):
            raise LossplugError(
                f"opd.task ({plugin.name}) needs at least {plugin.min_group_size} rollouts per group (group_id), "
                f"the smallest group has {int(counts.min())}"
            )
    result = plugin(batch, params)
    base = result.advantage.to(signal.dtype)
    base = base.unsqueeze(-1) if base.ndim == 1 else base
    advantage = torch.where(batch.action_mask, base + signal, 0)
    return lossplug.AdvantageResult(advantage=advantage, returns=result.returns)

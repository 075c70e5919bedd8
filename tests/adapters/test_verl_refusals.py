"""Every refusal of the verl adapter names the next step: each built-in plugin — with its defaults, and with each
setting that changes the fields it reads — through verl's own registries (the policy loss ``lossplug`` for gates,
regularizers and reductions, the advantage estimator ``lossplug`` for advantages), on a tiny micro-batch. A field verl
does not hand over is refused in the words of one table (``unfed.POLICY_UNFED``, ``unfed.ADVANTAGE_UNFED``), never
left to the batch contract's "this PolicyBatch has none"."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from verl.workers.config import ActorConfig

from lossplug import PolicyBatch
from lossplug.adapters.unfed import variants
from lossplug.adapters.verl import LossplugPolicyLossConfig, unfed
from lossplug.contracts import LossplugError
from lossplug.needs import ALWAYS

B, T = 4, 5


def policy_loss_refusal(recipe) -> str | None:
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=B,
        policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict()),
    )
    g = torch.Generator().manual_seed(0)
    try:
        get_policy_loss_fn("lossplug")(
            old_log_prob=-torch.rand(B, T, generator=g),
            log_prob=-torch.rand(B, T, generator=g),
            advantages=torch.randn(B, T, generator=g),
            response_mask=torch.ones(B, T, dtype=torch.bool),
            loss_agg_mode="token-mean",
            config=config,
        )
    except LossplugError as err:
        return str(err)
    return None


def estimator_refusal(recipe) -> str | None:
    try:
        get_adv_estimator_fn("lossplug")(
            torch.rand(B, T),
            torch.ones(B, T, dtype=torch.bool),
            index=np.array(["a", "a", "b", "b"], dtype=object),
            config={"lossplug": recipe.to_dict()},
        )
    except LossplugError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def refused() -> dict[str, str]:
    out = {}
    for variant in variants():
        refuse = estimator_refusal if variant.kind == "advantage" else policy_loss_refusal
        message = refuse(variant.recipe())
        if message is not None:
            out[f"{variant.kind} {variant.label}"] = message
    return out


def test_the_enumeration_reaches_the_refusals_a_newcomer_meets(refused):
    for label in ("advantage opd", "advantage gigpo", "advantage remax", "gate top_entropy", "reduction prompt_mean"):
        assert label in refused


def test_every_refusal_of_a_built_in_names_its_next_step(refused):
    without = {label: message for label, message in refused.items() if "Next step: " not in message}
    assert not without, "refusals without a next step:\n" + "\n".join(f"{k}: {v}" for k, v in without.items())


def test_a_field_verl_lacks_is_refused_before_the_batch_contract(refused):
    """The contract's own wording says what is missing, not what to do: the adapter refuses first."""
    late = {label: message for label, message in refused.items() if "this PolicyBatch has none" in message}
    assert not late, late


@pytest.mark.parametrize(
    "label, words",
    [
        ("advantage opd", ["teacher_logprobs", "this call did not come from it", "adv_estimator=lossplug"]),
        ("advantage gigpo", ["traj_uid", "non_tensor_batch", "adv_estimator=lossplug"]),
        ("advantage remax", ["adv_estimator=remax"]),
        ("reduction prompt_mean", ["group_id", "Next step: use a reduction"]),
        ("gate top_entropy", ["entropy", "run it in TRL"]),
    ],
)
def test_the_refusal_says_what_to_do_for_the_field(refused, label, words):
    for word in words:
        assert word in refused[label], refused[label]


def test_every_field_verl_lacks_has_a_row():
    lacking = set(PolicyBatch.FIELD_NAMES) - set(ALWAYS) - {"advantage"}
    assert lacking - unfed.POLICY_PROVIDED <= set(unfed.POLICY_UNFED)
    assert lacking - unfed.ADVANTAGE_PROVIDED <= set(unfed.ADVANTAGE_UNFED)

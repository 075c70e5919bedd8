"""``policy_loss(validate="full")`` reads the fresh ``logp`` once for the tolerance and proves its finiteness on the
actions from a sum the loss pass makes anyway: every bad value is still refused with the contract's own words,
every value off the actions is still allowed, and the loss is the same as without the check."""

import pytest
import torch

import lossplug
from lossplug import BatchValidationError, Normalizer, PolicyBatch, policy_loss
from lossplug.contracts import LossplugError

B, T = 4, 6
NAN, INF = float("nan"), float("inf")

RECIPES = {
    "ppo_clip": "dapo",
    "gspo": "gspo",
    "reinforce_no_old": {"gates": ["reinforce"], "reduction": "token"},
    "ppo_clip_kl": {
        "gates": ["ppo_clip"],
        "reduction": "token",
        "regularizers": [{"name": "kl", "coef": 0.1, "estimator": "k3"}],
    },
}


def fields(dtype=torch.float32, *, old=True):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -2:] = False
    mask[0, -2] = True
    out = {
        "logp": (-torch.rand(B, T, generator=g) - 0.1).to(dtype).requires_grad_(True),
        "action_mask": mask,
        "advantage": torch.randn(B, generator=g),
        "ref_logp": -torch.rand(B, T, generator=g),
    }
    if old:
        out["old_logp"] = (-torch.rand(B, T, generator=g) - 0.1).to(dtype)
    return out


def with_logp_at(f, row, pos, value):
    logp = f["logp"].detach().clone()
    logp[row, pos] = value
    return {**f, "logp": logp.requires_grad_(True)}


def recipe_for(name):
    return (
        lossplug.Recipe.load(RECIPES[name])
        if isinstance(RECIPES[name], str)
        else lossplug.Recipe.model_validate(RECIPES[name])
    )


@pytest.mark.parametrize("metrics", ["basic", "off", "full"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("value", [NAN, INF, -INF, 0.5])
def test_a_bad_logp_on_an_action_is_the_contracts_error(recipe, metrics, value):
    f = with_logp_at(fields(old=recipe != "reinforce_no_old"), 2, 1, value)
    with pytest.raises(BatchValidationError) as info:
        policy_loss(PolicyBatch.unchecked(**f), recipe_for(recipe), metrics=metrics)
    message = str(info.value)
    assert "logp:" in message and "(row 2, pos 1)" in message
    # the very same words as the contract's own check
    with pytest.raises(BatchValidationError) as direct:
        PolicyBatch(**f)
    assert str(direct.value) == message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_anything_off_the_actions_is_allowed_and_the_loss_is_unchanged(recipe, dtype):
    f = fields(dtype, old=recipe != "reinforce_no_old")
    for pos, value in ((-1, NAN), (-2, INF)):
        f = with_logp_at(f, 1, pos, value)  # off the actions (row 1's last two positions are padding)
    f = with_logp_at(f, 3, -1, 7.5)
    checked = policy_loss(PolicyBatch.unchecked(**f), recipe_for(recipe), validate="full")
    plain = policy_loss(PolicyBatch.unchecked(**f), recipe_for(recipe), validate="off")
    assert torch.equal(checked.loss, plain.loss) and torch.isfinite(checked.loss)


def test_a_value_at_the_tolerance_passes_and_just_above_it_fails():
    tolerance = lossplug.contracts.LOGP_TOLERANCE
    at = with_logp_at(fields(torch.float64), 0, 0, tolerance)
    policy_loss(PolicyBatch.unchecked(**at), "dapo")
    above = with_logp_at(fields(torch.float64), 0, 0, tolerance * 1.001)
    with pytest.raises(BatchValidationError, match=r"log-probs must be <= 0 .*\(row 0, pos 0\)"):
        policy_loss(PolicyBatch.unchecked(**above), "dapo")


def test_a_regularizer_that_trips_over_a_non_finite_logp_does_not_take_the_blame():
    f = with_logp_at(fields(), 0, 2, -INF)
    with pytest.raises(BatchValidationError, match=r"logp: must be finite on action positions"):
        policy_loss(PolicyBatch.unchecked(**f), recipe_for("ppo_clip_kl"))


def test_the_batch_is_validated_only_by_a_complete_check():
    batch = PolicyBatch.unchecked(**fields())
    policy_loss(batch, "dapo")
    assert not batch.validated  # its logp was checked for this loss; a later use checks it again
    assert batch.check() == () and batch.validated


def test_the_normalizer_must_still_cover_the_micro_batch():
    with pytest.raises(LossplugError, match="smaller than this micro-batch alone"):
        policy_loss(PolicyBatch.unchecked(**fields()), "dapo", Normalizer(action_tokens=3, sequences=B))
    policy_loss(PolicyBatch.unchecked(**fields()), "dapo", Normalizer(action_tokens=17, sequences=B))

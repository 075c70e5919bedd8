"""The ``entropy`` regularizer against the trainers' own code, in float64, loss and gradient (≤ 1e-8 relative):

* the static bonus against verl 0.9.1's ``ppo_loss`` term ``−entropy_coeff · agg_loss(entropy, response_mask,
  loss_agg_mode, **global_batch_info)`` (the recipe's reduction over the step's population), micro-batch by
  micro-batch;
* the static bonus against TRL 1.16's own ``GRPOTrainer._compute_loss`` (a token mean per micro-batch, divided by the
  gradient-accumulation steps: ``reduction: token, population: micro_batch`` under the TRL adapter's Normalizer);
* the adaptive coefficient (``use_adaptive_entropy``) against the same TRL code over several optimizer steps of two
  micro-batches each — losses, gradients, ``entropy_coef`` and ``last_world_entropy`` after every step — with a
  checkpoint save/load round trip (TRL's ``entropy_ctrl_state.json`` content) in the middle.
"""

from __future__ import annotations

import json

import pytest
import torch

import lossplug
from lossplug import Normalizer, PolicyBatch, Recipe

RTOL = 1e-8
VERL_AGG = {"token": "token-mean", "token_sum": "token-sum", "sequence_sum": "seq-mean-token-sum"}


def micro_batches(n=2, B=3, T=6, seed=0, level=1.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        logp = -(0.05 + 2.0 * torch.rand(B, T, generator=g, dtype=torch.float64))
        entropy = level * 2 * torch.rand(B, T, generator=g, dtype=torch.float64)
        mask = torch.rand(B, T, generator=g) > 0.3
        mask[:, 0] = True
        adv = torch.randn(B, generator=g, dtype=torch.float64)
        out.append((logp, entropy, mask, adv))
    return out


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-12)


def run(recipe, logp, entropy, mask, adv, normalizer=None, *, observe=True):
    """loss, d loss/d logp, d loss/d entropy."""
    leaf, ent = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    batch = PolicyBatch(logp=leaf, entropy=ent, action_mask=mask, advantage=adv, old_logp=logp)
    result = lossplug.policy_loss(batch, recipe, normalizer, observe=observe)
    g_logp, g_ent = torch.autograd.grad(result.loss, (leaf, ent))
    return result, g_logp, g_ent


@pytest.mark.parametrize("reduction", sorted(VERL_AGG))
def test_static_bonus_is_verls_entropy_term(reduction):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    coef = 0.003
    recipe = Recipe.load(
        {"gates": ["reinforce"], "reduction": reduction, "regularizers": [{"name": "entropy", "coef": coef}]}
    )
    parts = micro_batches(3)
    norm = Normalizer.for_masks([m for _, _, m, _ in parts])
    for logp, entropy, mask, _ in parts:
        zero = torch.zeros(mask.shape[0], dtype=torch.float64)  # the policy term: exactly 0, no gradient
        result, _, g_ent = run(recipe, logp, entropy, mask, zero, norm)
        ent = entropy.clone().requires_grad_()
        expected = -coef * core_algos.agg_loss(
            ent,
            mask,
            VERL_AGG[reduction],
            dp_size=1,
            batch_num_tokens=norm.action_tokens,
            global_batch_size=norm.sequences,
        )
        (expected_grad,) = torch.autograd.grad(expected, ent)
        assert_close(result.loss, expected)
        assert_close(g_ent, expected_grad)


def trl_recipe(**entropy):
    return Recipe.load(
        {
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": "token",
            "regularizers": [{"name": "entropy", "reduction": "token", "population": "micro_batch", **entropy}],
        }
    )


def trl_normalizer(parts):
    """The TRL adapter's Normalizer (population 'generation', one process, steps_per_generation = accumulation):
    its scale num_processes × steps_per_generation / accumulation is 1."""
    masks = [m for _, _, m, _ in parts]
    return Normalizer(action_tokens=int(sum(m.sum() for m in masks)), sequences=sum(m.shape[0] for m in masks))


def assert_micro_batches_match_trl(trainer, recipe, parts, norm):
    """Each micro-batch's loss and its gradients (logp and entropy) against TRL's ``compute_loss`` on the same one;
    the last of two micro-batches syncs gradients."""
    for i, (logp, entropy, mask, adv) in enumerate(parts):
        result, g_logp, g_ent = run(recipe, logp, entropy, mask, adv, norm)
        leaf, ent = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
        expected = trainer.compute_loss(
            leaf, ent, mask, adv, old_logp=logp, sync_gradients=i == 1, num_items_in_batch=norm.action_tokens
        )
        e_logp, e_ent = torch.autograd.grad(expected, (leaf, ent))
        assert_close(result.loss, expected)
        assert_close(g_logp, e_logp)
        assert_close(g_ent, e_ent)


def test_static_bonus_is_trls(fake_grpo):
    parts = micro_batches(2)
    trainer = fake_grpo(loss_type="dapo", entropy_coef=0.02, gradient_accumulation_steps=2)
    recipe = trl_recipe(coef=0.02)
    norm = trl_normalizer(parts)
    assert_micro_batches_match_trl(trainer, recipe, parts, norm)


def test_adaptive_coefficient_follows_trl_step_by_step_across_a_checkpoint(fake_grpo):
    config = dict(coef_min=0.0, coef_max=0.012, coef_delta=0.005, target=0.9)
    trl_args = dict(
        entropy_coef=0.004,
        use_adaptive_entropy=True,
        entropy_coef_min=config["coef_min"],
        entropy_coef_max=config["coef_max"],
        entropy_coef_delta=config["coef_delta"],
        entropy_target=config["target"],
    )
    trainer = fake_grpo(loss_type="dapo", gradient_accumulation_steps=2, **trl_args)
    recipe = trl_recipe(coef=0.004, adaptive=True, **config)
    # the entropy level per step: below the target (bonus on, coef up), above (coef down), …
    levels = [0.6, 0.5, 0.4, 1.2, 1.3, 0.6, 0.5]
    applied, coefs = [], []
    for step, level in enumerate(levels):
        if step == 3:  # checkpoint and resume: a new trainer and a new recipe object, state from the files
            saved = json.loads(json.dumps(lossplug.controller_state(recipe)))
            trl_saved = {"entropy_coef": trainer.entropy_coef, "last_world_entropy": trainer._last_world_entropy}
            assert saved == {"regularizers[0]": trl_saved}  # the same content as TRL's entropy_ctrl_state.json
            trainer = fake_grpo(loss_type="dapo", gradient_accumulation_steps=2, **trl_args)
            trainer.entropy_coef, trainer._last_world_entropy = (
                trl_saved["entropy_coef"],
                trl_saved["last_world_entropy"],
            )
            recipe = trl_recipe(coef=0.004, adaptive=True, **config)
            lossplug.load_controller_state(recipe, saved)
        parts = micro_batches(2, seed=step, level=level)
        norm = trl_normalizer(parts)
        (controller,) = lossplug.controllers(recipe).values()
        applied.append(controller.coefficient)
        assert_micro_batches_match_trl(trainer, recipe, parts, norm)
        controller.step()  # the optimizer-step boundary (one process: no all-reduce)
        assert controller.entropy_coef == pytest.approx(trainer.entropy_coef, rel=1e-12, abs=1e-15)
        assert controller.last_world_entropy == pytest.approx(trainer._last_world_entropy, rel=1e-12)
        coefs.append(controller.entropy_coef)
    # the run went both ways and hit the bounds: first window off (inf), then on while below the target
    assert applied[0] == 0.0 and any(a > 0 for a in applied) and 0.0 in applied[1:]
    assert max(coefs) == config["coef_max"] and min(coefs) < max(coefs)


def test_evaluation_does_not_move_the_coefficient():
    recipe = trl_recipe(coef=0.01, adaptive=True, target=5.0)
    (controller,) = lossplug.controllers(recipe).values()
    logp, entropy, mask, adv = micro_batches(1)[0]
    run(recipe, logp, entropy, mask, adv, observe=False)
    assert controller.step() == 0.0  # nothing observed: no measurement yet, so no bonus applies
    assert controller.entropy_coef == 0.01 and controller.last_world_entropy == float("inf")
    run(recipe, logp, entropy, mask, adv)
    assert controller.step() == 0.015  # below the target: coef + delta, and it applies
    expected = float(torch.where(mask, entropy, 0).sum() / mask.sum())
    assert controller.last_world_entropy == pytest.approx(expected) and controller.entropy_coef == 0.015


def test_the_bonus_rewards_entropy_and_reports_it():
    logp, entropy, mask, adv = micro_batches(1)[0]
    recipe = Recipe.load(
        {"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": "entropy", "coef": 0.5}]}
    )
    result, _, g_ent = run(recipe, logp, entropy, mask, torch.zeros_like(adv))
    mean = torch.where(mask, entropy, 0).sum() / mask.sum()
    assert_close(result.loss, -0.5 * mean)
    assert (g_ent[mask] < 0).all() and (g_ent[~mask] == 0).all()  # descending the loss raises the entropy
    m = result.metrics
    assert m["reg/entropy/entropy"] == pytest.approx(float(mean)) and m["reg/entropy/coef"] == 0.5
    assert m["reg/entropy/value"] == pytest.approx(-float(mean))


def test_needs_entropy_and_checks_its_bounds():
    logp, entropy, mask, adv = micro_batches(1)[0]
    recipe = Recipe.load({"gates": ["reinforce"], "reduction": "token", "regularizers": "entropy"})
    with pytest.raises(
        lossplug.BatchValidationError, match=r"entropy: required by recipe.regularizers\[0\] \(entropy\)"
    ):
        lossplug.policy_loss(PolicyBatch(logp=logp, action_mask=mask, advantage=adv), recipe)
    with pytest.raises(lossplug.RecipeError, match=r"coef_min \(0.5\) must be <= coef_max \(0.1\)"):
        trl_recipe(adaptive=True, coef_min=0.5, coef_max=0.1)

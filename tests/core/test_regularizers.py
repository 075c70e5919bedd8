"""The regularizer stage of the pipeline: loss = −reduce(objective) + Σ coef · reduce(term), each term reduced with
the recipe's reduction (or its own) over the step's population, never multiplied by correction weights; metrics;
bad plugin output; the decorator; explain / needs / list."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

import lossplug
from lossplug import Normalizer, PolicyBatch, Recipe, RecipeError, policy_loss, reduce


def fields(B=6, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -(0.05 + 2 * torch.rand(B, T, generator=g, dtype=torch.float64))
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return dict(
        logp=logp,
        action_mask=mask,
        old_logp=(logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3),
        behavior_logp=(logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3),
        ref_logp=(logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3),
        entropy=2 * torch.rand(B, T, generator=g, dtype=torch.float64),
        advantage=torch.randn(B, generator=g, dtype=torch.float64),
    )


def loss_of(recipe, f, normalizer=None, **kw):
    leaf = f["logp"].clone().requires_grad_()
    result = policy_loss(PolicyBatch(**{**f, "logp": leaf}), recipe, normalizer, **kw)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result, grad


GATES = ["ppo_clip", "icepop"]  # an update gate and a correction: the correction weights the policy term only


def test_loss_is_policy_term_plus_each_coefficient_times_its_reduced_term():
    f = fields()
    plain = Recipe.load({"gates": GATES, "reduction": "response"})
    regularized = Recipe.load(
        {
            "gates": GATES,
            "reduction": "response",
            "regularizers": [
                {"name": "kl", "coef": 0.3, "estimator": "k1"},
                {"name": "entropy", "coef": 0.02, "reduction": "token"},
            ],
        }
    )
    base, _ = loss_of(plain, f)
    result, _ = loss_of(regularized, f)
    kl = reduce(f["logp"] - f["ref_logp"], f["action_mask"], plain)  # the recipe's reduction, no correction weight
    bonus = reduce(-f["entropy"], f["action_mask"], reduction="token")  # its own reduction
    torch.testing.assert_close(result.loss, base.loss + 0.3 * kl + 0.02 * bonus, rtol=1e-12, atol=1e-14)
    m = result.metrics
    assert m["policy/loss"] == pytest.approx(float(base.loss.detach()))
    assert m["loss"] == pytest.approx(float(result.loss.detach()))
    assert m["reg/kl/value"] == pytest.approx(float(kl)) and m["reg/kl/coef"] == pytest.approx(0.3)
    assert m["reg/entropy/value"] == pytest.approx(float(bonus))


def test_neither_correction_weights_nor_the_trainers_weight_multiply_a_term():
    f = fields()
    spec = [{"name": "kl", "coef": 1.0}]
    only_kl = {"gates": ["reinforce"], "reduction": "token", "regularizers": spec}
    zero = {**f, "advantage": torch.zeros_like(f["advantage"])}  # policy term 0: the loss is the KL alone
    a, ga = loss_of(Recipe.load(only_kl), zero)
    b, gb = loss_of(Recipe.load({**only_kl, "gates": ["reinforce", "icepop"]}), zero)
    c, gc = loss_of(Recipe.load(only_kl), zero, weight=torch.full((6,), 3.0, dtype=torch.float64))
    for r, g in ((b, gb), (c, gc)):
        torch.testing.assert_close(r.loss, a.loss, rtol=0, atol=0)
        torch.testing.assert_close(g, ga, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["response", "token", "fixed", "sequence_sum", "token_sum"])
def test_micro_batch_losses_add_up_to_the_full_batch(reduction):
    f = fields()
    red = {"name": reduction, "budget": 8} if reduction == "fixed" else reduction
    recipe = Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": red,
            "regularizers": [{"name": "kl", "coef": 0.2, "estimator": "k3+"}, {"name": "entropy", "coef": 0.05}],
        }
    )
    norm = Normalizer.for_masks([f["action_mask"]], budget=8)
    full, full_grad = loss_of(recipe, f, norm)
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(f["logp"])
    for rows in ([0, 3], [1], [2, 4, 5]):
        idx = torch.tensor(rows)
        part, g = loss_of(recipe, {k: v[idx] for k, v in f.items()}, norm)
        total, grad[idx] = total + part.loss, g
    torch.testing.assert_close(total, full.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-14)


def test_micro_batch_population_is_the_mean_of_micro_batch_means():
    f = fields()
    recipe = Recipe.load(
        {
            "gates": ["reinforce"],
            "reduction": "response",
            "regularizers": [{"name": "entropy", "coef": 1.0, "reduction": "token", "population": "micro_batch"}],
        }
    )
    zero = {**f, "advantage": torch.zeros_like(f["advantage"])}
    splits = ([0, 1, 2], [3, 4, 5])
    norm = Normalizer.for_masks([f["action_mask"]])
    total = sum(loss_of(recipe, {k: v[torch.tensor(r)] for k, v in zero.items()}, norm)[0].loss for r in splits)
    means = [torch.where(f["action_mask"][r], f["entropy"][r], 0).sum() / f["action_mask"][r].sum() for r in splits]
    torch.testing.assert_close(total, -sum(means) / 2, rtol=1e-12, atol=1e-14)
    # without a Normalizer the micro-batch is the population: its own token mean
    alone, _ = loss_of(recipe, zero)
    torch.testing.assert_close(
        alone.loss, -torch.where(f["action_mask"], f["entropy"], 0).sum() / f["action_mask"].sum()
    )


def test_the_same_regularizer_twice_reports_both():
    f = fields()
    recipe = Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": "token",
            "regularizers": [{"name": "kl", "estimator": "k1"}, {"name": "kl", "estimator": "k2"}],
        }
    )
    metrics = loss_of(recipe, f)[0].metrics
    assert {"reg/kl.0/value", "reg/kl.1/value"} <= set(metrics) and "reg/kl/value" not in metrics


def test_metric_levels():
    f = fields()
    recipe = Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": ["kl"]})
    off, basic, full = (loss_of(recipe, f, metrics=m)[0] for m in ("off", "basic", "full"))
    assert off.metrics == {} and off.loss == basic.loss == full.loss
    assert {"reg/kl/value", "reg/kl/coef", "reg/kl/token_mean", "policy/loss"} <= set(basic.metrics)
    assert set(basic.metrics) <= set(full.metrics)
    plain = loss_of(Recipe.load({"gates": ["ppo_clip"], "reduction": "token"}), f)[0]
    assert not any(k.startswith(("reg/", "policy/")) for k in plain.metrics)  # unchanged without regularizers


class _P(lossplug.RegularizerParams):
    coef: float = Field(1.0, description="c")


@pytest.fixture
def register_regularizers():
    registered = []

    def register(*plugins):
        module = type("M", (), {})()
        module.lossplug_register_regularizers = lossplug.hookimpl(
            lambda register: [register(p) for p in plugins] and None
        )
        module.lossplug_register_regularizers.__name__ = "lossplug_register_regularizers"
        lossplug.register_plugin(module, name=f"test-regularizers-{len(registered)}")
        registered.append(module)

    yield register
    for module in registered:
        lossplug.unregister_plugin(module)


def test_bad_output_is_a_plugin_error_naming_the_stage(register_regularizers):
    @lossplug.regularizer("wrong_shape", params=_P)
    def wrong_shape(inp, p):
        """[B] instead of [B, T]."""
        return inp.logp.sum(-1)

    @lossplug.regularizer("not_finite", params=_P)
    def not_finite(inp, p):
        """inf on every action."""
        return torch.where(inp.mask, float("inf"), 0.0) + 0 * inp.logp

    @lossplug.regularizer("not_an_output", params=_P)
    def not_an_output(inp, p):
        """A dict."""
        return {"term": inp.logp}

    register_regularizers(wrong_shape, not_finite, not_an_output)
    f = fields()
    for name, message in (
        (
            "wrong_shape",
            r"recipe.regularizers\[0\] \(wrong_shape, .*\): a regularizer's term must be a tensor of shape \[6, 8\]",
        ),
        ("not_finite", r"not_finite.*its term is not finite on action positions"),
        ("not_an_output", r"must return a lossplug.RegularizerOutput or a \[B, T\] tensor, got dict"),
    ):
        recipe = Recipe.load({"gates": ["reinforce"], "reduction": "token", "regularizers": [name]})
        with pytest.raises(lossplug.PluginError, match=message):
            policy_loss(PolicyBatch(**f), recipe)


def test_the_decorator_wants_regularizer_params():
    with pytest.raises(lossplug.LossplugError, match="params must subclass lossplug.RegularizerParams"):
        lossplug.regularizer("plain_params", params=lossplug.NoParams)


def test_a_tensor_return_is_the_term(register_regularizers):
    @lossplug.regularizer("neg_logp", params=_P)
    def neg_logp(inp, p):
        """−logp."""
        return -inp.logp

    register_regularizers(neg_logp)
    f = {**fields(), "advantage": torch.zeros(6, dtype=torch.float64)}
    recipe = Recipe.load({"gates": ["reinforce"], "reduction": "token_sum", "regularizers": ["neg_logp"]})
    result, grad = loss_of(recipe, f)
    torch.testing.assert_close(result.loss, -torch.where(f["action_mask"], f["logp"], 0).sum())
    torch.testing.assert_close(grad, -f["action_mask"].to(torch.float64))


def test_explain_needs_list_and_show():
    from lossplug.cli.describe import explain_recipe, plugin_info
    from lossplug.needs import recipe_needs

    recipe = Recipe.load(
        {
            "gates": ["ppo_clip"],
            "reduction": "token",
            "regularizers": [{"name": "kl", "ratio_weight": "token"}, {"name": "entropy", "adaptive": True}],
        }
    )
    needs = recipe_needs(recipe)
    assert needs["ref_logp"] == ("regularizers[0] 'kl'",) and needs["entropy"] == ("regularizers[1] 'entropy'",)
    stages = {row["stage"]: row for row in explain_recipe(recipe)["stages"]}
    assert stages["regularizers[0]"]["role"] == "+ coef · token(term)"
    assert stages["regularizers[1]"]["role"] == "+ coef · token(term), adaptive coefficient"
    rows = {(r["kind"], r["name"]): r for r in lossplug.list_plugins()}
    assert rows[("regularizer", "kl")]["requires"] == ["ref_logp"]
    info = plugin_info("regularizer", "entropy", lossplug.registry().plugins["regularizer"]["entropy"], "x")
    assert info["needs"] == ["logp", "action_mask", "entropy"]


# ---------------------------------------------------------------------------------------------------------------------
# lossplug 0.1.0's spelling (regulariser) keeps working


def test_the_earlier_spelling_still_loads_recipes_names_and_hooks():
    import lossplug

    assert lossplug.RegulariserOutput is lossplug.RegularizerOutput
    assert lossplug.RegulariserParams is lossplug.RegularizerParams
    assert lossplug.RegulariserPlugin is lossplug.RegularizerPlugin
    assert lossplug.regulariser is lossplug.regularizer
    assert not any("Regularis" in name or "regularis" in name for name in lossplug.__all__)

    old = Recipe.model_validate(
        {"gates": ["ppo_clip"], "reduction": "token", "regularisers": [{"name": "kl", "coef": 0.1}]}
    )
    new = Recipe.model_validate(
        {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [{"name": "kl", "coef": 0.1}]}
    )
    assert old == new and "regularizers" in old.to_dict() and "regularisers" not in old.to_dict()
    with pytest.raises(RecipeError, match="old spelling of 'regularizers'"):
        Recipe.model_validate({"gates": ["ppo_clip"], "reduction": "token", "regularisers": [], "regularizers": []})


def test_a_plugin_implementing_the_earlier_hook_name_is_still_registered():
    import lossplug

    @lossplug.regularizer("legacy_square")
    def legacy_square(inp, p):
        """legacy_square: logp²."""
        return inp.logp**2

    class Legacy:
        @lossplug.hookimpl
        def lossplug_register_regularisers(self, register):
            register(legacy_square)

    plugin = Legacy()
    with pytest.warns(DeprecationWarning, match="lossplug_register_regularizers"):
        lossplug.register_plugin(plugin, "legacy-plugin")
        registered = lossplug.registry().plugins["regularizer"]
    try:
        assert registered["legacy_square"] is legacy_square
    finally:
        lossplug.unregister_plugin(plugin)

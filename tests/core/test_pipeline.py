"""policy_loss / compute_advantages / reduce: worked examples, exactness under a Normalizer, checks, hooks."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug import (
    BatchValidationError,
    LossplugError,
    Normalizer,
    PolicyBatch,
    Recipe,
    Violation,
    compute_advantages,
    policy_loss,
)

NAN = float("nan")
REDUCTIONS = ["response", "token", "fixed", "sequence_sum", "token_sum"]


def recipe_for(reduction, **params):
    return Recipe.model_validate({"gates": "ppo_clip", "reduction": {"name": reduction, **params}})


def reduction_example_batch(mask=None):
    # the reductions (response mean, DAPO's token mean arXiv:2503.14476, Dr. GRPO's fixed budget arXiv:2503.20783),
    # worked example: per-token values with NaN at masked positions. With logp == old_logp the
    # ratio is 1 and the PPO objective is exactly the advantage, so the advantage carries the example's values.
    values = torch.tensor([[2.0, NAN, NAN, NAN], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool) if mask is None else mask
    logp = torch.full((2, 4), -0.5)
    return dict(logp=logp, old_logp=logp.clone(), action_mask=mask, advantage=values)


@pytest.mark.parametrize(
    "reduction,params,expected",
    [
        ("response", {}, 1.5),
        ("token", {}, 1.2),
        ("fixed", {"budget": 4}, 0.75),
        ("sequence_sum", {}, 3.0),
        ("token_sum", {}, 6.0),
    ],
)
def test_reduction_worked_example(reduction, params, expected):
    result = policy_loss(PolicyBatch(**reduction_example_batch()), recipe_for(reduction, **params))
    assert -result.loss == pytest.approx(expected)
    assert math.isfinite(result.metrics["loss"])


def test_reduction_example_rejects_an_empty_response():
    with pytest.raises(BatchValidationError, match="every response needs at least one action token — row \\[0\\]"):
        PolicyBatch(**reduction_example_batch(torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)))


def test_fixed_needs_a_budget_from_recipe_or_normalizer():
    batch = PolicyBatch(**reduction_example_batch())
    with pytest.raises(LossplugError, match="reduction 'fixed' needs a positive budget"):
        policy_loss(batch, recipe_for("fixed"))
    norm = Normalizer(action_tokens=5, sequences=2, budget=4)
    assert -policy_loss(batch, recipe_for("fixed"), norm).loss == pytest.approx(0.75)


def test_ppo_worked_example_objective_and_gradient_signs():
    # PPO's sign-aware clip (arXiv:1707.06347), worked example: ratios [1.3, .7, 1.3, .7], advantages
    # [1, 1, -1, -1], eps 0.2.
    # Log-probs are shifted by −1 on both sides (the contract rejects positive log-probs); the ratio is unchanged.
    ratio = torch.tensor([1.3, 0.7, 1.3, 0.7])
    logp = (ratio.log() - 1).unsqueeze(-1).requires_grad_()
    batch = PolicyBatch(
        logp=logp,
        old_logp=torch.full((4, 1), -1.0),
        action_mask=torch.ones(4, 1, dtype=torch.bool),
        advantage=torch.tensor([1.0, 1.0, -1.0, -1.0]),
    )
    result = policy_loss(batch, recipe_for("response"), metrics="full")
    # response mean of one-token responses = mean of the objectives [1.2, .7, -1.3, -.8]
    assert -result.loss.item() == pytest.approx((1.2 + 0.7 - 1.3 - 0.8) / 4)
    result.loss.backward()
    grad = logp.grad.squeeze(-1)
    assert grad[0] == 0 and grad[3] == 0  # clipped: A>0 above 1+ε, A<0 below 1−ε
    assert grad[1] < 0 and grad[2] > 0  # loss gradients: the raw branch keeps its gradient
    m = result.metrics
    assert m["ppo_clip/clip_frac_high"] == 0.25 and m["ppo_clip/clip_frac_low"] == 0.25
    assert m["effective/token_frac"] == 0.5 and m["ppo_clip/active_token_frac"] == 0.5


def test_grpo_rloo_worked_example_through_compute_advantages():
    reward = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    batch = PolicyBatch(
        logp=torch.zeros(6, 1),
        action_mask=torch.ones(6, 1, dtype=torch.bool),
        reward=reward,
        group_id=torch.tensor([0, 0, 0, 1, 1, 1]),
    )
    rloo = compute_advantages(batch, Recipe.preset("rloo"))
    torch.testing.assert_close(rloo[:3], 1.5 * (reward[:3] - reward[:3].mean()))
    threshold_grpo = Recipe.model_validate(
        {
            "advantage": {"name": "grpo", "std": "population", "eps": 1e-6, "eps_mode": "threshold"},
            "gates": "ppo_clip",
            "reduction": "token",
        }
    )
    grpo = compute_advantages(batch, threshold_grpo)
    torch.testing.assert_close(grpo.view(2, 3).mean(1), torch.zeros(2))
    assert torch.count_nonzero(grpo[3:]) == 0


def test_rloo_refuses_singleton_groups_naming_them():
    batch = PolicyBatch(
        logp=torch.zeros(3, 1),
        action_mask=torch.ones(3, 1, dtype=torch.bool),
        reward=torch.tensor([0.0, 1.0, 1.0]),
        group_id=torch.tensor([4, 4, 9]),
    )
    with pytest.raises(
        BatchValidationError,
        match=r"recipe.advantage \(rloo\) needs at least 2 rollouts per group — "
        r"groups \[9\] have fewer",
    ):
        compute_advantages(batch, "rloo")


@st.composite
def micro_batched(draw):
    B = draw(st.integers(2, 7))
    T = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=3)))
    seed = draw(st.integers(0, 2**16))
    return B, T, lengths, cuts, seed


@given(micro_batched(), st.sampled_from(REDUCTIONS))
def test_micro_batches_under_a_normalizer_sum_to_the_full_batch(case, reduction):
    B, T, lengths, cuts, seed = case
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(-1)
    base = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    old = base + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old = old.clamp(max=0)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    recipe = recipe_for(reduction, **({"budget": 8} if reduction == "fixed" else {}))

    full_logp = base.clone().requires_grad_()
    full = policy_loss(PolicyBatch(logp=full_logp, old_logp=old, action_mask=mask, advantage=adv), recipe)
    full.loss.backward()

    norm = Normalizer.for_masks([mask])
    micro_logp = base.clone().requires_grad_()
    total = 0
    bounds = [0, *cuts, B]
    for lo, hi in zip(bounds, bounds[1:]):
        part = PolicyBatch(logp=micro_logp[lo:hi], old_logp=old[lo:hi], action_mask=mask[lo:hi], advantage=adv[lo:hi])
        total = total + policy_loss(part, recipe, norm).loss
    total.backward()
    torch.testing.assert_close(total, full.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_population_micro_batch_is_each_micro_batchs_own_value_weighted_by_the_normalizer(reduction):
    """``population: micro_batch``: the micro-batch's own denominators (the Normalizer's budget kept), its value
    weighted by 1 / micro_batches, else by rows / sequences — a mean of per-micro-batch values (not additive)."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([1, 4, 2, 3, 3, 1])
    mask = torch.arange(4) < lengths[:, None]
    logp = -torch.rand(6, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    budget = {"budget": 8} if reduction == "fixed" else {}
    local = recipe_for(reduction, population="micro_batch")
    step = recipe_for(reduction)
    parts = [(0, 2), (2, 6)]

    def loss(recipe, lo, hi, norm=None):
        batch = PolicyBatch(logp=logp[lo:hi], old_logp=logp[lo:hi], action_mask=mask[lo:hi], advantage=adv[lo:hi])
        return policy_loss(batch, recipe, norm).loss

    own = [loss(step, lo, hi, Normalizer.for_masks([mask[lo:hi]], budget=8.0)) for lo, hi in parts]
    counted = Normalizer.for_masks([mask], budget=8.0, micro_batches=len(parts))
    torch.testing.assert_close(sum(loss(local, lo, hi, counted) for lo, hi in parts), sum(own) / len(parts))
    by_rows = Normalizer.for_masks([mask], budget=8.0)
    torch.testing.assert_close(
        sum(loss(local, lo, hi, by_rows) for lo, hi in parts), sum(o * (hi - lo) / 6 for o, (lo, hi) in zip(own, parts))
    )
    if budget:  # without a Normalizer the micro-batch is its own population either way
        return
    torch.testing.assert_close(loss(local, 0, 6), loss(step, 0, 6))
    values = torch.where(mask, adv[:, None].expand(6, 4), 0)
    torch.testing.assert_close(
        lossplug.reduce(
            values[:2], mask[:2], reduction={"name": reduction, "population": "micro_batch"}, normalizer=counted
        ),
        lossplug.reduce(values[:2], mask[:2], reduction=reduction) / 2,
    )


def test_the_kit_sees_which_micro_batch_populations_stay_additive():
    """Weighted by its rows' share (a Normalizer without micro_batches), a micro-batch's own response mean is its
    share of the step's: additive; its own token mean (TRL's bnpo) is not, by design."""
    from lossplug.testing import check_plugin

    local = {"population": "micro_batch"}
    assert check_plugin("response", kind="reduction", params=local, checks=["microbatch_split"]).ok
    assert not check_plugin("token", kind="reduction", params=local, checks=["microbatch_split"]).ok


def test_a_regularizer_reduces_over_the_micro_batch_when_its_reduction_says_so():
    logp = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, -0.9]], dtype=torch.float64)
    ref = logp - 0.25
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    batch = PolicyBatch(logp=logp, old_logp=logp, ref_logp=ref, action_mask=mask, advantage=torch.zeros(2))
    norm = Normalizer(action_tokens=50, sequences=10, micro_batches=4)
    values = {}
    for reg in (
        {"name": "kl", "coef": 1.0, "estimator": "k1", "reduction": {"name": "token", "population": "micro_batch"}},
        {"name": "kl", "coef": 1.0, "estimator": "k1", "reduction": "token", "population": "micro_batch"},
        {"name": "kl", "coef": 1.0, "estimator": "k1", "reduction": "token"},
    ):
        recipe = Recipe.load({"gates": "reinforce", "reduction": "token", "regularizers": [reg]})
        values[len(values)] = policy_loss(batch, recipe, norm).loss.item()
    assert values[0] == pytest.approx(0.25 / 4) and values[1] == pytest.approx(0.25 / 4)
    assert values[2] == pytest.approx(0.25 * 5 / 50)


def test_missing_fields_are_named_with_who_needs_them():
    batch = PolicyBatch(logp=torch.zeros(2, 2), action_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(BatchValidationError) as info:
        policy_loss(batch, "dapo")
    msg = str(info.value)
    assert "advantage: required by policy_loss" in msg
    assert (
        "old_logp: required by recipe.gates[0] (ppo_clip), but this PolicyBatch has none (for a single on-policy "
        "step pass old_logp=logp.detach())" in msg
    )
    with pytest.raises(BatchValidationError, match="reward: required by recipe.advantage \\(grpo\\)"):
        compute_advantages(batch.replace(group_id=torch.tensor([0, 0])), "dapo")


def test_validate_off_skips_checks_and_full_checks_unchecked_batches():
    fields = reduction_example_batch()
    fields["logp"] = fields["logp"].clone()
    fields["logp"][1, 0] = 3.0  # positive log-prob on an action: a contract violation
    batch = PolicyBatch.unchecked(**fields)
    policy_loss(batch, "dapo", validate="off")
    with pytest.raises(BatchValidationError, match="log-probs must be <= 0"):
        policy_loss(batch, "dapo")
    with pytest.raises(LossplugError, match="validate must be 'full' or 'off'"):
        policy_loss(batch, "dapo", validate="yes")


def test_normalizer_smaller_than_the_batch_is_refused():
    batch = PolicyBatch(**reduction_example_batch())
    with pytest.raises(LossplugError, match="smaller than this micro-batch alone"):
        policy_loss(batch, "dapo", Normalizer(action_tokens=2, sequences=2))


def test_masked_nan_never_reaches_loss_or_gradient():
    fields = reduction_example_batch()
    logp = fields["logp"].clone()
    logp[0, 1:] = NAN
    logp.requires_grad_()
    old = fields["old_logp"].clone()
    old[0, 2] = float("inf")
    result = policy_loss(PolicyBatch(**{**fields, "logp": logp, "old_logp": old}), "dapo")
    result.loss.backward()
    assert torch.isfinite(result.loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[0, 1:] == 0).all()
    assert all(math.isfinite(v) for v in result.metrics.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logprobs_are_computed_in_float32(dtype):
    fields = reduction_example_batch()
    logp = fields["logp"].to(dtype).requires_grad_()
    result = policy_loss(PolicyBatch(**{**fields, "logp": logp, "old_logp": fields["old_logp"].to(dtype)}), "dapo")
    # the loss the trainers log is not rounded to the log-probs' precision (verl's own stays float32 too)
    assert result.loss.dtype == torch.float32
    exact = policy_loss(
        PolicyBatch(**{**fields, "logp": logp.detach().float(), "old_logp": fields["old_logp"].to(dtype).float()}),
        "dapo",
    ).loss
    assert result.loss.item() == exact.item()
    result.loss.backward()
    assert logp.grad.dtype == dtype and torch.isfinite(logp.grad.float()).all()


def test_metrics_are_lazy_tensors_then_floats():
    result = policy_loss(PolicyBatch(**reduction_example_batch()), "dapo")
    assert all(isinstance(v, torch.Tensor) for v in result.metric_tensors.values())
    assert all(isinstance(v, float) for v in result.metrics.values())
    assert policy_loss(PolicyBatch(**reduction_example_batch()), "dapo", metrics=False).metric_tensors == {}


def test_reduce_matches_the_recipe_reduction():
    fields = reduction_example_batch()
    mask = fields["action_mask"]
    for reduction, expected in (("response", 1.5), ("token", 1.2), ("sequence_sum", 3.0)):
        assert lossplug.reduce(fields["advantage"], mask, recipe_for(reduction)).item() == pytest.approx(expected)


def rows_with_an_empty_one():
    """Rows [1, 2 | 4 | —]: the last response has no action token (masked out, e.g. truncated)."""
    values = torch.tensor([[1.0, 2.0], [4.0, NAN], [NAN, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    return values, mask


def test_the_default_population_counts_responses_with_an_action_token():
    values, mask = rows_with_an_empty_one()
    # verl's agg_loss and OpenRLHF leave the empty row out of the mean: (1.5 + 4) / 2
    assert lossplug.reduce(values, mask, reduction="response").item() == 2.75
    assert lossplug.reduce(values, mask, reduction="sequence_sum").item() == 3.5
    assert lossplug.reduce(values, mask, reduction="token").item() == 7 / 3
    # policy_loss follows the same rule where validation does not refuse the row
    logp = torch.full((3, 2), -0.5, dtype=torch.float64)
    batch = PolicyBatch.unchecked(logp=logp, old_logp=logp.clone(), action_mask=mask, advantage=values)
    assert -policy_loss(batch, recipe_for("response"), validate="off").loss.item() == 2.75
    assert Normalizer.for_masks([mask]).sequences == 2


def test_a_normalizer_counts_empty_responses_as_trl_does():
    values, mask = rows_with_an_empty_one()
    # TRL's grpo loss: the mean over every row of its masked token mean — a mask_truncated_completions row stays in
    m = mask.double()
    trl = ((torch.where(mask, values, 0) * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    norm = Normalizer.for_masks([mask], count_empty_responses=True)
    assert norm.sequences == 3
    assert lossplug.reduce(values, mask, reduction="response", normalizer=norm).item() == pytest.approx(5.5 / 3)
    assert lossplug.reduce(values, mask, reduction="response", normalizer=norm) == trl


def test_a_batch_without_actions_reduces_to_zero():
    values = torch.full((2, 3), NAN)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for reduction in REDUCTIONS:
        spec = {"name": "fixed", "budget": 4} if reduction == "fixed" else reduction
        assert lossplug.reduce(values, mask, reduction=spec).item() == 0


def test_reduce_takes_a_recipe_or_a_reduction_named_like_a_recipe_names_one():
    fields = reduction_example_batch()
    mask, values = fields["action_mask"], fields["advantage"]
    assert lossplug.reduce(values, mask, reduction={"name": "fixed", "budget": 4}).item() == 0.75
    assert lossplug.reduce(values, mask, reduction="token") == lossplug.reduce(values, mask, "dapo")
    with pytest.raises(LossplugError, match="either recipe .* or reduction"):
        lossplug.reduce(values, mask, "dapo", reduction="token")
    with pytest.raises(LossplugError, match="either recipe"):
        lossplug.reduce(values, mask)
    with pytest.raises(LossplugError, match="unknown reduction plugin 'tokn' \\(did you mean 'token'"):
        lossplug.reduce(values, mask, reduction="tokn")
    with pytest.raises(LossplugError, match="unknown parameter 'budgt'"):
        lossplug.reduce(values, mask, reduction={"name": "fixed", "budgt": 4})


def test_token_sum_is_the_plain_sum_whatever_the_population():
    fields = reduction_example_batch()
    mask, values = fields["action_mask"], fields["advantage"]
    for norm in (None, Normalizer(action_tokens=50, sequences=7, budget=3)):
        assert lossplug.reduce(values, mask, reduction="token_sum", normalizer=norm).item() == 6.0


def engine_batch(with_behavior=True):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 5, generator=g) < 0.7
    mask[:, 0] = True
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    behavior = (old + 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)).clamp(max=0)
    garbage = torch.where(mask, 0.0, NAN)  # never read off the actions
    batch = PolicyBatch(
        logp=(old + 0.1).clamp(max=0) + garbage,
        old_logp=old + garbage,
        action_mask=mask,
        behavior_logp=(behavior + garbage) if with_behavior else None,
        advantage=torch.randn(3, generator=g, dtype=torch.float64),
    )
    return batch, old, behavior, mask


@pytest.mark.parametrize("level", ["basic", "full"])
def test_engine_kl_is_the_mean_of_behaviour_minus_old_on_the_actions(level):
    batch, old, behavior, mask = engine_batch()
    metrics = policy_loss(batch, "dapo", metrics=level).metric_tensors
    # verl's rollout_corr/kl: masked_mean(rollout_log_prob − old_log_prob)
    assert metrics["engine/approx_kl"].item() == pytest.approx((behavior - old)[mask].mean().item(), rel=1e-12)
    assert "engine/approx_kl" not in policy_loss(engine_batch(with_behavior=False)[0], "dapo").metrics
    assert policy_loss(batch, "dapo", metrics="off").metrics == {}


def test_compiled_recipe_is_cached_and_rebuilt_with_the_registry():
    recipe = Recipe.preset("dapo")
    first = lossplug.compile_recipe(recipe)
    assert lossplug.compile_recipe(recipe) is first
    lossplug.plugin_registry.reset()
    assert lossplug.compile_recipe(recipe) is not first


class CheckingPlugin:
    """Adds a batch rule and a metric through the hooks."""

    calls = 0

    @lossplug.hookimpl
    def lossplug_validate_batch(self, batch, recipe):
        if isinstance(batch, PolicyBatch) and batch.group_id is None:
            return [Violation("group_id", "required by the checking plugin")]
        return None

    @lossplug.hookimpl
    def lossplug_extra_metrics(self, batch, objective, recipe):
        type(self).calls += 1
        return {"checking/objective_abs_max": objective.abs().max()}


def test_validator_and_metric_hooks():
    plugin = CheckingPlugin()
    lossplug.register_plugin(plugin, "checking")
    try:
        fields = reduction_example_batch()
        with pytest.raises(BatchValidationError, match="group_id: required by the checking plugin"):
            policy_loss(PolicyBatch(**fields), "dapo")
        result = policy_loss(PolicyBatch(**fields, group_id=torch.tensor([0, 0])), "dapo")
        assert result.metrics["checking/objective_abs_max"] == 2.0
    finally:
        lossplug.unregister_plugin(plugin)
    assert "checking/objective_abs_max" not in policy_loss(PolicyBatch(**reduction_example_batch()), "dapo").metrics


class UndetachedWeightPlugin:
    @lossplug.hookimpl
    def lossplug_register_gates(self, register):
        @lossplug.gate("grad_weight", role="correction")
        def grad_weight(inp, p):
            """exp(logp − logp) — numerically 1, but it carries gradient (wrong on purpose)."""
            return lossplug.GateOutput(weight=(inp.logp - inp.logp.detach()).exp())

        register(grad_weight)


def test_a_correction_weight_that_carries_gradient_is_refused():
    plugin = UndetachedWeightPlugin()
    lossplug.register_plugin(plugin, "grad-weight")
    try:
        fields = reduction_example_batch()
        fields["logp"] = fields["logp"].clone().requires_grad_()
        recipe = Recipe.model_validate({"gates": ["ppo_clip", "grad_weight"], "reduction": "token"})
        with pytest.raises(
            lossplug.PluginError,
            match=r"recipe.gates\[1\] \(grad_weight, from in-process plugin "
            r"'grad-weight'\): a correction's weight must be detached",
        ):
            policy_loss(PolicyBatch(**fields), recipe)
    finally:
        lossplug.unregister_plugin(plugin)


@lossplug.gate("reads_logp_without_grad_first", requires=("old_logp",))
def reads_logp_without_grad_first(inp, p):
    """A·logp, after a diagnostic that reads inp.logp under no_grad before anything else does."""
    with torch.no_grad():
        inp.logp.sum()
        inp.update_log_ratio().sum()
    return lossplug.GateOutput(objective=inp.advantage.detach() * inp.logp + 0 * inp.update_log_ratio())


def test_fields_first_read_under_no_grad_still_carry_the_gradient(fresh_registry, register_gates):
    """The pipeline cleans each field on first read: under the grad mode of the call, not of the gate's block."""
    register_gates(reads_logp_without_grad_first, name="lazy")
    f = reduction_example_batch()
    logp = f["logp"].clone().requires_grad_(True)
    recipe = {"gates": ["reads_logp_without_grad_first"], "reduction": "token"}
    policy_loss(PolicyBatch(**{**f, "logp": logp}), recipe).loss.backward()
    expected = -torch.where(f["action_mask"], f["advantage"], 0) / f["action_mask"].sum()
    torch.testing.assert_close(logp.grad, expected)
    with torch.no_grad():  # and a call under no_grad builds no graph at all
        assert not policy_loss(PolicyBatch(**{**f, "logp": logp}), recipe).loss.requires_grad

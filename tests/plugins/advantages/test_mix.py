"""``mix`` (A = Σ_j w_j · A_j), float64: bit for bit the weighted sum of each component run alone through
``estimate_advantages`` (pairs of [B] estimators, a per-token one broadcast, a critic's returns passed on); TRL #7291's
λ·A_GRPO + (1 − λ)·A_RLOO and the per-reward form (each ``reward_components`` column through its own estimator)
against loops written here; agreement with ``normalize_then_sum`` and ``opd(task=grpo)``, which compose the same way;
hypothesis properties (one component of weight 1 is that component, weights add, opposite weights cancel, scaling
the weights scales the mix); every refusal names the component's position and the rule.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import BatchValidationError, LossplugError, RecipeError

F64 = torch.float64
B, T, K = 9, 5, 3
GROUP = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1, 2])  # scattered groups of three


def recipe(advantage):
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


def mix(*components, **params):
    return recipe({"name": "mix", "components": list(components), **params})


def fields(seed=0, group=GROUP):
    g = torch.Generator().manual_seed(seed)
    n = group.numel()
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    old = -(0.05 + 3 * torch.rand(n, T, generator=g, dtype=F64))
    reward = (torch.rand(n, generator=g) < 0.5).to(F64) + 0.25 * torch.rand(n, generator=g, dtype=F64)
    reward[group == 0] = 1.0  # a group of equal rewards: every group-relative estimator gives it 0
    components = torch.randn(n, K, generator=g, dtype=F64)
    components[group == 1, 2] = 0.5  # a reward constant within a group
    return dict(
        logp=old.clone(),
        old_logp=old,
        teacher_logp=(old + torch.randn(n, T, generator=g, dtype=F64)).clamp(max=-1e-4),
        action_mask=mask,
        reward=reward,
        reward_components=components,
        group_id=group,
        value=torch.randn(n, T, generator=g, dtype=F64),
    )


def alone(batch, spec):
    """A component run on its own through the pipeline, reading column ``reward_column`` when it names one."""
    spec = dict(spec)
    spec.pop("weight")
    column = spec.pop("reward_column", None)
    if column is not None:
        batch = lossplug.PolicyBatch(**{**batch.fields(), "reward": batch.reward_components[:, column]})
    return lossplug.estimate_advantages(batch, recipe(spec))


def weighted_sum(batch, specs):
    """Σ_j w_j · A_j in the recipe's order, a [B] advantage broadcast over its response when another is [B, T]."""
    advantages = [alone(batch, s).advantage for s in specs]
    per_token = any(a.ndim == 2 for a in advantages)
    total = None
    for s, a in zip(specs, advantages):
        term = s["weight"] * (a.unsqueeze(-1) if per_token and a.ndim == 1 else a)
        total = term if total is None else total + term
    return torch.where(batch.action_mask, total, 0) if per_token else total


PAIRS = {
    "grpo+rloo": [{"name": "grpo", "weight": 0.5}, {"name": "rloo", "weight": 0.5}],
    "lambda_0.3": [{"name": "grpo", "weight": 0.3, "eps": 1e-4}, {"name": "rloo", "weight": 0.7}],
    "dr_grpo+maxrl": [{"name": "grpo", "weight": 1.5, "scale": "none"}, {"name": "maxrl", "weight": -0.25}],
    "rloo+reinforce_pp_baseline": [
        {"name": "rloo", "weight": 0.6},
        {"name": "reinforce_plus_plus_baseline", "weight": 0.4},
    ],
    "gdpo+normalize_then_sum": [{"name": "gdpo", "weight": 0.5}, {"name": "normalize_then_sum", "weight": 0.5}],
    "grpo+opd (per token)": [{"name": "grpo", "weight": 0.8}, {"name": "opd", "weight": 0.2, "coef": 2.0}],
    "three, one repeated": [
        {"name": "grpo", "weight": 1.0},
        {"name": "grpo", "weight": 0.25, "scale": "batch"},
        {"name": "rloo", "weight": -0.5},
    ],
    "per reward column": [
        {"name": "grpo", "weight": 1.0, "reward_column": 0},
        {"name": "rloo", "weight": 0.5, "reward_column": 1},
        {"name": "grpo", "weight": 2.0, "reward_column": 2, "scale": "none"},
    ],
}


@pytest.mark.parametrize("specs", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("seed", [0, 1])
def test_the_mix_is_the_weighted_sum_of_its_components_run_alone(specs, seed):
    batch = lossplug.PolicyBatch(**fields(seed))
    got = lossplug.estimate_advantages(batch, mix(*specs)).advantage
    want = weighted_sum(batch, specs)
    assert got.dtype == F64 and got.shape == want.shape
    assert torch.equal(got, want)
    assert got.ndim == (2 if any(s["name"] == "opd" for s in specs) else 1)


def test_trl_7291s_lambda_mix_of_grpo_and_rloo_against_loops():
    """A = λ·(R − mean_g)/(std_g + ε) + (1 − λ)·(R − mean of the others), written with loops (sample std)."""
    f = fields(3)
    lam, eps = 0.3, 1e-6
    out = lossplug.compute_advantages(
        lossplug.PolicyBatch(**f),
        mix({"name": "grpo", "weight": lam, "eps": eps}, {"name": "rloo", "weight": 1 - lam}),
    )
    reward, group = f["reward"].tolist(), f["group_id"].tolist()
    for i in range(B):
        same = [reward[j] for j in range(B) if group[j] == group[i]]
        n = len(same)
        mean = sum(same) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in same) / (n - 1))
        a_grpo = 0.0 if max(same) == min(same) else (reward[i] - mean) / (std + eps)
        a_rloo = 0.0 if max(same) == min(same) else reward[i] - (sum(same) - reward[i]) / (n - 1)
        assert float(out[i]) == pytest.approx(lam * a_grpo + (1 - lam) * a_rloo, abs=1e-13, rel=1e-13)


def test_each_reward_column_through_its_own_estimator_against_loops():
    """GRPO on reward 0, RLOO on reward 1, Dr. GRPO (centred only) on reward 2, weighted — by hand."""
    f = fields(4)
    weights = (1.0, 0.5, 2.0)
    specs = [
        {"name": "grpo", "weight": weights[0], "reward_column": 0},
        {"name": "rloo", "weight": weights[1], "reward_column": 1},
        {"name": "grpo", "weight": weights[2], "reward_column": 2, "scale": "none"},
    ]
    out = lossplug.compute_advantages(lossplug.PolicyBatch(**f), mix(*specs))
    r, group = f["reward_components"].tolist(), f["group_id"].tolist()
    for i in range(B):
        rows = [j for j in range(B) if group[j] == group[i]]
        n = len(rows)
        by_hand = 0.0
        for k, w in enumerate(weights):
            same = [r[j][k] for j in rows]
            mean = sum(same) / n
            if max(same) == min(same):
                a = 0.0
            elif k == 0:
                a = (r[i][k] - mean) / (math.sqrt(sum((x - mean) ** 2 for x in same) / (n - 1)) + 1e-6)
            elif k == 1:
                a = r[i][k] - (sum(same) - r[i][k]) / (n - 1)
            else:
                a = r[i][k] - mean
            by_hand += w * a
        assert float(out[i]) == pytest.approx(by_hand, abs=1e-13, rel=1e-13)


def test_per_column_grpo_is_trls_normalize_then_sum_without_the_batch_step():
    """normalize_then_sum (TRL's GDPO form) with scale none is Σ_k w_k · GRPO_k with TRL's ε = 1e-4 on each column."""
    f = fields(5)
    weights = (1.0, 0.5, 2.0)  # exact in float32, as TRL holds reward_weights
    specs = [{"name": "grpo", "weight": w, "reward_column": k, "eps": 1e-4} for k, w in enumerate(weights)]
    batch = lossplug.PolicyBatch(**f)
    got = lossplug.compute_advantages(batch, mix(*specs))
    trl = lossplug.compute_advantages(
        batch, recipe({"name": "normalize_then_sum", "weights": list(weights), "eps": 1e-4, "scale": "none"})
    )
    torch.testing.assert_close(got, trl, atol=1e-14, rtol=1e-14)


def test_grpo_plus_opd_is_opd_with_grpo_as_its_task():
    """opd(task=grpo) composes the same sum inside one estimator: the mix of both with weight 1 equals it bit for bit."""
    batch = lossplug.PolicyBatch(**fields(6))
    got = lossplug.compute_advantages(batch, mix({"name": "grpo", "weight": 1.0}, {"name": "opd", "weight": 1.0}))
    want = lossplug.compute_advantages(batch, recipe({"name": "opd", "task": "grpo"}))
    assert torch.equal(got, want)


def test_a_critics_returns_are_passed_on_from_the_component_named():
    batch = lossplug.PolicyBatch(**fields(7))
    specs = [{"name": "gae", "weight": 0.5, "lam": 1.0, "whiten": False}, {"name": "grpo", "weight": 0.5}]
    out = lossplug.estimate_advantages(batch, mix(*specs, returns_from=0))
    gae = alone(batch, specs[0])
    assert torch.equal(out.returns, gae.returns)
    assert torch.equal(out.advantage, weighted_sum(batch, specs))
    with pytest.raises(LossplugError, match=r"components\[0\] \(gae\) returns critic targets.*returns_from: 0"):
        lossplug.estimate_advantages(batch, mix(*specs))
    with pytest.raises(LossplugError, match=r"returns_from is 1, but components\[1\] \(grpo\) returns no critic"):
        lossplug.estimate_advantages(batch, mix(specs[1], specs[1], returns_from=1))


def test_metrics_per_component():
    batch = lossplug.PolicyBatch(**fields(8))
    specs = [{"name": "grpo", "weight": 0.5}, {"name": "grpo", "weight": 0.5, "scale": "none"}]
    specs.append({"name": "gae", "weight": 1.0, "kl_coef": 0.1})
    f = fields(8)
    f["ref_logp"] = f["old_logp"] - 0.1
    batch = lossplug.PolicyBatch(**f)
    metrics = lossplug.estimate_advantages(batch, mix(*specs, returns_from=2)).metric_tensors
    a0 = alone(batch, specs[0]).advantage
    assert torch.equal(metrics["mix/grpo.0/mean"], a0.mean()) and torch.equal(metrics["mix/grpo.0/std"], a0.std())
    assert "mix/grpo.1/mean" in metrics and "mix/gae/mean" in metrics
    gae_own = alone(batch, specs[2]).metric_tensors
    assert gae_own and all(torch.equal(metrics[f"mix/gae/{k}"], v) for k, v in gae_own.items())


# ---------------------------------------------------------------------------------------------------------------------
# invariants

REWARDS = st.lists(st.floats(-10, 10, allow_nan=False, width=64), min_size=B, max_size=B)
WEIGHTS = st.floats(-4, 4, allow_nan=False, allow_infinity=False)
ESTIMATORS = st.sampled_from([{"name": "grpo"}, {"name": "rloo"}, {"name": "grpo", "scale": "none"}, {"name": "maxrl"}])


def batch_of(rewards):
    return lossplug.PolicyBatch(**{**fields(0), "reward": torch.tensor(rewards, dtype=F64)})


@settings(max_examples=30)
@given(REWARDS, ESTIMATORS)
def test_one_component_of_weight_one_is_that_component(rewards, estimator):
    batch = batch_of(rewards)
    got = lossplug.compute_advantages(batch, mix({**estimator, "weight": 1.0}))
    assert torch.equal(got, lossplug.compute_advantages(batch, recipe(estimator)))


@settings(max_examples=30)
@given(REWARDS, ESTIMATORS, WEIGHTS, WEIGHTS)
def test_weights_of_one_estimator_add(rewards, estimator, a, b):
    batch = batch_of(rewards)
    split = lossplug.compute_advantages(batch, mix({**estimator, "weight": a}, {**estimator, "weight": b}))
    whole = lossplug.compute_advantages(batch, mix({**estimator, "weight": a + b}))
    scale = max(1.0, float(lossplug.compute_advantages(batch, recipe(estimator)).abs().max()))
    torch.testing.assert_close(split, whole, atol=1e-13 * scale * (abs(a) + abs(b) + 1), rtol=0)


@settings(max_examples=30)
@given(REWARDS, ESTIMATORS, WEIGHTS)
def test_opposite_weights_cancel_exactly(rewards, estimator, w):
    batch = batch_of(rewards)
    out = lossplug.compute_advantages(batch, mix({**estimator, "weight": w}, {**estimator, "weight": -w}))
    assert bool((out == 0).all())


@settings(max_examples=30)
@given(REWARDS, WEIGHTS, WEIGHTS, st.floats(-3, 3, allow_nan=False))
def test_scaling_every_weight_scales_the_mix(rewards, a, b, s):
    batch = batch_of(rewards)
    base = lossplug.compute_advantages(batch, mix({"name": "grpo", "weight": a}, {"name": "rloo", "weight": b}))
    scaled = lossplug.compute_advantages(
        batch, mix({"name": "grpo", "weight": s * a}, {"name": "rloo", "weight": s * b})
    )
    bound = 1e-12 * max(1.0, float(base.abs().max()) * max(1.0, abs(s)))
    torch.testing.assert_close(scaled, s * base, atol=bound * 100, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# refusals, each naming the component's position and the rule


@pytest.mark.parametrize(
    "components, message",
    [
        (
            [{"name": "grpoo", "weight": 1.0}],
            r"components\[0\]: unknown advantage plugin 'grpoo' \(did you mean 'grpo'",
        ),
        ([{"name": "grpo", "weight": 1.0}, {"name": "ppo_clip", "weight": 1.0}], r"components\[1\].*is a gate plugin"),
        ([{"name": "grpo", "weight": float("nan")}], r"components\[0\] \(grpo\): weight must be a finite number"),
        ([{"name": "grpo", "weight": float("inf")}], r"components\[0\] \(grpo\): weight must be a finite number"),
        ([{"name": "grpo", "weight": True}], r"components\[0\] \(grpo\): weight must be a finite number"),
        ([{"name": "rloo"}], r"components\[0\] \(rloo\): weight is required"),
        ([{"name": "mix", "weight": 1.0}], r"components\[0\] \(mix\): a mix cannot contain a mix"),
        (
            [{"name": "grpo", "weight": 1.0, "scal": "none"}],
            r"components\[0\] \(grpo\): unknown parameter 'scal' \(did",
        ),
        ([{"name": "grpo", "weight": 1.0, "scale": "rows"}], r"components\[0\] \(grpo\): parameter 'scale'"),
        ([{"name": "grpo", "weight": 1.0, "reward_column": -1}], r"components\[0\] \(grpo\): reward_column must be"),
        (["grpo"], r"components\[0\]: give a mapping with the estimator's name and a weight"),
        ("grpo", r"components must be a list"),
        ([], r"components.*at least 1 item"),
    ],
    ids=[
        "unknown",
        "a gate",
        "nan weight",
        "inf weight",
        "bool weight",
        "no weight",
        "nested mix",
        "unknown parameter",
        "bad parameter value",
        "negative column",
        "bare name",
        "not a list",
        "empty",
    ],
)
def test_bad_components_are_refused_when_the_recipe_is_built(components, message):
    with pytest.raises(RecipeError, match=r"recipe\.advantage \(mix\)") as err:
        recipe({"name": "mix", "components": components})
    assert err.match(message)


def test_every_bad_component_is_reported_at_once():
    with pytest.raises(RecipeError) as err:
        mix({"name": "grpo", "weight": float("nan")}, {"name": "rloo", "weight": 1.0}, {"name": "nope", "weight": 1})
    assert err.match(r"components\[0\] \(grpo\): weight") and err.match(r"components\[2\]: unknown advantage plugin")


def test_returns_from_must_name_a_component():
    with pytest.raises(RecipeError, match=r"returns_from is 2, but there are 2 components"):
        mix({"name": "grpo", "weight": 1.0}, {"name": "rloo", "weight": 1.0}, returns_from=2)


def test_a_group_too_small_for_one_component_names_it():
    f = fields(0, group=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3]))
    with pytest.raises(BatchValidationError, match=r"components\[1\] \(rloo\) needs at least 2 rollouts per group"):
        lossplug.compute_advantages(
            lossplug.PolicyBatch(**f), mix({"name": "grpo", "weight": 0.5}, {"name": "rloo", "weight": 0.5})
        )


def test_a_reward_column_the_batch_lacks_is_named():
    batch = lossplug.PolicyBatch(**fields(0))
    with pytest.raises(LossplugError, match=r"components\[1\] \(rloo\) reads reward_column 3, but reward_components"):
        lossplug.compute_advantages(
            batch, mix({"name": "grpo", "weight": 1.0}, {"name": "rloo", "weight": 1.0, "reward_column": 3})
        )
    without = lossplug.PolicyBatch(**{k: v for k, v in fields(0).items() if k != "reward_components"})
    with pytest.raises(BatchValidationError, match=r"reward_components.*recipe\.advantage \(mix"):
        lossplug.compute_advantages(without, mix({"name": "grpo", "weight": 1.0, "reward_column": 0}))


def test_what_the_batch_needs_is_the_union_of_the_components_needs():
    from lossplug.needs import recipe_needs

    needs = recipe_needs(
        mix(
            {"name": "grpo", "weight": 1.0, "reward_column": 0},
            {"name": "opd", "weight": 1.0},
            {"name": "gae", "weight": 0.0},
            returns_from=2,
        )
    )
    assert {"reward_components", "group_id", "teacher_logp", "old_logp", "reward", "value"} <= set(needs)
    only_columns = recipe_needs(mix({"name": "grpo", "weight": 1.0, "reward_column": 0}))
    assert "reward" not in only_columns and "reward_components" in only_columns


@pytest.fixture
def register_advantages():
    plugins = []

    def register(*estimators):
        class Plugin:
            @staticmethod
            @lossplug.hookimpl
            def lossplug_register_advantages(register):
                for estimator in estimators:
                    register(estimator)

        lossplug.register_plugin(Plugin, name="test-mix-advantages")
        plugins.append(Plugin)

    yield register
    for plugin in plugins:
        lossplug.unregister_plugin(plugin)


def test_a_component_with_an_incompatible_output_shape_is_named(register_advantages):
    @lossplug.advantage("wrong_shape", requires=("reward",))
    def wrong_shape(batch, p):
        return torch.zeros(batch.batch_size + 1, dtype=F64)

    register_advantages(wrong_shape)
    batch = lossplug.PolicyBatch(**fields(0))
    with pytest.raises(
        LossplugError, match=r"components\[1\] \(wrong_shape\) returned advantages that have shape \[10\]"
    ):
        lossplug.compute_advantages(batch, mix({"name": "grpo", "weight": 1.0}, {"name": "wrong_shape", "weight": 1.0}))


def test_a_component_that_crashes_is_named_with_its_origin(register_advantages):
    @lossplug.advantage("crashes", requires=("reward",))
    def crashes(batch, p):
        raise ZeroDivisionError("boom")

    register_advantages(crashes)
    with pytest.raises(lossplug.PluginError, match=r"components\[0\] \(crashes, from .*\) raised ZeroDivisionError"):
        lossplug.compute_advantages(lossplug.PolicyBatch(**fields(0)), mix({"name": "crashes", "weight": 1.0}))


def test_a_component_whose_parameters_clash_with_the_mixs_keys_is_refused(register_advantages):
    class Weighted(lossplug.Params):
        weight: float = 1.0

    @lossplug.advantage("weighted", params=Weighted, requires=("reward",))
    def weighted(batch, p):
        return p.weight * batch.reward

    register_advantages(weighted)
    with pytest.raises(RecipeError, match=r"components\[0\] \(weighted\): its parameter\(s\) \['weight'\]"):
        mix({"name": "weighted", "weight": 1.0})


# ---------------------------------------------------------------------------------------------------------------------
# the record and recipe explain


def test_the_record_names_every_parameter_and_round_trips():
    r = mix({"name": "grpo", "weight": 0.5, "reward_column": 1}, {"name": "rloo", "weight": 0.5})
    (first, second) = r.advantage.params["components"]
    assert first == {
        "name": "grpo",
        "weight": 0.5,
        "reward_column": 1,
        "scale": "group",
        "std": "sample",
        "eps": 1e-6,
        "eps_mode": "add",
    }
    assert second == {"name": "rloo", "weight": 0.5, "reward_column": None}
    assert lossplug.Recipe.from_yaml(r.to_yaml()).to_dict() == r.to_dict()


def test_recipe_explain_shows_each_component_under_the_mix():
    from lossplug.cli.describe import explain_recipe

    r = mix({"name": "grpo", "weight": 0.7, "reward_column": 0}, {"name": "rloo", "weight": 0.3})
    rows = {row["stage"]: row for row in explain_recipe(r)["stages"]}
    assert rows["advantage"]["plugin"] == "mix"
    assert rows["advantage.components[0]"]["plugin"] == "grpo"
    assert rows["advantage.components[0]"]["role"] == "× 0.7 · reads reward_components[:, 0]"
    assert rows["advantage.components[0]"]["params"]["scale"] == "group"
    assert rows["advantage.components[1]"]["role"] == "× 0.3 · reads reward"
    assert rows["advantage.components[1]"]["summary"].startswith("RLOO")


def test_what_sits_off_the_actions_is_never_read():
    """NaN/inf off the action mask (teacher and old log-probs, values) changes nothing of a per-token mix."""
    clean = fields(9)
    dirty = dict(clean)
    off = ~clean["action_mask"]
    for name, poison in (("teacher_logp", float("nan")), ("old_logp", float("inf")), ("value", float("-inf"))):
        dirty[name] = torch.where(off, poison, clean[name])
    specs = [{"name": "grpo", "weight": 0.5}, {"name": "opd", "weight": 0.3}, {"name": "gae", "weight": 0.2}]
    got = lossplug.estimate_advantages(lossplug.PolicyBatch(**dirty), mix(*specs, returns_from=2))
    want = lossplug.estimate_advantages(lossplug.PolicyBatch(**clean), mix(*specs, returns_from=2))
    assert torch.equal(got.advantage, want.advantage) and bool(torch.isfinite(got.advantage).all())
    assert bool((got.advantage[off] == 0).all())


def test_the_docs_page_examples_run_and_print_what_they_say(capsys):
    """docs/mixed-advantages.md: its YAML recipe builds, its Python example prints the advantages its comment shows."""
    import re
    from pathlib import Path

    import yaml

    page = (Path(__file__).resolve().parents[3] / "docs" / "mixed-advantages.md").read_text()
    (recipe_yaml,) = re.findall(r"```yaml\n(.*?)```", page, flags=re.S)
    assert [c["weight"] for c in lossplug.Recipe.load(yaml.safe_load(recipe_yaml)).advantage.params["components"]] == [
        0.3,
        0.7,
    ]
    (code,) = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    exec(compile(code, "docs/mixed-advantages.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()[0]
    shown = re.search(r"print\(result\.advantage\)\s+# (.*)", code).group(1)
    assert printed == shown


@pytest.mark.parametrize(
    "components",
    [
        [{"name": "grpo", "weight": 0.8}, {"name": "opd", "weight": 0.2}],
        [{"name": "gdpo", "weight": 1.0}, {"name": "rloo", "weight": 0.5, "reward_column": 1}],
        [{"name": "maxrl", "weight": -1.0, "reward_column": 0}],
    ],
    ids=["per token", "reward columns", "one component"],
)
def test_the_conformance_kit_passes_with_other_components(components):
    from lossplug.testing import assert_conforms

    assert_conforms("mix", kind="advantage", params={"components": components})


def test_a_component_that_works_on_packed_transitions_only_is_refused(register_advantages):
    @lossplug.advantage("packed_only", requires=("reward",), layouts=("packed",))
    def packed_only(batch, p):
        return batch.reward

    register_advantages(packed_only)
    with pytest.raises(RecipeError, match=r"components\[0\] \(packed_only\): works on the packed layout only"):
        mix({"name": "packed_only", "weight": 1.0})

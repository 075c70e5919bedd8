"""Every hook spec is documented — in its docstring (when it is called, each argument, what it returns, what happens
when it raises) and in docs/plugin-hooks.md (a section with an example) — and every example there runs: each is
registered in-process as a plugin and must have its effect."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lossplug
from lossplug import hookspecs
from lossplug.kinds import RENAMED_HOOKS

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin-hooks.md"
#: every hook but the earlier spellings of renamed ones (documented under their new names; tests/core/test_regularizers.py)
SPECS = {
    name: f
    for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("lossplug_") and name not in RENAMED_HOOKS
}


def sections() -> dict[str, tuple[list[str], str]]:
    """hook name → (arguments named in its heading, the section's text)."""
    parts = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    out = {}
    for part in parts:
        heading, _, body = part.partition("\n")
        found = re.fullmatch(r"(lossplug_\w+)\(([^)]*)\)\s*", heading)
        assert found, f"docs/plugin-hooks.md: a section heading must be 'hook_name(arg, ...)', got {heading!r}"
        out[found[1]] = ([a.strip() for a in found[2].split(",") if a.strip()], body)
    return out


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def param_text(doc: str, name: str) -> str:
    """The text of ``:param name:``, up to the next field or blank line."""
    found = re.search(rf"^:param {name}:(.*?)(?=^:|^\s*$|\Z)", doc, flags=re.M | re.S)
    return found[1].strip() if found else ""


def test_there_are_hooks_to_document():
    assert len(SPECS) >= 6


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_docstring_says_when_each_argument_what_it_returns_and_what_an_exception_does(name):
    spec = SPECS[name]
    doc = inspect.getdoc(spec) or ""
    assert "Called" in doc, f"{name}: the docstring must say when it is called ('Called ...')"
    signature = inspect.signature(spec)
    for arg, param in signature.parameters.items():
        assert param.annotation is not inspect.Parameter.empty, f"{name}: argument '{arg}' has no type annotation"
        assert param_text(doc, arg), f"{name}: no ':param {arg}:' with a description"
    assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    returns = re.search(r"^:return:(.+?)(?=^:|^\s*$|\Z)", doc, flags=re.M | re.S)
    assert returns and returns[1].strip(), f"{name}: no ':return:' saying what to return"
    assert re.search(r"\braises\b", doc), f"{name}: the docstring must say what happens when the implementation raises"
    assert "Return" in doc  # the original rule, kept


def test_every_hook_has_a_section_and_every_section_a_hook():
    documented = sections()
    assert sorted(set(SPECS) - set(documented)) == [], "hooks without a section in docs/plugin-hooks.md"
    assert sorted(set(documented) - set(SPECS)) == [], "sections of docs/plugin-hooks.md for hooks that do not exist"
    for name, (args, body) in documented.items():
        assert args == list(inspect.signature(SPECS[name]).parameters), f"{name}: heading arguments differ"
        for arg in args:
            assert f"`{arg}` — " in body, f"docs/plugin-hooks.md, {name}: argument '{arg}' is not described"
        assert "**Called**" in body and "**Return**" in body, f"docs/plugin-hooks.md, {name}: when / what to return"
        assert len(python_blocks(body)) == 1, f"docs/plugin-hooks.md, {name}: needs exactly one ```python example"


# ---------------------------------------------------------------------------------------------------------------------
# Running the examples


def batch(reward=(0.25, 1.0)):
    return lossplug.PolicyBatch(
        logp=torch.full((2, 3), -1.0, requires_grad=True),
        old_logp=torch.full((2, 3), -1.1),
        action_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0]),
        reward=torch.tensor(reward),
        group_id=torch.tensor([0, 0]),
    )


PLAIN = {"gates": ["ppo_clip"], "reduction": "token"}


@dataclass(frozen=True)
class Before:
    """What lossplug offered before the example was registered."""

    plugins: list[dict]
    metrics: set[str]


def added(before: Before, kind: str) -> list[dict]:
    names = {(r["kind"], r["name"]) for r in before.plugins}
    return [r for r in lossplug.list_plugins() if r["kind"] == kind and (kind, r["name"]) not in names]


def finite_loss_with_gradient(recipe) -> None:
    b = batch()
    result = lossplug.policy_loss(b, recipe)
    assert torch.isfinite(result.loss)
    result.loss.backward()
    assert b.logp.grad is not None and torch.isfinite(b.logp.grad).all()


def registered_advantages(before):
    new = added(before, "advantage")
    assert new, "the example registered no advantage"
    for row in new:
        adv = lossplug.compute_advantages(batch(), {**PLAIN, "advantage": row["name"]})
        assert adv.shape[0] == 2 and torch.isfinite(adv).all()


def registered_shapers(before):
    new = added(before, "shaper")
    assert new, "the example registered no shaper"
    for row in new:
        b = batch().replace(terminated=torch.tensor([True, False]))
        recipe = {**PLAIN, "advantage": "grpo", "shapers": [row["name"]]}
        result = lossplug.estimate_advantages(b, recipe)
        assert result.reward is not None and not torch.equal(result.reward, b.reward), "the shaper changed nothing"
        assert torch.isfinite(result.advantage).all()


def registered_filters(before):
    new = added(before, "filter")
    assert new, "the example registered no filter"
    for row in new:
        recipe = {**PLAIN, "advantage": "grpo", "filters": [{"name": row["name"], "tokens": 3}]}
        result = lossplug.estimate_advantages(batch(), recipe)
        assert result.action_mask is not None and result.action_mask.sum() < batch().action_mask.sum()
        assert float(result.metric_tensors[f"filter/{row['name']}/dropped_responses"]) == 0.5


def registered_gates(before):
    new = added(before, "gate")
    assert new, "the example registered no gate"
    for row in new:
        gates = [row["name"]] if row["role"] == "update" else ["ppo_clip", row["name"]]
        finite_loss_with_gradient({"gates": gates, "reduction": "token"})


def registered_reductions(before):
    new = added(before, "reduction")
    assert new, "the example registered no reduction"
    for row in new:
        finite_loss_with_gradient({"gates": ["ppo_clip"], "reduction": row["name"]})


def registered_regularizers(before):
    new = added(before, "regularizer")
    assert new, "the example registered no regularizer"
    for row in new:
        recipe = {**PLAIN, "regularizers": [{"name": row["name"], "coef": 0.5}]}
        finite_loss_with_gradient(recipe)
        plain, regularized = (lossplug.policy_loss(batch(), r) for r in (PLAIN, recipe))
        assert float(plain.loss.detach()) != float(regularized.loss.detach()), "the regularizer changed nothing"
        assert f"reg/{row['name']}/value" in regularized.metrics


def registered_presets(before):
    new = added(before, "preset")
    assert new, "the example registered no preset"
    for row in new:
        assert lossplug.Recipe.preset(row["name"]).name == row["name"]
        finite_loss_with_gradient(row["name"])


def validator_refuses_a_bad_batch(before):
    # the example's rule: rewards are probabilities; with the plugin gone the same batch passes (see the caller)
    lossplug.policy_loss(batch(reward=(0.0, 1.0)), PLAIN)
    with pytest.raises(lossplug.BatchValidationError) as info:
        lossplug.policy_loss(batch(reward=(0.5, 3.0)), PLAIN)
    assert [v.field for v in info.value.violations] == ["reward"] and "rows [1]" in str(info.value)


def metrics_appear(before):
    for level in ("basic", "full"):
        metrics = lossplug.policy_loss(batch(), PLAIN, metrics=level).metrics
        new = {k: v for k, v in metrics.items() if k not in before.metrics}
        assert new, f"the example added no metric at metrics={level!r}"
        assert all(isinstance(v, float) and v == v for v in new.values())
    assert len(lossplug.policy_loss(batch(), PLAIN, metrics="off").metrics) == 0


#: what each hook's example must achieve once registered; a new hook needs an entry here
EFFECTS: dict[str, Callable[[Before], None]] = {
    "lossplug_register_shapers": registered_shapers,
    "lossplug_register_filters": registered_filters,
    "lossplug_register_advantages": registered_advantages,
    "lossplug_register_gates": registered_gates,
    "lossplug_register_reductions": registered_reductions,
    "lossplug_register_regularizers": registered_regularizers,
    "lossplug_register_presets": registered_presets,
    "lossplug_validate_batch": validator_refuses_a_bad_batch,
    "lossplug_extra_metrics": metrics_appear,
}


def test_every_hook_has_an_effect_check():
    assert sorted(EFFECTS) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_example_runs_and_has_its_effect(name, fresh_registry):
    (code,) = python_blocks(sections()[name][1])
    module = types.ModuleType(f"plugin_hooks_example_{name}")
    exec(compile(code, f"docs/plugin-hooks.md ({name})", "exec"), module.__dict__)
    assert any(
        getattr(f, "lossplug_impl", None) is not None and f.__name__ == name
        for f in vars(module).values()
        if callable(f)
    ), f"the example does not implement {name}"
    before = Before(lossplug.list_plugins(), set(lossplug.policy_loss(batch(), PLAIN, metrics="full").metrics))
    plugin_name = f"docs-example-{name}"
    lossplug.register_plugin(module, plugin_name)
    try:
        origin = f"in-process plugin '{plugin_name}'"
        assert not [b for b in lossplug.registry().broken if b.origin == origin], lossplug.registry().broken
        EFFECTS[name](before)
    finally:
        lossplug.unregister_plugin(module)
    # gone with the plugin: nothing of the example outlives it
    assert lossplug.list_plugins() == before.plugins
    assert set(lossplug.policy_loss(batch(), PLAIN, metrics="full").metrics) == before.metrics
    lossplug.policy_loss(batch(reward=(0.5, 3.0)), PLAIN)  # the validator's bad batch passes the contract alone


def test_the_min_length_example_filter_equals_dropping_the_short_responses_before_verls_loss(fresh_registry):
    """docs/plugin-hooks.md's ``min_length`` filter, registered as the page shows it: its narrowed mask and
    advantages, fed to the policy loss, give verl 0.9.1's vanilla loss (``compute_policy_loss_vanilla`` +
    ``agg_loss``, token-mean) and its gradient on the batch with the short responses dropped first. No trainer ships
    a minimum-length filter; verl's loss on the dropped batch is the oracle of what filtering must mean."""
    pytest.importorskip("verl")
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    (code,) = python_blocks(sections()["lossplug_register_filters"][1])
    module = types.ModuleType("plugin_hooks_example_min_length")
    exec(compile(code, "docs/plugin-hooks.md (min_length)", "exec"), module.__dict__)
    lossplug.register_plugin(module, "docs-example-min-length")
    try:
        g = torch.Generator().manual_seed(5)
        B, T = 8, 6
        lengths = torch.tensor([1, 6, 2, 5, 3, 4, 2, 6])
        mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
        old = -torch.rand(B, T, generator=g, dtype=torch.float64)
        logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
        reward = torch.randint(0, 2, (B,), generator=g).double()
        recipe = {"filters": [{"name": "min_length", "tokens": 3}], "advantage": "grpo", "gates": ["ppo_clip"]}
        recipe["reduction"] = "token"
        group_id = torch.arange(B) // 4
        batch = lossplug.PolicyBatch(logp=logp, old_logp=old, action_mask=mask, reward=reward, group_id=group_id)
        res = lossplug.estimate_advantages(batch, recipe)
        kept = lengths >= 3
        assert torch.equal(res.action_mask.any(-1), kept)
        ours_logp = logp.clone().requires_grad_(True)
        rows = res.action_mask.any(-1)
        ours = lossplug.PolicyBatch(
            logp=ours_logp[rows], old_logp=old[rows], action_mask=res.action_mask[rows], advantage=res.advantage[rows]
        )
        normalizer = lossplug.Normalizer(action_tokens=int(res.action_mask.sum()), sequences=int(rows.sum()))
        loss = lossplug.policy_loss(ours, recipe, normalizer).loss
        loss.backward()

        # verl: the short responses dropped first, its GRPO on the rest, its vanilla loss aggregated token-mean
        verl_logp = logp[kept].clone().requires_grad_(True)
        scores = torch.zeros(int(kept.sum()), T, dtype=torch.float64)
        scores[torch.arange(int(kept.sum())), lengths[kept] - 1] = reward[kept]
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            scores, mask[kept].double(), group_id[kept].numpy(), norm_adv_by_std_in_grpo=True
        )
        config = ActorConfig(
            strategy="fsdp",
            rollout_n=4,
            ppo_micro_batch_size_per_gpu=B,
            loss_agg_mode="token-mean",
            policy_loss=PolicyLossConfig(loss_mode="vanilla"),
        )
        config.global_batch_info.update(
            dp_size=1, batch_num_tokens=int(mask[kept].sum()), global_batch_size=int(kept.sum())
        )
        pg = core_algos.compute_policy_loss_vanilla(
            old[kept], verl_logp, adv, mask[kept].double(), loss_agg_mode="token-mean", config=config
        )[0]
        pg.backward()
        torch.testing.assert_close(res.advantage[kept], adv[:, 0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(loss, pg, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ours_logp.grad[kept], verl_logp.grad, rtol=1e-12, atol=1e-14)
        assert torch.equal(ours_logp.grad[~kept], torch.zeros_like(ours_logp.grad[~kept]))
    finally:
        lossplug.unregister_plugin(module)

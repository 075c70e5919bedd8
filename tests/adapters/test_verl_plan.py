"""The verl adapter derives its plan once per configuration: recipes are keyed by content (an edited file is read
again), nothing is keyed by an object's identity, many micro-batches cost one derivation, and the modules of
``lossplug.adapters.verl`` import each other without a loop."""

from __future__ import annotations

import ast
import copy
import gc
import json
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

import lossplug
import lossplug.adapters.verl as adapter
from lossplug.adapters.verl import LossplugPolicyLossConfig, load_recipe, plan, recipes
from lossplug.adapters.verl.equivalent.settings import LOSSPLUG_POLICY_LOSS_KEYS
from lossplug.contracts import Recipe

B, T = 4, 6
PPO_CLIP = {"gates": [{"name": "ppo_clip", "eps_high": 0.28}], "reduction": "token"}
CISPO = {"gates": [{"name": "cispo", "eps_low": 0.2, "eps_high": 0.28}], "reduction": "token"}


def micro_batch(seed: int, *, width: int = T) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, width, generator=g) < 0.8
    mask[:, 0] = True
    old = -torch.rand(B, width, generator=g, dtype=torch.float64) * 2
    return {
        "old_log_prob": old,
        "log_prob": (old + 0.3 * torch.randn(B, width, generator=g, dtype=torch.float64)).clamp(max=0),
        "advantages": torch.randn(B, width, generator=g, dtype=torch.float64),
        "response_mask": mask,
    }


def actor(policy_loss, **kw) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=B, policy_loss=policy_loss, **kw)


def call(config, mb, **kw):
    return get_policy_loss_fn("lossplug")(**mb, loss_agg_mode="token-mean", config=config, **kw)


def update_gate_of(metrics: dict) -> str:
    """The update gate that ran, from lossplug's own metric keys (actor/lossplug/<gate>/…)."""
    gates = {k.split("/")[2] for k in metrics if k.startswith("actor/lossplug/") and k.count("/") >= 3}
    gates -= {"update", "engine"}
    assert len(gates) == 1, sorted(metrics)
    return gates.pop()


# ---------------------------------------------------------------------------------------------------------------------
# (a) recipes by content: an edited file is read again


def test_an_edited_recipe_file_is_read_again(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("gates:\n  - {name: ppo_clip, eps_high: 0.28}\nreduction: token\n")
    first = load_recipe(str(path), adapter.POLICY_RECIPE_KEY)
    assert load_recipe(str(path), adapter.POLICY_RECIPE_KEY) is first  # unchanged text: the loaded recipe
    path.write_text("gates:\n  - {name: cispo, eps_low: 0.2, eps_high: 0.28}\nreduction: response\n")
    second = load_recipe(str(path), adapter.POLICY_RECIPE_KEY)
    assert (second.gates[0].name, second.reduction.name) == ("cispo", "response")


def test_a_new_configuration_reads_the_edited_file(tmp_path):
    """Two runs in one process, the recipe file edited in between: the second run computes the new recipe."""
    path = tmp_path / "recipe.yaml"
    path.write_text("gates:\n  - {name: ppo_clip, eps_high: 0.28}\nreduction: token\n")
    first = actor(LossplugPolicyLossConfig(recipe=str(path)))
    assert update_gate_of(call(first, micro_batch(0))[1]) == "ppo_clip"
    path.write_text("gates:\n  - {name: cispo, eps_low: 0.2, eps_high: 0.28}\nreduction: token\n")
    second = actor(LossplugPolicyLossConfig(recipe=str(path)))
    assert update_gate_of(call(second, micro_batch(0))[1]) == "cispo"
    assert update_gate_of(call(first, micro_batch(0))[1]) == "ppo_clip"  # a configuration keeps what it read


def test_a_hand_made_section_reads_the_edited_file_too(tmp_path):
    """A plain DictConfig (not verl's dataclass) is planned by value: its recipe file by the file's text."""
    path = tmp_path / "recipe.yaml"
    path.write_text("gates:\n  - {name: ppo_clip, eps_high: 0.28}\nreduction: token\n")
    config = OmegaConf.create({"policy_loss": {"loss_mode": "lossplug", "recipe": str(path)}, "global_batch_info": {}})
    assert update_gate_of(call(config, micro_batch(0))[1]) == "ppo_clip"
    path.write_text("gates:\n  - {name: cispo, eps_low: 0.2, eps_high: 0.28}\nreduction: token\n")
    assert update_gate_of(call(config, micro_batch(0))[1]) == "cispo"


def test_the_same_content_shares_one_recipe_and_the_caches_are_bounded(monkeypatch):
    assert load_recipe(dict(PPO_CLIP), "k") is load_recipe(OmegaConf.create(PPO_CLIP), "k")
    assert load_recipe(PPO_CLIP, "k") is not load_recipe(CISPO, "k")
    # 1 and 1.0 and True are different configs: kept apart
    assert recipes.frozen({"a": 1}) != recipes.frozen({"a": 1.0}) != recipes.frozen({"a": True})

    monkeypatch.setattr(recipes, "RECIPE_CACHE_SIZE", 3)
    for eps in (0.21, 0.22, 0.23, 0.24, 0.25):
        load_recipe({"gates": [{"name": "ppo_clip", "eps_high": eps}], "reduction": "token"}, "k")
    assert len(recipes._loaded) <= 3

    monkeypatch.setattr(plan, "PLANS_BY_VALUE", 2)
    for eps in (0.21, 0.22, 0.23):
        section = {"recipe": {"gates": [{"name": "ppo_clip", "eps_high": eps}], "reduction": "token"}}
        plan.plan_for_section(section)
    assert len(plan._plans_by_value) <= 2

    one = LossplugPolicyLossConfig(recipe=PPO_CLIP).plan
    for coef in range(plan.TERMS_PER_PLAN + 3):
        one.term(plan.CallPattern(plan.VerlTerms(entropy_coeff=float(coef)), has_weights=False, has_engine_logp=False))
    assert len(one._terms) == plan.TERMS_PER_PLAN


# ---------------------------------------------------------------------------------------------------------------------
# (b) nothing keyed by identity: recipes that get the same id() never share a plan


def test_recipes_that_reuse_an_id_never_share_a_plan(monkeypatch):
    """Create, use, drop, create: CPython often hands the next object the memory (and so the id) of the last one,
    but not always (CI once saw no reuse in 16 tries). So every id() the adapter's modules could call returns one
    number here: a cache keyed by identity would hand the second recipe the first one's plan. Each configuration
    still computes its own recipe."""
    import sys

    collided = 0
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("lossplug.adapters.verl"):
            # a module-level name shadows the builtin for that module only; deepcopy and pydantic keep the real id()
            monkeypatch.setattr(module, "id", lambda _obj: 0, raising=False)
            collided += 1
    assert collided > 5, "the adapter's modules were not found in sys.modules"
    for i in range(8):
        spec, gate = (PPO_CLIP, "ppo_clip") if i % 2 == 0 else (CISPO, "cispo")
        recipe = Recipe.load(spec)
        config = actor(LossplugPolicyLossConfig(recipe=recipe))
        assert update_gate_of(call(config, micro_batch(i))[1]) == gate
        # the regularizer and rollout-correction steps are plain functions now: they also follow the recipe given
        assert adapter.regularizers.policy_term(recipe, plan.VerlTerms()).gates[0].name == gate
        assert adapter.rollout.without_verls_correction(recipe, None, has_weights=False).gates[0].name == gate
        del recipe, config
        gc.collect()


def test_hand_made_sections_are_planned_by_value_not_by_object():
    one = plan.plan_for_section(OmegaConf.create({"recipe": PPO_CLIP}))
    same = plan.plan_for_section({"recipe": dict(PPO_CLIP)})
    other = plan.plan_for_section({"recipe": CISPO})
    assert one is same and other is not one
    assert plan.plan_for_section({"recipe": PPO_CLIP, "metrics": "full"}) is not one


# ---------------------------------------------------------------------------------------------------------------------
# (c) the plan is derived once for many micro-batches


class Spy:
    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("with_weights", [False, True])
def test_many_micro_batches_derive_the_plan_once(monkeypatch, with_weights):
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0} if with_weights else None
    gates = [{"name": "ppo_clip", "eps_high": 0.28}] + ([{"name": "tis", "cap": 2.0}] if with_weights else [])
    spec = {"gates": gates, "reduction": "token", "regularizers": [{"name": "entropy", "coef": 0.01}]}
    spies = {
        "load_recipe": Spy(monkeypatch, recipes, "load_recipe"),
        "Recipe.load": Spy(monkeypatch, Recipe, "load"),
        "plan.load_recipe": Spy(monkeypatch, plan, "load_recipe"),
        "PolicyPlan.build": Spy(monkeypatch, plan.PolicyPlan, "build"),
    }
    config = actor(
        LossplugPolicyLossConfig(recipe=spec, rollout_correction=correction),
        entropy_coeff=0.01,
        loss_agg_mode="token-mean",
    )
    assert spies["PolicyPlan.build"].calls == 1  # when verl builds the config
    spies |= {
        "policy_term": Spy(monkeypatch, plan, "policy_term"),
        "without_verls_correction": Spy(monkeypatch, plan, "without_verls_correction"),
        "lossplug.compile_recipe": Spy(monkeypatch, lossplug, "compile_recipe"),
        "json.dumps": Spy(monkeypatch, json, "dumps"),
        "_derive": Spy(monkeypatch, plan.PolicyPlan, "_derive"),
    }
    for spy in spies.values():
        spy.calls = 0

    weights = torch.full((B, T), 1.0, dtype=torch.float64) if with_weights else None
    call(config, micro_batch(0), rollout_is_weights=weights)
    first = {name: spy.calls for name, spy in spies.items()}
    assert first["_derive"] == first["policy_term"] == first["without_verls_correction"] == 1
    assert first["PolicyPlan.build"] == first["load_recipe"] == first["plan.load_recipe"] == 0
    for i in range(1, 12):
        width = T - i % 3  # verl pads each micro-batch to its own longest response
        mb = micro_batch(i, width=width)
        call(config, mb, rollout_is_weights=None if weights is None else weights[:, :width])
    after = {name: spy.calls for name, spy in spies.items()}
    assert after == first, "the micro-batches after the first derived something again"
    # the micro-batch path itself: no recipe loading, no serialising (json.dumps), no compile through the adapter
    assert after["Recipe.load"] == first["Recipe.load"]
    assert after["json.dumps"] == first["json.dumps"]
    assert after["lossplug.compile_recipe"] == first["lossplug.compile_recipe"]


def test_a_copy_carries_the_settings_and_derives_its_own_plan():
    config = LossplugPolicyLossConfig(recipe=PPO_CLIP)
    original_plan = config.plan
    assert config.plan is original_plan  # kept, not re-derived
    for duplicate in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert "_lossplug_plan" not in duplicate.__getstate__()
        assert duplicate.plan is not original_plan and duplicate.plan.recipe == original_plan.recipe
        assert update_gate_of(call(actor(duplicate), micro_batch(0))[1]) == "ppo_clip"
    assert dict(config) == dict(copy.deepcopy(config))  # verl's Mapping view: the fields only, not the plan


def test_the_config_declares_exactly_lossplugs_own_keys():
    """The key check (verl-free) knows LossplugPolicyLossConfig's own fields from a constant: the two agree."""
    own = set(LossplugPolicyLossConfig.__dataclass_fields__) - set(PolicyLossConfig.__dataclass_fields__)
    assert own == LOSSPLUG_POLICY_LOSS_KEYS


# ---------------------------------------------------------------------------------------------------------------------
# (d) no import loop inside lossplug.adapters.verl


PACKAGE = "lossplug.adapters.verl"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name → file, for every .py under ``root`` (the folder of ``package``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the modules of the package it imports, from every import statement in its AST (function-level and
    conditional ones included). ``from M import name`` is an edge to ``M.name`` when that is a module, else to ``M``;
    a module's parent packages, which Python runs first, are not edges it chose and are left out."""
    files = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` imports a.b.c; `a.b.c.func` → a.b.c
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_builder_sees_function_level_and_relative_imports(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from pkg.a import f\n")
    (root / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "b.py").write_text("def g():\n    from ..a import f\n")
    graph = import_graph(root, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_the_modules_of_the_verl_adapter_import_each_other_without_a_loop():
    graph = import_graph(Path(adapter.__file__).parent, PACKAGE)
    assert len(graph) >= 15 and f"{PACKAGE}.plan" in graph[f"{PACKAGE}.policy_loss"]  # the graph is the real one
    cycle = find_cycle(graph)
    assert cycle is None, "import loop: " + " → ".join(cycle or [])

"""``import verl`` registers lossplug — in a fresh process and in a Ray worker — through the installed
``verl.plugins`` entry point; with ``VERL_USE_EXTERNAL_PLUGINS=none`` it does not, and lossplug's own check says how
to fix it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos

import lossplug.adapters.verl as adapter
from lossplug.adapters.verl import registration
from lossplug.contracts import LossplugError, RecipeError

ENV_VARS = ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")

#: run in a fresh interpreter: `import verl` first, nothing of lossplug imported by hand
PROBE = textwrap.dedent("""
    import json, sys, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import verl
    from verl.trainer.ppo import core_algos
    out = {
        "imported_by_verl": "lossplug.adapters.verl" in sys.modules,
        "policy_loss": getattr(core_algos.POLICY_LOSS_REGISTRY.get("lossplug"), "__qualname__", None),
        "estimator": getattr(core_algos.ADV_ESTIMATOR_REGISTRY.get("lossplug"), "__qualname__", None),
        "trl_warnings": [str(w.message) for w in caught if "TRL" in str(w.message)],
    }
    try:
        core_algos.get_policy_loss_fn("lossplug")
        core_algos.get_adv_estimator_fn("lossplug")
        out["resolvable"] = True
    except ValueError as err:
        out["resolvable"] = False
        out["verl_error"] = str(err)
    from lossplug.adapters.verl import check_registration
    try:
        check_registration()
        out["check"] = "ok"
    except Exception as err:
        out["check"] = f"{type(err).__name__}: {err}"
    print("PROBE" + json.dumps(out))
""")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(extra)
    return env


def probe_results(tmp_path, envs: dict[str, dict]) -> dict[str, dict]:
    """Run PROBE once per environment, in parallel (each is mostly `import verl`)."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", PROBE],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in envs.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("PROBE")]
        assert proc.returncode == 0 and lines, f"probe '{name}' failed (rc={proc.returncode}):\n{out}\n{err[-3000:]}"
        results[name] = json.loads(lines[-1][len("PROBE") :])
    return results


def test_import_verl_alone_registers_lossplug_and_none_disables_it(tmp_path):
    results = probe_results(tmp_path, {"auto": clean_env(), "none": clean_env(VERL_USE_EXTERNAL_PLUGINS="none")})

    auto = results["auto"]
    assert auto["imported_by_verl"], auto
    assert auto["resolvable"], auto
    assert auto["policy_loss"] == "compute_policy_loss_lossplug"
    assert auto["estimator"] == "compute_lossplug_advantage"
    assert auto["check"] == "ok"

    # `import verl` alone says nothing of TRL beside verl: only a verl actor configured with lossplug does
    assert auto["trl_warnings"] == []

    none = results["none"]
    assert not none["imported_by_verl"] and not none["resolvable"], none
    assert none["policy_loss"] is None and none["estimator"] is None
    assert "Unsupported loss mode: lossplug" in none["verl_error"]
    # lossplug's own error names the cause and the fix
    assert none["check"].startswith("LossplugError: lossplug is not registered with verl")
    assert "VERL_USE_EXTERNAL_PLUGINS=none" in none["check"]
    assert "unset it" in none["check"] and "'lossplug'" in none["check"]


def test_import_verl_registers_lossplug_in_a_ray_worker(monkeypatch):
    ray = pytest.importorskip("ray")
    for key in ENV_VARS:  # workers inherit the environment of the local cluster, started from here
        monkeypatch.delenv(key, raising=False)
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as err:  # pragma: no cover - depends on the sandbox
        pytest.fail(
            f"Ray could not start a local cluster in this environment, so the worker check cannot run: "
            f"{type(err).__name__}: {err}"
        )
    try:

        @ray.remote(num_cpus=1)
        def probe():
            import sys as worker_sys

            before = "lossplug.adapters.verl" in worker_sys.modules
            import verl  # noqa: F401  - the only thing the worker does
            from verl.trainer.ppo import core_algos as algos

            loss = algos.get_policy_loss_fn("lossplug")
            estimator = algos.get_adv_estimator_fn("lossplug")
            return {
                "before": before,
                "pid": __import__("os").getpid(),
                "policy_loss": f"{loss.__module__}.{loss.__qualname__}",
                "estimator": f"{estimator.__module__}.{estimator.__qualname__}",
            }

        result = ray.get(probe.remote(), timeout=90)
    finally:
        ray.shutdown()
    assert result["pid"] != os.getpid()
    assert result["before"] is False  # nothing of lossplug was imported in the worker before `import verl`
    assert result["policy_loss"] == "lossplug.adapters.verl.policy_loss.compute_policy_loss_lossplug"
    assert result["estimator"] == "lossplug.adapters.verl.advantage.compute_lossplug_advantage"


# ---------------------------------------------------------------------------------------------------------------------
# The check and the registration, in this process


@pytest.fixture
def plain_env(monkeypatch):
    for key in ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_installed_entry_point_names_the_adapter_module():
    ep = registration.entry_point()
    assert ep is not None and ep.group == "verl.plugins" and ep.value == "lossplug.adapters.verl"


def test_check_passes_where_import_verl_loaded_lossplug(plain_env):
    adapter.check_registration()
    assert core_algos.get_policy_loss_fn("lossplug") is adapter.compute_policy_loss_lossplug
    assert core_algos.get_adv_estimator_fn("lossplug") is adapter.compute_lossplug_advantage


@pytest.mark.parametrize(
    "value,ok",
    [("none", False), ("auto", True), ("lossplug", True), ("other_pkg", False), ("other_pkg, lossplug", True)],
)
def test_check_follows_verls_plugin_policy(plain_env, value, ok):
    plain_env.setenv("VERL_USE_EXTERNAL_PLUGINS", value)
    if ok:
        adapter.check_registration()
    else:
        with pytest.raises(LossplugError, match=f"VERL_USE_EXTERNAL_PLUGINS={value} stops `import verl`"):
            adapter.check_registration()


def test_verl_use_external_modules_is_an_accepted_route(plain_env):
    plain_env.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    plain_env.setenv("VERL_USE_EXTERNAL_MODULES", "some.other,lossplug.adapters.verl")
    adapter.check_registration()


def test_check_names_a_missing_entry_point(plain_env):
    plain_env.setattr(registration, "entry_point", lambda: None)
    with pytest.raises(LossplugError, match="'verl.plugins' entry point is not installed.*every Ray worker"):
        adapter.check_registration()


def test_check_names_a_missing_registry_entry(plain_env):
    plain_env.delitem(core_algos.ADV_ESTIMATOR_REGISTRY, "lossplug")
    with pytest.raises(LossplugError, match="advantage estimator registry has no 'lossplug'.*algorithm.adv_estimator"):
        adapter.check_registration()
    adapter.check_registration(estimator=False)  # the policy-loss side alone is fine


def test_registration_is_idempotent():
    adapter.register()
    adapter.register()
    assert core_algos.ADV_ESTIMATOR_REGISTRY["lossplug"] is adapter.compute_lossplug_advantage
    assert core_algos.POLICY_LOSS_REGISTRY["lossplug"] is adapter.compute_policy_loss_lossplug


def test_an_older_copy_of_the_adapter_is_replaced(monkeypatch):
    def stale(*args, **kwargs):  # what importlib.reload would leave behind
        raise AssertionError

    stale.__lossplug_verl__ = True
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "lossplug", stale)
    adapter.register()
    assert core_algos.ADV_ESTIMATOR_REGISTRY["lossplug"] is adapter.compute_lossplug_advantage


def test_a_foreign_function_under_the_name_is_reported_not_overwritten(monkeypatch):
    def foreign(*args, **kwargs):
        raise AssertionError

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "lossplug", foreign)
    with pytest.raises(LossplugError, match="already taken by .*foreign"):
        adapter.register()
    with pytest.raises(LossplugError, match="another package registered the same name"):
        adapter.check_registration()
    assert core_algos.POLICY_LOSS_REGISTRY["lossplug"] is foreign


# ---------------------------------------------------------------------------------------------------------------------
# The config class and recipe errors


def test_the_config_needs_a_recipe():
    with pytest.raises(LossplugError, match=r"\+actor_rollout_ref\.actor\.policy_loss\.recipe="):
        adapter.LossplugPolicyLossConfig(loss_mode="lossplug")


def test_an_unknown_plugin_names_the_config_key():
    with pytest.raises(
        RecipeError,
        match=r"^actor_rollout_ref\.actor\.policy_loss\.recipe\.gates\[0\]: unknown gate "
        r"plugin 'ppo_clp' \(did you mean 'ppo_clip'\?\)",
    ):
        adapter.LossplugPolicyLossConfig(recipe={"gates": ["ppo_clp"], "reduction": "token"})


def test_a_recipe_without_loss_mode_lossplug_is_refused():
    with pytest.raises(LossplugError, match="only used with loss_mode=lossplug"):
        adapter.LossplugPolicyLossConfig(loss_mode="vanilla", recipe="dapo")
    assert adapter.LossplugPolicyLossConfig(loss_mode="vanilla").loss_mode == "vanilla"


def test_recipes_load_from_a_preset_a_file_or_inline(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("gates:\n  - {name: ppo_clip, eps_high: 0.28}\nreduction: token\n")
    for source in (
        "dapo",
        str(path),
        {"gates": [{"name": "ppo_clip", "eps_high": 0.28}], "reduction": "token"},
        OmegaConf.create({"preset": "dapo", "reduction": "response"}),
    ):
        config = adapter.LossplugPolicyLossConfig(recipe=source)
        assert adapter.load_recipe(config.recipe, adapter.POLICY_RECIPE_KEY).gates[0].name == "ppo_clip"
    with pytest.raises(LossplugError, match="no such recipe file.*absolute path"):
        adapter.LossplugPolicyLossConfig(recipe=str(tmp_path / "missing.yaml"))


def test_an_unknown_plugin_fails_at_the_first_call_of_the_policy_loss():
    """A config that did not go through LossplugPolicyLossConfig (a plain DictConfig) fails at the first call, with
    the recipe's config key."""
    import torch

    config = OmegaConf.create(
        {
            "policy_loss": {
                "loss_mode": "lossplug",
                "recipe": {"gates": [{"name": "ppo_clip", "eps_hi": 0.28}], "reduction": "token"},
            },
            "global_batch_info": {},
        }
    )
    x = torch.zeros(2, 3)
    with pytest.raises(
        RecipeError,
        match=r"actor_rollout_ref\.actor\.policy_loss\.recipe\.gates\[0\] \(ppo_clip\): "
        r"unknown parameter 'eps_hi' \(did you mean 'eps_high'\?\)",
    ):
        core_algos.get_policy_loss_fn("lossplug")(
            old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(2, 3, dtype=torch.bool), config=config
        )


def test_import_lossplug_does_not_import_verl(tmp_path):
    code = "import sys, lossplug; lossplug.list_plugins(); print('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _fake_trl(root, *, has_value_head: bool = False, experimental_ppo: bool = False):
    package = root / "trl"
    package.mkdir()
    (package / "__init__.py").write_text("AutoModelForCausalLMWithValueHead = None\n" if has_value_head else "\n")
    if experimental_ppo:
        (package / "experimental" / "ppo").mkdir(parents=True)
    return root


@pytest.mark.parametrize(
    "has_value_head,experimental_ppo,broken", [(False, False, True), (True, False, False), (False, True, False)]
)
def test_trl_beside_verl_is_detected_without_importing_trl(
    tmp_path, monkeypatch, has_value_head, experimental_ppo, broken
):
    """verl's FSDP monkey patch imports AutoModelForCausalLMWithValueHead from trl.experimental.ppo or trl whenever
    TRL is importable: a TRL with neither breaks verl, and the message says how to get out."""
    monkeypatch.delitem(sys.modules, "trl", raising=False)
    monkeypatch.syspath_prepend(
        str(_fake_trl(tmp_path, has_value_head=has_value_head, experimental_ppo=experimental_ppo))
    )
    problem = adapter.trl_breaks_verl()
    assert "trl" not in sys.modules
    if broken:
        assert problem is not None
        assert "monkey_patch.py" in problem and "pip uninstall trl" in problem and "lossplug[verl]" in problem
    else:
        assert problem is None


def test_trl_beside_verl_is_named_once_when_a_lossplug_actor_is_configured(monkeypatch):
    import warnings

    from lossplug.adapters import common
    from lossplug.adapters.verl import trl_beside

    monkeypatch.setattr(common, "ONCE_WARNED", set())
    monkeypatch.setattr(trl_beside, "trl_breaks_verl", lambda: "lossplug: TRL 1.16.0 is installed beside verl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter.LossplugPolicyLossConfig(loss_mode="vanilla")  # not lossplug's actor: nothing to say
        assert caught == []
        for _ in range(3):
            adapter.LossplugPolicyLossConfig(loss_mode="lossplug", recipe="dapo")
    assert [str(w.message) for w in caught] == ["lossplug: TRL 1.16.0 is installed beside verl"]


def test_no_trl_no_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # what find_spec sees when TRL is not importable
    assert adapter.trl_breaks_verl() is None

"""The example plugin end to end: pip-installed as a real third-party distribution, then used by TRL and by verl in
fresh processes that know it only through its installed ``lossplug`` entry point.

The example is pip-installed (no network) into a temporary directory, never into the environment running the tests
(see ``test_example_plugin.py``); each check runs in a new interpreter whose ``PYTHONPATH`` starts with that
directory. The child imports only what a user would — lossplug's TRL adapter and tiny-model helpers, or ``import
verl`` and the config classes — and never ``lossplug_example_plugin``: the probes assert it is absent until lossplug's
registry loads it from the entry point, and that the code that ran is the installed copy.

* TRL: a 2-step ``LossplugGRPOTrainer`` run (gradient accumulation 2, so 4 micro-batches) with a recipe naming
  ``tanh_clip``. The child counts ``_compute_loss`` calls (an instance wrapper) and calls of the gate's function
  (a counting wrapper around the registered plugin's ``fn``) and records which micro-batch each gate call ran in:
  the gate must run exactly once inside every micro-batch, on all of its rows and action tokens, and its metric must
  reach TRL's logs at every step.
* verl: after ``import verl`` alone, ``get_policy_loss_fn("lossplug")`` with an ``ActorConfig`` whose
  ``LossplugPolicyLossConfig`` recipe names ``tanh_clip`` returns a finite loss and gradient equal (bit for bit) to
  ``lossplug.policy_loss`` with the same recipe, and equal to the gate's formula written out by hand here.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from lossplug.testing import install_isolated

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lossplug-example-plugin"
DIST = "lossplug-example-plugin 0.1.0"
ORIGIN = f"entry point 'tanh_clip = lossplug_example_plugin' of distribution '{DIST}'"

pytestmark = pytest.mark.slow

#: environment variables that would change which plugins load (theirs, verl's), or make the child slow / online
_DROP = (
    "LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD",
    "LOSSPLUG_PLUGINS",
    "VERL_USE_EXTERNAL_PLUGINS",
    "VERL_USE_EXTERNAL_MODULES",
    "PYTEST_ADDOPTS",
)
_SET = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONDONTWRITEBYTECODE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(install target, environment for the children): the example pip-installed into a temporary directory."""
    target = tmp_path_factory.mktemp("example-e2e") / "site"
    try:
        env = install_isolated(EXAMPLE, target)
    except RuntimeError as err:
        pytest.fail(f"could not pip-install the example plugin into a temporary directory:\n{err}")
    for key in _DROP:
        env.pop(key, None)
    env.update(_SET)
    return target, env


def run_child(code: str, env: dict, cwd: Path, *args: str, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter; return the JSON it printed after ``RESULT``, plus its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, (
        f"child failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    out = json.loads(lines[-1][len("RESULT") :])
    out["_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out["_wall_s"] = time.perf_counter() - start
    return out


def _provenance_checks(out: dict, target: Path) -> None:
    """The gate that ran came from the installed distribution, loaded by lossplug's entry point, not by the child."""
    assert out["imported_before"] is False, "the child imported lossplug_example_plugin before lossplug did"
    assert out["origin"] == ORIGIN
    installed_file = str(target / "lossplug_example_plugin" / "__init__.py")
    assert out["module_file"] == installed_file, out["module_file"]
    assert out["gate_code_file"] == installed_file, out["gate_code_file"]  # the installed copy, not the checkout's


# ---------------------------------------------------------------------------------------------------------------------
# TRL

TRL_CHILD = textwrap.dedent("""
    import json, sys

    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    MAX_STEPS, ACCUMULATION = 2, 2
    imported_before = "lossplug_example_plugin" in sys.modules
    tok = tiny.tiny_tokenizer()
    args = tiny.tiny_grpo_config(sys.argv[1], max_steps=MAX_STEPS, gradient_accumulation_steps=ACCUMULATION)
    trainer = LossplugGRPOTrainer(model=tiny.tiny_model(tok), reward_funcs=[tiny.length_reward], args=args,
                                  train_dataset=tiny.tiny_dataset(), processing_class=tok,
                                  recipe={"advantage": "grpo", "gates": ["tanh_clip"], "reduction": "token"})

    # the probes: which gate the recipe resolved to, and counters around it and around every micro-batch's loss
    import lossplug

    registry = lossplug.registry()
    plugin = registry.lookup("gate", "tanh_clip")
    (stage,) = trainer._lossplug.compiled.gates
    module = sys.modules.get("lossplug_example_plugin")
    micro, gate_calls, inside = [], [], [None]

    compute_loss = trainer._compute_loss
    def counted_compute_loss(model, inputs):
        action = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        micro.append({"rows": int(action.shape[0]), "tokens": int(action.sum())})
        inside[0] = len(micro) - 1
        try:
            return compute_loss(model, inputs)
        finally:
            inside[0] = None
    trainer._compute_loss = counted_compute_loss

    gate_fn = plugin.fn
    def counted_gate(inp, p):
        gate_calls.append({"micro_batch": inside[0], "rows": int(inp.mask.shape[0]), "tokens": int(inp.mask.sum()),
                           "eps_high": p.eps_high})
        return gate_fn(inp, p)
    object.__setattr__(plugin, "fn", counted_gate)  # GatePlugin is a frozen dataclass

    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    print("RESULT" + json.dumps({
        "imported_before": imported_before,
        "origin": registry.origin("gate", "tanh_clip"),
        "resolved_is_registered": stage.plugin is plugin,
        "module_file": getattr(module, "__file__", None),
        "gate_code_file": gate_fn.__code__.co_filename,
        "global_step": trainer.state.global_step,
        "expected_micro_batches": MAX_STEPS * ACCUMULATION,  # a step is GA micro-batches, whatever num_iterations
        "num_iterations": args.num_iterations,
        "micro": micro, "gate_calls": gate_calls,
        "saturated_frac_per_log": [e.get("lossplug/tanh_clip/saturated_frac") for e in logs],
        "loss_per_log": [e.get("loss") for e in logs],
    }))
""")


@pytest.mark.skipif(find_spec("trl") is None, reason="needs TRL")
def test_a_trl_grpo_run_calls_the_installed_gate_on_every_micro_batch(installed, tmp_path):
    target, env = installed
    out = run_child(TRL_CHILD, env, tmp_path, str(tmp_path / "out"))
    _provenance_checks(out, target)
    assert out["resolved_is_registered"]
    assert out["global_step"] == 2

    expected = out["expected_micro_batches"]
    assert expected == 4  # 2 optimizer steps × 2 accumulated micro-batches
    assert out["num_iterations"] == 2  # tiny's default: the second step re-uses the first one's rollouts
    assert len(out["micro"]) == expected, out["micro"]
    # once per micro-batch, inside that micro-batch's _compute_loss, on every row and action token TRL handed it
    assert len(out["gate_calls"]) == expected, out["gate_calls"]
    assert [c["micro_batch"] for c in out["gate_calls"]] == list(range(expected))
    for call, mb in zip(out["gate_calls"], out["micro"]):
        assert (call["rows"], call["tokens"]) == (mb["rows"], mb["tokens"]) and mb["tokens"] > 0
        assert call["eps_high"] == 0.28  # the plugin's default parameters, validated by its own Params model

    # and TRL's logs carry the plugin's metric at every step, with a finite loss
    assert len(out["saturated_frac_per_log"]) == 2
    assert all(v is not None and 0.0 <= v <= 1.0 for v in out["saturated_frac_per_log"]), out
    assert out["saturated_frac_per_log"][1] > 0, out  # off-policy at the second step: the gate saturated a token
    assert all(v is not None and abs(v) < float("inf") for v in out["loss_per_log"]), out


# ---------------------------------------------------------------------------------------------------------------------
# verl

VERL_CHILD = textwrap.dedent("""
    import json, sys

    import verl  # the only registration step: loads lossplug's verl.plugins entry point

    imported_before = "lossplug_example_plugin" in sys.modules
    registered_by_verl = "lossplug.adapters.verl" in sys.modules

    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig
    from lossplug.adapters.verl import LossplugPolicyLossConfig

    EPS_LOW, EPS_HIGH = 0.2, 0.28
    RECIPE = {"gates": [{"name": "tanh_clip", "eps_low": EPS_LOW, "eps_high": EPS_HIGH}], "reduction": "token"}
    config = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=4, loss_agg_mode="token-mean",
                         policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=RECIPE))

    B, T = 4, 7
    g = torch.Generator().manual_seed(7)
    mask = torch.arange(T) < torch.tensor([7, 5, 3, 6])[:, None]
    mask[0, 2] = False  # an observation token inside a response
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp0 = (old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.tensor([1.5, -1.0, 0.5, -0.25], dtype=torch.float64)[:, None].expand(B, T).contiguous()
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)

    logp = logp0.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("lossplug")(old_log_prob=old, log_prob=logp, advantages=adv,
                                                   response_mask=mask, loss_agg_mode="token-mean", config=config)
    (grad,) = torch.autograd.grad(loss, logp)

    import lossplug

    direct_logp = logp0.clone().requires_grad_(True)
    batch = lossplug.PolicyBatch(logp=direct_logp, old_logp=old, action_mask=mask, advantage=adv)
    direct = lossplug.policy_loss(batch, lossplug.Recipe.load(RECIPE),
                                  lossplug.Normalizer(action_tokens=int(mask.sum()), sequences=B))
    (direct_grad,) = torch.autograd.grad(direct.loss, direct_logp)

    # the gate's formula, written out here: token mean of -J over the action tokens
    hand_logp = logp0.clone().requires_grad_(True)
    r = (hand_logp - old).clamp(-20, 20).exp()
    high = 1 + EPS_HIGH * torch.tanh((r - 1) / EPS_HIGH)
    low = 1 - EPS_LOW * torch.tanh((1 - r) / EPS_LOW)
    J = adv * torch.where(adv >= 0, torch.minimum(r, high), torch.maximum(r, low))
    hand = -torch.where(mask, J, 0).sum() / mask.sum()
    (hand_grad,) = torch.autograd.grad(hand, hand_logp)

    registry = lossplug.registry()
    module = sys.modules.get("lossplug_example_plugin")
    print("RESULT" + json.dumps({
        "imported_before": imported_before, "registered_by_verl": registered_by_verl,
        "origin": registry.origin("gate", "tanh_clip"),
        "module_file": getattr(module, "__file__", None),
        "gate_code_file": registry.lookup("gate", "tanh_clip").fn.__code__.co_filename,
        "loss": loss.item(), "loss_dtype": str(loss.dtype), "grad_finite": bool(torch.isfinite(grad).all()),
        "grad_off_mask_zero": bool((grad[~mask] == 0).all()), "grad_nonzero": bool((grad[mask] != 0).any()),
        "equal_to_policy_loss": bool(torch.equal(loss.detach(), direct.loss.detach())
                                     and torch.equal(grad, direct_grad)),
        "loss_vs_direct": abs(loss.item() - direct.loss.item()),
        "grad_vs_direct": (grad - direct_grad).abs().max().item(),
        "loss_vs_hand": abs(loss.item() - hand.item()), "grad_vs_hand": (grad - hand_grad).abs().max().item(),
        "metrics": {k: v for k, v in metrics.items() if "tanh_clip" in k},
        "direct_metrics": {k: v.item() for k, v in direct.metric_tensors.items() if "tanh_clip" in k},
    }))
""")


@pytest.mark.skipif(find_spec("verl") is None, reason="needs verl")
def test_verl_get_policy_loss_fn_runs_the_installed_gate_after_import_verl(installed, tmp_path):
    target, env = installed
    out = run_child(VERL_CHILD, env, tmp_path)
    _provenance_checks(out, target)
    assert out["registered_by_verl"]

    assert out["loss_dtype"] == "torch.float64" and abs(out["loss"]) < float("inf")
    assert out["grad_finite"] and out["grad_nonzero"] and out["grad_off_mask_zero"]
    # verl's loss_mode=lossplug is lossplug.policy_loss with the same recipe, exactly
    assert out["equal_to_policy_loss"], (out["loss_vs_direct"], out["grad_vs_direct"])
    # and that is tanh_clip's formula (not some other gate under the name)
    assert out["loss_vs_hand"] < 1e-12 and out["grad_vs_hand"] < 1e-12, out
    # the plugin's own metric reaches verl's metrics; the inputs reach its saturating branch
    frac = out["metrics"]["actor/lossplug/tanh_clip/saturated_frac"]
    assert frac == pytest.approx(out["direct_metrics"]["tanh_clip/saturated_frac"]) and 0 < frac < 1, out

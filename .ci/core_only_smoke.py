"""lossplug with nothing but its declared dependencies, end to end (the core-only step of .ci/run).

.ci/run installs exactly ``[project].dependencies`` and ``pip install --no-deps .`` into a fresh venv and runs this
script there, outside the checkout. The dev venv holds every extra and their dependencies (numpy comes with
matplotlib, trl and verl), so an undeclared import can hide in it; here it is a ModuleNotFoundError:

1. the extras are really absent (otherwise the check proves nothing);
2. every module of the package imports, except where the missing module is the optional extra it serves;
3. every preset runs compute_advantages → policy_loss → backward on a small random batch;
4. the tools (lossplug.tools) run;
5. ``lossplug list`` exits 0 and lists the presets.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

# torch's own note that it runs without numpy — the point of this environment
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

#: the modules that may fail to import here, each only reached through its extra (its entry point, or a user who
#: installed the extra), with the modules that extra provides; any other missing import is a failure
OPTIONAL = {
    "lossplug.adapters.verl": ("lossplug[verl]", {"verl", "numpy"}),  # numpy: verl requires it
    "lossplug.adapters.trl.trainer": ("lossplug[trl]", {"trl"}),  # (lossplug.adapters.trl itself needs no TRL)
    "lossplug.testing.pytest_plugin": ("pytest, which loads it", {"pytest"}),
}
#: must not be installed here: pulled in by an extra, never by the core dependencies
EXTRAS = ("trl", "verl", "transformers", "datasets", "safetensors", "matplotlib", "pytest", "hypothesis")


def check_extras_absent() -> None:
    present = [name for name in EXTRAS if importlib.util.find_spec(name) is not None]
    assert not present, f"not a core-only environment: {present} installed"
    numpy = importlib.util.find_spec("numpy") is not None
    print(f"core-only environment: no extras; numpy {'present (brought by a core dependency)' if numpy else 'absent'}")


def import_every_module() -> None:
    import lossplug

    skipped, failures, done = [], [], set()
    pending = ["lossplug"]
    while pending:
        name = pending.pop()
        if name in done:
            continue
        done.add(name)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            extra, provides = OPTIONAL.get(name, ("", set()))
            if (err.name or "").split(".")[0] in provides:
                skipped.append(f"{name} (needs {extra})")
            else:
                failures.append(f"{name}: {err!r}")
            continue
        except Exception as err:  # any other import-time error is a failure too
            failures.append(f"{name}: {err!r}")
            continue
        if hasattr(module, "__path__"):
            pending += [m.name for m in pkgutil.iter_modules(module.__path__, name + ".")]
        if not pending:  # a subpackage mapped from another folder (an editable install) is found once imported
            pending = sorted(n for n in sys.modules if n.startswith("lossplug.") and n not in done)
    assert not failures, "modules that do not import with only the core dependencies:\n  " + "\n  ".join(failures)
    print(
        f"imported {len(done) - len(skipped)} modules of {lossplug.__name__}; optional, skipped: "
        f"{', '.join(sorted(skipped)) or 'none'}"
    )


def batch(torch, lossplug):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False  # a prompt
    mask[1, -2:] = False  # padding
    mask[4, 3] = False  # an observation inside a response
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    return lossplug.PolicyBatch(
        logp=logp,
        action_mask=mask,
        old_logp=old,
        behavior_logp=old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64),
        ref_logp=old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64),
        reward=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64),
        value=torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1,
        group_id=torch.tensor([0, 0, 0, 1, 1, 1]),
        terminated=torch.ones(B, dtype=torch.bool),
    ), logp


def run_every_preset() -> None:
    import torch

    import lossplug

    presets = [row["name"] for row in lossplug.list_plugins() if row["kind"] == "preset"]
    assert "dapo" in presets, presets
    for name in presets:
        recipe = lossplug.Recipe.preset(name)
        b, logp = batch(torch, lossplug)
        b = b.replace(advantage=lossplug.compute_advantages(b, recipe))
        normalizer = lossplug.Normalizer(action_tokens=int(b.action_mask.sum()), sequences=b.batch_size, budget=8)
        result = lossplug.policy_loss(b, recipe, normalizer)
        result.loss.backward()
        assert math.isfinite(result.loss.item()), (name, result.loss)
        assert logp.grad is not None and bool(torch.isfinite(logp.grad).all()), name
        assert float(logp.grad.abs().sum()) > 0, f"{name}: no gradient reached logp"
    print(f"presets end to end (advantages → loss → backward): {', '.join(presets)}")


def run_the_tools() -> None:
    import torch

    import lossplug
    from lossplug.tools.diagnostics import ppo_diagnostics
    from lossplug.tools.dynamic_sampling import keep_mixed_groups
    from lossplug.tools.kl import AdaptiveKLController, ProportionalKLController, kl_penalty, kl_shaped_rewards
    from lossplug.tools.reward_model import pairwise_reward_loss
    from lossplug.tools.value_loss import value_loss

    b, logp = batch(torch, lossplug)
    shaped = kl_shaped_rewards(b.reward, b.old_logp, b.ref_logp, b.action_mask, kl_coef=0.1)
    for controller in (AdaptiveKLController(0.1, 0.05), ProportionalKLController(0.1, 0.05, horizon=100)):
        controller.update(shaped.kl_mean, 4)
    kl_penalty(logp, b.ref_logp, "low_var_kl+", b.action_mask).sum().backward()
    values = b.value.clone().requires_grad_()
    value_loss(values, b.value, b.value + 0.5, b.action_mask).loss.backward()
    keep_mixed_groups(b.reward, b.group_id, action_mask=b.action_mask)
    ppo_diagnostics(logp, b.old_logp, b.action_mask)
    scores = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)  # 2 chosen rows, then 2 rejected
    pairwise_reward_loss(scores, torch.ones(4, 5, dtype=torch.bool)).loss.backward()
    print("tools: kl, value_loss, dynamic_sampling, diagnostics, reward_model")


def run_the_cli() -> None:
    cli = Path(sys.executable).with_name("lossplug")
    out = subprocess.run([str(cli), "list"], capture_output=True, text=True)
    assert out.returncode == 0, f"lossplug list exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "dapo" in out.stdout, out.stdout
    print("lossplug list: ok")


def main() -> None:
    check_extras_absent()
    import_every_module()
    run_every_preset()
    run_the_tools()
    run_the_cli()
    print("core-only install: ok")


if __name__ == "__main__":
    main()

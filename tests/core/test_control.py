"""lossplug.control: the controller state mechanism (AdaptiveEntropyController, the live controllers of a recipe,
save/load) and the KL controllers of lossplug.tools.kl sharing it."""

from __future__ import annotations

import json
import math

import pytest
import torch

import lossplug
from lossplug.control import AdaptiveEntropyController, Controller, StepController
from lossplug.tools.kl import AdaptiveKLController, FixedKLController, ProportionalKLController


def controller(**kw):
    args = dict(coef_min=0.0, coef_max=0.02, coef_delta=0.005, target=0.5)
    args.update(kw)
    return AdaptiveEntropyController(kw.pop("coef", 0.01), **{k: v for k, v in args.items() if k != "coef"})


def observe(c, entropy_sum, tokens):
    c.observe(torch.tensor([entropy_sum, tokens], dtype=torch.float64))


def test_trls_rule_step_by_step():
    c = controller()
    assert c.coefficient == 0.0  # no measurement yet (last_world_entropy = inf): no bonus
    observe(c, 4.0, 10)  # window mean 0.4 ≤ 0.5: up
    assert c.step() == pytest.approx(0.015) and c.last_world_entropy == pytest.approx(0.4)
    observe(c, 3.0, 5)
    observe(c, 0.0, 5)  # token-weighted over the window: 3 / 10 = 0.3, not the mean of 0.6 and 0
    assert c.step() == pytest.approx(0.02) and c.last_world_entropy == pytest.approx(0.3)  # capped at coef_max
    observe(c, 6.0, 10)  # 0.6 > 0.5: down, and the bonus switches off
    assert c.step() == 0.0 and c.entropy_coef == pytest.approx(0.015)
    for _ in range(5):
        observe(c, 9.0, 10)
        c.step()
    assert c.entropy_coef == 0.0  # floored at coef_min


def test_all_reduce_sums_the_window_over_ranks():
    c = controller()
    observe(c, 1.0, 10)  # this rank: 0.1; with the other rank's [9, 10]: 0.5 ≤ target
    c.step(all_reduce=lambda t: t + torch.tensor([9.0, 10.0], dtype=torch.float64))
    assert c.last_world_entropy == pytest.approx(0.5)


def test_an_empty_window_keeps_the_state_and_zero_tokens_do_not_divide_by_zero():
    c = controller()
    c.step()
    assert c.state_dict() == {"entropy_coef": 0.01, "last_world_entropy": math.inf}
    observe(c, 0.0, 0)  # a window without a token: TRL's clamp(min=1) gives 0
    c.step()
    assert c.last_world_entropy == 0.0


def test_state_round_trips_through_json_and_drops_the_window():
    c = controller()
    observe(c, 4.0, 10)
    c.step()
    observe(c, 100.0, 1)  # observed but not stepped: not part of the saved state
    saved = json.loads(json.dumps(c.state_dict()))
    d = controller(coef=0.0)
    d.load_state_dict(saved)
    assert d.state_dict() == c.state_dict() and d._window is None


def test_bounds_are_checked():
    with pytest.raises(lossplug.LossplugError, match="coef_min"):
        controller(coef_min=0.3, coef_max=0.1)


def test_every_controller_shares_the_protocol():
    for c in (
        controller(),
        AdaptiveKLController(0.1, 6.0),
        ProportionalKLController(0.1, 6.0, 1000),
        FixedKLController(0.2),
    ):
        assert isinstance(c, Controller)
        restored = type(c).__new__(type(c))
        restored.__dict__.update(c.__dict__)
        restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
        assert restored.coefficient == c.coefficient
    assert isinstance(controller(), StepController)
    kl = AdaptiveKLController(0.1, 6.0)
    kl.update(100.0)
    assert kl.coefficient == kl.value == 0.2


RECIPE = {
    "gates": ["reinforce"],
    "reduction": "token",
    "regularizers": [{"name": "kl", "coef": 0.1}, {"name": "entropy", "coef": 0.01, "adaptive": True}],
}


def test_a_recipe_owns_live_controllers_that_survive_a_registry_rebuild():
    recipe = lossplug.Recipe.load(RECIPE)
    live = lossplug.controllers(recipe)
    assert list(live) == ["regularizers[1]"] and isinstance(live["regularizers[1]"], AdaptiveEntropyController)
    live["regularizers[1]"].update(0.1)
    lossplug.plugin_registry.reset()  # e.g. a plugin registered mid-run: the recipe is recompiled
    assert lossplug.controllers(recipe)["regularizers[1]"] is live["regularizers[1]"]
    assert lossplug.controllers(lossplug.Recipe.load(RECIPE))["regularizers[1]"] is not live["regularizers[1]"]
    assert lossplug.controllers({"gates": ["reinforce"], "reduction": "token"}) == {}


def test_controller_state_saves_and_loads_by_stage():
    recipe = lossplug.Recipe.load(RECIPE)
    lossplug.controllers(recipe)["regularizers[1]"].update(0.1)
    saved = json.loads(json.dumps(lossplug.controller_state(recipe)))
    assert saved == {"regularizers[1]": {"entropy_coef": 0.015, "last_world_entropy": 0.1}}
    fresh = lossplug.Recipe.load(RECIPE)
    lossplug.load_controller_state(fresh, saved)
    assert lossplug.controller_state(fresh) == saved
    with pytest.raises(lossplug.LossplugError, match=r"controller state for \['regularizers\[0\]'\]"):
        lossplug.load_controller_state(fresh, {"regularizers[0]": saved["regularizers[1]"]})

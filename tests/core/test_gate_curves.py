"""lossplug.gate_curves: gate specs from text, the default set of curves, and coefficients by autograd. The PNG
itself is drawn in tests/test_cli.py (``lossplug plot gates``)."""

import pytest

import lossplug
from lossplug.gate_curves import default_gate_specs, gate_coefficients, parse_assignments, parse_gate_spec


def test_assignments_are_yaml_scalars():
    assert parse_assignments(["eps_low=0.1", "mode=token", "cap=", "flag=true", "odd=[1"], "--param") == {
        "eps_low": 0.1,
        "mode": "token",
        "cap": None,
        "flag": True,
        "odd": "[1",
    }
    assert parse_assignments(None, "--param") == {}
    for bad in ("eps_low", "=0.1"):
        with pytest.raises(ValueError, match=r"--param must look like key=value"):
            parse_assignments([bad], "--param")


def test_gate_specs_from_text():
    assert parse_gate_spec("sapo") == {"name": "sapo"}
    assert parse_gate_spec(" icepop:low=0.8,high=2") == {"name": "icepop", "low": 0.8, "high": 2}
    with pytest.raises(ValueError, match="--gate parameters"):
        parse_gate_spec("ppo_clip:eps_low")


def test_default_specs_put_update_gates_first_then_corrections():
    reg = lossplug.registry()
    specs = default_gate_specs(reg)
    roles = [reg.plugins["gate"][s["name"]].role for s in specs]
    assert roles == sorted(roles, key=lambda r: r != "update")
    assert specs.index({"name": "ppo_clip", "dual_clip_c": 3.0}) == specs.index({"name": "ppo_clip"}) + 1


def test_coefficients_follow_the_clip_and_the_correction_weights():
    r = [0.5, 1.0, 2.0]
    assert gate_coefficients({"name": "reinforce"}, r, 1.0).tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert gate_coefficients({"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}, r, -1.0).tolist() == pytest.approx(
        [0.0, -1.0, -2.0]
    )
    assert gate_coefficients({"name": "tis", "cap": 1.5}, r, -1.0).tolist() == pytest.approx([-0.5, -1.0, -1.5])


def test_an_unknown_gate_is_a_recipe_error():
    with pytest.raises(lossplug.RecipeError, match="unknown gate plugin 'no_such_gate'"):
        gate_coefficients({"name": "no_such_gate"}, [1.0], 1.0)

"""lossplug.cli.gate_curves: gate specs from text, the default set of curves, and coefficients by autograd. The PNG
itself is drawn in tests/cli/test_app.py (``lossplug plot gates``)."""

import pytest

import lossplug
from lossplug.cli.gate_curves import (
    GROUP_OBJECTIVES,
    NOT_PLOTTED,
    RATIO_NOT_READ,
    default_gate_specs,
    gate_coefficients,
    parse_assignments,
    parse_gate_spec,
    ratio_axis,
)

RATIOS = [0.3, 0.6, 1.0, 1.5, 2.5, 3.5]


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
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    r = [0.5, 1.0, 2.0]
    assert gate_coefficients({"name": "reinforce"}, r, 1.0).tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert gate_coefficients({"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}, r, -1.0).tolist() == pytest.approx(
        [0.0, -1.0, -2.0]
    )
    assert gate_coefficients({"name": "tis", "cap": 1.5}, r, -1.0).tolist() == pytest.approx([-0.5, -1.0, -1.5])


def test_an_unknown_gate_is_a_recipe_error():
    with pytest.raises(lossplug.RecipeError, match="unknown gate plugin 'no_such_gate'"):
        gate_coefficients({"name": "no_such_gate"}, [1.0], 1.0)


@pytest.mark.parametrize("spec", default_gate_specs(lossplug.registry()), ids=lambda s: str(s))
def test_every_plotted_gate_draws_its_own_curve(spec):
    """The default plot shows each gate doing something reinforce's flat A does not, somewhere on the ratio axis
    (reinforce itself is the flat line), and is the policy gradient at ratio 1."""
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    curves = {adv: gate_coefficients(spec, RATIOS, adv) for adv in (1.0, -1.0)}
    for adv, coef in curves.items():
        assert coef[RATIOS.index(1.0)] == pytest.approx(adv, rel=1e-6)
    departs = any(c != pytest.approx(adv, rel=1e-6) for adv, coef in curves.items() for c in coef)
    assert departs == (spec["name"] != "reinforce"), curves


def test_the_gates_left_out_are_those_that_read_no_ratio_and_the_group_objectives():
    assert NOT_PLOTTED == {**RATIO_NOT_READ, **GROUP_OBJECTIVES}
    assert not set(RATIO_NOT_READ) & set(GROUP_OBJECTIVES) and all(NOT_PLOTTED.values())


#: the flat line of a gate that reads the entropy instead of a ratio, at the plot's 1 nat per token (else A)
FLAT_AT_ONE_NAT = {
    # A + min(α·H, |A|/κ) at α = 0.4, κ = 2: 1 + 0.4, −1 + 0.4
    "entropy_advantage": {1.0: 1.4, -1.0: -0.6},
    # the mean entropy H̄ = 1 is above τ = 0.7: the response is filtered out (advantage 0)
    "gtpo": {1.0: 0.0, -1.0: 0.0},
}


@pytest.mark.parametrize("name", sorted(RATIO_NOT_READ))
def test_gates_left_out_of_the_plot_are_flat_but_still_drawable(name):
    """What RATIO_NOT_READ says stays true: on request the gate draws, and its curve is flat — A at every ratio, or
    for a gate that reads the entropy its formula's value at 1 nat."""
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    for adv in (1.0, -1.0):
        flat = FLAT_AT_ONE_NAT.get(name, {adv: adv})[adv]
        assert gate_coefficients({"name": name}, RATIOS, adv).tolist() == pytest.approx([flat] * len(RATIOS))


def test_group_objectives_draw_a_response_beside_its_partner():
    """GROUP_OBJECTIVES on request: response i (ratio r, advantage A) in a group of two with a partner at ratio 1
    and advantage −A, both at π_old, gets its gate's gradient, transcribed here from the papers' formulas."""
    np = pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    r = np.array(RATIOS)
    for adv in (1.0, -1.0):
        # GVPO (β = 0.1, n = 2): r_i = β·log r, partner 0, c_i = r_i − (r_i + 0)/2, ∂J/∂logp = β·(A − c_i)/(n − 1)
        expected = 0.1 * (adv - 0.1 * np.log(r) / 2) / 1
        assert gate_coefficients({"name": "gvpo"}, RATIOS, adv).tolist() == pytest.approx(expected.tolist())
        # TPO (η = 1, K = 2): p = softmax(log r, 0), q = softmax(A, −A), ∂J/∂ℓ = K·(q − p)
        p, q = r / (1 + r), 1 / (1 + np.exp(-2 * adv))
        assert gate_coefficients({"name": "tpo"}, RATIOS, adv).tolist() == pytest.approx((2 * (q - p)).tolist())
    assert gate_coefficients({"name": "tpo"}, [1.0], 1.0).tolist() == pytest.approx([np.tanh(1.0)])  # not A


def test_each_correction_is_drawn_against_the_ratio_it_reads():
    reg = lossplug.registry().plugins["gate"]
    axes = {n: ratio_axis(p, {"name": n}) for n, p in reg.items()}
    assert {axes[n] for n in ("tis", "tis_seq", "icepop", "icepop_seq", "rollout_rs")} == {"engine"}
    assert {axes[n] for n in ("bypass_is", "bypass_is_seq", "bypass_rs", "ppo_clip", "dppo_tv")} == {"update"}
    assert axes["top_entropy"] == "none"


def test_dppo_is_drawn_where_its_probability_trust_region_binds():
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    # π_old = 0.2: a gap π_θ − π_old above eps_high (0.2, verl's clip_ratio_high) cuts A > 0 beyond r = 2
    assert gate_coefficients({"name": "dppo_tv"}, [1.5, 2.5], 1.0).tolist() == pytest.approx([1.5, 0.0])

"""decoupled_ppo against a transcription of the decoupled objective and of AReaL's proximal approximation, and
against AReaL's own ppo_actor_loss_fn / compute_prox_logp_approximations / M2PO mask (float64, loss and gradient),
with its invariants."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing import assert_conforms
from lossplug.testing.batches import loss_and_grad

SHAPES = [(1, 3), (3, 8), (6, 17)]
POLICY_VERSION = 7

#: (decoupled_ppo's parameters besides prox_logp, AReaL's: rejection sampling, c_clip, eps_clip_higher, m2)
CASES = [
    ({}, dict(rejection=dict(upper=math.inf))),
    ({"eps_high": 0.28, "dual_clip_c": 3.0}, dict(rejection=dict(upper=math.inf), eps_clip_higher=0.28, c_clip=3.0)),
    ({"weight_cap": 1.3}, dict(rejection=dict(upper=1.3))),
    (
        {"weight_cap": 1.2, "weight_floor": 0.8, "weight_action": "clamp"},
        dict(rejection=dict(upper=1.2, lower=0.8, action="clamp")),
    ),
    ({"weight_cap": 1.25, "weight_floor": 0.9}, dict(rejection=dict(upper=1.25, lower=0.9))),
    ({"behavior_weight": False}, dict(rejection=None)),
    ({"m2_threshold": 0.02, "weight_cap": 1.5}, dict(rejection=dict(upper=1.5), m2=0.02)),
]
PROX = ["recompute", "loglinear", "linear", "rollout"]


def async_batch(B, T, seed):
    """float64 log-probs of three policies near each other, tokens from the last five versions (a [B, T] version
    per token, AReaL's layout)."""
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = (behave + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    versions = torch.randint(POLICY_VERSION - 4, POLICY_VERSION + 1, (B, T), generator=g)
    return dict(
        logp=logp,
        old_logp=old,
        behavior_logp=behave,
        advantage=adv,
        action_mask=mask,
        behavior_version=versions,
        policy_version=torch.full((B,), POLICY_VERSION),
    )


def transcribed_prox(f, method):
    """π_prox as AReaL's prox_approx.md writes it, one token at a time (α from the versions, v_prox = v_θ − 1)."""
    if method == "recompute":
        return f["old_logp"].clone()
    behave, theta = f["behavior_logp"], f["logp"]
    if method == "rollout":
        return behave.clone()
    prox = torch.empty_like(behave)
    B, T = behave.shape
    for b in range(B):
        for t in range(T):
            v_b, v_theta = int(f["behavior_version"][b, t]), int(f["policy_version"][b])
            alpha = min(max((v_theta - 1 - v_b) / (v_theta - v_b), 0.0), 1.0) if v_theta > v_b else 0.0
            lb, lt = float(behave[b, t]), float(theta[b, t])
            if method == "loglinear":
                prox[b, t] = lb + alpha * (lt - lb)
            else:
                prox[b, t] = math.log((1 - alpha) * math.exp(lb) + alpha * math.exp(lt) + 1e-10)
    return prox


def transcribed_m2_keep(delta, mask, threshold):
    m2 = sorted(
        ((float(v) ** 2, i) for i, (v, k) in enumerate(zip(delta.flatten(), mask.flatten())) if k), reverse=True
    )
    for drop in range(len(m2)):
        rest = [v for v, _ in m2[drop:]]
        if sum(rest) / len(rest) < threshold:
            break
    else:
        drop = len(m2) - 1
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    keep[[i for _, i in m2[drop:]]] = True
    return keep.view_as(mask)


def transcribed_loss(f, method, params):
    """The decoupled objective of Fu et al. (2025), eq. 5, with AReaL's bounds on the behaviour weight and its
    per-micro-batch token mean: −Σ_kept sg(w)·min(r·A, clip(r)·A) / n_kept."""
    eps_low, eps_high = params.get("eps_low", 0.2), params.get("eps_high", 0.2)
    logp = f["logp"].clone().requires_grad_()
    mask, adv, behave = f["action_mask"], f["advantage"], f["behavior_logp"]
    prox = transcribed_prox(f, method)
    keep = mask
    if params.get("m2_threshold") is not None:
        keep = transcribed_m2_keep(prox - behave, mask, params["m2_threshold"])
    ratio = torch.exp(logp - prox)
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if params.get("dual_clip_c") is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, params["dual_clip_c"] * adv), objective)
    w = torch.exp(prox - behave)
    if not params.get("behavior_weight", True) or method == "rollout":
        w = torch.ones_like(w)
    elif params.get("weight_cap") is not None:
        cap, floor = params["weight_cap"], params.get("weight_floor")
        if params.get("weight_action", "mask") == "clamp":
            w = w.clamp(min=floor or 0.0, max=cap)
        else:
            w = torch.where((w <= cap) & (w >= (floor or 0.0)), w, 0.0)
    loss = -torch.where(keep, w * objective, 0).sum() / keep.sum()
    loss.backward()
    return loss.detach(), logp.grad


def ours(f, method, params):
    recipe = {"gates": [{"name": "decoupled_ppo", "prox_logp": method, **params}], "reduction": "token"}
    return loss_and_grad(recipe, **f)


def _errors(worst, loss, grad, expected_loss, expected_grad):
    err = float((loss.detach() - expected_loss).abs())
    worst["loss_abs"] = max(worst["loss_abs"], err)
    worst["loss_rel"] = max(worst["loss_rel"], err / max(float(expected_loss.abs()), 1e-300))
    worst["grad_abs"] = max(worst["grad_abs"], float((grad - expected_grad).abs().max()))
    scale = expected_grad.abs().max().clamp(min=1e-300)
    worst["grad_rel"] = max(worst["grad_rel"], float((grad - expected_grad).abs().max() / scale))


@pytest.mark.parametrize("method", PROX)
def test_matches_the_transcribed_objective(method):
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0, grad_rel=0.0)
    for (B, T), seed in zip(SHAPES, range(len(SHAPES))):
        f = async_batch(B, T, seed)
        for params, _ in CASES:
            result, grad = ours(f, method, params)
            expected_loss, expected_grad = transcribed_loss(f, method, params)
            torch.testing.assert_close(result.loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            _errors(worst, result.loss, grad, expected_loss, expected_grad)
    print(f"decoupled_ppo[{method}] vs transcription", worst)


def areal_loss(areal, f, method, areal_params):
    """AReaL 1.0.4's grpo_loss_fn path for a [B, T] micro-batch: π_prox resolved, M2PO, ppo_actor_loss_fn."""
    logp = f["logp"].clone().requires_grad_()
    behave, mask = f["behavior_logp"], f["action_mask"]
    if method == "recompute":
        prox = f["old_logp"]
    else:
        prox = areal.compute_prox_logp_approximations(
            old_logp=behave,
            logprobs=logp.detach(),
            versions=f["behavior_version"],
            current_version=POLICY_VERSION,
            method=method,
        )[method]
    if areal_params.get("m2") is not None:
        mask = areal.apply_m2po_masking(behave, prox, mask, areal_params["m2"])
    rejection = areal_params["rejection"]
    loss, _ = areal.ppo_actor_loss_fn(
        logprobs=logp,
        proximal_logprobs=prox,
        old_logprobs=behave,
        advantages=f["advantage"],
        eps_clip=0.2,
        loss_mask=mask,
        eps_clip_higher=areal_params.get("eps_clip_higher"),
        c_clip=areal_params.get("c_clip"),
        rejection_sampling=None if rejection is None else areal.rejection_config(**rejection),
    )
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("method", PROX)
def test_matches_areal(areal, method):
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0, grad_rel=0.0)
    for (B, T), seed in zip(SHAPES, range(10, 10 + len(SHAPES))):
        f = async_batch(B, T, seed)
        for params, areal_params in CASES:
            result, grad = ours(f, method, params)
            expected_loss, expected_grad = areal_loss(areal, f, method, areal_params)
            # AReaL computes the behaviour weight (and the versions' α) in float32, whatever the log-probs' dtype:
            # float32's rounding where either is used, float64's elsewhere
            float32_inside = areal_params["rejection"] is not None or method in ("loglinear", "linear")
            tolerance = dict(rtol=1e-6, atol=1e-7) if float32_inside else dict(rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(result.loss.detach(), expected_loss, **tolerance)
            torch.testing.assert_close(grad, expected_grad, **tolerance)
            _errors(worst, result.loss, grad, expected_loss, expected_grad)
    print(f"decoupled_ppo[{method}] vs AReaL", worst)


@pytest.mark.parametrize("method", PROX)
def test_matches_areal_in_float64_once_its_two_float32_casts_are_float64(areal_float64, method):
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0, grad_rel=0.0)
    for (B, T), seed in zip(SHAPES, range(10, 10 + len(SHAPES))):
        f = async_batch(B, T, seed)
        for params, areal_params in CASES:
            result, grad = ours(f, method, params)
            expected_loss, expected_grad = areal_loss(areal_float64, f, method, areal_params)
            torch.testing.assert_close(result.loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            _errors(worst, result.loss, grad, expected_loss, expected_grad)
    print(f"decoupled_ppo[{method}] vs AReaL, its float32 casts in float64", worst)


@given(
    eps_low=st.floats(0.01, 0.9),
    eps_high=st.floats(0.01, 2.0),
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    T=st.integers(1, 9),
)
def test_without_staleness_it_is_ppo_clip(eps_low, eps_high, seed, B, T):
    f = async_batch(B, T, seed)
    f["behavior_logp"] = f["old_logp"].clone()
    clip = {"eps_low": eps_low, "eps_high": eps_high}
    expected, expected_grad = loss_and_grad({"gates": [{"name": "ppo_clip", **clip}], "reduction": "token"}, **f)
    result, grad = ours(f, "recompute", clip)
    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-13, atol=1e-15)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 4), T=st.integers(1, 9), method=st.sampled_from(PROX[1:3]))
def test_tokens_of_the_two_newest_versions_take_the_behaviour_policy_as_proximal(seed, B, T, method):
    f = async_batch(B, T, seed)
    f["behavior_version"] = f["behavior_version"].clamp(min=POLICY_VERSION - 1)  # α = 0 for every token
    result, grad = ours(f, method, {})
    rollout, rollout_grad = ours(f, "rollout", {})
    # linear adds 1e-10 inside the log: log(p + 1e-10) − log p ≤ 1e-10 / p
    torch.testing.assert_close(result.loss, rollout.loss, rtol=0, atol=1e-8)
    torch.testing.assert_close(grad, rollout_grad, rtol=0, atol=1e-8)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 4), T=st.integers(1, 9))
def test_the_loglinear_proximal_lies_between_the_behaviour_and_the_current_policy(seed, B, T):
    from lossplug.plugins.gates.decoupled_ppo import DecoupledPPOParams, proximal_logp

    f = async_batch(B, T, seed)
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    prox = proximal_logp(inp, DecoupledPPOParams(prox_logp="loglinear"))
    low, high = torch.minimum(f["logp"], f["behavior_logp"]), torch.maximum(f["logp"], f["behavior_logp"])
    mask = f["action_mask"]
    assert bool(((prox >= low - 1e-15) & (prox <= high + 1e-15))[mask].all())
    assert not prox.requires_grad


def test_a_per_response_behavior_version_broadcasts_over_the_response():
    f = async_batch(3, 6, 4)
    per_row = torch.tensor([POLICY_VERSION - 3, POLICY_VERSION, POLICY_VERSION - 2])
    result, grad = ours(dict(f, behavior_version=per_row), "loglinear", {})
    expanded, expanded_grad = ours(dict(f, behavior_version=per_row.unsqueeze(-1).expand(3, 6)), "loglinear", {})
    torch.testing.assert_close(result.loss, expanded.loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, expanded_grad, rtol=0, atol=0)


def test_the_approximations_need_versions_and_no_old_logp():
    f = async_batch(2, 4, 0)
    without_old = {k: v for k, v in f.items() if k != "old_logp"}
    ours(without_old, "loglinear", {})  # runs: π_prox comes from the versions
    without_versions = {k: v for k, v in f.items() if k not in ("behavior_version", "policy_version")}
    with pytest.raises(lossplug.LossplugError, match="behavior_version"):
        ours(without_versions, "loglinear", {})


@pytest.mark.parametrize(
    "params, message",
    [
        ({"weight_floor": 0.5}, "weight_floor needs weight_cap"),
        ({"weight_cap": 0.5, "weight_floor": 0.9}, "must not exceed"),
        ({"weight_cap": 2.0, "behavior_weight": False}, "needs behavior_weight"),
        ({"prox_logp": "exact"}, "prox_logp"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, message):
    with pytest.raises(lossplug.LossplugError, match=message):
        lossplug.Recipe.model_validate({"gates": [{"name": "decoupled_ppo", **params}]})


@pytest.mark.parametrize(
    "params",
    [
        {"prox_logp": "loglinear"},
        {"prox_logp": "linear", "weight_cap": 2.0},
        {"prox_logp": "rollout"},
        {"weight_cap": 2.0, "weight_floor": 0.5, "weight_action": "clamp", "dual_clip_c": 3.0},
        {"behavior_weight": False, "eps_high": 0.28},
    ],
)
def test_non_default_parameters_conform(params):
    # the extreme-ratio check's batch carries no token versions (the approximations need them): covered below
    skip = {"extreme_ratios": "no versions in that batch"} if params.get("prox_logp") in ("loglinear", "linear") else {}
    assert_conforms("decoupled_ppo", kind="gate", params=params, skip=skip)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_approximations_stay_finite_for_extreme_log_probs(method, dtype):
    logp = torch.tensor([[-1e-6, -1000.0, -30.0, -700.0]], dtype=dtype)
    behave = torch.tensor([[-1000.0, -1e-6, -80.0, -1e-8]], dtype=dtype)
    f = dict(
        logp=logp,
        behavior_logp=behave,
        advantage=torch.tensor([1.0], dtype=dtype),
        behavior_version=torch.tensor([[0, 1, 2, 3]]),
        policy_version=torch.tensor([5]),
    )
    for sign in (1, -1):
        result, grad = ours(dict(f, advantage=sign * f["advantage"]), method, {"weight_cap": 3.0})
        assert bool(torch.isfinite(result.loss)) and bool(torch.isfinite(grad).all())

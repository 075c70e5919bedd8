"""dppo_binary_tv and ipo: prime-rl's default and IPO losses; dppo_binary_kl: SkyRL's binary-KL DPPO.

Oracles, float64, loss and gradient: prime-rl's ``default_loss_fn`` / ``ipo_loss_fn`` summed over packed samples and
divided by the global loss-token count (``compute_loss``), transcribed here — prime-rl is not on a package index, so
its code does not run here; SkyRL 0.3.0's ``dppo_policy_loss`` (binary_tv, with rollout log-probs) for the
``kl_tau: 0`` case and for ``binary_kl``, read from its wheel (``tests/_origins.py``). And how they differ from verl's
``dppo_tv`` / ``dppo_kl``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

from ._field_origins import skyrl_config, skyrl_ppo_utils

SHAPES = [(1, 3), (3, 7), (6, 10), (8, 33)]
DPPO_PARAMS = [{}, {"kl_tau": 0.0}, {"eps_low": 0.05, "eps_high": 0.3, "adv_tau": 0.5, "kl_tau": 0.1}]
IPO_PARAMS = [{}, {"threshold": 0.02, "kl_tau": 0.0}, {"threshold": 0.3, "adv_tau": 2.0, "kl_tau": 0.05}]
CASES = [("dppo_binary_tv", p) for p in DPPO_PARAMS] + [("ipo", p) for p in IPO_PARAMS]


def fields(B: int, T: int, seed: int, scale: float = 0.6, token_advantage: bool = False) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=scale, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True
    return {k: f[k] for k in ("logp", "behavior_logp", "advantage", "action_mask")}


def run(name: str, params: dict, f: dict, normalizer: lossplug.Normalizer | None = None):
    return loss_and_grad(
        {"gates": [{"name": name, **params}], "reduction": "token"}, normalizer=normalizer, metrics="full", **f
    )


def prime_rl_sample_loss(name: str, params: dict, trainer, inference, adv, mask):
    """One packed sample's loss, as prime-rl's default_loss_fn / ipo_loss_fn compute it (1-D tensors)."""
    log_ratio = trainer - inference
    ratio = log_ratio.exp()
    diff = trainer.exp() - inference.exp()
    if name == "dppo_binary_tv":
        masked = torch.where(adv > 0, diff > params.get("eps_high", 0.2), diff < -params.get("eps_low", 0.2))
    else:
        masked = diff.abs() > params.get("threshold", 0.1)
    keep = mask & ~masked
    pg = keep * (params.get("adv_tau", 1.0) * adv) * ratio
    kl = mask * log_ratio**2
    return (-pg + params.get("kl_tau", 1e-3) * kl).sum()


def prime_rl_loss(name: str, params: dict, logp, behavior, adv, mask, rl_scale: int):
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(logp)
    total = sum(prime_rl_sample_loss(name, params, logp[i], behavior[i], adv[i], mask[i]) for i in range(logp.shape[0]))
    return total / rl_scale


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("token_advantage", [False, True])
def test_against_prime_rl_transcribed(name, params, B, T, token_advantage):
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=token_advantage)
        result, grad = run(name, params, f)
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"]
        expected = prime_rl_loss(name, params, logp, f["behavior_logp"], f["advantage"], mask, int(mask.sum()))
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,params", CASES)
def test_micro_batches_with_the_global_token_count_add_up_to_prime_rls_step(name, params):
    # prime-rl divides every micro-batch's sum by the step's loss-token count (rl_scale)
    f = fields(8, 12, seed=5)
    mask = f["action_mask"]
    normalizer = lossplug.Normalizer.for_masks([mask])
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(f["logp"])
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part = {k: v[rows] for k, v in f.items()}
        result, g = run(name, params, part, normalizer)
        total, grad[rows] = total + result.loss, g
    logp = f["logp"].clone().requires_grad_()
    expected = prime_rl_loss(name, params, logp, f["behavior_logp"], f["advantage"], mask, int(mask.sum()))
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("delta", [(0.2, 0.2), (0.05, 0.3)])
def test_without_kl_it_is_skyrls_dppo_binary_tv(ppo_utils, B, T, delta):
    low, high = delta
    config = skyrl_config(
        policy_loss_type="dppo", dppo={"dppo_type": "binary_tv", "delta_low": low, "delta_high": high}
    )
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=True)
        params = {"eps_low": low, "eps_high": high, "kl_tau": 0.0}
        result, grad = loss_and_grad({"gates": [{"name": "dppo_binary_tv", **params}], "reduction": "token_sum"}, **f)
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        behavior = f["behavior_logp"]
        expected, _ = ppo_utils.dppo_policy_loss(
            logp, behavior, f["advantage"], config, loss_mask=mask, rollout_logprobs=behavior
        )
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=1e-7)  # SkyRL's ratio: float32
        torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("delta", [(0.2, 0.2), (0.01, 0.05), (0.0, 0.0)])
@pytest.mark.parametrize("scale", [0.6, 2.0])
def test_dppo_binary_kl_is_skyrls_binary_kl(ppo_utils, monkeypatch, B, T, delta, scale):
    # SkyRL exponentiates the log-ratio in float32 (safe_exp_delta); in float64 the rest of its code is ours exactly
    monkeypatch.setattr(ppo_utils, "safe_exp_delta", lambda d, clip=20.0, out_dtype=None: d.clamp(-clip, clip).exp())
    low, high = delta
    config = skyrl_config(
        policy_loss_type="dppo", dppo={"dppo_type": "binary_kl", "delta_low": low, "delta_high": high}
    )
    masked_somewhere = False
    for seed in range(3):
        f = fields(B, T, seed, scale=scale, token_advantage=True)
        params = {"eps_low": low, "eps_high": high}
        result, grad = loss_and_grad(
            {"gates": [{"name": "dppo_binary_kl", **params}], "reduction": "token_sum"}, metrics="full", **f
        )
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        behavior = f["behavior_logp"]
        expected, metrics = ppo_utils.dppo_policy_loss(
            logp, behavior, f["advantage"], config, loss_mask=mask, rollout_logprobs=behavior
        )
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)
        masked_somewhere |= float(result.metrics["dppo_binary_kl/mask_frac"]) > 0
    assert masked_somewhere or scale < 1 or B * T < 60  # wide log-ratios over enough tokens reach the mask


def test_dppo_binary_kl_masks_only_moves_the_advantage_pushes_past_the_bound():
    # three A > 0 tokens: rose far (masked), fell far (kept: it moved against A), rose a little (kept)
    logp = torch.tensor([[-0.2, -3.0, -1.0]], dtype=torch.float64)
    behavior = torch.tensor([[-3.0, -0.2, -1.01]], dtype=torch.float64)
    f = {
        "logp": logp,
        "behavior_logp": behavior,
        "advantage": torch.tensor([1.0], dtype=torch.float64),
        "action_mask": torch.ones(1, 3, dtype=torch.bool),
    }
    _, grad = loss_and_grad({"gates": [{"name": "dppo_binary_kl", "eps_high": 0.01}], "reduction": "token_sum"}, **f)
    ratio = (logp - behavior).exp()
    torch.testing.assert_close(-grad[0], torch.stack([torch.zeros((), dtype=torch.float64), ratio[0, 1], ratio[0, 2]]))
    # with A < 0 the same moves: the token that fell far is the one masked
    _, grad = loss_and_grad(
        {"gates": [{"name": "dppo_binary_kl", "eps_low": 0.01}], "reduction": "token_sum"},
        **{**f, "advantage": -f["advantage"]},
    )
    torch.testing.assert_close(grad[0], torch.stack([ratio[0, 0], torch.zeros((), dtype=torch.float64), ratio[0, 2]]))


def test_differs_from_verls_dppo_kl_in_value_and_gradient():
    # verl's dppo_kl anchors at old_logp and detaches min(r, cap): same mask rule, another value and gradient
    f = fields(6, 10, seed=3, scale=1.5)
    ours, g_ours = run("dppo_binary_kl", {}, f)
    verl, g_verl = loss_and_grad(
        {"gates": [{"name": "dppo_kl"}], "reduction": "token"},
        old_logp=f["behavior_logp"],
        **{k: v for k, v in f.items() if k != "behavior_logp"},
    )
    assert not torch.allclose(ours.loss, verl.loss) and not torch.allclose(g_ours, g_verl)


def test_differs_from_verls_dppo_tv_in_value_and_gradient():
    # dppo_tv anchors at old_logp and detaches min(r, cap); here the ratio carries the gradient and there is a KL
    f = fields(6, 10, seed=3, scale=1.5)
    ours, g_ours = run("dppo_binary_tv", {}, f)
    verl, g_verl = loss_and_grad(
        {"gates": [{"name": "dppo_tv"}], "reduction": "token"},
        old_logp=f["behavior_logp"],
        **{k: v for k, v in f.items() if k != "behavior_logp"},
    )
    assert not torch.allclose(ours.loss, verl.loss) and not torch.allclose(g_ours, g_verl)


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    return fields(B, T, seed=draw(st.integers(0, 2**20)), scale=draw(st.sampled_from([0.0, 0.05, 0.5, 2.0])))


def gradient(name: str, params: dict, f: dict):
    _, grad = loss_and_grad({"gates": [{"name": name, **params}], "reduction": "token_sum"}, **f)
    return grad


@given(batches(), st.sampled_from(["dppo_binary_tv", "dppo_binary_kl", "ipo"]))
def test_at_ratio_one_the_gradient_is_the_advantage_and_kl_adds_nothing(f, name):
    f = {**f, "behavior_logp": f["logp"].clone()}
    grad = gradient(name, {"kl_tau": 0.5}, f)
    adv = f["advantage"][:, None].expand_as(grad)
    torch.testing.assert_close(-grad[f["action_mask"]], adv[f["action_mask"]], rtol=1e-12, atol=1e-12)


@given(batches(), st.sampled_from(["dppo_binary_tv", "ipo"]))
def test_a_masked_token_keeps_only_the_kl_gradient(f, name):
    tau = 0.25
    grad = gradient(name, {"kl_tau": tau, "eps_low": 0.0, "eps_high": 0.0} if name != "ipo" else {"kl_tau": tau}, f)
    log_ratio = f["logp"] - f["behavior_logp"]
    change = f["logp"].exp() - f["behavior_logp"].exp()
    adv = f["advantage"][:, None].expand_as(grad)
    masked = (change.abs() > 0.1) if name == "ipo" else torch.where(adv > 0, change > 0, change < 0)
    where = masked & f["action_mask"]
    torch.testing.assert_close(grad[where], (2 * tau * log_ratio)[where], rtol=1e-12, atol=1e-12)


@given(batches())
def test_ipo_is_symmetric_in_the_sign_of_the_advantage(f):
    flipped = {**f, "advantage": -f["advantage"]}
    g, g_flipped = gradient("ipo", {"kl_tau": 0.0}, f), gradient("ipo", {"kl_tau": 0.0}, flipped)
    torch.testing.assert_close(g, -g_flipped, rtol=0, atol=0)

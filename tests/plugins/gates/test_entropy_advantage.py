"""entropy_advantage (Cheng et al., arXiv:2506.14758): the paper's shaped advantage ``A + min(α·H^detach, |A|/κ)``
fed to verl 0.9.1's own ``compute_policy_loss_vanilla`` (the PPO/GRPO clipped surrogate the paper modifies), and a
loop-by-loop float64 transcription of the same, against ``[ppo_clip, entropy_advantage]`` — loss and gradient;
the factor's exactness behind every homogeneous update gate; the detach contract; the parameter rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.contracts import LossplugError
from lossplug.testing.batches import loss_and_grad, policy_fields

ALPHA, KAPPA = 0.4, 2.0


def fields_with_entropy(seed: int, *, token_advantage: bool = True, B: int = 6, T: int = 9) -> dict[str, torch.Tensor]:
    """``policy_fields`` plus entropies in [0, 3] nats, so that both branches of the min occur (α·H ≶ |A|/κ)."""
    f = policy_fields(B, T, seed=seed, token_advantage=token_advantage)
    g = torch.Generator().manual_seed(seed + 100)
    f["entropy"] = 3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return f


def paper_shaped_advantage(adv: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    """The paper's line, written as the verl reimplementations write it (before ``compute_policy_loss``)."""
    return adv + torch.min(alpha * entropy.detach(), adv.abs() / kappa)


def loops_oracle(f: dict[str, torch.Tensor], alpha: float, kappa: float, eps: float = 0.2) -> tuple[float, list]:
    """PPO's clipped surrogate on the shaped advantage, token by token in Python floats: the token-mean loss
    ``−Σ min(r·A', clip(r)·A') / N`` and its derivative in each ``logp`` (``r·A'`` on the unclipped branch, 0 on the
    clipped one)."""
    B, T = f["logp"].shape
    mask = f["action_mask"].tolist()
    n = sum(sum(row) for row in mask)
    adv = f["advantage"]
    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            a = float(adv[i, t] if adv.ndim == 2 else adv[i])
            h = float(f["entropy"][i, t])
            shaped = a + min(alpha * h, abs(a) / kappa)
            r = math.exp(float(f["logp"][i, t]) - float(f["old_logp"][i, t]))
            unclipped, clipped = r * shaped, min(max(r, 1 - eps), 1 + eps) * shaped
            total += min(unclipped, clipped)
            grad[i][t] = -(r * shaped) / n if unclipped <= clipped else 0.0
    return -total / n, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_advantage", [True, False], ids=["token-adv", "response-adv"])
def test_matches_verls_vanilla_loss_on_the_shaped_advantage(seed, token_advantage):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    f = fields_with_entropy(seed, token_advantage=token_advantage)
    mask = f["action_mask"]
    keep = ("old_logp", "advantage", "entropy", "action_mask")
    result, grad = loss_and_grad(
        {"gates": ["ppo_clip", {"name": "entropy_advantage", "alpha": ALPHA, "kappa": KAPPA}], "reduction": "token"},
        logp=f["logp"],
        **{k: f[k] for k in keep},
    )
    adv = f["advantage"] if token_advantage else f["advantage"][:, None].expand_as(mask)
    logp = f["logp"].clone().requires_grad_()
    config = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=6, clip_ratio=0.2)
    verl_loss, _ = compute_policy_loss_vanilla(
        f["old_logp"], logp, paper_shaped_advantage(adv, f["entropy"], ALPHA, KAPPA), mask, "token-mean", config
    )
    verl_loss.backward()
    torch.testing.assert_close(result.loss, verl_loss.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(grad, logp.grad, rtol=0, atol=1e-13)
    loops_loss, loops_grad = loops_oracle(f, ALPHA, KAPPA)
    assert abs(result.loss.item() - loops_loss) < 1e-13
    torch.testing.assert_close(grad, torch.tensor(loops_grad, dtype=torch.float64), rtol=0, atol=1e-13)
    # both branches of the min were exercised
    shaped_bonus = torch.min(ALPHA * f["entropy"], adv.abs() / KAPPA)
    capped = (ALPHA * f["entropy"] > adv.abs() / KAPPA) & mask
    assert 0 < int(capped.sum()) < int(mask.sum()), shaped_bonus
    assert result.metric_tensors["entropy_advantage/capped_frac"].item() == pytest.approx(
        capped.sum().item() / mask.sum().item()
    )


#: update gates whose objective scales with A for a given sign: behind them the factor is the shaped advantage
HOMOGENEOUS = [
    "ppo_clip",
    "reinforce",
    "gspo",
    "gspo_token",
    "sapo",
    "sapo_seq",
    "cispo",
    "cispo_seq",
    "dis",
    "dppo_tv",
    "dppo_kl",
    "decoupled_ppo",
    "topr",
    "vespo",
]
#: gates with a term that does not scale with A (a (log r)² penalty, a covariance selection), or that pool the
#: token advantages of a response into one number (GMPO): the factor is not the paper's shaped advantage there
NOT_HOMOGENEOUS = ["dro", "kimi15", "ipo", "dppo_binary_tv", "kl_cov", "gmpo"]


def shaped_vs_factor(gate: str, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    f = fields_with_entropy(seed)
    keep = {k: f[k] for k in ("old_logp", "behavior_logp", "ref_logp", "action_mask", "group_id")}
    factor, factor_grad = loss_and_grad(
        {"gates": [gate, "entropy_advantage"], "reduction": "token"},
        logp=f["logp"],
        advantage=f["advantage"],
        entropy=f["entropy"],
        **keep,
    )
    shaped, shaped_grad = loss_and_grad(
        {"gates": [gate], "reduction": "token"},
        logp=f["logp"],
        advantage=paper_shaped_advantage(f["advantage"], f["entropy"], ALPHA, KAPPA),
        **keep,
    )
    return factor.loss, shaped.loss, factor_grad, shaped_grad


@pytest.mark.parametrize("gate", HOMOGENEOUS)
def test_behind_a_homogeneous_update_gate_the_factor_is_the_shaped_advantage(gate):
    factor, shaped, factor_grad, shaped_grad = shaped_vs_factor(gate)
    torch.testing.assert_close(factor, shaped, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(factor_grad, shaped_grad, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("gate", NOT_HOMOGENEOUS)
def test_behind_a_penalty_on_the_ratio_it_is_not(gate):
    factor, shaped, _, _ = shaped_vs_factor(gate)
    assert not torch.allclose(factor, shaped, rtol=1e-9, atol=1e-12)


def test_entropy_carries_no_gradient_only_logp_does():
    f = fields_with_entropy(4)
    entropy = f["entropy"].clone().requires_grad_()
    logp = f["logp"].clone().requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp, old_logp=f["old_logp"], advantage=f["advantage"], action_mask=f["action_mask"], entropy=entropy
    )
    out = lossplug.policy_loss(batch, {"gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"})
    assert out.loss.requires_grad
    out.loss.backward()
    assert entropy.grad is None  # the factor is computed from the detached entropy: α·H^detach
    assert logp.grad is not None and logp.grad.abs().sum() > 0


def test_zero_advantage_stays_zero_and_the_factor_is_one_there():
    f = fields_with_entropy(5)
    f["advantage"][0] = 0.0
    plugin = lossplug.registry().plugins["gate"]["entropy_advantage"]
    batch = lossplug.PolicyBatch(**{k: f[k] for k in ("logp", "old_logp", "advantage", "action_mask", "entropy")})
    weight = plugin(lossplug.GateInput.from_batch(batch), plugin.params()).weight
    assert torch.equal(weight[0], torch.ones_like(weight[0]))
    assert not weight.requires_grad


@given(
    adv=st.floats(-50, 50, allow_nan=False, allow_subnormal=False),
    entropy=st.floats(0, 20, allow_nan=False),
    alpha=st.floats(1e-3, 5),
    kappa=st.floats(1.01, 10),
)
def test_the_factor_keeps_the_sign_and_stays_within_one_over_kappa(adv, entropy, alpha, kappa):
    batch = lossplug.PolicyBatch(
        logp=torch.full((1, 1), -1.0, dtype=torch.float64),
        action_mask=torch.ones(1, 1, dtype=torch.bool),
        advantage=torch.tensor([adv], dtype=torch.float64),
        entropy=torch.tensor([[entropy]], dtype=torch.float64),
    )
    plugin = lossplug.registry().plugins["gate"]["entropy_advantage"]
    w = plugin(lossplug.GateInput.from_batch(batch), plugin.params(alpha=alpha, kappa=kappa)).weight.item()
    assert 1 - 1 / kappa - 1e-12 <= w <= 1 + 1 / kappa + 1e-12
    shaped = adv + min(alpha * entropy, abs(adv) / kappa)
    assert w * adv == pytest.approx(shaped, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize(
    "params, words",
    [({"kappa": 1.0}, ["kappa", "greater than 1"]), ({"alpha": 0.0}, ["alpha", "greater than 0"])],
)
def test_the_papers_constraints_are_parameter_errors(params, words):
    with pytest.raises(LossplugError) as err:
        lossplug.Recipe.model_validate({"gates": ["ppo_clip", {"name": "entropy_advantage", **params}]}).compile()
    for word in words:
        assert word in str(err.value), str(err.value)


def test_a_batch_without_entropy_is_refused_naming_the_field():
    f = fields_with_entropy(6)
    batch = lossplug.PolicyBatch(**{k: f[k] for k in ("logp", "old_logp", "advantage", "action_mask")})
    with pytest.raises(LossplugError, match="entropy"):
        lossplug.policy_loss(batch, {"gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"})

"""``whiten: center`` of ``gae``, ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline`` — OpenRLHF 0.11.2's
``--algo.advantage.no_std_norm`` — against OpenRLHF's own ``compute_advantages_and_returns``
(``openrlhf/trainer/ppo_utils/experience_maker.py``, read from its wheel, ``tests/plugins/_openrlhf.py``).

OpenRLHF normalises the advantages of ``gae``, ``reinforce`` and ``reinforce_baseline`` only, over every action token
of the rollout batch: ``A − Σ A·mask / Σ mask`` with ``no_std_norm`` (and ``· rsqrt(clamp(var, 1e-8))``, a biased
variance, without). Its mean is taken on ``.float()`` — float32; the oracle runs its code in float64
(``KeepsFloat64``), and one test pins what the float32 mean costs on plain float64 tensors. OpenRLHF's GAE and
return-to-go walk every position (masked ones with zero reward and value), so the batches are right-padded responses
without observation tokens, where that and lossplug's action-token walk agree. Advantages ≤ 1e-12 on the action
tokens; the PPO loss and gradient (``ppo_clip``, ``reduction: token`` against OpenRLHF's ``PolicyLoss`` on its own
advantages) ≤ 1e-12.
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug.testing import assert_conforms
from lossplug.testing.batches import loss_and_grad

from .._openrlhf import f64, openrlhf_advantages, openrlhf_experience_maker, openrlhf_model_utils, plain
from ..gates._field_origins import openrlhf_loss

F64 = torch.float64
N = 3  # responses per prompt
PROMPTS, T = 4, 7
ATOL = 1e-12


@pytest.fixture(scope="module")
def maker(origins):
    return openrlhf_experience_maker(origins)


@pytest.fixture(scope="module")
def model_utils(origins):
    return openrlhf_model_utils(origins)


def rollout(seed: int) -> dict[str, torch.Tensor]:
    """``PROMPTS × N`` right-padded responses in prompt order: scores, values, log-probs (|old − ref| < 10, inside
    OpenRLHF's ±10 clamp of k1)."""
    g = torch.Generator().manual_seed(seed)
    B = PROMPTS * N
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T) < lengths[:, None]
    old = -(0.05 + 3 * torch.rand(B, T, generator=g, dtype=F64))
    ref = (old + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    return {
        "score": 2 * torch.rand(B, generator=g, dtype=F64) - 0.5,
        "value": torch.randn(B, T, generator=g, dtype=F64),
        "old": torch.where(mask, old, 0.0),
        "ref": torch.where(mask, ref, 0.0),
        "logp": torch.where(mask, (old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3), 0.0),
        "mask": mask,
        "group": torch.arange(B) // N,
    }


def openrlhf_kl(model_utils, r):
    """The KL of OpenRLHF's shaped reward (``kl.use_loss`` off): ``compute_approx_kl(old, ref, "k1")``."""
    return plain(model_utils.compute_approx_kl(f64(r["old"]), f64(r["ref"]), kl_estimator="k1"))


def ours(r, advantage: dict, **fields) -> torch.Tensor:
    batch = lossplug.PolicyBatch(logp=r["logp"], action_mask=r["mask"], **fields)
    recipe = {"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"}
    adv = lossplug.estimate_advantages(batch, recipe).advantage
    return adv if adv.ndim == 2 else adv[:, None].expand_as(r["mask"])


def on_mask(x, mask):
    return torch.where(mask, x, 0.0)


def assert_advantages_equal(got, expected, mask):
    assert (on_mask(got, mask) - on_mask(expected, mask)).abs().max() <= ATOL


def assert_ppo_equal(loss_module, r, ours_adv, theirs_adv):
    """lossplug's ppo_clip (token mean) on its advantages = OpenRLHF's PolicyLoss on OpenRLHF's, loss and gradient."""
    fields = {"old_logp": r["old"], "advantage": on_mask(ours_adv, r["mask"]), "action_mask": r["mask"]}
    result, grad = loss_and_grad(
        {"gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}], "reduction": "token"},
        logp=r["logp"],
        **fields,
    )
    leaf = r["logp"].clone().requires_grad_()
    policy_loss = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2)
    expected, *_ = policy_loss(leaf, r["old"], theirs_adv, r["mask"].to(F64))
    expected.backward()
    assert abs(float(result.loss.detach()) - float(expected.detach())) <= ATOL
    assert (grad - leaf.grad).abs().max() <= ATOL


@pytest.fixture(scope="module")
def loss_module(origins):
    return openrlhf_loss(origins)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_gae_center_is_openrlhfs_no_std_norm(maker, model_utils, loss_module, seed, gamma, lam, kl_coef):
    r = rollout(seed)
    kl = openrlhf_kl(model_utils, r)
    theirs = openrlhf_advantages(
        maker,
        "gae",
        r["score"],
        r["mask"],
        n_samples_per_prompt=N,
        values=r["value"],
        kl=kl,
        kl_coef=kl_coef,
        gamma=gamma,
        lambd=lam,
    )
    advantage = {"name": "gae", "gamma": gamma, "lam": lam, "whiten": "center", "kl_coef": kl_coef or None}
    got = ours(r, advantage, reward=r["score"], value=r["value"], old_logp=r["old"], ref_logp=r["ref"])
    assert_advantages_equal(got, theirs, r["mask"])
    assert_ppo_equal(loss_module, r, got, theirs)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_reinforce_plus_plus_center_is_openrlhfs_reinforce_with_no_std_norm(
    maker, model_utils, loss_module, seed, gamma, kl_coef
):
    r = rollout(seed)
    kl = openrlhf_kl(model_utils, r)
    theirs = openrlhf_advantages(
        maker, "reinforce", r["score"], r["mask"], n_samples_per_prompt=N, kl=kl, kl_coef=kl_coef, gamma=gamma
    )
    last = r["mask"].sum(-1) - 1  # the score on each response's last action token, the KL penalty on every one
    token_reward = on_mask(-kl_coef * (r["old"] - r["ref"]), r["mask"])
    token_reward[torch.arange(len(last)), last] += r["score"]
    got = ours(r, {"name": "reinforce_plus_plus", "gamma": gamma, "whiten": "center"}, reward=token_reward)
    assert_advantages_equal(got, theirs, r["mask"])
    assert_ppo_equal(loss_module, r, got, theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_center_is_openrlhfs_reinforce_baseline_with_no_std_norm(maker, loss_module, seed):
    """The group mean, then the token-weighted batch mean (each response counts once per action token)."""
    r = rollout(seed)
    theirs = openrlhf_advantages(maker, "reinforce_baseline", r["score"], r["mask"], n_samples_per_prompt=N)
    got = ours(r, {"name": "reinforce_plus_plus_baseline", "whiten": "center"}, reward=r["score"], group_id=r["group"])
    assert_advantages_equal(got, theirs, r["mask"])
    assert_ppo_equal(loss_module, r, got, theirs)
    assert abs(float(on_mask(got, r["mask"]).sum())) <= ATOL  # centred over the action tokens


@pytest.mark.parametrize("estimator", ["rloo", "group_norm", "dr_grpo", "flash_reinforce"])
def test_openrlhf_applies_no_std_norm_to_gae_and_reinforce_only(maker, estimator):
    """Its other estimators are left as they are with or without no_std_norm: no ``center`` option is theirs."""
    r = rollout(3)
    kwargs = {"n_samples_per_prompt": N}
    centred = openrlhf_advantages(maker, estimator, r["score"], r["mask"], no_std_norm=True, **kwargs)
    assert torch.equal(
        centred, openrlhf_advantages(maker, estimator, r["score"], r["mask"], no_std_norm=False, **kwargs)
    )
    white = openrlhf_advantages(maker, "reinforce", r["score"], r["mask"], no_std_norm=False, **kwargs)
    assert not torch.equal(white, openrlhf_advantages(maker, "reinforce", r["score"], r["mask"], **kwargs))


def test_openrlhfs_own_float32_mean_is_the_only_gap_on_plain_float64_tensors(maker):
    """Without ``KeepsFloat64`` OpenRLHF takes the mean on ``.float()``: its advantages then differ from the float64
    ones (lossplug's) by the float32 rounding of that one mean, the same on every token."""
    r = rollout(0)
    exact = openrlhf_advantages(maker, "reinforce_baseline", r["score"], r["mask"], n_samples_per_prompt=N)
    rounded = openrlhf_advantages(
        maker, "reinforce_baseline", r["score"], r["mask"], n_samples_per_prompt=N, keep_float64=False
    )
    shift = (rounded - exact)[r["mask"]]
    assert float(shift.abs().max()) <= 2**-24 * float(exact[r["mask"]].abs().max() + 1)
    assert float((shift - shift[0]).abs().max()) <= 1e-15


def test_whiten_keeps_true_and_false_and_names_a_bad_value():
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        for value in (True, False, "center"):
            recipe = lossplug.Recipe.model_validate(
                {"advantage": {"name": name, "whiten": value}, "gates": ["ppo_clip"], "reduction": "token"}
            )
            assert recipe.advantage.params["whiten"] == value and type(recipe.advantage.params["whiten"]) is type(value)
        with pytest.raises(lossplug.LossplugError, match="whiten"):
            lossplug.Recipe.model_validate(
                {"advantage": {"name": name, "whiten": "centre"}, "gates": ["ppo_clip"], "reduction": "token"}
            )


def test_whiten_false_leaves_reinforce_plus_plus_returns_and_the_centred_scores():
    r = rollout(4)
    token = ours(r, {"name": "reinforce_plus_plus", "gamma": 0.9, "whiten": False}, reward=r["score"])
    returns = lossplug.estimate_advantages(
        lossplug.PolicyBatch(logp=r["logp"], action_mask=r["mask"], reward=r["score"]),
        {"advantage": {"name": "reinforce_plus_plus", "gamma": 0.9}, "gates": ["ppo_clip"], "reduction": "token"},
    ).returns
    assert torch.equal(on_mask(token, r["mask"]), on_mask(returns, r["mask"]))
    base = ours(r, {"name": "reinforce_plus_plus_baseline", "whiten": False}, reward=r["score"], group_id=r["group"])
    group_mean = r["score"].reshape(PROMPTS, N).mean(-1).repeat_interleave(N)
    torch.testing.assert_close(base[:, 0], r["score"] - group_mean, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("whiten", ["center", False])
def test_the_conformance_kit_passes_with_center_and_without_whitening(name, whiten):
    assert_conforms(name, kind="advantage", params={"whiten": whiten})

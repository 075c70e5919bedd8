"""``gdpo_loo`` (float64): against NeMo-RL's ``GDPOAdvantageEstimator`` transcribed here — its
``calculate_baseline_and_std_per_prompt`` per component (masking matrices, E[r²] − E[r]² with the n/(n − 1)
correction, ``nan_to_num(0)``), the division only where std > 0, the weighted sum, and the final ``(S − mean) / std``
with torch's sample std over the responses — for leave-one-out and group-mean baselines, with and without the
per-component division, with weights; and, end to end, the loss and gradient of a REINFORCE recipe against
``−Σ A·logp / N``. Properties: the rows' order changes nothing, scaling every weight by the same positive number
changes nothing, a component constant over the batch adds nothing, the result has mean 0 and sample std 1.

NeMo-RL's PyPI package (``nemo-rl`` 0.0.0) is an empty placeholder, so its code cannot run here. The transcription is
of NVIDIA-NeMo/RL 7ea279abfbeb698b092856d0dab61e7cf39bc909 (``nemo_rl/algorithms/advantage_estimator.py``,
``nemo_rl/algorithms/utils.py``). The rewards are chosen where NeMo-RL's one-pass variance is exact or far from 0
(binary components, continuous ones in groups where the others never coincide, equal groups of exact binary
fractions), so that its rounding cannot turn a zero std into a tiny one: see ``grpo_loo``'s tests for that case.
Measured: ≤ 3.8e-15 abs against the transcription (all parametrised cases).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import LossplugError

F64 = torch.float64
ATOL, RTOL = 1e-12, 1e-12
SIZES = [(4, 4, 4, 4), (2, 5, 3, 8, 1, 6), (3, 1, 7), (2, 2)]


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "gdpo_loo", **params}, "gates": ["reinforce"], "reduction": "token"}
    )


def batch_for(seed, sizes, K=3, T=6):
    """Groups of the given sizes in shuffled order; component 0 binary, 1 continuous, 2 on a coarse grid; group 0
    equal in every component."""
    gen = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=gen)]
    B = group.numel()
    cols = [
        (torch.rand(B, generator=gen) < 0.5).to(F64),
        torch.rand(B, generator=gen, dtype=F64) * 3,
        torch.randint(0, 4, (B,), generator=gen).to(F64) * 0.25,
    ][:K]
    components = torch.stack(cols, -1)
    components[group == 0] = 0.5
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    logp = -(0.1 + torch.rand(B, T, generator=gen, dtype=F64))
    return lossplug.PolicyBatch(
        logp=logp, action_mask=mask, reward=components.sum(-1), group_id=group, reward_components=components
    )


def nemo_baseline_and_std(prompts, rewards, leave_one_out):
    """NeMo-RL's ``calculate_baseline_and_std_per_prompt`` (every sample valid), group by group."""
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for p in prompts.unique():
        idx = (prompts == p).nonzero().flatten()
        n = idx.numel()
        if n <= 1:  # "no valid responses": baseline = reward, std 0
            baseline[idx] = rewards[idx]
            continue
        matrix = 1 - torch.eye(n, dtype=F64) if leave_one_out else torch.ones(n, n, dtype=F64)
        num_valid = n - int(leave_one_out)
        b = matrix @ rewards[idx] / num_valid
        sq = matrix @ rewards[idx].pow(2) / num_valid
        factor = num_valid / (num_valid - 1) if num_valid > 1 else float("inf")  # python: 1/0 in torch is inf
        baseline[idx] = b
        std[idx] = ((sq - b.square()) * factor).sqrt().nan_to_num(0)
    return baseline, std


def nemo_gdpo(components, group, weights=None, leave_one_out=True, normalize=True):
    """NeMo-RL's ``GDPOAdvantageEstimator.compute_advantage`` as ``[B]``."""
    K = components.shape[-1]
    weights = [1.0] * K if weights is None else weights
    parts = []
    for k in range(K):
        r = components[:, k]
        base, std_k = nemo_baseline_and_std(group, r, leave_one_out)
        adv_k = (r - base).unsqueeze(-1)
        if normalize:
            nonzero = std_k > 0
            adv_k[nonzero] = adv_k[nonzero] / (std_k.unsqueeze(-1)[nonzero] + 1e-6)
        parts.append(adv_k)
    advantages = sum(w * a for w, a in zip(weights, parts))
    adv_std = advantages.std()
    if adv_std > 0:
        advantages = (advantages - advantages.mean()) / adv_std
    else:
        advantages = advantages - advantages.mean()
    return advantages.squeeze(-1)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("baseline", ["leave_one_out", "mean"])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_matches_nemo_rls_gdpo_estimator(sizes, baseline, scale):
    batch = batch_for(len(sizes) * 7, sizes)
    adv = lossplug.compute_advantages(batch, recipe(baseline=baseline, scale=scale))
    expected = nemo_gdpo(
        batch.reward_components, batch.group_id, leave_one_out=baseline == "leave_one_out", normalize=scale == "std"
    )
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("weights", [(1.0, 0.5, 0.25), (2.0, 0.0, -1.0)])
def test_weights_match_nemo_rls_reward_weights(weights):
    batch = batch_for(3, (4, 3, 5, 2))
    adv = lossplug.compute_advantages(batch, recipe(weights=weights))
    expected = nemo_gdpo(batch.reward_components, batch.group_id, weights=list(weights))
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=RTOL)


def test_loss_and_gradient_of_reinforce_with_it():
    batch = batch_for(11, (4, 3, 5, 2))
    adv = lossplug.compute_advantages(batch, recipe())
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe())
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    a = nemo_gdpo(batch.reward_components, batch.group_id)[:, None]
    expected = -(a * reference * batch.action_mask).sum() / batch.action_mask.sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logp.grad, reference.grad, atol=ATOL, rtol=RTOL)


def test_differs_from_verls_gdpo_by_its_statistics():
    """Same batch, the two GDPOs: verl's (group mean, std + ε, whitening over tokens) is another estimator."""
    batch = batch_for(5, (4, 3, 5))
    verl = lossplug.Recipe.model_validate({"advantage": "gdpo", "gates": ["reinforce"], "reduction": "token"})
    assert (lossplug.compute_advantages(batch, recipe()) - lossplug.compute_advantages(batch, verl)).abs().max() > 0.01


def test_a_pair_a_singleton_and_equal_groups():
    """Components (binary, binary): a pair is compared with the other's value (no division), a singleton and an
    equal group give 0 for every component; S = [1−1, −(1−1)... ] standardised over the five rows."""
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.5], [0.5, 0.5]], dtype=F64)
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(5, 2, dtype=F64),
        action_mask=torch.ones(5, 2, dtype=torch.bool),
        reward=components.sum(-1),
        group_id=torch.tensor([0, 0, 1, 2, 2]),
        reward_components=components,
    )
    adv = lossplug.compute_advantages(batch, recipe())
    total = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0], dtype=F64)  # the pair's first component: ±1; the rest 0
    torch.testing.assert_close(adv, (total - total.mean()) / total.std(), atol=1e-15, rtol=0)


def test_a_constant_sum_and_a_single_row_give_exactly_zero():
    for components, group in [
        (torch.tensor([[0.3, 0.1], [0.3, 0.1], [0.7, 0.2]], dtype=F64), torch.tensor([0, 0, 1])),
        (torch.tensor([[0.3, 0.1]], dtype=F64), torch.tensor([0])),
    ]:
        B = components.shape[0]
        batch = lossplug.PolicyBatch(
            logp=-torch.ones(B, 2, dtype=F64),
            action_mask=torch.ones(B, 2, dtype=torch.bool),
            reward=components.sum(-1),
            group_id=group,
            reward_components=components,
        )
        assert torch.equal(lossplug.compute_advantages(batch, recipe()), torch.zeros(B, dtype=F64))


@settings(deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**20),
    factor=st.floats(0.01, 100.0),
)
def test_order_weight_scale_and_a_batch_constant_component_change_nothing(sizes, seed, factor):
    batch = batch_for(seed, sizes, K=2)
    adv = lossplug.compute_advantages(batch, recipe())
    perm = torch.randperm(batch.reward.numel(), generator=torch.Generator().manual_seed(seed))
    shuffled = batch.replace(
        logp=batch.logp[perm],
        action_mask=batch.action_mask[perm],
        reward=batch.reward[perm],
        group_id=batch.group_id[perm],
        reward_components=batch.reward_components[perm],
    )
    torch.testing.assert_close(lossplug.compute_advantages(shuffled, recipe()), adv[perm], atol=1e-9, rtol=1e-9)
    scaled = lossplug.compute_advantages(batch, recipe(weights=(factor, factor)))
    torch.testing.assert_close(scaled, adv, atol=1e-9, rtol=1e-9)
    constant = torch.cat([batch.reward_components, torch.full_like(batch.reward_components[:, :1], 0.7)], -1)
    widened = lossplug.compute_advantages(batch.replace(reward_components=constant), recipe())
    torch.testing.assert_close(widened, adv, atol=1e-12, rtol=0)
    if bool(adv.abs().max() > 0):  # a non-constant sum is standardised: mean 0, sample std 1
        assert abs(float(adv.mean())) < 1e-12
        assert abs(float(adv.std()) - 1.0) < 1e-12


def test_bad_weights_and_parameters_are_refused():
    batch = batch_for(1, (3, 3))
    with pytest.raises(LossplugError, match=r"gdpo_loo: weights has 2 entries but reward_components has 3 columns"):
        lossplug.compute_advantages(batch, recipe(weights=(1.0, 1.0)))
    for bad in ({"baseline": "group"}, {"scale": "group"}, {"eps": -1.0}):
        with pytest.raises(lossplug.RecipeError, match="gdpo_loo"):
            recipe(**bad)

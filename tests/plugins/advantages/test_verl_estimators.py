"""verl 0.9.1's remaining advantage estimators against lossplug's plugins, through verl's own dispatch.

Each case builds a real ``DataProto`` (float64 ``token_level_rewards`` with the score on the last response token or
dense token rewards, an int64 ``response_mask`` with observation-token holes, mixed response lengths, ``uid`` as
verl's numpy object array with scattered groups — one of them a group of one, one of equal rewards) and runs
``verl.trainer.ppo.ray_trainer.compute_advantage``; lossplug's plugin runs on a :class:`~lossplug.PolicyBatch` of the
same tensors. Advantages and returns must agree on the action tokens to 1e-8 relative (to the largest |verl value|),
in float64.

GDPO is the exception: verl 0.9.1 computes it in float32 (``np.float32`` components), so the comparison through
``compute_advantage`` is at float32 precision, and the float64 comparison composes verl's own steps
(``compute_grpo_outcome_advantage`` per component, weighted sum, ``masked_whiten``) exactly as its GDPO does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug.contracts import LossplugError

pytest.importorskip("verl")
pytest.importorskip("verl.trainer.ppo.ray_trainer")

import numpy as np  # verl's uid arrays; verl brings numpy
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils import torch_functional as verl_F

F64 = torch.float64
TOL = 1e-8
T = 10
PROMPT = 3
# a group of one, a group of equal rewards (the first), unequal sizes
SIZES = (4, 1, 3, 5, 4, 2)
SIZES_NO_SINGLETON = (4, 3, 5, 2, 6)
KEYS = ("format_reward", "accuracy_reward", "length_reward")


def make_case(seed: int, sizes=SIZES, *, dense: bool = False, holes: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=g)]
    B = group.numel()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # the longest response fills the width
    mask = torch.arange(T) < lengths[:, None]
    span = mask.clone()  # the response incl. observation tokens (attention_mask's response part)
    if holes:  # observation/tool tokens inside multi-turn responses, never the last response token
        hole = torch.rand(B, T, generator=g) < 0.25
        hole[torch.arange(B), lengths - 1] = False
        hole[:, 0] = False  # a response starts with a generated token (verl's do)
        mask &= ~hole
    score = torch.randint(0, 3, (B,), generator=g).to(F64) + 0.5 * torch.rand(B, generator=g, dtype=F64)
    score[torch.rand(B, generator=g) < 0.2] = 0.0  # some responses without reward (GPG's α)
    score[group == 0] = 0.75  # a group of equal rewards
    if dense:  # process rewards on every action token
        rewards = torch.where(mask, torch.randn(B, T, generator=g, dtype=F64), 0)
    else:
        rewards = torch.zeros(B, T, dtype=F64)
        rewards[torch.arange(B), lengths - 1] = score
    # reward components exactly representable in float32 (verl casts them with np.float32)
    components = (torch.randint(-8, 9, (B, len(KEYS)), generator=g).to(F64) / 8) * torch.tensor([1.0, 3.0, 0.25])
    components[group == 0, 1] = 2.0  # one component constant in a group
    uid = np.array([f"uid-{int(k) * 7919 % 1000:03d}-{int(k)}" for k in group], dtype=object)
    return {
        "group": group,
        "uid": uid,
        "mask": mask,
        "span": span,
        "rewards": rewards,
        "reward_baselines": torch.randn(B, generator=g, dtype=F64),
        "components": components,
    }


def data_proto(case: dict) -> DataProto:
    B = case["mask"].shape[0]
    attention = torch.cat([torch.ones(B, PROMPT, dtype=torch.long), case["span"].long()], -1)
    tensors = {
        "token_level_rewards": case["rewards"].clone(),
        "response_mask": case["mask"].long(),
        "reward_baselines": case["reward_baselines"].clone(),
        "prompts": torch.ones(B, PROMPT, dtype=torch.long),
        "attention_mask": attention,
    }
    non_tensors = {"uid": case["uid"].copy()}
    for k, key in enumerate(KEYS):
        non_tensors[key] = case["components"][:, k].numpy().copy()
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def verl(case: dict, estimator: str, **algorithm) -> tuple[torch.Tensor, torch.Tensor]:
    config = OmegaConf.create({"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0, **algorithm})
    out = compute_advantage(
        data_proto(case),
        adv_estimator=estimator,
        gamma=config.gamma,
        lam=config.lam,
        norm_adv_by_std_in_grpo=config.get("norm_adv_by_std_in_grpo", True),
        config=config,
    )
    return out.batch["advantages"], out.batch["returns"]


def policy_batch(case: dict, *, scores: bool = False) -> lossplug.PolicyBatch:
    mask = case["mask"]
    reward = case["rewards"].sum(-1) if scores else case["rewards"]
    return lossplug.PolicyBatch(
        logp=torch.zeros(mask.shape, dtype=F64),
        action_mask=mask,
        reward=reward,
        group_id=case["group"],
        reward_baseline=case["reward_baselines"],
        reward_components=case["components"],
    )


def recipe(advantage) -> lossplug.Recipe:
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


def ours(case: dict, advantage, *, scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    result = lossplug.estimate_advantages(policy_batch(case, scores=scores), recipe(advantage))
    mask = case["mask"]

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.unsqueeze(-1) if x.ndim == 1 else x, 0)

    adv = tokens(result.advantage)
    return adv, tokens(result.returns) if result.returns is not None else adv


def relative_difference(case: dict, got, expect) -> float:
    """max |ours − verl| / max |verl| over the action tokens, advantages and returns together."""
    mask = case["mask"]
    worst = 0.0
    for a, b in zip(got, expect):
        scale = torch.where(mask, b, 0).abs().max().clamp(min=1e-300)
        worst = max(worst, (torch.where(mask, a - b, 0).abs().max() / scale).item())
    return worst


# ---------------------------------------------------------------------------------------------------------------------
# Oracles through compute_advantage


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.7])
def test_reinforce_plus_plus_matches_verl(dense, gamma):
    case = make_case(int(gamma * 100) + dense, dense=dense)
    expect = verl(case, "reinforce_plus_plus", gamma=gamma)
    got = ours(case, {"name": "reinforce_plus_plus", "gamma": gamma})
    assert relative_difference(case, got, expect) <= TOL
    if not dense:  # a [B] score gives the same as the score on the last action token
        assert (
            relative_difference(case, ours(case, {"name": "reinforce_plus_plus", "gamma": gamma}, scores=True), expect)
            <= TOL
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_matches_verl(seed):
    case = make_case(10 + seed)
    expect = verl(case, "reinforce_plus_plus_baseline")
    got = ours(case, "reinforce_plus_plus_baseline")
    assert relative_difference(case, got, expect) <= TOL
    assert relative_difference(case, ours(case, "reinforce_plus_plus_baseline", scores=True), expect) <= TOL


@pytest.mark.parametrize("dense", [False, True])
def test_remax_matches_verl(dense):
    case = make_case(20 + dense, dense=dense)
    expect = verl(case, "remax")
    assert relative_difference(case, ours(case, "remax"), expect) <= TOL
    if not dense:
        assert relative_difference(case, ours(case, "remax", scores=True), expect) <= TOL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_matches_verl(seed):
    case = make_case(30 + seed)
    expect = verl(case, "opo")
    assert relative_difference(case, ours(case, "opo"), expect) <= TOL


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_passk_matches_verl(norm, seed):
    case = make_case(40 + seed + 2 * norm, SIZES_NO_SINGLETON)
    # a tie for the best response in one group: the margin is 0
    tied = (case["group"] == 2).nonzero()[:2, 0]
    last = case["mask"].shape[1] - 1 - case["mask"].flip(-1).long().argmax(-1)
    case["rewards"][tied, last[tied]] = 9.0
    expect = verl(case, "grpo_passk", norm_adv_by_std_in_grpo=norm)
    got = ours(case, {"name": "grpo_passk", "scale_by_std": norm})
    assert relative_difference(case, got, expect) <= TOL


def test_grpo_passk_refuses_a_group_of_one_like_verl():
    case = make_case(45)
    with pytest.raises(ValueError, match="at least 2 samples"):
        verl(case, "grpo_passk")
    with pytest.raises(LossplugError, match="group"):
        ours(case, "grpo_passk")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_matches_verl(seed):
    case = make_case(50 + seed)
    expect = verl(case, "gpg")
    assert relative_difference(case, ours(case, "gpg"), expect) <= TOL


def verl_gdpo_float64(case: dict, weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's compute_gdpo_outcome_advantage, step by step with verl's own functions, in float64."""
    mask = case["mask"].long()
    B = mask.shape[0]
    lengths = case["span"].sum(-1)
    total = None
    for k in range(len(KEYS)):
        scores = torch.zeros(mask.shape, dtype=F64)
        scores[torch.arange(B), lengths - 1] = case["components"][:, k]
        normalised, _ = core_algos.compute_grpo_outcome_advantage(scores, mask, case["uid"])
        term = (1.0 if weights is None else weights[k]) * normalised
        total = term if total is None else total + term
    adv = verl_F.masked_whiten(total, mask) * mask
    return adv, adv


@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
@pytest.mark.parametrize("seed", [0, 1])
def test_gdpo_matches_verl(weights, seed):
    case = make_case(60 + seed)
    spec = {"name": "gdpo"} if weights is None else {"name": "gdpo", "weights": weights}
    got = ours(case, spec)
    # float64: verl's own steps
    assert relative_difference(case, got, verl_gdpo_float64(case, weights)) <= TOL
    # through compute_advantage: verl computes GDPO in float32
    algorithm = {"gdpo_reward_keys": list(KEYS)} | ({} if weights is None else {"gdpo_reward_weights": weights})
    expect = verl(case, "gdpo", **algorithm)
    assert expect[0].dtype == torch.float32
    assert relative_difference(case, got, (expect[0].double(), expect[1].double())) <= 1e-5


def test_gdpo_weights_must_match_the_components():
    case = make_case(70)
    with pytest.raises(LossplugError, match="3 columns"):
        ours(case, {"name": "gdpo", "weights": [1.0, 2.0]})


def test_singletons_follow_verl():
    """A group of one: verl's baseline is 0 (REINFORCE++-baseline, OPO, GPG keep the score)."""
    case = make_case(80)
    singleton = case["group"] == 1
    assert singleton.sum() == 1
    for name in ("opo", "gpg"):
        adv, _ = ours(case, name)
        score = case["rewards"].sum(-1)
        row = adv[singleton][0][case["mask"][singleton][0]]
        if name == "opo":
            assert torch.all(row == score[singleton])
        else:
            assert torch.all(row != 0) or score[singleton] == 0


# ---------------------------------------------------------------------------------------------------------------------
# Properties


def property_batch(scores: list[float], groups: list[int], lengths: list[int]) -> lossplug.PolicyBatch:
    mask = torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]
    return lossplug.PolicyBatch(
        logp=torch.zeros(mask.shape, dtype=F64),
        action_mask=mask,
        reward=torch.tensor(scores, dtype=F64),
        group_id=torch.tensor(groups),
        reward_baseline=torch.zeros(len(scores), dtype=F64),
    )


group_inputs = st.integers(2, 8).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]), min_size=n, max_size=n),
        st.lists(st.integers(0, 2), min_size=n, max_size=n),
        st.lists(st.integers(1, 6), min_size=n, max_size=n),
    )
)


@settings(max_examples=30, deadline=None)
@given(group_inputs)
def test_opo_is_length_weighted_zero_sum_and_gpg_zero_sum_within_groups(inputs):
    scores, groups, lengths = inputs
    batch = property_batch(scores, groups, lengths)
    opo = lossplug.compute_advantages(batch, recipe("opo"))
    gpg = lossplug.compute_advantages(batch, recipe("gpg"))
    group, length = torch.tensor(groups), torch.tensor(lengths, dtype=F64)
    for g in group.unique():
        rows = group == g
        if rows.sum() > 1:
            assert abs(float((length[rows] * opo[rows]).sum())) <= 1e-9
            assert abs(float(gpg[rows].sum())) <= 1e-9


@settings(max_examples=30, deadline=None)
@given(group_inputs)
def test_passk_credits_at_most_one_response_per_group(inputs):
    scores, groups, lengths = inputs
    groups = [g % 2 for g in groups]
    batch = property_batch(scores, groups, lengths)
    if min(groups.count(g) for g in set(groups)) < 2:
        return
    adv = lossplug.compute_advantages(batch, recipe("grpo_passk"))
    assert (adv >= 0).all()
    for g in set(groups):
        rows = torch.tensor(groups) == g
        assert int((adv[rows] != 0).sum()) <= 1


@settings(max_examples=30, deadline=None)
@given(group_inputs)
def test_whitened_estimators_have_token_mean_zero(inputs):
    scores, groups, lengths = inputs
    batch = property_batch(scores, groups, lengths)
    mask = batch.action_mask
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = lossplug.compute_advantages(batch, recipe(name))
        tokens = torch.where(mask, adv.unsqueeze(-1) if adv.ndim == 1 else adv, 0)
        assert abs(float(tokens.sum())) <= 1e-6 * max(1.0, float(tokens.abs().sum()))


# ---------------------------------------------------------------------------------------------------------------------
# Optimal token baseline: the kernel (not a plugin: PolicyBatch has no sum_pi_squared field)


def otb_inputs(case: dict, seed: int, *, is_weights: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    B = case["mask"].shape[0]
    old_logp = -2 * torch.rand(B, T, generator=g, dtype=F64)
    extra = {
        "old_log_probs": old_logp,
        # π(a)² + (the rest's Σπ², between 0 and (1 − π(a))²): a real distribution's Σ_v π(v)²
        "sum_pi_squared": torch.exp(old_logp) ** 2
        + torch.rand(B, T, generator=g, dtype=F64) * (1 - torch.exp(old_logp)) ** 2,
    }
    if is_weights:
        extra["rollout_is_weights"] = 0.5 + torch.rand(B, T, generator=g, dtype=F64)
    return extra


def verl_with(case: dict, estimator: str, extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    data = data_proto(case)
    for key, value in extra.items():
        data.batch[key] = value.clone()
    config = OmegaConf.create({"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0})
    out = compute_advantage(data, adv_estimator=estimator, config=config)
    return out.batch["advantages"], out.batch["returns"]


@pytest.mark.parametrize("is_weights", [False, True])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize(
    "estimator, align", [("optimal_token_baseline", "position"), ("tir_optimal_token_baseline", "action")]
)
def test_optimal_token_baseline_kernel_matches_verl(estimator, align, dense, is_weights):
    from lossplug.plugins.advantages.optimal_baseline import optimal_token_baseline_advantage

    case = make_case(90 + dense + 2 * is_weights, dense=dense)
    # a group with a strictly longest response: its tail baseline is zeroed
    extra = otb_inputs(case, 7, is_weights=is_weights)
    expect = verl_with(case, estimator, extra)
    got = optimal_token_baseline_advantage(
        case["rewards"],
        case["mask"],
        case["group"],
        extra["old_log_probs"],
        extra["sum_pi_squared"],
        extra.get("rollout_is_weights"),
        align=align,
    )
    assert relative_difference(case, got, expect) <= TOL
    # without the zero tail: verl's function called directly
    fn = getattr(
        core_algos,
        {"position": "compute_optimal_token_baseline_advantage"}.get(
            align, "compute_multi_turn_optimal_token_baseline_advantage"
        ),
    )
    expect = fn(
        token_level_rewards=case["rewards"],
        response_mask=case["mask"].long(),
        index=case["uid"],
        old_log_probs=extra["old_log_probs"],
        sum_pi_squared=extra["sum_pi_squared"],
        rollout_is_weights=extra.get("rollout_is_weights"),
        handle_zero_tail=False,
    )
    got = optimal_token_baseline_advantage(
        case["rewards"],
        case["mask"],
        case["group"],
        extra["old_log_probs"],
        extra["sum_pi_squared"],
        extra.get("rollout_is_weights"),
        align=align,
        zero_tail=False,
    )
    assert relative_difference(case, got, expect) <= TOL


# dense token rewards have no [B] score form: three layouts
@pytest.mark.parametrize("dense,scores", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_plugins_match_verl(estimator, dense, scores):
    case = make_case(95 + dense, dense=dense)
    extra = otb_inputs(case, 3, is_weights=False)
    expect = verl_with(case, estimator, extra)
    batch = policy_batch(case, scores=scores).replace(
        old_logp=extra["old_log_probs"], sum_pi_squared=extra["sum_pi_squared"]
    )
    result = lossplug.estimate_advantages(batch, recipe(estimator))
    assert result.advantage.shape == case["mask"].shape
    assert relative_difference(case, (result.advantage, result.returns), expect) <= TOL


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_ignores_a_prompt_in_front(estimator):
    """Positions count from each response's first action token: masked columns in front change nothing."""
    case = make_case(97)
    extra = otb_inputs(case, 4, is_weights=False)
    batch = policy_batch(case).replace(old_logp=extra["old_log_probs"], sum_pi_squared=extra["sum_pi_squared"])
    B = batch.batch_size

    def pad(x, fill):
        return torch.cat([torch.full((B, 3), fill, dtype=x.dtype), x], -1)

    shifted = lossplug.PolicyBatch(
        logp=pad(batch.logp, 0.0),
        action_mask=pad(batch.action_mask, False),
        reward=pad(batch.reward, 0.0),
        group_id=batch.group_id,
        old_logp=pad(batch.old_logp, -1.0),
        sum_pi_squared=pad(batch.sum_pi_squared, 0.5),
    )
    plain = lossplug.compute_advantages(batch, recipe(estimator))
    moved = lossplug.compute_advantages(shifted, recipe(estimator))
    torch.testing.assert_close(moved[:, 3:], plain, rtol=0, atol=0)

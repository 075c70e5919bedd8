"""``advantage_stage`` (verl ``algorithm`` config → lossplug advantage spec), end to end: for every verl 0.9.1
estimator, the mapped recipe run by ``lossplug.estimate_advantages`` on a PolicyBatch read from a ``DataProto``
equals ``verl.trainer.ppo.ray_trainer.compute_advantage`` on that same ``DataProto`` (float64, ≤ 1e-8 relative to
the largest |verl value|, advantages and returns on the response mask), or is refused with a LossplugError naming
the setting.

Batches: mixed response lengths with observation-token holes, scattered groups, one group of equal rewards, one
group of one (left out for grpo/rloo, whose singleton conventions differ: pinned in
``tests/plugins/advantages/test_verl_oracles.py``). verl computes ``grpo_vectorized`` and ``gdpo`` in float32:
those are compared at float32 precision.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.ray_trainer")  # first: lossplug.adapters.verl imports numpy, which verl brings

import numpy as np
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.ray_trainer import compute_advantage

import lossplug
from lossplug.adapters.verl.equivalent.advantages import VERL_ESTIMATORS, advantage_stage
from lossplug.contracts import LossplugError

F64 = torch.float64
TOL = 1e-8
FLOAT32_TOL = 1e-5
T, PROMPT = 11, 4
KEYS = ["format_reward", "accuracy_reward"]
WITH_SINGLETON = (4, 1, 3, 5, 4, 2)
WITHOUT_SINGLETON = (4, 3, 5, 4, 2)


def data_proto(seed: int, sizes=WITH_SINGLETON, *, baselines: bool = False) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=g)]
    B = group.numel()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    span = torch.arange(T) < lengths[:, None]
    hole = torch.rand(B, T, generator=g) < 0.2
    hole[torch.arange(B), lengths - 1] = False
    hole[:, 0] = False  # a response starts with a generated token (verl's do)
    mask = span & ~hole
    score = torch.randint(0, 3, (B,), generator=g).to(F64) + 0.5 * torch.rand(B, generator=g, dtype=F64)
    score[torch.rand(B, generator=g) < 0.2] = 0.0
    score[group == 0] = 1.0  # a group of equal rewards
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), lengths - 1] = score
    components = torch.randint(-4, 5, (B, len(KEYS)), generator=g).to(F64) / 4  # exact in float32
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": mask.long(),
        "values": torch.randn(B, T, generator=g, dtype=F64),
        "old_log_probs": -2 * torch.rand(B, T, generator=g, dtype=F64),
        "prompts": torch.ones(B, PROMPT, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(B, PROMPT, dtype=torch.long), span.long()], -1),
    }
    pi = torch.exp(tensors["old_log_probs"])  # Σ_v π(v)² of a distribution with π(a_t) = pi
    tensors["sum_pi_squared"] = pi**2 + torch.rand(B, T, generator=g, dtype=F64) * (1 - pi) ** 2
    reward_baselines = torch.randn(B, generator=g, dtype=F64)
    if baselines:  # verl computes them for remax only (and grpo_vectorized would refuse the keyword)
        tensors["reward_baselines"] = reward_baselines
    uid = np.array([f"prompt-{int(k) * 104729 % 997}" for k in group], dtype=object)
    non_tensors = {"uid": uid} | {key: components[:, k].numpy().copy() for k, key in enumerate(KEYS)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def policy_batch(data: DataProto, algorithm: dict) -> lossplug.PolicyBatch:
    """The PolicyBatch of a DataProto: what verl's batch holds under lossplug's field names."""
    b = data.batch
    mask = b["response_mask"].bool()
    _, group = np.unique(data.non_tensor_batch["uid"], return_inverse=True)
    fields = {
        "logp": torch.zeros(mask.shape, dtype=F64),
        "action_mask": mask,
        "reward": b["token_level_rewards"],
        "value": b["values"],
        "old_logp": b["old_log_probs"],
        "group_id": torch.from_numpy(group.reshape(-1)),
        "sum_pi_squared": b["sum_pi_squared"],
    }
    if "reward_baselines" in b.keys():
        fields["reward_baseline"] = b["reward_baselines"]
    if algorithm.get("gdpo_reward_keys"):
        fields["reward_components"] = torch.stack(
            [torch.as_tensor(data.non_tensor_batch[k], dtype=F64) for k in algorithm["gdpo_reward_keys"]], -1
        )
    return lossplug.PolicyBatch(**fields)


def theirs(data: DataProto, algorithm: dict) -> tuple[torch.Tensor, torch.Tensor]:
    config = OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True, **algorithm})
    out = compute_advantage(
        data,
        adv_estimator=config.adv_estimator,
        gamma=config.gamma,
        lam=config.lam,
        norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
        config=config,
    )
    return out.batch["advantages"].double(), out.batch["returns"].double()


def ours(data: DataProto, algorithm: dict) -> tuple[torch.Tensor, torch.Tensor]:
    spec = advantage_stage(algorithm)
    recipe = lossplug.Recipe.model_validate({"advantage": spec, "gates": ["ppo_clip"], "reduction": "token"})
    result = lossplug.estimate_advantages(policy_batch(data, algorithm), recipe)
    mask = data.batch["response_mask"].bool()

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.unsqueeze(-1) if x.ndim == 1 else x, 0)

    adv = tokens(result.advantage)
    return adv, tokens(result.returns) if result.returns is not None else adv


def relative_difference(data: DataProto, got, expect) -> float:
    mask = data.batch["response_mask"].bool()
    worst = 0.0
    for a, b in zip(got, expect):
        scale = torch.where(mask, b, 0).abs().max().clamp(min=1e-300)
        worst = max(worst, (torch.where(mask, a - b, 0).abs().max() / scale).item())
    return worst


# (algorithm config, group sizes, tolerance)
CASES = {
    "gae": ({"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95}, WITH_SINGLETON, TOL),
    "gae-1-1": ({"adv_estimator": "gae"}, WITH_SINGLETON, TOL),
    "grpo": ({"adv_estimator": "grpo"}, WITHOUT_SINGLETON, TOL),
    "grpo-no-std": ({"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False}, WITHOUT_SINGLETON, TOL),
    "grpo_vectorized": ({"adv_estimator": "grpo_vectorized"}, WITHOUT_SINGLETON, FLOAT32_TOL),
    # verl 0.9.1 ignores norm_adv_by_std_in_grpo for grpo_vectorized (compute_advantage does not pass it)
    "grpo_vectorized-no-std": (
        {"adv_estimator": "grpo_vectorized", "norm_adv_by_std_in_grpo": False},
        WITHOUT_SINGLETON,
        FLOAT32_TOL,
    ),
    "rloo": ({"adv_estimator": "rloo"}, WITHOUT_SINGLETON, TOL),
    "rloo_vectorized": ({"adv_estimator": "rloo_vectorized"}, WITHOUT_SINGLETON, TOL),
    "reinforce_plus_plus": ({"adv_estimator": "reinforce_plus_plus", "gamma": 0.97}, WITH_SINGLETON, TOL),
    "reinforce_plus_plus_baseline": ({"adv_estimator": "reinforce_plus_plus_baseline"}, WITH_SINGLETON, TOL),
    "remax": ({"adv_estimator": "remax"}, WITH_SINGLETON, TOL),
    "opo": ({"adv_estimator": "opo"}, WITH_SINGLETON, TOL),
    "grpo_passk": ({"adv_estimator": "grpo_passk"}, WITHOUT_SINGLETON, TOL),
    "grpo_passk-no-std": ({"adv_estimator": "grpo_passk", "norm_adv_by_std_in_grpo": False}, WITHOUT_SINGLETON, TOL),
    "gpg": ({"adv_estimator": "gpg"}, WITH_SINGLETON, TOL),
    "gdpo": ({"adv_estimator": "gdpo", "gdpo_reward_keys": KEYS}, WITH_SINGLETON, FLOAT32_TOL),
    "gdpo-weights": (
        {"adv_estimator": "gdpo", "gdpo_reward_keys": KEYS, "gdpo_reward_weights": [0.3, 2.0]},
        WITH_SINGLETON,
        FLOAT32_TOL,
    ),
    "optimal_token_baseline": ({"adv_estimator": "optimal_token_baseline"}, WITH_SINGLETON, TOL),
    "tir_optimal_token_baseline": ({"adv_estimator": "tir_optimal_token_baseline"}, WITH_SINGLETON, TOL),
    # rollout correction without IS weights (rejection sampling only) leaves the baseline unweighted
    "optimal_token_baseline-rs-only": (
        {"adv_estimator": "optimal_token_baseline", "rollout_correction": {"rollout_is": None}},
        WITH_SINGLETON,
        TOL,
    ),
}
OTB = ["optimal_token_baseline", "tir_optimal_token_baseline"]


def test_every_verl_estimator_is_mapped():
    assert set(VERL_ESTIMATORS) == {e.value for e in AdvantageEstimator}
    assert {algorithm["adv_estimator"] for algorithm, _, _ in CASES.values()} == set(VERL_ESTIMATORS)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mapped_recipe_equals_verl_compute_advantage(case, seed):
    algorithm, sizes, tol = CASES[case]
    baselines = algorithm["adv_estimator"] == "remax"
    expect = theirs(data_proto(seed, sizes, baselines=baselines), algorithm)  # (compute_advantage writes into it)
    data = data_proto(seed, sizes, baselines=baselines)
    got = ours(data, algorithm)
    assert torch.where(data.batch["response_mask"].bool(), expect[0], 0).abs().max() > 0
    assert relative_difference(data, got, expect) <= tol


def test_gae_whitening_is_exact_to_1e_8():
    """verl's masked_whiten on its integer response_mask computes the Bessel factor n / (n − 1) in float32; gae's
    whitening does the same (a float64 factor differed by up to 2.9e-8 relative on these seeds; now ~4e-16)."""
    algorithm = CASES["gae"][0]
    for seed in range(4):
        expect, got = theirs(data_proto(seed), algorithm), ours(data_proto(seed), algorithm)
        assert relative_difference(data_proto(seed), got, expect) <= 1e-14


@pytest.mark.parametrize("estimator", OTB)
def test_optimal_token_baselines_with_rollout_is_weights_are_refused_with_the_reason(estimator):
    algorithm = {"adv_estimator": estimator, "rollout_correction": {"rollout_is": "token", "bypass_mode": False}}
    with pytest.raises(LossplugError, match=rf"rollout_correction.rollout_is='token' with adv_estimator={estimator}"):
        advantage_stage(algorithm)
    bypass = {"adv_estimator": estimator, "rollout_correction": {"rollout_is": "token", "bypass_mode": True}}
    assert advantage_stage(bypass) == {"name": estimator}  # bypass mode computes no weights before the estimator


def test_defaults_are_verl_algo_config_defaults():
    from verl.trainer.config import AlgoConfig

    defaults = AlgoConfig()
    assert advantage_stage({}) == {"name": "gae", "gamma": defaults.gamma, "lam": defaults.lam, "whiten": True}
    assert advantage_stage({"adv_estimator": "grpo"})["scale"] == "group"


@pytest.mark.parametrize(
    "algorithm, setting",
    [
        ({"adv_estimator": "gae", "use_pf_ppo": True}, "algorithm.use_pf_ppo"),
        ({"adv_estimator": "gdpo"}, "algorithm.gdpo_reward_keys"),
        ({"adv_estimator": "gdpo", "gdpo_reward_keys": KEYS, "gdpo_reward_weights": [1.0]}, "gdpo_reward_weights"),
        ({"adv_estimator": "ppo"}, "algorithm.adv_estimator=ppo"),
    ],
)
def test_unsupported_settings_are_refused_by_name(algorithm, setting):
    with pytest.raises(LossplugError, match=setting):
        advantage_stage(algorithm)


def test_grpo_singleton_group_differs_from_verl():
    """The one documented gap of the mapping: verl's GRPO gives a group of one R / (1 + 1e-6), lossplug's 0."""
    algorithm = {"adv_estimator": "grpo"}
    data = data_proto(4, WITH_SINGLETON)
    expect, got = theirs(data_proto(4, WITH_SINGLETON), algorithm), ours(data, algorithm)
    _, group = np.unique(data.non_tensor_batch["uid"], return_inverse=True)
    counts = np.bincount(group.reshape(-1))
    singleton = torch.from_numpy(counts[group.reshape(-1)] == 1)
    mask = data.batch["response_mask"].bool()
    rest = mask & ~singleton[:, None]
    score = data.batch["token_level_rewards"].sum(-1)
    one_plus_eps = float(torch.tensor(1.0) + 1e-6)  # verl: a float32 1 plus epsilon
    lone = singleton[:, None] & mask
    assert (got[0][singleton] == 0).all() and (score[singleton] != 0).all()
    assert torch.equal(expect[0][lone], (score[:, None] / one_plus_eps).expand_as(mask)[lone])
    assert (torch.where(rest, got[0] - expect[0], 0).abs().max() / expect[0].abs().max()) <= TOL


# ---------------------------------------------------------------------------------------------------------------------
# Inside verl: the mapped spec as algorithm.lossplug under adv_estimator=lossplug (lossplug.adapters.verl)

# verl hands a registered estimator only rewards, mask, uid and reward_baselines: gdpo's components and the optimal
# token baselines' sum_pi_squared / old_log_probs reach only verl's own estimators of those names (adv_estimator=gdpo,
# optimal_token_baseline, ...), gae's values none: those run through the adapter's compute_advantage (below)
IN_VERL = [
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "rloo_vectorized",
]


def in_verl(data: DataProto, algorithm: dict) -> tuple[torch.Tensor, torch.Tensor]:
    pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
    recipe = {"advantage": advantage_stage(algorithm), "gates": ["ppo_clip"], "reduction": "token"}
    return theirs(data, {**algorithm, "adv_estimator": "lossplug", "lossplug": recipe})


@pytest.mark.parametrize("case", IN_VERL)
def test_mapped_spec_inside_verl_equals_verl(case):
    algorithm, sizes, tol = CASES[case]
    baselines = case == "remax"
    expect = theirs(data_proto(5, sizes, baselines=baselines), algorithm)
    got = in_verl(data_proto(5, sizes, baselines=baselines), algorithm)
    assert relative_difference(data_proto(5, sizes), got, expect) <= tol


@pytest.mark.parametrize("case", sorted(CASES))
def test_mapped_spec_through_the_adapters_compute_advantage_equals_verl(case):
    """``lossplug.adapters.verl.compute_advantage(data, recipe, reward_keys=)`` (custom trainers) on the same
    DataProto: it reads ``sum_pi_squared`` (optimal token baselines) and the ``gdpo_reward_keys`` columns itself."""
    adapter = pytest.importorskip("lossplug.adapters.verl")
    algorithm, sizes, tol = CASES[case]
    baselines = algorithm["adv_estimator"] == "remax"
    expect = theirs(data_proto(6, sizes, baselines=baselines), algorithm)
    recipe = {"advantage": advantage_stage(algorithm), "gates": ["ppo_clip"], "reduction": "token"}
    reward_keys = algorithm.get("gdpo_reward_keys")
    out = adapter.compute_advantage(data_proto(6, sizes, baselines=baselines), recipe, reward_keys=reward_keys)
    got = (out.batch["advantages"], out.batch["returns"])
    assert relative_difference(data_proto(6, sizes), got, expect) <= tol


# ---------------------------------------------------------------------------------------------------------------------
# algorithm.use_kl_in_reward


@pytest.mark.parametrize("beta", [0.001, 0.2])
def test_kl_in_reward_maps_to_the_kl_shaper_before_gae(beta):
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    algorithm = {
        "adv_estimator": "gae",
        "gamma": 0.99,
        "lam": 0.95,
        "use_kl_in_reward": True,
        "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": beta},
    }
    from lossplug.adapters.verl.equivalent.rollout_side import reward_shapers

    (shaper,) = reward_shapers(algorithm)
    assert shaper == {"name": "kl_in_reward", "estimator": "kl", "coef": beta, "controller": "fixed"}
    assert "kl_coef" not in advantage_stage(algorithm)  # the shaper, not the estimator, puts the KL in the reward
    data = data_proto(7)
    g = torch.Generator().manual_seed(7)
    noise = 0.3 * torch.randn(data.batch["old_log_probs"].shape, generator=g, dtype=F64)
    data.batch["ref_log_prob"] = (data.batch["old_log_probs"] + noise).clamp(max=-1e-3)
    data.batch["token_level_scores"] = data.batch["token_level_rewards"].clone()
    batch = policy_batch(data, algorithm).replace(
        ref_logp=data.batch["ref_log_prob"].clone(), reward=data.batch["token_level_scores"].clone()
    )
    data, _ = apply_kl_penalty(data, FixedKLController(beta), kl_penalty="kl")
    expect = theirs(data, algorithm)
    recipe = lossplug.Recipe.model_validate(
        {"shapers": [shaper], "advantage": advantage_stage(algorithm), "gates": ["ppo_clip"], "reduction": "token"}
    )
    result = lossplug.estimate_advantages(batch, recipe)
    assert relative_difference(data, (result.advantage, result.returns), expect) <= TOL

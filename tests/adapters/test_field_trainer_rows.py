"""docs/field.md's rows that once needed the trainer's cooperation and now run as recipes, each taken from the page
itself (the row's recipe merged onto its section's base recipe, as ``tests/docs/test_field.py`` builds it) and run
through verl's own seams against the origin's formula:

* AReaL ``kl_ctl`` with ``kl_estimator`` in the reward (areal 1.0.4 ``PPOActor.compute_advantages``, transcribed
  below): ``kl_in_reward`` then AReaL's critic-free GAE, through ``lossplug.adapters.verl.compute_advantage`` (``gae``
  reads the critic's values, which verl's registered estimator is not handed);
* OpenRLHF's KL in the reward: the shaped reward equals OpenRLHF's own ``compute_approx_kl`` + ``compute_reward``
  (openrlhf 0.11.2, loaded from its wheel), the advantages verl's GAE on that reward;
* the DAPO overlong penalty of NeMo-RL (``apply_reward_shaping``, transcribed) through verl's ``compute_advantage``
  with ``adv_estimator=lossplug``, and of OpenRLHF (its own ``apply_overlong_penalty``, from its wheel);
* ROLL's ``train_infer_correction.filters`` ratio bounds (token, geometric, sequence; ``_compute_all_granularity``
  transcribed) as ``mismatch_rejection``, whose mask verl's ``compute_advantage`` writes into ``response_mask``;
  TRL refuses the filter at ``attach`` (the per-token log-probs are not in its gathered batch).
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("verl")

import numpy as np  # verl's uid arrays; verl brings numpy
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage as verl_compute_advantage

from lossplug.adapters.verl import compute_advantage as lossplug_compute_advantage
from lossplug.contracts import LossplugError

from .._origins import Origins
from ..docs.test_field import ROWS, base_recipe, build, code_span

B, T, G = 8, 6, 4
F64 = torch.float64


def row_recipe(framework: str, option_starts: str) -> dict:
    """The page's own recipe for the row whose option cell starts with ``option_starts``, merged onto the base."""
    found = [row for row in ROWS if row.framework == framework and row.option.startswith(option_starts)]
    assert len(found) == 1, f"{framework}: {len(found)} rows start with {option_starts!r}"
    build(found[0])  # validated as the page's test validates it
    merged = {**base_recipe(framework), **yaml.safe_load(code_span(found[0].recipe))}
    return copy.deepcopy({key: value for key, value in merged.items() if value is not None})


def make_data(seed: int, *, values: bool = False, rollout: bool = False) -> DataProto:
    """verl's batch at advantage time (float64): scores on each response's last token, old, reference and (rollout)
    engine log-probs, a response mask of lengths 2..T, uid groups of G."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([2, 6, 4, 5, 3, 6, 6, 4])
    mask = torch.arange(T).expand(B, T) < lengths[:, None]
    attention = torch.cat([torch.ones(B, 2, dtype=torch.long), mask.long()], 1)
    scores = torch.randint(0, 2, (B,), generator=g).to(F64) + 0.25 * torch.rand(B, generator=g, dtype=F64)
    token_scores = torch.zeros(B, T, dtype=F64)
    token_scores[torch.arange(B), lengths - 1] = scores
    old = torch.where(mask, -torch.rand(B, T, generator=g, dtype=F64) * 2, 0.0)
    ref = torch.where(mask, (old + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=0), 0.0)
    tensors = {
        "responses": torch.ones(B, T, dtype=torch.long),
        "attention_mask": attention,
        "response_mask": mask.long(),
        "token_level_scores": token_scores,
        "old_log_probs": old,
        "ref_log_prob": ref,
    }
    if values:
        tensors["values"] = torch.zeros(B, T, dtype=F64)  # AReaL and OpenRLHF without a critic: V = 0
    if rollout:
        tensors["rollout_log_probs"] = torch.where(
            mask, (old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=0), 0.0
        )
    data = DataProto.from_dict(
        tensors=tensors, non_tensors={"uid": np.array([f"p{i // G}" for i in range(B)], dtype=object)}
    )
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # use_kl_in_reward off: verl copies them
    return data


def last_token_scores(data: DataProto) -> torch.Tensor:
    return data.batch["token_level_scores"].sum(-1)


# -- KL in the reward --------------------------------------------------------------------------------------------------
def areal_gae(rewards: torch.Tensor, mask: torch.Tensor, discount: float = 1.0, lam: float = 1.0) -> torch.Tensor:
    """AReaL's backward GAE loop with values 0, carrying over masked positions (PPOActor.compute_advantages)."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        last = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                last = rewards[i, t] + discount * lam * last
                advantages[i, t] = last
    return advantages


def test_areals_kl_ctl_in_the_reward_is_areals_reward_and_critic_free_gae():
    recipe = row_recipe("AReaL", "`kl_ctl`")
    assert recipe["shapers"][0]["name"] == "kl_in_reward" and recipe["advantage"]["name"] == "gae"
    data = make_data(0, values=True)
    mask = data.batch["response_mask"].bool()
    old, ref = data.batch["old_log_probs"].clone(), data.batch["ref_log_prob"].clone()
    out = lossplug_compute_advantage(data, recipe)
    # AReaL: rewards = −kl_ctl·clamp(k1(old, ref), ±10) on the loss mask, the score added at the last token
    kl_ctl = 0.1
    rewards = torch.where(mask, -kl_ctl * (old - ref).clamp(-10, 10), 0.0)
    lengths = mask.sum(-1)
    rewards[torch.arange(B), lengths - 1] += last_token_scores(make_data(0))
    assert (old - ref).abs().max() < 10, "the ±10 clamp AReaL applies would bind: not the documented range"
    torch.testing.assert_close(out.batch["token_level_rewards"], rewards, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.batch["advantages"], areal_gae(rewards, mask), rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def origins(tmp_path_factory: pytest.TempPathFactory) -> Origins:
    return Origins(Path(__file__).resolve().parents[2] / ".pytest_cache" / "d" / "origin-wheels")


def test_openrlhfs_kl_in_the_reward_is_its_compute_reward_then_verls_gae(origins):
    recipe = row_recipe("OpenRLHF", "KL in the reward")
    shaper = recipe["shapers"][0]
    assert (
        shaper["name"] == "kl_in_reward"
        and shaper["estimator"] == "k1"
        and shaper.get("controller", "fixed") == "fixed"
    )
    utils = origins.module("openrlhf.models.utils", {"deepspeed": types.ModuleType("deepspeed")})
    data = make_data(1, values=True)
    mask = data.batch["response_mask"].bool()
    kl = utils.compute_approx_kl(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_estimator="k1")
    theirs = utils.compute_reward(last_token_scores(data).float(), shaper["coef"], kl, action_mask=mask)
    out = lossplug_compute_advantage(data, recipe)
    # OpenRLHF computes the KL in float32 (``log_probs.float()``): equal to that rounding
    torch.testing.assert_close(out.batch["token_level_rewards"], theirs.to(F64), rtol=0, atol=1e-6)
    gamma, lam = recipe["advantage"]["gamma"], recipe["advantage"]["lam"]
    expected, _ = core_algos.compute_gae_advantage_return(
        token_level_rewards=out.batch["token_level_rewards"],
        values=data.batch["values"],
        response_mask=mask.to(F64),
        gamma=gamma,
        lam=lam,
    )
    torch.testing.assert_close(torch.where(mask, out.batch["advantages"], 0), torch.where(mask, expected, 0))


#: overlong_penalty computes in the reward's dtype (float64 here), as the origins do in Python floats: exact
OVERLONG_ATOL = 0.0


# -- the DAPO overlong penalty -----------------------------------------------------------------------------------------
def nemo_overlong(scores: torch.Tensor, lengths: torch.Tensor, max_len: int, buffer: int, penalty: float):
    """NeMo-RL ``apply_reward_shaping`` (DAPO branch): reward + min(−(L − (max − buffer)) / buffer · penalty, 0)."""
    out = scores.clone()
    for i, length in enumerate(lengths.tolist()):
        exceed = length - (max_len - buffer)
        out[i] = scores[i] + min(-exceed / buffer * penalty, 0)
    return out


def test_nemo_rls_overlong_shaping_through_verls_compute_advantage():
    recipe = row_recipe("NeMo-RL", "overlong reward shaping")
    shaper = recipe["shapers"][0]
    shaper.update(max_response_length=T, buffer=3, factor=0.5)  # the page's lengths scaled down to this batch
    data = make_data(2)
    mask = data.batch["response_mask"].bool()
    config = OmegaConf.create({"adv_estimator": "lossplug", "gamma": 1.0, "lam": 1.0, "lossplug": recipe})
    out = verl_compute_advantage(data, adv_estimator="lossplug", num_repeat=G, config=config)
    expected = nemo_overlong(last_token_scores(make_data(2)), mask.sum(-1), T, 3, 0.5)
    assert (expected != last_token_scores(make_data(2))).sum() >= 3, "no response is penalised: the test proves nothing"
    torch.testing.assert_close(out.batch["token_level_rewards"].sum(-1), expected, rtol=0, atol=OVERLONG_ATOL)
    lengths = mask.sum(-1)
    on_last = out.batch["token_level_rewards"][torch.arange(B), lengths - 1]
    torch.testing.assert_close(on_last, expected, rtol=0, atol=OVERLONG_ATOL)


def test_openrlhfs_overlong_penalty_is_its_apply_overlong_penalty(origins):
    recipe = row_recipe("OpenRLHF", "DAPO overlong penalty")
    shaper = recipe["shapers"][0]
    shaper.update(max_response_length=T, buffer=3, factor=0.5)
    logging_utils = types.ModuleType("openrlhf.utils.logging_utils")
    logging_utils.init_logger = lambda name: types.SimpleNamespace(info=lambda *a, **k: None)
    penalty = origins.module(
        "openrlhf.trainer.ppo_utils.length_penalty", {"openrlhf.utils.logging_utils": logging_utils}
    )
    data = make_data(3, values=True)
    mask = data.batch["response_mask"].bool()
    experience = types.SimpleNamespace(response_length=mask.sum(-1), rewards=last_token_scores(data).clone())
    assert (
        penalty.apply_overlong_penalty(
            [experience], max_new_tokens=T, overlong_buffer_len=3, overlong_penalty_factor=0.5
        )
        >= 3
    )
    out = lossplug_compute_advantage(data, recipe)
    torch.testing.assert_close(out.batch["token_level_rewards"].sum(-1), experience.rewards, rtol=0, atol=OVERLONG_ATOL)


# -- ROLL's train/infer correction filters ----------------------------------------------------------------------------
def roll_ratio_filter(old, infer, mask, agg: str, low: float, high: float) -> torch.Tensor:
    """ROLL ``compute_train_infer_correction`` (ratio filter), ratio = π_old/π_infer at ROLL's granularities."""
    m = mask.to(old.dtype)
    log_ratio = old - infer
    if agg == "token":
        ratio = log_ratio.exp()
    elif agg == "geometric":
        ratio = ((log_ratio * m).sum(-1) / m.sum(-1)).exp()[:, None].expand_as(old)
    else:  # sequence
        ratio = (log_ratio * m).sum(-1).exp()[:, None].expand_as(old)
    return mask & (ratio >= low) & (ratio <= high)


#: ROLL's agg_type → (rollout_rs option, ratio_low, ratio_high): bounds that reject some of this batch, not all
OPTIONS = {
    "token": ("token_k1", 0.5, 1.6),
    "geometric": ("seq_mean_k1", 0.8, 1.15),
    "sequence": ("seq_sum_k1", 0.3, 2.5),
}


@pytest.mark.parametrize("agg", list(OPTIONS))
def test_rolls_ratio_filters_narrow_verls_response_mask_as_roll_narrows_its_own(agg):
    recipe = row_recipe("ROLL", "`train_infer_correction.filters`")
    # ROLL's ratio_low/high bound π_old/π_infer; rollout_rs bounds the reciprocal π_infer/π_old
    option, low, high = OPTIONS[agg]
    recipe["filters"][0].update(options=option, threshold=f"{1 / high}_{1 / low}")
    data = make_data(4, rollout=True)
    mask = data.batch["response_mask"].bool()
    old, infer = data.batch["old_log_probs"].clone(), data.batch["rollout_log_probs"].clone()
    config = OmegaConf.create({"adv_estimator": "lossplug", "gamma": 1.0, "lam": 1.0, "lossplug": recipe})
    out = verl_compute_advantage(data, adv_estimator="lossplug", num_repeat=G, config=config)
    expected = roll_ratio_filter(old, infer, mask, agg, low, high)
    assert expected.sum() < mask.sum(), "ROLL's filter removes nothing here: the test would prove nothing"
    assert expected.any(), "ROLL's filter removes everything here"
    assert torch.equal(out.batch["response_mask"].bool(), expected)
    assert torch.equal(out.batch["advantages"][~expected], torch.zeros(int((~expected).sum()), dtype=F64))


def test_trl_refuses_rolls_filter_at_attach(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    from lossplug.adapters.trl import attach
    from lossplug.testing.tiny import tiny_dataset, tiny_grpo_config, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    trainer = GRPOTrainer(
        model=tiny_model(tok),
        reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
        args=tiny_grpo_config(tmp_path),
        train_dataset=tiny_dataset(),
        processing_class=tok,
    )
    with pytest.raises(LossplugError, match=r"filters\[0\] \(mismatch_rejection\)"):
        attach(trainer, row_recipe("ROLL", "`train_infer_correction.filters`"))

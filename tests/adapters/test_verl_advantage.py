"""verl advantage estimator ``lossplug`` against verl's own estimators, through ``ray_trainer.compute_advantage``.

Each case builds a real ``DataProto`` (float64 token-level rewards on the last response token, masks with
observation-token holes, ``uid`` as verl's numpy object array with scattered groups) and runs verl's
``compute_advantage`` twice: once with verl's estimator, once with ``adv_estimator=lossplug`` and the recipe under
``algorithm.lossplug``. Advantages and returns must match on the response mask to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

import numpy as np  # verl's uid arrays; verl brings numpy
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage

from lossplug.adapters.verl import compute_advantage as lossplug_compute_advantage
from lossplug.adapters.verl import compute_lossplug_advantage, group_ids
from lossplug.contracts import LossplugError

DT = torch.float64
TOL = 1e-6
B, T, G = 16, 12, 4


def make_batch(seed: int, *, holes: bool = True, empty_rows: tuple[int, ...] = ()) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    if holes:  # observation/tool tokens inside multi-turn responses (never the last response token here)
        hole = torch.rand(B, T, generator=g) < 0.2
        hole[torch.arange(B), lengths - 1] = False
        mask = mask & ~hole
    for r in empty_rows:
        mask[r] = False
    scores = torch.randint(0, 3, (B,), generator=g).to(DT) + 0.5 * torch.rand(B, generator=g, dtype=DT)
    scores[:G] = 1.0  # one group of equal rewards: zero advantage in every convention
    rewards = torch.zeros(B, T, dtype=DT)
    rewards[torch.arange(B), lengths - 1] = scores
    rewards = torch.where(mask, rewards, 0)
    prompt = [i // G for i in range(B)]
    order = torch.randperm(B, generator=g).tolist()  # groups scattered over the batch, as after shuffling/balancing
    uid = np.array([f"uid-{prompt[i]:03d}-{'x' * prompt[i]}" for i in order], dtype=object)
    values = torch.randn(B, T, generator=g, dtype=DT)
    return {"token_level_rewards": rewards, "response_mask": mask.long(), "values": values, "uid": uid}


def data_proto(batch: dict) -> DataProto:
    tensors = {k: v.clone() for k, v in batch.items() if k != "uid"}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": batch["uid"].copy()})


def run(batch: dict, estimator: str, *, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, **algorithm):
    config = OmegaConf.create(
        {
            "adv_estimator": estimator,
            "gamma": gamma,
            "lam": lam,
            "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
            **algorithm,
        }
    )
    out = compute_advantage(
        data_proto(batch),
        adv_estimator=estimator,
        gamma=gamma,
        lam=lam,
        num_repeat=G,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
    )
    return out.batch["advantages"], out.batch["returns"]


def max_diff(batch, ours, theirs) -> float:
    mask = batch["response_mask"].bool()
    return max(
        torch.where(mask, ours[0] - theirs[0], 0).abs().max().item(),
        torch.where(mask, ours[1] - theirs[1], 0).abs().max().item(),
    )


def recipe(advantage) -> dict:
    return {"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"}


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_with_std_matches_verl(seed):
    batch = make_batch(seed)
    theirs = run(batch, "grpo")
    ours = run(batch, "lossplug", lossplug=recipe({"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6}))
    assert max_diff(batch, ours, theirs) <= TOL
    assert ours[0].dtype == DT and torch.count_nonzero(ours[0]) > 0


def test_grpo_without_std_matches_verl():
    batch = make_batch(2)
    theirs = run(batch, "grpo", norm_adv_by_std_in_grpo=False)
    ours = run(batch, "lossplug", lossplug=recipe({"name": "grpo", "scale": "none"}))
    assert max_diff(batch, ours, theirs) <= TOL


def test_rloo_matches_verl():
    batch = make_batch(3)
    theirs = run(batch, "rloo")
    ours = run(batch, "lossplug", lossplug="rloo")  # a preset name
    assert max_diff(batch, ours, theirs) <= TOL


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_through_compute_advantage_matches_verl(gamma, lam):
    """GAE needs the critic's values, which verl does not pass to a registered estimator: a custom trainer's path is
    ``compute_advantage(data, recipe)`` on the DataProto (it reads ``values`` from data.batch); verl's own trainer's,
    the estimator reading the same DataProto (below)."""
    batch = make_batch(4)
    theirs = run(batch, "gae", gamma=gamma, lam=lam, use_pf_ppo=False)
    data = lossplug_compute_advantage(
        data_proto(batch), recipe({"name": "gae", "gamma": gamma, "lam": lam, "whiten": True})
    )
    assert max_diff(batch, (data.batch["advantages"], data.batch["returns"]), theirs) <= TOL


def test_decoupled_gae_takes_the_advantages_and_the_returns_from_verls_gae_at_two_lambdas():
    """verl #479 (decoupled GAE, as in VC-PPO, arXiv:2503.01491, and VAPO): one λ for the policy's advantages, another for
    the critic's returns. verl 0.9.1 has one ``algorithm.lam``; ``gae``'s ``critic_lam`` gives the advantages of verl's
    GAE at ``lam`` and the returns of verl's GAE at ``critic_lam``, through the same DataProto path."""
    batch = make_batch(7)
    at_actor = run(batch, "gae", gamma=0.99, lam=0.95, use_pf_ppo=False)
    at_critic = run(batch, "gae", gamma=0.99, lam=1.0, use_pf_ppo=False)
    data = lossplug_compute_advantage(
        data_proto(batch), recipe({"name": "gae", "gamma": 0.99, "lam": 0.95, "critic_lam": 1.0, "whiten": True})
    )
    assert max_diff(batch, (data.batch["advantages"], data.batch["returns"]), (at_actor[0], at_critic[1])) <= TOL
    assert not torch.allclose(at_actor[1], at_critic[1])  # the two λ give different returns here


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_under_verls_trainer_reads_the_values_of_its_dataproto(gamma, lam):
    """Under ``adv_estimator=lossplug`` verl's ``compute_advantage`` passes the estimator no values: it reads them from
    the DataProto of that call (its caller's frame, the exact caller and tensor checked), as for shapers, filters, a
    teacher and turns — the same advantages and returns as ``compute_advantage(data, recipe)`` on that DataProto,
    bitwise, and as verl's own gae."""
    batch = make_batch(5)
    spec = recipe({"name": "gae", "gamma": gamma, "lam": lam, "whiten": True})
    ours = run(batch, "lossplug", gamma=gamma, lam=lam, lossplug=spec)
    explicit = lossplug_compute_advantage(data_proto(batch), spec)
    assert torch.equal(ours[0], explicit.batch["advantages"]) and torch.equal(ours[1], explicit.batch["returns"])
    theirs = run(batch, "gae", gamma=gamma, lam=lam, use_pf_ppo=False)
    assert max_diff(batch, ours, theirs) <= TOL
    assert ours[0].dtype == DT and torch.count_nonzero(ours[0]) > 0


def test_gae_under_verls_trainer_without_a_critic_is_refused_naming_the_setting():
    """No critic, no ``values`` in verl's DataProto: refused with what to set."""
    batch = {k: v for k, v in make_batch(5).items() if k != "values"}
    with pytest.raises(LossplugError, match=r"needs 'values', which the batch does not hold\. Next step: set critic"):
        run(batch, "lossplug", lossplug=recipe({"name": "gae"}))


def test_gae_values_passed_by_a_caller_are_used():
    batch = make_batch(6)
    config = OmegaConf.create({"lossplug": recipe({"name": "gae"})})
    data = data_proto(batch)  # in this frame, as in verl's: read only when verl's compute_advantage is the caller
    with pytest.raises(LossplugError) as refused:  # called some other way, without values
        compute_lossplug_advantage(
            data.batch["token_level_rewards"], data.batch["response_mask"], index=batch["uid"], config=config
        )
    message = str(refused.value)
    assert "needs 'values'" in message and "this call did not come from it" in message, message
    assert "algorithm.adv_estimator=lossplug" in message and "compute_advantage(data, recipe)" in message
    adv, ret = compute_lossplug_advantage(
        batch["token_level_rewards"], batch["response_mask"], index=batch["uid"], config=config, values=batch["values"]
    )  # a caller that passes them
    assert adv.shape == ret.shape == (B, T)


def test_compute_advantage_names_a_missing_field():
    batch = make_batch(7)
    data = data_proto({k: v for k, v in batch.items() if k != "values"})
    with pytest.raises(LossplugError, match="needs 'values', which the batch does not hold"):
        lossplug_compute_advantage(data, recipe({"name": "gae"}))


def test_rows_without_action_tokens_get_zero_and_stay_out_of_the_groups():
    batch = make_batch(7, empty_rows=(5, 9))
    adv, ret = run(batch, "lossplug", lossplug=recipe({"name": "grpo"}))
    assert torch.all(adv[[5, 9]] == 0) and torch.all(ret[[5, 9]] == 0)
    keep = [i for i in range(B) if i not in (5, 9)]
    sub = {k: (v[keep] if k != "uid" else v[keep]) for k, v in batch.items()}
    alone = run(sub, "lossplug", lossplug=recipe({"name": "grpo"}))
    assert torch.equal(adv[keep], alone[0])


def test_singleton_groups_differ_from_verl_on_purpose():
    """verl scores a prompt with a single rollout as (R − 0) / (1 + eps); lossplug's GRPO gives a group without a
    ranking signal exactly 0. Documented difference — the equivalence cases use groups of G rollouts."""
    batch = make_batch(8)
    batch["uid"] = np.array([f"solo-{i}" for i in range(B)], dtype=object)
    ours = run(batch, "lossplug", lossplug=recipe({"name": "grpo"}))
    theirs = run(batch, "grpo")
    assert torch.all(ours[0] == 0)
    assert torch.count_nonzero(theirs[0]) > 0


def test_uid_strings_become_integer_group_ids_in_order_of_first_appearance():
    uid = np.array(["b", "a", "b", "c", "a"], dtype=object)
    assert group_ids(uid).tolist() == [0, 1, 0, 2, 1]
    assert group_ids(uid).dtype == torch.long


def test_missing_recipe_says_which_key_to_set():
    batch = make_batch(9)
    with pytest.raises(LossplugError, match=r"\+algorithm\.lossplug="):
        run(batch, "lossplug")


def test_an_unknown_plugin_fails_at_the_first_call_naming_the_config_key():
    batch = make_batch(10)
    with pytest.raises(
        LossplugError,
        match=r"algorithm\.lossplug\.advantage: unknown advantage plugin 'grp'.*"
        r"did you mean 'grpo'",
    ):
        run(batch, "lossplug", lossplug=recipe({"name": "grp"}))


def test_a_recipe_without_an_advantage_stage_is_refused():
    batch = make_batch(11)
    with pytest.raises(LossplugError, match="no advantage stage"):
        run(batch, "lossplug", lossplug={"gates": ["ppo_clip"], "reduction": "token"})


@pytest.mark.parametrize("empty_rows", [(), (0,)])
def test_rewards_outside_the_response_mask_are_refused_by_the_contracts_rule(empty_rows):
    """The refusal is PolicyBatch's rule (the same message, the same positions as the contract reports for these
    tensors) in verl's names and row numbers — a row without a response token, which the advantage stage never sees,
    included."""
    from lossplug.contracts import BatchValidationError, PolicyBatch
    from lossplug.contracts.batch_rules import OFF_ACTION_REWARD

    batch = make_batch(12, empty_rows=empty_rows)
    mask = batch["response_mask"].bool()
    row, col = (~mask).nonzero()[0].tolist()
    batch["token_level_rewards"][row, col] = 0.25
    with pytest.raises(LossplugError) as refused:
        run(batch, "lossplug", lossplug=recipe({"name": "grpo"}))
    message = str(refused.value)
    where = f"(row {row}, pos {col}); the first is 0.25"
    assert message.startswith("token_level_rewards (PolicyBatch.reward): ") and OFF_ACTION_REWARD in message
    assert f"outside response_mask at {where}" in message
    fields = dict(logp=torch.zeros(B, T, dtype=DT), action_mask=mask, reward=batch["token_level_rewards"])
    if empty_rows:  # row 0 has no action: the batch the advantage stage sees lacks it, the refusal does not
        assert row == 0
        PolicyBatch(**{k: v[1:] for k, v in fields.items()})
        return
    with pytest.raises(BatchValidationError) as contract:
        PolicyBatch(**fields)
    assert [(v.field, v.rule, v.where) for v in contract.value.violations] == [("reward", OFF_ACTION_REWARD, where)]


def test_the_estimator_is_the_registered_one():
    assert core_algos.get_adv_estimator_fn("lossplug") is compute_lossplug_advantage


def test_compute_advantage_reads_reward_components_by_key():
    """Multi-reward plugins (gdpo) read ``PolicyBatch.reward_components``: ``reward_keys`` (verl's
    ``algorithm.gdpo_reward_keys``) name the per-response scores in ``non_tensor_batch``, one column each."""
    import lossplug
    from lossplug.contracts import PolicyBatch

    batch = make_batch(8)
    g = torch.Generator().manual_seed(8)
    components = {k: np.asarray(torch.rand(B, generator=g, dtype=DT)) for k in ("accuracy", "format")}
    data = data_proto(batch)
    data.non_tensor_batch.update(components)
    spec = {"name": "gdpo"}
    out = lossplug_compute_advantage(data, recipe(spec), reward_keys=["accuracy", "format"])

    mask = batch["response_mask"].bool()
    direct = lossplug.estimate_advantages(
        PolicyBatch(
            logp=torch.zeros(B, T, dtype=DT),
            action_mask=mask,
            reward=batch["token_level_rewards"],
            group_id=group_ids(batch["uid"]),
            reward_components=torch.stack([torch.as_tensor(components[k]) for k in ("accuracy", "format")], -1),
        ),
        recipe(spec),
    ).advantage
    expected = torch.where(mask, direct if direct.ndim == 2 else direct[:, None].expand(B, T), 0)
    assert torch.equal(out.batch["advantages"], expected)

    with pytest.raises(LossplugError, match="reward_keys"):
        lossplug_compute_advantage(data_proto(batch), recipe(spec))
    with pytest.raises(LossplugError, match="'style', which is in neither"):
        lossplug_compute_advantage(data, recipe(spec), reward_keys=["style"])

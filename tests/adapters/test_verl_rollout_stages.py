"""A recipe's shapers and filters through verl's advantage seam (``adv_estimator=lossplug``, called by verl 0.9.1's own
``ray_trainer.compute_advantage`` on a ``DataProto``), against verl's own reward side:

* the KL shaper equals verl's ``apply_kl_penalty`` then verl's estimator (GRPO, REINFORCE++) over three steps with
  the adaptive controller, for each ``kl_penalty``: advantages, the ``token_level_rewards`` written back, and β;
* the zero-variance filter writes the narrowed mask into ``response_mask`` (new tensors: ``attention_mask``, which a
  verl ``response_mask`` may be a view of, and ``token_level_scores`` keep their values), and the kept rows'
  advantages equal verl's GRPO on the batch without the filtered rows;
* refusals: a KL counted twice (``algorithm.use_kl_in_reward``), no reference log-probs, a filter whose mask cannot
  reach the actor (an estimator called outside ``compute_advantage``, verl's TransferQueue trainer);
* the controllers saved with verl's checkpoint and restored: a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("verl")

import numpy as np  # verl's uid arrays; verl brings numpy
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

import lossplug
from lossplug.adapters.verl import compute_advantage as lossplug_compute_advantage
from lossplug.adapters.verl import compute_lossplug_advantage, load_recipe
from lossplug.adapters.verl.checkpoint import CONTROLLER_FILE, LossplugCheckpoints
from lossplug.contracts import LossplugError

B, T, G = 16, 10, 4
TOL = 1e-6
_names = itertools.count()


def make_data(seed: int, *, zero_variance_group: bool = False) -> DataProto:
    """verl's batch at advantage time: float32 scores on each response's last token, old and reference log-probs, a
    response mask that is a view of the attention mask (verl's compute_response_mask), uid groups of G."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    prompt = torch.ones(B, 3, dtype=torch.long)
    attention = torch.cat([prompt, (torch.arange(T) < lengths[:, None]).long()], 1)
    response_mask = attention[:, -T:]
    mask = response_mask.bool()
    scores = torch.randint(0, 2, (B,), generator=g).float() + 0.25 * torch.rand(B, generator=g)
    if zero_variance_group:
        scores[G : 2 * G] = 1.0
    token_scores = torch.zeros(B, T)
    token_scores[torch.arange(B), lengths - 1] = scores
    old = torch.where(mask, -torch.rand(B, T, generator=g) * 2, 0)
    ref = torch.where(mask, (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0), 0)
    data = DataProto.from_dict(
        tensors={
            "responses": torch.ones(B, T, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": token_scores,
            "old_log_probs": old,
            "ref_log_prob": ref,
        },
        non_tensors={"uid": np.array([f"p{i // G}" for i in range(B)], dtype=object)},
    )
    # what RayPPOTrainer.fit does when algorithm.use_kl_in_reward is off: the same tensor under both keys
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    return data


def algorithm(estimator: str, **more) -> object:
    return OmegaConf.create({"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0, **more})


def run_verl(data: DataProto, estimator: str, config) -> DataProto:
    return compute_advantage(data, adv_estimator=estimator, num_repeat=G, config=config)


def recipe(advantage, *, shapers=(), filters=()) -> dict:
    """A recipe of its own (a fresh name: the estimator's recipes are cached by content, controllers included)."""
    spec = {"name": f"rollout-stages-{next(_names)}", "advantage": advantage, "gates": ["ppo_clip"]}
    return {**spec, "reduction": "token", "shapers": list(shapers), "filters": list(filters)}


GRPO = {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6, "eps_mode": "add"}
ADVANTAGES = {"grpo": GRPO, "reinforce_plus_plus": {"name": "reinforce_plus_plus", "gamma": 1.0}}
ADAPTIVE = {"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.01, "horizon": 64}


def kl_shaper(penalty: str) -> dict:
    return {
        "name": "kl_in_reward",
        "estimator": penalty,
        "coef": ADAPTIVE["kl_coef"],
        "controller": "adaptive",
        "target_kl": ADAPTIVE["target_kl"],
        "horizon": ADAPTIVE["horizon"],
    }


def _beta(spec) -> float:
    """β of the recipe's KL shaper, as the estimator left it (its controller's saved state)."""
    return float(lossplug.controller_state(load_recipe(spec, "algorithm.lossplug"))["shapers[0]"]["value"])


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
@pytest.mark.parametrize("penalty", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_shaper_equals_verls_apply_kl_penalty_over_three_adaptive_steps(estimator, penalty):
    spec = recipe(ADVANTAGES[estimator], shapers=[kl_shaper(penalty)])
    ours_config = algorithm("lossplug", lossplug=spec)
    verl_ctrl = core_algos.get_kl_controller(OmegaConf.create(ADAPTIVE))
    betas = []
    for step in range(3):
        theirs = make_data(step)
        theirs, _ = apply_kl_penalty(theirs, kl_ctrl=verl_ctrl, kl_penalty=penalty)
        theirs = run_verl(theirs, estimator, algorithm(estimator))
        ours = run_verl(make_data(step), "lossplug", ours_config)
        mask = ours.batch["response_mask"].bool()
        for key in ("advantages", "token_level_rewards"):
            diff = torch.where(mask, ours.batch[key] - theirs.batch[key], 0).abs().max().item()
            assert diff <= TOL, f"step {step}: {key} differs by {diff}"
        assert torch.equal(ours.batch["token_level_scores"], make_data(step).batch["token_level_scores"])
        betas.append(_beta(spec))
        assert betas[-1] == pytest.approx(verl_ctrl.value, rel=1e-9, abs=0)
    assert len(set(betas)) == 3  # the coefficient moved every step


def test_zero_variance_filter_writes_response_mask_and_equals_dropping_the_rows():
    data = make_data(7, zero_variance_group=True)
    attention_before = data.batch["attention_mask"].clone()
    mask_before = data.batch["response_mask"].clone()
    out = run_verl(data, "lossplug", algorithm("lossplug", lossplug=recipe(GRPO, filters=["zero_variance"])))
    filtered = torch.zeros(B, dtype=torch.bool)
    filtered[G : 2 * G] = True
    written = out.batch["response_mask"]
    assert written.dtype == mask_before.dtype
    assert torch.equal(written, torch.where(filtered[:, None], 0, mask_before))
    assert torch.equal(out.batch["attention_mask"], attention_before)  # the view's base is untouched
    assert torch.equal(out.batch["advantages"][filtered], torch.zeros(G, T))

    kept = (~filtered).nonzero().squeeze(-1).tolist()
    dropped = run_verl(make_data(7, zero_variance_group=True).select_idxs(kept), "grpo", algorithm("grpo"))
    diff = (out.batch["advantages"][~filtered] - dropped.batch["advantages"]).abs().max().item()
    assert diff <= TOL


def test_a_kl_in_the_reward_counted_twice_is_refused():
    config = algorithm("lossplug", lossplug=recipe(GRPO, shapers=[kl_shaper("kl")]), use_kl_in_reward=True)
    with pytest.raises(LossplugError) as err:
        run_verl(make_data(0), "lossplug", config)
    message = str(err.value)
    assert "algorithm.lossplug.shapers[0] (kl_in_reward)" in message
    assert "algorithm.use_kl_in_reward=True" in message and "Next step: set algorithm.use_kl_in_reward=false" in message


def test_the_same_refusal_in_a_custom_trainer():
    with pytest.raises(LossplugError, match="counted twice"):
        lossplug_compute_advantage(
            make_data(0), recipe(GRPO, shapers=[kl_shaper("kl")]), algorithm={"use_kl_in_reward": True}
        )


def test_a_kl_shaper_without_reference_log_probs_says_what_to_set():
    data = make_data(0)
    data.batch.pop("ref_log_prob")
    with pytest.raises(LossplugError) as err:
        run_verl(data, "lossplug", algorithm("lossplug", lossplug=recipe(GRPO, shapers=[kl_shaper("kl")])))
    message = str(err.value)
    assert "shaper plugin 'kl_in_reward' needs 'ref_log_prob'" in message
    assert "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0" in message


def test_a_filter_outside_verls_compute_advantage_is_refused():
    data = make_data(1, zero_variance_group=True)
    config = algorithm("lossplug", lossplug=recipe(GRPO, filters=["zero_variance"]))
    with pytest.raises(LossplugError, match=r"filters\[0\] \(zero_variance\).*Next step"):
        compute_lossplug_advantage(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=data.batch["response_mask"],
            index=data.non_tensor_batch["uid"],
            config=config,
        )


def _as_if_from_verls_v1_trainer(data: DataProto, config) -> DataProto:
    """verl's TransferQueue trainer calls compute_advantage from verl.trainer.ppo.v1.utils (not importable here
    without transfer_queue): the same call, from a function of that module's name."""
    namespace = {"__name__": "verl.trainer.ppo.v1.utils", "compute_advantage": compute_advantage, "G": G}
    exec(  # a caller whose module is in verl's v1 package
        "def compute_advantage_for_multi_trajectories(data, config):\n"
        "    return compute_advantage(data, adv_estimator='lossplug', num_repeat=G, config=config)\n",
        namespace,
    )
    return namespace["compute_advantage_for_multi_trajectories"](data, config)


def test_under_verls_transfer_queue_trainer_a_filter_is_refused_and_a_shaper_runs():
    filtering = algorithm("lossplug", lossplug=recipe(GRPO, filters=["zero_variance"]))
    with pytest.raises(LossplugError, match="trainer.use_v1=false"):
        _as_if_from_verls_v1_trainer(make_data(2, zero_variance_group=True), filtering)
    spec = recipe(GRPO, shapers=[{"name": "kl_in_reward", "coef": 0.1}])
    ours = _as_if_from_verls_v1_trainer(make_data(2), algorithm("lossplug", lossplug=spec))
    theirs, _ = apply_kl_penalty(make_data(2), kl_ctrl=core_algos.FixedKLController(0.1), kl_penalty="kl")
    theirs = run_verl(theirs, "grpo", algorithm("grpo"))
    mask = theirs.batch["response_mask"].bool()
    assert torch.where(mask, ours.batch["advantages"] - theirs.batch["advantages"], 0).abs().max() <= TOL


# ---------------------------------------------------------------------------------------------------------------------
# the controllers with verl's checkpoint


class _VerlTrainer:
    """The part of verl's RayPPOTrainer that the mixin relies on: its checkpoint methods and attributes."""

    def __init__(self, config) -> None:
        self.config = config
        self.global_steps = 0

    def _save_checkpoint(self) -> None:
        os.makedirs(os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}"))

    def _load_checkpoint(self):
        self.global_steps = self.config.trainer.get("resumed_step", 0)
        return self.global_steps


class Trainer(LossplugCheckpoints, _VerlTrainer):
    pass


def _trainer_config(tmp_path, spec, **trainer):
    return OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "lossplug", "lossplug": spec},
            "trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto", **trainer},
        }
    )


def test_a_resumed_run_continues_the_adaptive_coefficient(tmp_path):
    spec = recipe(GRPO, shapers=[kl_shaper("kl")])
    uninterrupted = recipe(GRPO, shapers=[kl_shaper("kl")])
    for step in range(3):
        run_verl(make_data(step), "lossplug", algorithm("lossplug", lossplug=uninterrupted))

    trainer = Trainer(_trainer_config(tmp_path, spec))
    for step in range(2):
        run_verl(make_data(step), "lossplug", algorithm("lossplug", lossplug=spec))
    trainer.global_steps = 2
    trainer._save_checkpoint()
    assert (tmp_path / "global_step_2" / CONTROLLER_FILE).is_file()

    resumed = dict(spec, name=spec["name"] + "-resumed")  # another process: a recipe whose controller starts afresh
    assert _beta(resumed) == ADAPTIVE["kl_coef"]
    Trainer(_trainer_config(tmp_path, resumed, resumed_step=2))._load_checkpoint()
    assert _beta(resumed) == _beta(spec)
    run_verl(make_data(2), "lossplug", algorithm("lossplug", lossplug=resumed))
    assert _beta(resumed) == _beta(uninterrupted)


def test_a_checkpoint_without_the_controllers_is_refused_unless_a_fresh_start_is_asked(tmp_path):
    spec = recipe(GRPO, shapers=[kl_shaper("kl")])
    (tmp_path / "global_step_3").mkdir()
    with pytest.raises(LossplugError, match="lossplug_fresh_controllers=true"):
        Trainer(_trainer_config(tmp_path, spec, resumed_step=3))._load_checkpoint()
    config = _trainer_config(tmp_path, spec, resumed_step=3)
    config.algorithm.lossplug_fresh_controllers = True
    Trainer(config)._load_checkpoint()
    assert _beta(spec) == ADAPTIVE["kl_coef"]


# ---------------------------------------------------------------------------------------------------------------------
# verl_equivalent: the reward side of verl's algorithm section


def test_verl_equivalent_writes_use_kl_in_reward_as_the_shaper_and_the_recipe_runs_as_verl_does():
    from lossplug.adapters.verl import verl_equivalent

    verls = {
        "adv_estimator": "grpo",
        "use_kl_in_reward": True,
        "kl_penalty": "low_var_kl",
        "kl_ctrl": {"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.01, "horizon": 64},
    }
    spec = verl_equivalent(algorithm_config=verls).to_dict()
    assert spec["shapers"] == [
        {"name": "kl_in_reward", "estimator": "low_var_kl", "coef": 0.2, "controller": "adaptive"}
        | {"target_kl": 0.01, "horizon": 64.0}
    ]
    spec["name"] += f"-{next(_names)}"
    verl_ctrl = core_algos.get_kl_controller(OmegaConf.create(verls["kl_ctrl"]))
    for step in range(3):  # verl with its own KL in the reward; lossplug's recipe with verl's switched off
        theirs, _ = apply_kl_penalty(make_data(step), kl_ctrl=verl_ctrl, kl_penalty="low_var_kl")
        theirs = run_verl(theirs, "grpo", algorithm("grpo"))
        ours = run_verl(make_data(step), "lossplug", algorithm("lossplug", lossplug=spec, use_kl_in_reward=False))
        mask = theirs.batch["response_mask"].bool()
        assert torch.where(mask, ours.batch["advantages"] - theirs.batch["advantages"], 0).abs().max() <= TOL
    assert _beta(spec) == pytest.approx(verl_ctrl.value, rel=1e-9, abs=0)


@pytest.mark.parametrize("penalty", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_verl_equivalent_fixed_kl_controller_with_verls_defaults(penalty):
    from lossplug.adapters.verl import verl_equivalent

    spec = verl_equivalent(algorithm_config={"adv_estimator": "gae", "use_kl_in_reward": True, "kl_penalty": penalty})
    (shaper,) = spec.to_dict()["shapers"]
    assert shaper == {"name": "kl_in_reward", "estimator": penalty, "coef": 0.001, "controller": "fixed"} | {
        "target_kl": None,  # (an adaptive controller's settings)
        "horizon": None,
    }
    assert spec.advantage.params["kl_coef"] is None  # the KL is in the reward once: the shaper's


def test_verl_equivalent_writes_filter_groups_on_the_reward_as_zero_variance():
    from lossplug.adapters.verl import verl_equivalent

    spec = verl_equivalent(
        algorithm_config={"adv_estimator": "grpo", "filter_groups": {"enable": True, "metric": "reward"}}
    )
    assert spec.to_dict()["filters"] == [{"name": "zero_variance", "drop_singletons": False}]  # verl keeps groups of 1
    assert not verl_equivalent(algorithm_config={"adv_estimator": "grpo", "filter_groups": {"enable": False}}).filters


@pytest.mark.parametrize(
    "verls, named",
    [
        ({"filter_groups": {"enable": True, "metric": "acc"}}, "algorithm.filter_groups.metric='acc'"),
        (
            {"filter_groups": {"enable": True, "metric": "reward"}, "use_kl_in_reward": True},
            "algorithm.filter_groups with use_kl_in_reward=True",
        ),
        ({"use_kl_in_reward": True, "kl_penalty": "full"}, "algorithm.kl_penalty='full'"),
        ({"use_kl_in_reward": True, "kl_ctrl": {"type": "pid"}}, "algorithm.kl_ctrl.type='pid'"),
    ],
)
def test_verl_equivalent_refuses_what_has_no_equivalent_by_name(verls, named):
    from lossplug.adapters.verl import verl_equivalent

    with pytest.raises(LossplugError) as err:
        verl_equivalent(algorithm_config={"adv_estimator": "grpo", **verls})
    assert named in str(err.value)

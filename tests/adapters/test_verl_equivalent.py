"""``verl_equivalent(actor_config, algorithm_config)``: the recipe that computes what verl computes.

* The mapping itself: each ``loss_agg_mode`` → reduction (``loss_scale_factor`` → the ``fixed`` budget), entropy and
  KL → regularizers, the config forms verl hands over (``DictConfig``, ``ActorConfig``, plain dict), omitted sides,
  and a refusal naming the setting for everything without an exact equivalent.
* Oracles (float64, loss and gradient): every verl loss mode the recipe modules map, under every ``loss_agg_mode``,
  at dp_size 1 and 2 with verl's ``global_batch_info`` — verl's registered function against the recipe through the
  adapter; and the whole actor loss ``ppo_loss`` builds (policy term − entropy_coeff·agg(H) + kl_loss_coef·agg(KL))
  against ``lossplug.policy_loss`` with the recipe's regularizers, as a TRL or plain-PyTorch user runs it.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, get_policy_loss_fn, kl_penalty
from verl.workers.config import ActorConfig, PolicyLossConfig

import lossplug
from lossplug.adapters.verl import LossplugPolicyLossConfig, verl_equivalent, verl_normalizer
from lossplug.adapters.verl.equivalent import ACTOR_DEFAULTS, LOSS_AGG_REDUCTIONS
from lossplug.contracts import LossplugError, PolicyBatch

ROOT = Path(__file__).resolve().parents[2]
DT = torch.float64
RTOL = 1e-8
B, T, MICRO = 8, 12, 2
AGG_MODES = list(LOSS_AGG_REDUCTIONS)
#: every policy loss verl 0.9.1 registers, except lossplug's own
VERL_LOSS_MODES = sorted(m for m in POLICY_LOSS_REGISTRY if m != "lossplug")


# ---------------------------------------------------------------------------------------------------------------------
# The mapping


@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_agg_mode_becomes_the_reduction(mode: str) -> None:
    actor = {"loss_agg_mode": mode, "loss_scale_factor": 512}
    recipe = verl_equivalent(actor)
    assert recipe.reduction.name == LOSS_AGG_REDUCTIONS[mode]
    if mode == "seq-mean-token-sum-norm":
        assert recipe.reduction.params["budget"] == 512.0
    assert recipe.advantage is None and recipe.regularizers == ()


def test_seq_mean_token_sum_norm_without_a_scale_factor_is_refused() -> None:
    with pytest.raises(LossplugError, match="loss_scale_factor"):
        verl_equivalent({"loss_agg_mode": "seq-mean-token-sum-norm"})


def test_an_unknown_loss_agg_mode_is_refused_naming_it() -> None:
    with pytest.raises(LossplugError, match="loss_agg_mode='token-median'"):
        verl_equivalent({"loss_agg_mode": "token-median"})


def test_vanilla_defaults_are_verls() -> None:
    """An empty actor mapping is verl's default actor: vanilla PPO clip 0.2 with dual-clip 3.0, token-mean."""
    recipe = verl_equivalent({})
    (gate,) = recipe.gates
    assert gate.name == "ppo_clip"
    assert (gate.params["eps_low"], gate.params["eps_high"], gate.params["dual_clip_c"]) == (0.2, 0.2, 3.0)
    assert recipe.reduction.name == "token"


def test_entropy_and_kl_become_regularizers() -> None:
    actor = {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.05}
    recipe = verl_equivalent(actor)
    specs = {s.name: s.params for s in recipe.regularizers}
    assert specs["entropy"]["coef"] == 0.01
    assert (specs["kl"]["coef"], specs["kl"]["estimator"]) == (0.05, "k3+")
    assert specs["entropy"]["reduction"] is None and specs["kl"]["reduction"] is None  # the recipe's own: token


def test_kl_full_is_refused_naming_it() -> None:
    with pytest.raises(LossplugError, match="kl_loss_type='full'"):
        verl_equivalent({"use_kl_loss": True, "kl_loss_type": "full"})


def test_the_config_forms_verl_hands_over_give_the_same_recipe() -> None:
    plain = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-mean"}
    dataclass = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, **plain)
    recipes = [verl_equivalent(c) for c in (plain, OmegaConf.create(plain), dataclass)]
    assert recipes[0] == recipes[1] == recipes[2]


def test_algorithm_only_gives_the_advantage_on_verls_default_actor() -> None:
    algorithm = {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0}
    recipe = verl_equivalent(algorithm_config=OmegaConf.create(algorithm))
    assert recipe.advantage is not None
    assert recipe == verl_equivalent({}, algorithm)
    assert [g.name for g in recipe.gates] == ["ppo_clip"]


def test_neither_side_is_refused() -> None:
    with pytest.raises(LossplugError, match="give actor_config, algorithm_config or both"):
        verl_equivalent()


def test_a_config_of_another_kind_is_refused() -> None:
    with pytest.raises(LossplugError, match="actor_config must be verl's config"):
        verl_equivalent("vanilla")


def test_the_verl_adapter_reexports_it() -> None:
    import lossplug.adapters.verl as adapter
    import lossplug.adapters.verl.equivalent as recipes

    assert adapter.verl_equivalent is recipes.verl_equivalent


# ---------------------------------------------------------------------------------------------------------------------
# Oracles: verl's registered loss vs the recipe through the adapter


def make_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    holes = torch.rand(B, T, generator=g) < 0.15  # observation/tool tokens inside the response
    holes[:, 0] = False
    mask = mask & ~holes
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=0)
    far = torch.rand(B, T, generator=g) < 0.1  # far-off-policy tokens: dual-clip territory
    logp = torch.where(far & mask, (old + 1.5).clamp(max=0), logp)
    adv = torch.randn(B, 1, generator=g, dtype=DT).expand(B, T) + 0.3 * torch.randn(B, T, generator=g, dtype=DT)
    return {
        "old_log_prob": torch.where(mask, old, 0),
        "log_prob": torch.where(mask, logp, 0),
        "advantages": torch.where(mask, adv, 0),
        "ref_log_prob": torch.where(mask, old + 0.2 * torch.randn(B, T, generator=g, dtype=DT), 0),
        "entropy": torch.rand(B, T, generator=g, dtype=DT) * 2,
        "response_mask": mask,
        "lengths": lengths,
    }


def micro_batches(
    inputs: dict[str, torch.Tensor], dp: int, rank: int, micro: int = MICRO
) -> list[dict[str, torch.Tensor]]:
    """This rank's contiguous share, in micro-batches padded to their own longest response (as verl pads them)."""
    share = B // dp
    out = []
    for start in range(rank * share, (rank + 1) * share, micro):
        rows = slice(start, start + micro)
        width = int(inputs["lengths"][rows].max())
        out.append({k: v[rows, :width] for k, v in inputs.items() if k != "lengths"})
    return out


def global_info(inputs: dict[str, torch.Tensor], dp: int, loss_scale_factor: float | None) -> dict[str, Any]:
    return {
        "dp_size": dp,
        "batch_num_tokens": int(inputs["response_mask"].sum()),
        "global_batch_size": B,
        "loss_scale_factor": loss_scale_factor,
    }


#: the parameters a loss mode needs beyond verl's defaults (dro has no default dro_beta)
MODE_PARAMS: dict[str, dict[str, Any]] = {"dro": {"dro_beta": 0.5}}
#: loss modes whose verl function is batch-local (docs/verl.md): compared with one micro-batch per rank, the split
#: under which the recipe equals verl's function exactly
BATCH_LOCAL = {"geo_mean"}


def actor(loss_mode: str, agg: str, policy_loss: Any = None, **kw: Any) -> ActorConfig:
    lsf = float(T) if agg == "seq-mean-token-sum-norm" else None
    if policy_loss is None:
        policy_loss = PolicyLossConfig(loss_mode=loss_mode, **MODE_PARAMS.get(loss_mode, {}))
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=MICRO,
        loss_agg_mode=agg,
        loss_scale_factor=lsf,
        clip_ratio_high=0.28,
        policy_loss=policy_loss,
        **kw,
    )
    return config


def call(name: str, config: ActorConfig, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    log_prob = mb["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(1234)  # verl's clip_cov / kl_cov draw random tokens: the same RNG state for both
    loss, _ = get_policy_loss_fn(name)(
        old_log_prob=mb["old_log_prob"],
        log_prob=log_prob,
        advantages=mb["advantages"],
        response_mask=mb["response_mask"],
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


def close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    scale = max(theirs.abs().max().item(), 1e-12)
    return (ours - theirs).abs().max().item() / scale


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode", VERL_LOSS_MODES)
def test_every_verl_loss_mode_through_the_adapter(loss_mode: str, agg: str, dp: int) -> None:
    theirs_cfg = actor(loss_mode, agg)
    recipe = verl_equivalent(theirs_cfg)  # every loss mode has a recipe under every loss_agg_mode
    ours_cfg = actor(
        loss_mode, agg, policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict())
    )
    inputs = make_inputs(7)
    lsf = theirs_cfg.loss_scale_factor
    worst = 0.0
    micro = B // dp if loss_mode in BATCH_LOCAL else MICRO
    for rank in range(dp):
        for mb in micro_batches(inputs, dp, rank, micro):
            for config in (theirs_cfg, ours_cfg):
                config.global_batch_info.update(global_info(inputs, dp, lsf))
            ref_loss, ref_grad = call(loss_mode, theirs_cfg, mb)
            loss, grad = call("lossplug", ours_cfg, mb)
            worst = max(worst, close(loss, ref_loss), close(grad, ref_grad))
    assert worst <= RTOL, f"{loss_mode} under {agg}, dp {dp}: relative difference {worst:.3g} (recipe {recipe})"


# ---------------------------------------------------------------------------------------------------------------------
# The whole actor loss, regularizers included, outside verl


@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1", "k2", "k3+", "abs"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dp", [1, 2])
def test_the_whole_actor_loss_with_entropy_and_kl(kl_type: str, agg: str, dp: int) -> None:
    """What verl's ``workers/utils/losses.py:ppo_loss`` computes per micro-batch — vanilla's term, minus
    entropy_coeff·agg_loss(entropy), plus kl_loss_coef·agg_loss(kl_penalty(logp, ref, kl_loss_type)) — against
    ``lossplug.policy_loss`` with the recipe of ``verl_equivalent`` (regularizers included)."""
    config = actor("vanilla", agg, entropy_coeff=0.01, use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.05)
    recipe = verl_equivalent(config)
    assert {s.name for s in recipe.regularizers} == {"entropy", "kl"}
    inputs = make_inputs(3)
    info = global_info(inputs, dp, None)
    config.global_batch_info.update(info)
    worst = 0.0
    for rank in range(dp):
        for mb in micro_batches(inputs, dp, rank):
            mask = mb["response_mask"]
            logp = mb["log_prob"].clone().requires_grad_(True)
            entropy = mb["entropy"].clone().requires_grad_(True)
            pg, _ = get_policy_loss_fn("vanilla")(
                old_log_prob=mb["old_log_prob"],
                log_prob=logp,
                advantages=mb["advantages"],
                response_mask=mask,
                loss_agg_mode=agg,
                config=config,
            )
            ent = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=agg, **info)
            kld = kl_penalty(logprob=logp, ref_logprob=mb["ref_log_prob"], kl_penalty=kl_type)
            kl = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg, **info)
            theirs = pg - 0.01 * ent + 0.05 * kl
            ref_grads = torch.autograd.grad(theirs, (logp, entropy))

            logp2 = mb["log_prob"].clone().requires_grad_(True)
            entropy2 = mb["entropy"].clone().requires_grad_(True)
            batch = PolicyBatch(
                logp=logp2,
                old_logp=mb["old_log_prob"],
                advantage=mb["advantages"],
                action_mask=mask,
                ref_logp=mb["ref_log_prob"],
                entropy=entropy2,
            )
            normalizer, dp_size = verl_normalizer(info, mask)
            ours = lossplug.policy_loss(batch, recipe, normalizer).loss * dp_size
            grads = torch.autograd.grad(ours, (logp2, entropy2))
            worst = max(worst, close(ours.detach(), theirs.detach()))
            worst = max(worst, *(close(a, b) for a, b in zip(grads, ref_grads)))
    assert worst <= RTOL, f"{kl_type} under {agg}, dp {dp}: relative difference {worst:.3g}"


def test_actor_defaults_are_verls_own() -> None:
    """:data:`ACTOR_DEFAULTS` is read off verl's ``ActorConfig`` / ``PolicyLossConfig``: a partial mapping means to
    verl_equivalent what it means to verl."""
    theirs = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    for key, value in ACTOR_DEFAULTS.items():
        if key == "policy_loss":
            for sub, default in value.items():
                assert getattr(theirs.policy_loss, sub) == default, f"policy_loss.{sub}"
        else:
            assert getattr(theirs, key) == value, key


# ---------------------------------------------------------------------------------------------------------------------
# What verl users see


@pytest.mark.parametrize("agg", AGG_MODES)
def test_verls_metric_keys_carry_verls_values(agg: str) -> None:
    """``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` under ``loss_mode=lossplug`` have
    ``compute_policy_loss_vanilla``'s definitions, micro-batch by micro-batch."""
    theirs_cfg = actor("vanilla", agg)
    recipe = verl_equivalent(theirs_cfg)
    ours_cfg = actor(
        "vanilla", agg, policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict())
    )
    inputs = make_inputs(11)
    seen = 0.0
    for mb in micro_batches(inputs, 1, 0):
        results = []
        for name, config in (("vanilla", theirs_cfg), ("lossplug", ours_cfg)):
            config.global_batch_info.update(global_info(inputs, 1, theirs_cfg.loss_scale_factor))
            _, metrics = get_policy_loss_fn(name)(
                old_log_prob=mb["old_log_prob"],
                log_prob=mb["log_prob"],
                advantages=mb["advantages"],
                response_mask=mb["response_mask"],
                loss_agg_mode=agg,
                config=config,
            )
            results.append(metrics)
        for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
            assert results[1][key] == pytest.approx(results[0][key], abs=1e-12), key
        seen += results[0]["actor/pg_clipfrac"] + results[0]["actor/pg_clipfrac_lower"]
    assert seen > 0  # the inputs clip


def test_verls_own_composed_config() -> None:
    """The config verl's trainer composes (Hydra, ``ppo_trainer.yaml``) goes in as it is: its default algorithm
    (``gae``), and GRPO with token-level TIS switched on."""
    import os

    import verl.trainer
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.trainer.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        default = compose(config_name="ppo_trainer")
        grpo_tis = compose(
            config_name="ppo_trainer",
            overrides=["algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_is=token"],
        )
    recipe = verl_equivalent(default.actor_rollout_ref.actor, default.algorithm)
    assert recipe.advantage is not None and recipe.advantage.name == "gae"
    assert [g.name for g in recipe.gates] == ["ppo_clip"]
    recipe = verl_equivalent(grpo_tis.actor_rollout_ref.actor, grpo_tis.algorithm)
    assert recipe.advantage is not None and recipe.advantage.name == "grpo"
    assert [g.name for g in recipe.gates][:2] == ["ppo_clip", "tis"]
    assert recipe.gates[1].params["cap"] == 2.0


def test_a_correction_recipe_runs_under_verl_with_the_rollout_correction_forwarded() -> None:
    """Under verl, the driver computes the rollout correction and hands the loss ``rollout_is_weights``: the recipe of
    ``verl_equivalent(actor, algorithm)`` (tis + offpolicy_metrics) runs as it is when ``algorithm.rollout_correction``
    is forwarded to the actor — verl's weights in place of its corrections, equal to verl's vanilla — and is refused,
    naming the forwarding line, when it is not."""
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    config = actor("vanilla", "token-mean")
    recipe = verl_equivalent(config, {"rollout_correction": correction})
    assert [g.name for g in recipe.gates] == ["ppo_clip", "tis", "offpolicy_metrics"]
    mb = micro_batches(make_inputs(2), 1, 0)[0]
    weights = torch.where(mb["response_mask"], 0.5 + torch.rand_like(mb["log_prob"]), 0)

    def loss(policy_loss: Any) -> torch.Tensor:
        value, _ = get_policy_loss_fn(policy_loss.loss_mode)(
            old_log_prob=mb["old_log_prob"],
            log_prob=mb["log_prob"],
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode="token-mean",
            config=actor("vanilla", "token-mean", policy_loss=policy_loss),
            rollout_is_weights=weights,
        )
        return value

    ours = LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict(), rollout_correction=correction)
    assert torch.allclose(loss(ours), loss(PolicyLossConfig(loss_mode="vanilla")), rtol=1e-12, atol=0)
    with pytest.raises(LossplugError, match=r"policy_loss\.rollout_correction=\$\{algorithm\.rollout_correction\}"):
        loss(LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict()))


def test_regularizers_verl_does_not_add_are_refused_under_verl() -> None:
    """verl hands a policy loss neither entropy nor ref_log_prob: a recipe KL term that verl's ppo_loss will not
    add (use_kl_loss false) is refused, naming the settings — never silently dropped or counted twice."""
    recipe = verl_equivalent({"use_kl_loss": True, "kl_loss_coef": 0.05})
    ours = actor(
        "vanilla", "token-mean", policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict())
    )
    mb = micro_batches(make_inputs(2), 1, 0)[0]

    def call(config):
        return get_policy_loss_fn("lossplug")(
            old_log_prob=mb["old_log_prob"],
            log_prob=mb["log_prob"],
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode="token-mean",
            config=config,
        )

    # the exact override lines that make verl add the recipe's terms
    lines = (
        r"set: actor_rollout_ref.actor.entropy_coeff=0.0 actor_rollout_ref.actor.use_kl_loss=True "
        r"actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.kl_loss_coef=0.05"
    )
    with pytest.raises(LossplugError, match=r"use_kl_loss=False.*" + lines):
        call(ours)
    # a term no verl setting adds (TRL's bias-corrected KL): said so, no lines that would not help
    weighted = lossplug.Recipe.load(
        {**recipe.to_dict(), "regularizers": [{"name": "kl", "coef": 0.05, "ratio_weight": "token"}]}
    )
    policy = LossplugPolicyLossConfig(loss_mode="lossplug", recipe=weighted.to_dict())
    with pytest.raises(LossplugError, match=r"No verl setting adds these terms"):
        call(actor("vanilla", "token-mean", policy_loss=policy))


@pytest.mark.parametrize("loss_mode", [m for m in VERL_LOSS_MODES if m not in ("bypass_mode", "vanilla")])
def test_each_loss_modes_metric_keys_carry_its_values(loss_mode: str) -> None:
    """Each of ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl`` that a verl loss mode reports
    comes back under ``loss_mode=lossplug`` with that mode's own definition, micro-batch by micro-batch."""
    theirs_cfg = actor(loss_mode, "token-mean")
    recipe = verl_equivalent(theirs_cfg)
    policy = LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe.to_dict())
    ours_cfg = actor(loss_mode, "token-mean", policy_loss=policy)
    inputs = make_inputs(11)
    for mb in micro_batches(inputs, 1, 0):
        results = []
        for name, config in ((loss_mode, theirs_cfg), ("lossplug", ours_cfg)):
            config.global_batch_info.update(global_info(inputs, 1, None))
            torch.manual_seed(1234)  # clip_cov draws random tokens: the same RNG state for both
            _, metrics = get_policy_loss_fn(name)(
                old_log_prob=mb["old_log_prob"],
                log_prob=mb["log_prob"],
                advantages=mb["advantages"],
                response_mask=mb["response_mask"],
                loss_agg_mode="token-mean",
                config=config,
            )
            results.append(metrics)
        for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
            if key in results[0]:
                assert key in results[1], f"{loss_mode}: {key} missing"
                assert results[1][key] == pytest.approx(results[0][key], abs=1e-12), f"{loss_mode}: {key}"


def test_geo_mean_with_rollout_weights_is_refused_naming_them() -> None:
    """verl's geo_mean folds rollout_is_weights into the sequence as their geometric mean per response; correction
    gates weight each token: not the same function, so no recipe is returned."""
    actor = {"policy_loss": {"loss_mode": "geo_mean"}, "loss_agg_mode": "token-mean"}
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    with pytest.raises(LossplugError, match=r"loss_mode='geo_mean' with algorithm.rollout_correction \(tis\)"):
        verl_equivalent(actor, {"adv_estimator": "grpo", "rollout_correction": correction})
    # without the weights it maps, and rollout-correction metrics alone are no weighting
    assert verl_equivalent(actor, {"adv_estimator": "grpo"}).gates[0].name == "gmpo"


# ---------------------------------------------------------------------------------------------------------------------
# Unknown keys: a misspelling is an error naming it, where it is and the closest valid key


def verl_config(name: str = "_generated_ppo_trainer.yaml") -> Any:
    """One of verl's own composed trainer configs, loaded as it ships (OmegaConf, interpolations intact)."""
    import os

    import verl.trainer

    return OmegaConf.load(os.path.join(os.path.dirname(verl.trainer.__file__), "config", name))


@pytest.mark.parametrize("form", ["dict", "DictConfig"])
def test_the_issues_two_misspellings_are_refused_naming_key_place_and_the_closest_key(form: str) -> None:
    def given(config: dict[str, Any]) -> Any:
        return config if form == "dict" else OmegaConf.create(config)

    with pytest.raises(LossplugError) as err:
        verl_equivalent(given({"clip_ratio_low": 0.2, "clip_ratio_hgh": 0.28}))
    assert "actor_rollout_ref.actor.clip_ratio_hgh (did you mean clip_ratio_high?)" in str(err.value)
    with pytest.raises(LossplugError) as err:
        verl_equivalent(algorithm_config=given({"adv_estimatr": "grpo"}))
    assert "algorithm.adv_estimatr (did you mean adv_estimator?)" in str(err.value)


@pytest.mark.parametrize(
    ("argument", "section", "misspelt", "meant"),
    [
        ("actor", ("policy_loss",), "loss_mod", "loss_mode"),
        ("actor", ("policy_loss", "rollout_correction"), "rollout_iss", "rollout_is"),
        ("algorithm", ("kl_ctrl",), "kl_cof", "kl_coef"),
        ("algorithm", ("rollout_correction",), "rollout_is_treshold", "rollout_is_threshold"),
    ],
)
def test_a_misspelling_in_a_nested_section_of_verls_own_config_is_named_by_its_full_path(
    argument: str, section: tuple[str, ...], misspelt: str, meant: str
) -> None:
    config = verl_config()
    root = config.actor_rollout_ref.actor if argument == "actor" else config.algorithm
    node = root
    for key in section:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[misspelt] = 1
    prefix = "actor_rollout_ref.actor" if argument == "actor" else "algorithm"
    with pytest.raises(LossplugError) as err:
        verl_equivalent(config.actor_rollout_ref.actor, config.algorithm)
    assert f"{'.'.join((prefix, *section, misspelt))} (did you mean {meant}?)" in str(err.value)


def test_every_unknown_key_is_listed_once_in_one_error_as_the_docs_show() -> None:
    with pytest.raises(LossplugError) as err:
        verl_equivalent({"clip_ratio_hgh": 0.28}, {"adv_estimatr": "grpo"})
    docs = (ROOT / "docs" / "verl.md").read_text().split("**A key verl's config does not have is an error too**", 1)[1]
    assert str(err.value) == docs.split("```\n", 1)[1].split("\n```", 1)[0]


def test_a_key_close_to_no_valid_one_lists_the_valid_keys() -> None:
    with pytest.raises(LossplugError) as err:
        verl_equivalent({"policy_loss": {"zzz": 1}})
    assert "actor_rollout_ref.actor.policy_loss.zzz (no valid key is close; valid: " in str(err.value)
    assert "loss_mode" in str(err.value) and "recipe" in str(err.value)  # verl's and lossplug's own fields


@pytest.mark.parametrize(
    "name",
    [
        "_generated_ppo_trainer.yaml",
        "_generated_ppo_megatron_trainer.yaml",
        "_generated_ppo_torchtitan_trainer.yaml",
        "_generated_ppo_veomni_trainer.yaml",
    ],
)
def test_verls_own_trainer_configs_pass_as_they_ship(name: str) -> None:
    config = verl_config(name)
    recipe = verl_equivalent(config.actor_rollout_ref.actor, config.algorithm)
    assert [g.name for g in recipe.gates] == ["ppo_clip"] and recipe.advantage is not None


def test_keys_verl_accepts_and_lossplug_does_not_read_are_not_errors() -> None:
    actor = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "ppo_mini_batch_size": 64,
        "optim": {"lr": 1e-6, "anything_below": "is verl's"},  # a section lossplug does not read
        "ulysses_sequence_parallel_size": 1,  # FSDPActorConfig's
        "megatron": {},  # McoreActorConfig's
        "policy_loss": {"loss_mode": "vanilla", "recipe": None, "metrics": "basic"},  # verl's and lossplug's fields
    }
    algorithm = {"adv_estimator": "grpo", "filter_groups": None, "lossplug": "dapo", "kl_ctrl": {"horizon": 10000}}
    assert verl_equivalent(actor, algorithm) == verl_equivalent({}, {"adv_estimator": "grpo"})


def test_the_valid_keys_are_verls_dataclass_fields_and_cover_what_lossplug_reads() -> None:
    import dataclasses

    from verl.trainer.config.algorithm import AlgoConfig, RolloutCorrectionConfig

    from lossplug.adapters.verl.equivalent import keys

    source, valid = keys.valid_keys()
    assert source == f"verl {version('verl')}'s config dataclasses"
    lossplugs = {"lossplug", "lossplug_fresh_controllers"}  # the estimator's recipe; resume without its state
    assert {f.name for f in dataclasses.fields(AlgoConfig)} | lossplugs == valid["algorithm"]
    assert {f.name for f in dataclasses.fields(RolloutCorrectionConfig)} == valid["rollout_correction"]
    assert {f.name for f in dataclasses.fields(LossplugPolicyLossConfig)} <= valid["policy_loss"]
    for section, read in keys.keys_lossplug_reads().items():  # the fallback never refuses a key verl has
        assert read <= valid[section], (section, sorted(read - valid[section]))


def test_without_verl_the_keys_lossplug_reads_are_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lossplug.adapters.verl.equivalent import keys

    keys._verl_keys.cache_clear()
    monkeypatch.setitem(sys.modules, "verl.workers.config.actor", None)  # import raises ImportError
    try:
        assert keys.valid_keys()[0] == "the keys lossplug reads (verl is not installed)"
        assert verl_equivalent({"clip_ratio_high": 0.28, "policy_loss": {"recipe": None}}, {"lossplug": "dapo"})
        with pytest.raises(
            LossplugError, match=r"(?s)the keys lossplug reads.*clip_ratio_hgh \(did you mean clip_ratio_h"
        ):
            verl_equivalent({"clip_ratio_hgh": 0.28})
    finally:
        monkeypatch.undo()
        keys._verl_keys.cache_clear()
    assert keys.valid_keys()[0].startswith("verl ")


def test_correction_gates_on_its_own_names_a_misspelling_and_the_closest_key() -> None:
    from lossplug.adapters.verl.equivalent.rollout_correction import correction_gates

    with pytest.raises(
        LossplugError, match=r"algorithm\.rollout_correction\.rollout_iss \(did you mean rollout_is\?\)"
    ):
        correction_gates({"rollout_iss": "token"})
    assert correction_gates({"_target_": "verl.trainer.config.RolloutCorrectionConfig", "rollout_is": "token"})

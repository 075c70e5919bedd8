"""One recipe, both trainers: the same recipe YAML and the same tensors through TRL's and verl's loss seams.

The recipe (:data:`RECIPE_YAML`) has every stage kind: an advantage (``grpo``), an update gate (``ppo_clip`` with
clip-higher and dual clip), a correction (``tis`` against the rollout engine), a KL regularizer (``low_var_kl``,
which both trainers can compute) and an entropy regularizer, reduced per ``token``. One float64 batch of 8 responses
(2 prompt groups of 4) with observation tokens inside the responses (not actions) and finite garbage off the actions
goes through

* **TRL** — ``LossplugGRPOTrainer(..., recipe=<the YAML file>)`` (``beta`` = the KL coefficient, so that TRL computes
  reference log-probs; ``entropy_coef=0``; a ``rollout_func`` so that there are behaviour log-probs). Its seam is
  ``_compute_loss(model, inputs)`` on TRL's micro-batch dict, with ``_get_per_token_logps_and_entropies`` stubbed to
  return the fixed log-probs and entropies; advantages from the adapter's ``group_advantages`` on the rewards.
  Two micro-batches of 4 rows, ``gradient_accumulation_steps = steps_per_generation = 2`` on one process: TRL's
  convention is that each returned loss is already scaled for accumulation, so their sum is the step's loss.
* **verl** — verl's own actor loss ``verl.workers.utils.losses.ppo_loss`` with ``loss_mode=lossplug`` and **the same
  recipe file**, ``entropy_coeff`` / ``use_kl_loss`` / ``kl_loss_type`` / ``kl_loss_coef`` set to the recipe's
  regularizers (the adapter checks they agree and counts each once), the correction as verl's rollout correction
  (``rollout_is=token``, ``rollout_is_threshold=cap``: weights from verl's own ``rollout_corr_helper``) forwarded to the
  actor as ``policy_loss.rollout_correction`` (the adapter checks it maps to the recipe's ``tis`` and applies verl's
  weights in its place, once), ``loss_agg_mode=token-mean``;
  advantages from verl's estimator ``lossplug`` on token-level rewards and ``uid``. dp_size 2 × 2 micro-batches of 2
  rows, each padded to its own longest response, with verl's global batch info: each returned loss is the
  micro-batch's share × dp_size, and DDP averages over the ranks, so their sum / dp_size is the step's loss.
* **lossplug itself** — ``lossplug.policy_loss(batch, recipe)`` on the whole batch.

Loss and gradient (wrt the log-probs and the entropies) agree to ≤ 1e-10 relative (they agree to rounding, ~1e-16);
verl's native ``vanilla`` loss with the same settings gives the same numbers, and ``verl_equivalent`` of the verl
settings is the recipe.

verl hands a registered policy loss ``rollout_is_weights`` but never ``rollout_log_probs``, so under ``ppo_loss`` the
recipe's ``tis`` is computed by verl's driver from ``algorithm.rollout_correction``; the policy loss sees that config
only when it is forwarded (``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}``).
Without it, or with a config that maps to another correction, the adapter refuses, naming the override lines —
asserted below, with the Hydra composition of that line against verl's own config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("verl")

import numpy as np  # verl's uid arrays; verl brings numpy
from tensordict import TensorDict
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import lossplug
from lossplug.adapters import trl as trl_adapter
from lossplug.adapters.trl import LossplugGRPOTrainer
from lossplug.adapters.verl import (
    LossplugPolicyLossConfig,
    compute_lossplug_advantage,
    compute_policy_loss_lossplug,
    verl_equivalent,
)
from lossplug.contracts import LossplugError
from lossplug.testing import tiny

DT = torch.float64
REL_TOL = 1e-10

RECIPE_YAML = """\
name: one-recipe-both-trainers
advantage: {name: grpo}                                       # group-relative, std-normalised
gates:
  - {name: ppo_clip, eps_low: 0.2, eps_high: 0.28, dual_clip_c: 3.0}   # clip-higher + dual clip
  - {name: tis, cap: 2.0}                                     # truncated IS against the rollout engine
reduction: token
regularizers:
  - {name: kl, coef: 0.04, estimator: low_var_kl}             # + 0.04 · KL to the reference
  - {name: entropy, coef: 0.01}                               # − 0.01 · entropy
"""

#: the verl settings this recipe corresponds to (actor_rollout_ref.actor.* and algorithm.*)
VERL_ACTOR = {
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 0.01,
    "use_kl_loss": True,
    "kl_loss_type": "low_var_kl",
    "kl_loss_coef": 0.04,
    # read by loss_mode=vanilla only (the native comparison and verl_equivalent); lossplug reads the recipe
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
}
VERL_ROLLOUT_CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 2.0}

B, T, P, GROUP = 8, 10, 3, 4
TRL_MICRO, VERL_MICRO, DP = 4, 2, 2
TRL_ACCUMULATION = B // TRL_MICRO  # one process: the generation batch is one accumulation window


# ---------------------------------------------------------------------------------------------------------------------
# The shared tensors


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    lengths[0] = T  # someone uses the whole width
    response = torch.arange(T) < lengths[:, None]
    observation = (torch.rand(B, T, generator=g) < 0.2) & response  # tool/environment tokens inside a response
    observation &= (torch.arange(T) > 0) & (torch.arange(T) < lengths[:, None] - 1)  # a response ends on an action
    action = response & ~observation
    old = -torch.rand(B, T, generator=g, dtype=DT) * 2 - 0.05
    logp = (old + 0.5 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=-1e-3)
    behavior = (old + 0.6 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=-1e-3)
    ref = (old + 0.4 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=-1e-3)
    entropy = 2 * torch.rand(B, T, generator=g, dtype=DT)
    garbage = 5 * torch.rand(B, T, generator=g, dtype=DT)  # what the trainers hold off the actions: never read

    def off(x: torch.Tensor) -> torch.Tensor:
        return torch.where(action, x, -garbage)

    rewards = torch.rand(B, generator=g, dtype=DT)
    return {
        "lengths": lengths,
        "response": response,
        "action": action,
        "logp": off(logp),
        "old": off(old),
        "behavior": off(behavior),
        "ref": off(ref),
        "entropy": torch.where(action, entropy, garbage),
        "rewards": rewards,
    }


def leaves(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return x["logp"].clone().requires_grad_(True), x["entropy"].clone().requires_grad_(True)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (float64)."""
    scale = max(theirs.abs().max().item(), 1e-300)
    return (ours.detach() - theirs.detach()).abs().max().item() / scale


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("one_recipe") / "recipe.yaml"
    path.write_text(RECIPE_YAML)
    return path


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return make_tensors()


# ---------------------------------------------------------------------------------------------------------------------
# TRL


@pytest.fixture(scope="module")
def trl_trainer(recipe_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("one_recipe_trl")
    model, tok = tiny.tiny_model_and_tokenizer(tmp / "model")  # beta != 0: TRL loads a reference model
    args = tiny.tiny_grpo_config(
        tmp / "out",
        per_device_train_batch_size=TRL_MICRO,
        num_generations=GROUP,
        gradient_accumulation_steps=TRL_ACCUMULATION,
        beta=0.04,  # = the recipe's KL coefficient: switches TRL's reference log-probs on, the recipe's KL replaces TRL's
        entropy_coef=0.0,  # the recipe's entropy replaces TRL's bonus
        max_completion_length=T,
    )
    trainer = LossplugGRPOTrainer(
        model=model,
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        rollout_func=tiny.TinyRollout(tok),  # TRL then has behaviour log-probs (sampling_per_token_logps) for tis
        recipe=str(recipe_file),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = TRL_ACCUMULATION
    assert trainer.args.steps_per_generation == TRL_ACCUMULATION
    assert trainer._lossplug.recipe_kl and trainer._lossplug.recipe_entropy
    return trainer


def trl_advantages(trainer: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The adapter's advantage seam: the recipe's stage on the rewards TRL gathered (one reward function)."""
    advantages, _, group_ids, _ = trl_adapter.group_advantages(trainer, x["rewards"].unsqueeze(-1), GROUP)
    assert advantages is not None
    assert torch.equal(group_ids - group_ids[0], torch.arange(B) // GROUP)
    return advantages


def trl_step(trainer: Any, x: dict[str, torch.Tensor], advantages: torch.Tensor) -> dict[str, Any]:
    """TRL's micro-batches through ``_compute_loss``; the model's forward returns the fixed log-probs/entropies."""
    logp, entropy = leaves(x)
    action = x["action"]
    losses = []
    for start in range(0, B, TRL_MICRO):
        rows = slice(start, start + TRL_MICRO)
        completion_mask = x["response"][rows].long()

        def forward(
            model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, rows: slice = rows, **kw: Any
        ) -> Any:
            assert logits_to_keep == T and kw["compute_entropy"]  # the recipe reads entropies: TRL computes them
            return logp[rows], entropy[rows]

        inputs = {
            "prompt_ids": torch.ones(TRL_MICRO, P, dtype=torch.long),
            "prompt_mask": torch.ones(TRL_MICRO, P, dtype=torch.long),
            "completion_ids": torch.ones(TRL_MICRO, T, dtype=torch.long),
            "completion_mask": completion_mask,
            "tool_mask": (action[rows] | ~x["response"][rows]).long(),  # 0 on observation tokens only
            "old_per_token_logps": x["old"][rows],
            "sampling_per_token_logps": x["behavior"][rows],
            "ref_per_token_logps": x["ref"][rows],
            "advantages": advantages[rows],
            "num_items_in_batch": action.sum(),  # TRL: action tokens of the whole generation batch, all processes
        }
        trainer._get_per_token_logps_and_entropies = forward
        try:
            loss = trainer._compute_loss(trainer.model, inputs)
        finally:
            del trainer._get_per_token_logps_and_entropies
        loss.backward()
        losses.append(loss.detach())
    total = torch.stack(losses).sum()  # accumulation: the returned losses are already scaled, their sum is the step's
    return {"loss": total, "micro": losses, "grad_logp": logp.grad, "grad_entropy": entropy.grad}


# ---------------------------------------------------------------------------------------------------------------------
# verl


def verl_actor(policy_loss: Any, **settings: Any) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=GROUP,
        ppo_micro_batch_size_per_gpu=VERL_MICRO,
        policy_loss=policy_loss,
        **{**VERL_ACTOR, **settings},
    )


def lossplug_policy(recipe: Any, rollout_correction: Any = VERL_ROLLOUT_CORRECTION) -> LossplugPolicyLossConfig:
    """``policy_loss`` under ``loss_mode=lossplug``, with ``algorithm.rollout_correction`` forwarded (the Hydra line
    ``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}``)."""
    return LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe, rollout_correction=rollout_correction)


def verl_advantages(recipe: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """verl's estimator ``lossplug`` (``algorithm.adv_estimator=lossplug``, ``+algorithm.lossplug=<recipe>``): the
    score on each response's last token, ``uid`` a numpy object array."""
    last = x["lengths"] - 1
    token_level_rewards = torch.zeros(B, T, dtype=DT)
    token_level_rewards[torch.arange(B), last] = x["rewards"]
    uid = np.array([f"prompt-{i // GROUP}" for i in range(B)], dtype=object)
    assert bool(x["action"][torch.arange(B), last].all())
    advantages, returns = compute_lossplug_advantage(
        token_level_rewards, x["action"].long(), index=uid, config={"lossplug": recipe}
    )
    assert torch.equal(advantages, returns)
    return advantages


def verl_rollout_is_weights(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """What verl's driver adds to the batch (decoupled mode, ``algorithm.rollout_correction``), from its own helper."""
    proto, mask, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old"],
        rollout_log_prob=x["behavior"],
        response_mask=x["response"].long(),
        **VERL_ROLLOUT_CORRECTION,
    )
    assert proto is not None and torch.equal(mask.bool(), x["response"])
    weights: torch.Tensor = proto.batch["rollout_is_weights"]
    return weights


def verl_step(
    actor: ActorConfig, x: dict[str, torch.Tensor], advantages: torch.Tensor, *, weights: bool = True
) -> dict[str, Any]:
    """dp_size 2 × 2 micro-batches through verl's ``ppo_loss``, each padded to its own longest response; ``weights``:
    verl's driver put ``rollout_is_weights`` into the batch."""
    logp, entropy = leaves(x)
    is_weights = verl_rollout_is_weights(x) if weights else None
    losses = []
    for start in range(0, B, VERL_MICRO):
        rows = range(start, start + VERL_MICRO)
        lengths = x["lengths"][start : start + VERL_MICRO]
        width = int(lengths.max())

        def flat(per_token: torch.Tensor, lengths: torch.Tensor = lengths, rows: range = rows) -> torch.Tensor:
            """verl's un-padded model output: prompt + response per sequence, log-prob of token t+1 at position t."""
            pieces = []
            for k, i in enumerate(rows):
                n = int(lengths[k])
                pieces += [torch.zeros(P - 1, dtype=DT), per_token[i, :n], torch.zeros(1, dtype=DT)]
            return torch.cat(pieces)

        def cut(t: torch.Tensor, start: int = start, width: int = width) -> torch.Tensor:
            return t[start : start + VERL_MICRO, :width]

        data = TensorDict(
            {
                "prompts": torch.ones(VERL_MICRO, P, dtype=torch.long),
                "responses": torch.ones(VERL_MICRO, width, dtype=torch.long),
                "attention_mask": torch.cat(
                    [torch.ones(VERL_MICRO, P, dtype=torch.long), cut(x["response"]).long()], dim=1
                ),
                "response_mask": cut(x["action"]).long(),
                "old_log_probs": cut(x["old"]),
                "advantages": cut(advantages),
                "ref_log_prob": cut(x["ref"]),
                **({} if is_weights is None else {"rollout_is_weights": cut(is_weights)}),
            },
            batch_size=[VERL_MICRO],
        )
        tu.assign_non_tensor(data, dp_size=DP, batch_num_tokens=int(x["action"].sum()), global_batch_size=B)
        loss, _ = ppo_loss(actor, {"log_probs": flat(logp), "entropy": flat(entropy)}, data)
        loss.backward()
        losses.append(loss.detach())
    total = torch.stack(losses).sum() / DP  # each is its share × dp_size; DDP averages the ranks' gradients
    # DDP's average applies to the gradients too
    return {"loss": total, "micro": losses, "grad_logp": logp.grad / DP, "grad_entropy": entropy.grad / DP}


# ---------------------------------------------------------------------------------------------------------------------
# lossplug itself


def direct(x: dict[str, torch.Tensor], advantages: torch.Tensor) -> dict[str, Any]:
    logp, entropy = leaves(x)
    batch = lossplug.PolicyBatch(
        logp=logp,
        old_logp=x["old"],
        behavior_logp=x["behavior"],
        ref_logp=x["ref"],
        entropy=entropy,
        advantage=advantages,
        action_mask=x["action"],
    )
    result = lossplug.policy_loss(batch, lossplug.Recipe.load(RECIPE_YAML))
    result.loss.backward()
    return {"loss": result.loss.detach(), "grad_logp": logp.grad, "grad_entropy": entropy.grad}


def direct_advantages(x: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(B, 1, dtype=DT),
        action_mask=torch.ones(B, 1, dtype=torch.bool),
        reward=x["rewards"],
        group_id=torch.arange(B) // GROUP,
    )
    advantages: torch.Tensor = lossplug.compute_advantages(batch, lossplug.Recipe.load(RECIPE_YAML))
    return advantages.reshape(B)


# ---------------------------------------------------------------------------------------------------------------------
# The tests


def test_the_advantage_stage_is_the_same_in_both_trainers(trl_trainer: Any, recipe_file: Path, tensors: Any) -> None:
    ours = direct_advantages(tensors)
    trl = trl_advantages(trl_trainer, tensors)
    verl = verl_advantages(str(recipe_file), tensors)
    assert rel(trl.to(DT), ours) <= REL_TOL
    assert torch.equal(verl, torch.where(tensors["action"], ours.unsqueeze(-1), 0.0))  # per row, on the actions
    assert ours.abs().max() > 0.5


def test_same_loss_and_gradient_in_trl_verl_and_lossplug(trl_trainer: Any, recipe_file: Path, tensors: Any) -> None:
    x = tensors
    advantages = direct_advantages(x)
    expected = direct(x, advantages)

    trl = trl_step(trl_trainer, x, trl_advantages(trl_trainer, x).to(DT))
    verl = verl_step(verl_actor(lossplug_policy(str(recipe_file))), x, verl_advantages(str(recipe_file), x))
    native = verl_step(verl_actor(PolicyLossConfig(loss_mode="vanilla")), x, advantages.unsqueeze(-1).expand(B, T))

    worst = {}
    for name, run in (("trl", trl), ("verl", verl), ("verl-vanilla", native)):
        assert run["loss"].dtype == DT
        for key in ("loss", "grad_logp", "grad_entropy"):
            worst[f"{name}/{key}"] = rel(run[key], expected[key])
    assert max(worst.values()) <= REL_TOL, worst
    # each TRL micro-batch (rows 4i..4i+3) is the share of verl's two micro-batches on the same rows
    for i, loss in enumerate(trl["micro"]):
        assert rel(loss, (verl["micro"][2 * i] + verl["micro"][2 * i + 1]) / DP) <= REL_TOL

    # the gradient lives on the actions only, and every stage moved it: observation tokens and padding get none
    action = x["action"]
    for run in (trl, verl, expected):
        assert (run["grad_logp"][~action] == 0).all() and (run["grad_entropy"][~action] == 0).all()
    assert (expected["grad_entropy"][action] < 0).all()  # the entropy bonus (a loss term −coef·H/N)
    assert (expected["grad_logp"][action] != 0).sum() > action.sum() // 2
    print("max relative differences:", {k: f"{v:.2e}" for k, v in worst.items()})


def test_every_stage_changes_the_loss(tensors: Any) -> None:
    """The comparison above is not vacuous: dropping the correction, the KL or the entropy changes the loss, the
    clip and the truncation are active on this batch."""
    x = tensors
    advantages = direct_advantages(x)
    full = direct(x, advantages)["loss"]
    base = lossplug.Recipe.load(RECIPE_YAML).to_dict()
    variants = {
        "no tis": {**base, "gates": base["gates"][:1]},
        "no kl": {**base, "regularizers": [r for r in base["regularizers"] if r["name"] != "kl"]},
        "no entropy": {**base, "regularizers": [r for r in base["regularizers"] if r["name"] != "entropy"]},
    }
    logp, entropy = leaves(x)
    batch = lossplug.PolicyBatch(
        logp=logp,
        old_logp=x["old"],
        behavior_logp=x["behavior"],
        ref_logp=x["ref"],
        entropy=entropy,
        advantage=advantages,
        action_mask=x["action"],
    )
    for name, recipe in variants.items():
        other = lossplug.policy_loss(batch, lossplug.Recipe.load(recipe)).loss.detach()
        assert abs(float(other) - float(full)) > 1e-4, name
    result = lossplug.policy_loss(batch, lossplug.Recipe.load(RECIPE_YAML), metrics="basic")
    metrics = {k: float(v) for k, v in result.metric_tensors.items()}
    assert metrics["ppo_clip/clip_frac_high"] + metrics["ppo_clip/clip_frac_low"] > 0
    assert metrics["tis/trunc_frac"] > 0


def test_verl_settings_are_the_recipe(recipe_file: Path) -> None:
    """``verl_equivalent`` of the verl settings used above is the recipe (verl's ``offpolicy_metrics`` diagnostics gate
    aside): the config lines of the README select exactly this loss."""
    recipe = lossplug.Recipe.load(RECIPE_YAML).to_dict()
    theirs = verl_equivalent(
        VERL_ACTOR,
        {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "rollout_correction": VERL_ROLLOUT_CORRECTION},
    ).to_dict()
    theirs["gates"] = [g for g in theirs["gates"] if g["name"] != "offpolicy_metrics"]
    for key in ("advantage", "gates", "reduction"):
        assert theirs[key] == recipe[key], key
    assert sorted(theirs["regularizers"], key=str) == sorted(recipe["regularizers"], key=str)


def test_under_verls_ppo_loss_the_correction_is_verls_rollout_correction_and_the_terms_verls_settings(
    recipe_file: Path, tensors: Any
) -> None:
    """verl passes a policy loss rollout_is_weights, never rollout_log_probs: the recipe's tis runs as verl's rollout
    correction only when algorithm.rollout_correction is forwarded and maps to it; otherwise refused, naming the
    override lines. verl's entropy/KL settings must be the recipe's regularizers (each counted once)."""
    x = tensors
    advantages = direct_advantages(x).unsqueeze(-1).expand(B, T)
    recipe = str(recipe_file)
    forward = "'+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'"
    lines = "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0"
    not_forwarded = verl_actor(lossplug_policy(recipe, rollout_correction=None))
    with pytest.raises(LossplugError, match="never passes") as refused:
        verl_step(not_forwarded, x, advantages)
    assert f"{forward} {lines}" in str(refused.value)
    other = verl_actor(lossplug_policy(recipe, rollout_correction={"rollout_is": "token", "rollout_is_threshold": 3.0}))
    with pytest.raises(LossplugError, match=r"maps to \[\{'name': 'tis', 'cap': 3.0\}\], not to the recipe's"):
        verl_step(other, x, advantages)
    with pytest.raises(LossplugError, match="no rollout_is_weights"):
        verl_step(verl_actor(lossplug_policy(recipe)), x, advantages, weights=False)
    # a recipe without tis next to verl's weights: verl's correction, applied once (the README's earlier form)
    without_tis = lossplug.Recipe.load(RECIPE_YAML).to_dict()
    without_tis["gates"] = without_tis["gates"][:1]
    assert verl_step(verl_actor(lossplug_policy(without_tis, None)), x, advantages)["loss"].isfinite()
    disagreeing = verl_actor(lossplug_policy(recipe), kl_loss_coef=0.05)
    with pytest.raises(LossplugError, match="not what verl's ppo_loss adds"):
        verl_step(disagreeing, x, advantages)
    with pytest.raises(LossplugError, match="never passes"):
        compute_policy_loss_lossplug(x["old"], x["logp"], advantages, x["action"], "token-mean", not_forwarded)


def test_the_forwarding_line_composes_with_verls_config(recipe_file: Path) -> None:
    """``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}`` against verl's own
    Hydra config: the actor's LossplugPolicyLossConfig then holds the algorithm's rollout correction."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from lossplug.adapters.verl.equivalent import as_plain

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        lines = [line.replace("/abs/recipe.yaml", str(recipe_file)) for line in readme_verl_lines()]
        lines.append("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")  # (the run's own; verl requires one)
        cfg = compose(config_name="ppo_trainer", overrides=lines)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, LossplugPolicyLossConfig) and actor.policy_loss.recipe == str(recipe_file)
    forwarded = as_plain(actor.policy_loss.rollout_correction, "rollout_correction")
    assert forwarded is not None
    assert {k: forwarded[k] for k in VERL_ROLLOUT_CORRECTION} == VERL_ROLLOUT_CORRECTION
    assert forwarded == as_plain(cfg.algorithm.rollout_correction, "algorithm.rollout_correction")


def readme_section() -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return readme.split("## Same recipe in TRL and verl", 1)[1].split("\n## ", 1)[0]


def readme_verl_lines() -> list[str]:
    """The Hydra overrides of the README section's bash block (the shell's quotes and line continuations removed)."""
    import shlex

    block = readme_section().split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [t for t in shlex.split(block) if "=" in t]


def test_the_readme_section_shows_this_recipe_and_these_settings() -> None:
    import yaml

    section = readme_section()
    shown = lossplug.Recipe.load(yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])).to_dict()
    ours = lossplug.Recipe.load(RECIPE_YAML).to_dict()
    shown.pop("name", None)
    ours.pop("name", None)
    assert shown == ours
    settings = dict(token.split("=", 1) for token in readme_verl_lines())
    assert settings["+actor_rollout_ref.actor.policy_loss.recipe"] == "/abs/recipe.yaml"  # the same file as TRL's
    assert settings["+algorithm.lossplug"] == "/abs/recipe.yaml"
    assert settings["+actor_rollout_ref.actor.policy_loss.rollout_correction"] == "${algorithm.rollout_correction}"
    actor = {
        k.removeprefix("actor_rollout_ref.actor."): yaml.safe_load(v)
        for k, v in settings.items()
        if k.startswith("actor_rollout_ref.actor.") and "policy_loss" not in k
    }
    correction = {
        k.removeprefix("algorithm.rollout_correction."): yaml.safe_load(v)
        for k, v in settings.items()
        if k.startswith("algorithm.rollout_correction.")
    }
    assert actor == {k: v for k, v in VERL_ACTOR.items() if not k.startswith("clip_ratio")}
    assert correction == VERL_ROLLOUT_CORRECTION
    assert "beta=0.04" in section

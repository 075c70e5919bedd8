"""The proof users ask for: inside a real TRL GRPOTrainer, lossplug reproduces TRL's native loss, gradients and
advantages on the same inputs and parameters.

One tiny trainer (beta > 0, gradient accumulation 2, num_iterations 2, two reward functions) generates one real
generation batch through TRL's own ``_prepare_inputs``; its parameters are then perturbed (as an optimizer step
would) so that the update ratio is no longer 1 and clipping happens. For each ``loss_type`` TRL's
``GRPOTrainer._compute_loss`` and the adapter's ``_compute_loss`` run on the same two micro-batches; their losses and
the accumulated parameter gradients must agree to 1e-6 (absolute, float32; the losses and gradients are O(0.01–1)).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer

import lossplug
from lossplug.adapters.trl import LossplugGRPOTrainer, attach, trl_equivalent
from lossplug.testing import tiny

pytestmark = pytest.mark.slow

TOL = 1e-6


LOSS_TYPES = {
    # loss_type: GRPOConfig settings (TRL's defaults otherwise)
    "grpo": {"epsilon_high": 0.28},
    "bnpo": {"epsilon_high": 0.28},
    "dr_grpo": {},
    "dapo": {"epsilon_high": 0.28},
    "cispo": {"epsilon_high": 5.0},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    "grpo+delta": {"epsilon_high": 0.28, "delta": 1.3},
    # delta inside the clip range: TRL's cap, not a dual clip (it caps A > 0 ratios at δ, keeps A < 0's raw branch)
    "grpo+delta_inside": {"epsilon_high": 0.28, "delta": 1.1},
    "grpo+gspo": {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
}


@pytest.fixture(scope="module", params=["generate", "rollout"])
def setup(request, tmp_path_factory):
    """``generate``: TRL's own transformers generation. ``rollout``: a ``rollout_func`` with behaviour log-probs
    (some unscored), tool tokens (``tool_mask``) and truncated completions masked out
    (``mask_truncated_completions`` — rows with no action token at all)."""
    tmp = tmp_path_factory.mktemp("trl_eq")
    model, tok = tiny.tiny_model_and_tokenizer(tmp / "model")
    extra, rollout = {}, None
    if request.param == "rollout":
        extra = {"mask_truncated_completions": True}
        rollout = tiny.TinyRollout(tok, seed=3)
    args = tiny.tiny_grpo_config(
        tmp / "out", gradient_accumulation_steps=2, num_iterations=2, beta=0.04, loss_type="dapo", **extra
    )
    trainer = LossplugGRPOTrainer(
        model=model,
        reward_funcs=[tiny.length_reward, tiny.digit_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe="dapo",
        rollout_func=rollout,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    torch.manual_seed(0)
    generation_batch = next(iter(trainer.get_train_dataloader()))
    trainer._prepare_inputs(generation_batch)
    micro_batches = list(trainer._buffered_inputs)
    assert len(micro_batches) == 2 and all("old_per_token_logps" in mb for mb in micro_batches)
    assert all("ref_per_token_logps" in mb for mb in micro_batches)
    if rollout is not None:
        assert all("tool_mask" in mb and "sampling_per_token_logps" in mb for mb in micro_batches)
        assert any((mb["completion_mask"].sum(-1) == 0).any() for mb in micro_batches)  # masked truncated rows
    with torch.no_grad():  # an optimizer step's worth of drift: ratios ≠ 1, some clipped
        gen = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    return trainer, micro_batches, generation_batch


@contextlib.contextmanager
def configured(trainer, loss_type: str, settings: dict):
    """Set TRL's loss settings on the trainer (both its args and the attributes TRL caches from them)."""
    args = trainer.args
    fields = {
        "loss_type": loss_type,
        "epsilon": 0.2,
        "epsilon_high": None,
        "delta": None,
        "importance_sampling_level": "token",
        **settings,
    }
    saved_args = {k: getattr(args, k) for k in fields}
    saved_attrs = {
        k: getattr(trainer, k) for k in ("loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level")
    }
    for k, v in fields.items():
        setattr(args, k, v)
    trainer.loss_type = loss_type
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.importance_sampling_level = args.importance_sampling_level
    try:
        yield args
    finally:
        for k, v in saved_args.items():
            setattr(args, k, v)
        for k, v in saved_attrs.items():
            setattr(trainer, k, v)


def accumulate(trainer, micro_batches, loss_fn):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    total, grads = 0.0, [torch.zeros_like(p) for p in params]
    for mb in micro_batches:
        trainer.model.zero_grad(set_to_none=True)
        loss = loss_fn(mb)
        loss.backward()
        total = total + loss.detach()
        for g, p in zip(grads, params):
            g += p.grad
    trainer.model.zero_grad(set_to_none=True)
    return total, grads


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def native_and_ours(trainer, micro_batches):
    """``(|Δloss|, max |Δgrad|, native grads)`` of TRL's own ``_compute_loss`` and the attached recipe's, both
    accumulated over the same micro-batches."""
    native_loss, native_grads = accumulate(
        trainer, micro_batches, lambda mb: GRPOTrainer._compute_loss(trainer, trainer.model, mb)
    )
    ours_loss, ours_grads = accumulate(trainer, micro_batches, lambda mb: trainer._compute_loss(trainer.model, mb))
    return abs(float(native_loss - ours_loss)), max_diff(native_grads, ours_grads), native_grads


@pytest.mark.parametrize("case", list(LOSS_TYPES))
def test_loss_and_gradients_match_trl(setup, case):
    trainer, micro_batches, _ = setup
    loss_type = case.split("+")[0]
    with configured(trainer, loss_type, LOSS_TYPES[case]) as args:
        recipe, population = trl_equivalent(args)
        attach(trainer, recipe, population=population)
        trainer.model.train()
        loss_diff, grad_diff, native_grads = native_and_ours(trainer, micro_batches)
        grad_scale = max(float(g.abs().max()) for g in native_grads)
        print(
            f"{case}: recipe={recipe.to_dict()} population={population} "
            f"|Δloss|={loss_diff:.2e} max|Δgrad|={grad_diff:.2e} (max|grad|={grad_scale:.3g})"
        )
        assert grad_scale > 1e-3  # the comparison is not vacuous
        assert loss_diff <= TOL
        assert grad_diff <= TOL

        # eval mode: TRL neither splits nor accumulates; the adapter's scaling follows
        trainer.model.eval()
        try:
            with torch.no_grad():
                native = GRPOTrainer._compute_loss(trainer, trainer.model, micro_batches[0])
                ours = trainer._compute_loss(trainer.model, micro_batches[0])
        finally:
            trainer.model.train()
        assert abs(float(native - ours)) <= TOL


@pytest.mark.parametrize("case", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_steps_per_generation_other_than_accumulation(setup, case):
    """steps_per_generation = 4 with gradient accumulation 2 (each optimizer step sees half a generation batch):
    the adapter's scaling reproduces TRL's convention (the loss formulas only read these two numbers)."""
    trainer, micro_batches, _ = setup
    saved = trainer.args.steps_per_generation
    with configured(trainer, case, LOSS_TYPES[case]) as args:
        recipe, population = trl_equivalent(args)
        attach(trainer, recipe, population=population)
        trainer.args.steps_per_generation = 4
        try:
            loss_diff, grad_diff, _ = native_and_ours(trainer, micro_batches)
        finally:
            trainer.args.steps_per_generation = saved
    assert loss_diff <= TOL
    assert grad_diff <= TOL


def test_the_comparison_exercises_clipping_and_kl(setup):
    trainer, micro_batches, _ = setup
    with configured(trainer, "dapo", LOSS_TYPES["dapo"]) as args:
        attach(trainer, trl_equivalent(args)[0], metrics="full")
        trainer._metrics["train"].clear()
        for mb in micro_batches:
            with torch.no_grad():
                trainer._compute_loss(trainer.model, mb)
        m = trainer._metrics["train"]
        clipped = [
            lo + hi for lo, hi in zip(m["lossplug/ppo_clip/clip_frac_low"], m["lossplug/ppo_clip/clip_frac_high"])
        ]
        assert max(clipped) > 0
        assert min(m["kl"]) > 0 and min(m["lossplug/reg/kl/value"]) > 0  # the recipe's KL regularizer
        assert max(m["lossplug/ratio/update/max"]) > 1.05


def test_bnpo_needs_the_micro_batch_population(setup):
    """TRL's bnpo is a mean of per-micro-batch token means: with the global ('generation') population the token
    reduction is DAPO's instead, and differs whenever micro-batches hold different numbers of tokens."""
    trainer, micro_batches, _ = setup
    tokens = [int((mb["completion_mask"] * mb.get("tool_mask", 1)).sum()) for mb in micro_batches]
    if tokens[0] == tokens[1]:  # equal counts make bnpo and dapo coincide: take one action token out of the first
        first = dict(micro_batches[0])
        mask = (first["completion_mask"] * first.get("tool_mask", 1)).clone()
        row, pos = mask.nonzero()[-1].tolist()
        first["completion_mask"] = first["completion_mask"].clone()
        first["completion_mask"][row, pos] = 0
        micro_batches = [first, *micro_batches[1:]]
    with configured(trainer, "bnpo", LOSS_TYPES["bnpo"]) as args:
        recipe, population = trl_equivalent(args)
        assert population == "micro_batch"
        attach(trainer, recipe, population="generation")
        with torch.no_grad():
            native = sum(GRPOTrainer._compute_loss(trainer, trainer.model, mb) for mb in micro_batches)
            wrong = sum(trainer._compute_loss(trainer.model, mb) for mb in micro_batches)
        assert abs(float(native - wrong)) > 1e-4


@pytest.mark.parametrize("recipe", ["dapo", "grpo", "dr_grpo"])
def test_micro_batch_losses_sum_to_the_full_step_reduction(setup, recipe):
    """With the 'generation' population (steps_per_generation == gradient_accumulation_steps) the micro-batch losses
    TRL back-propagates add up to the recipe's reduction over the whole step — no mean of micro-batch means."""
    trainer, micro_batches, _ = setup
    attach(trainer, recipe)
    beta, trainer.beta = trainer.beta, 0.0
    try:
        with torch.no_grad():
            summed = sum(trainer._compute_loss(trainer.model, mb) for mb in micro_batches)
            parts = []
            for mb in micro_batches:
                ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
                att = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
                logp = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, att, mb["completion_ids"].shape[1]
                )[0]
                parts.append((logp, mb))
            mask = torch.cat([(mb["completion_mask"] * mb.get("tool_mask", 1)).bool() for _, mb in parts])
            keep = mask.any(-1)  # rows TRL masked out entirely still count as responses of the population
            full = lossplug.PolicyBatch(
                logp=torch.cat([p for p, _ in parts])[keep],
                action_mask=mask[keep],
                old_logp=torch.cat([mb["old_per_token_logps"] for _, mb in parts])[keep],
                advantage=torch.cat([mb["advantages"] for _, mb in parts])[keep],
            )
            normalizer = lossplug.Normalizer(
                action_tokens=int(mask.sum()), sequences=mask.shape[0], budget=float(trainer.max_completion_length)
            )
            expected = lossplug.policy_loss(full, recipe, normalizer).loss
    finally:
        trainer.beta = beta
    assert abs(float(summed - expected)) <= TOL


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl(setup, scale):
    """lossplug's grpo advantage (sample std, eps 1e-4) = TRL's, including unscorable completions (reward None)."""
    trainer, _, generation_batch = setup

    def sometimes_none(completions, **kwargs):
        return [None if i % 5 == 2 else 1.0 / (1.0 + len(str(c).split())) for i, c in enumerate(completions)]

    funcs, names, weights, processing = (
        trainer.reward_funcs,
        trainer.reward_func_names,
        trainer.reward_weights,
        trainer.reward_processing_classes,
    )
    trainer.reward_funcs, trainer.reward_func_names = [sometimes_none], ["sometimes_none"]
    trainer.reward_weights, trainer.reward_processing_classes = torch.ones(1), [None]
    saved = trainer.scale_rewards
    trainer.scale_rewards = trainer.args.scale_rewards = scale
    try:
        recipe, _ = trl_equivalent(trainer.args)
        assert recipe.advantage.params["scale"] == scale
        attach(trainer, recipe)
        rollout = trainer.rollout_func
        torch.manual_seed(7)
        if rollout is not None:
            rollout.calls = 0
        native = GRPOTrainer._generate_and_score_completions(trainer, generation_batch)
        torch.manual_seed(7)
        if rollout is not None:
            rollout.calls = 0
        ours = trainer._generate_and_score_completions(generation_batch)
    finally:
        trainer.reward_funcs, trainer.reward_func_names = funcs, names
        trainer.reward_weights, trainer.reward_processing_classes = weights, processing
        trainer.scale_rewards = trainer.args.scale_rewards = saved
    assert torch.equal(native["completion_ids"], ours["completion_ids"])  # same rollouts
    assert torch.isnan(ours["lossplug_reward"]).any()  # the unscorable path is exercised
    assert (ours["advantages"][torch.isnan(ours["lossplug_reward"])] == 0).all()
    diff = float((native["advantages"] - ours["advantages"]).abs().max())
    print(f"scale_rewards={scale}: max|ΔA|={diff:.2e}")
    assert diff <= TOL
    assert ours["lossplug_group_id"].tolist() == sorted(ours["lossplug_group_id"].tolist())


def test_static_entropy_bonus_matches_trl(setup):
    trainer, micro_batches, _ = setup
    with configured(trainer, "dapo", LOSS_TYPES["dapo"]) as args:
        attach(trainer, trl_equivalent(args)[0])
        coef, enabled = trainer.entropy_coef, trainer._entropy_bonus_enabled
        trainer.entropy_coef, trainer._entropy_bonus_enabled = 0.05, True
        try:
            loss_diff, grad_diff, _ = native_and_ours(trainer, micro_batches)
        finally:
            trainer.entropy_coef, trainer._entropy_bonus_enabled = coef, enabled
    assert loss_diff <= TOL
    assert grad_diff <= TOL

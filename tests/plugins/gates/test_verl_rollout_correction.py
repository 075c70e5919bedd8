"""verl 0.9.1's rollout correction (``rollout_corr_helper``) against lossplug's correction gates, float64.

* weights: every ``rollout_is`` level with TIS / IcePop thresholds, with and without ``rollout_is_batch_normalize``
  → ``tis``, ``tis_seq``, ``icepop``, ``icepop_seq`` (exact: 0 or float rounding), and ``compute_is_metrics``;
* rejection: every ``rollout_rs`` option and chains of them with verl's threshold syntax → ``rollout_rs`` (the kept
  masks equal, ``compute_rs_metrics`` and the masked fractions equal);
* ``compute_offpolicy_metrics`` → ``offpolicy_metrics``;
* the loss and its gradient: ``ppo_clip`` + those gates through ``lossplug.policy_loss`` against verl's
  ``compute_policy_loss_vanilla`` fed verl's ``rollout_is_weights`` and rejection-modified ``response_mask``, over a
  step of 2 data-parallel ranks × 2 micro-batches (``global_batch_info``), ≤ 1e-8 relative;
* ``whole_batch_weight`` (the corrections of a whole rollout batch) against verl's
  ``compute_rollout_correction_and_rejection_mask``, and as ``policy_loss(weight=...)`` across micro-batches.

verl's masks are the trainer's integer ``response_mask``; verl's ``masked_mean`` adds ``1e-8`` to the count in
float32, where it vanishes for a count ≥ 1.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import lossplug
from lossplug.plugins.gates import whole_batch_weight

pytest.importorskip("verl")
from verl.trainer.ppo import core_algos
from verl.trainer.ppo import rollout_corr_helper as verl_rc
from verl.workers.config.actor import ActorConfig

DP, MICRO, ROWS, T = 2, 2, 4, 9
N_ROWS = DP * MICRO * ROWS
RTOL = 1e-8
LOSS_SCALE_FACTOR = 16
MODE_REDUCTIONS = {
    "token-mean": {"name": "token"},
    "seq-mean-token-mean": {"name": "response"},
    "seq-mean-token-sum": {"name": "sequence_sum"},
    "seq-mean-token-sum-norm": {"name": "fixed", "budget": LOSS_SCALE_FACTOR},
    "token-sum": {"name": "token_sum"},
}


def rollout_batch(seed: int = 0, *, mismatch: float = 0.3) -> dict[str, torch.Tensor]:
    """A rollout batch with holes in the masks (observation tokens), junk off the actions and engine mismatch."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, T + 1, (N_ROWS,), generator=g)
    mask = torch.arange(T) < length.unsqueeze(-1)
    mask &= (torch.rand(N_ROWS, T, generator=g) > 0.2) | (torch.arange(T) == 0)
    old = -(torch.rand(N_ROWS, T, generator=g, dtype=torch.float64) * 3 + 0.05)
    behavior = (old - mismatch * torch.randn(N_ROWS, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    logp = (old + 0.3 * torch.randn(N_ROWS, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    advantage = torch.randn(N_ROWS, T, generator=g, dtype=torch.float64)
    junk = torch.full_like(old, 7.0)
    return dict(
        logp=torch.where(mask, logp, junk),
        old_logp=torch.where(mask, old, junk),
        behavior_logp=torch.where(mask, behavior, -junk),
        advantage=advantage,
        action_mask=mask,
    )


def gate_output(f: dict[str, torch.Tensor], spec: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The gate's weight as a [B, T] tensor (0 off the actions) and its metrics and details, evaluated."""
    plugin = lossplug.registry().plugins["gate"][spec["name"]]
    params = plugin.params(**{k: v for k, v in spec.items() if k != "name"})
    out = plugin(lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f)), params)
    weight = out.weight if out.weight.ndim == 2 else out.weight.unsqueeze(-1).expand(f["action_mask"].shape)
    values = {k: float(lossplug.plugin.evaluate(v)) for k, v in {**out.metrics, **out.details}.items()}
    return torch.where(f["action_mask"], weight, 0), values


def assert_metrics_equal(verl_metrics: dict[str, float], ours: dict[str, float], strip: str = "") -> None:
    for key, value in verl_metrics.items():
        name = key.removeprefix(strip)
        assert name in ours, f"{key} has no lossplug counterpart ({name})"
        assert ours[name] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def log_ratio(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["old_logp"] - f["behavior_logp"]


# -- weights ----------------------------------------------------------------------------------------------------------

IS_CASES = [
    # verl rollout_is_threshold → our gate parameters
    (2.0, {"cap": 2.0}),
    (1.1, {"cap": 1.1}),
    ("1.5", {"cap": 1.5}),
    (0.8, {"cap": 0.8}),
    ("0.5_2.0", {"low": 0.5, "high": 2.0}),
    ("0.8_1.25", {"low": 0.8, "high": 1.25}),
]


@pytest.mark.parametrize("batch_normalize", [False, True], ids=["raw", "batch_normalize"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold, params", IS_CASES, ids=[str(c[0]) for c in IS_CASES])
def test_is_weights_and_metrics_equal_verls(level, threshold, params, batch_normalize):
    f = rollout_batch(1, mismatch=0.3 if level == "token" else 0.2)
    name = ("tis" if "cap" in params else "icepop") + ("_seq" if level == "sequence" else "")
    weights, metrics = verl_rc.compute_rollout_correction_weights(
        log_ratio(f), f["action_mask"].long(), level, threshold, batch_normalize
    )
    ours, values = gate_output(f, {"name": name, **params, "batch_normalize": batch_normalize})
    torch.testing.assert_close(ours, weights, rtol=1e-14, atol=0)
    assert_metrics_equal(metrics, values)
    assert 0 < metrics["rollout_is_ratio_fraction_high"] + metrics["rollout_is_ratio_fraction_low"], "no weight cut"


# -- rejection ----------------------------------------------------------------------------------------------------------

RS_CASES = [
    ("token_k1", "0.7_1.4"),
    ("token_k1", 1.3),  # one value u: bounds 1/u and u
    ("token_k2", 0.05),
    ("token_k3", "0.04"),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", 0.3),
    ("seq_sum_k3", 0.25),
    ("seq_mean_k1", 1.05),
    ("seq_mean_k2", 0.04),
    ("seq_mean_k3", 0.04),
    ("seq_max_k2", 0.2),
    ("seq_max_k3", 0.15),
    ("token_k1,seq_mean_k3", "0.7_1.4,0.05"),  # one threshold per option
    ("seq_max_k2, seq_sum_k3 ,token_k3", 0.2),  # one shared threshold, spaces
    ("seq_mean_k1,token_k2,seq_mean_k1", "0.9_1.1,0.08"),  # a duplicate is dropped (as verl does)
]


@pytest.mark.parametrize("options, threshold", RS_CASES, ids=[f"{o}@{t}" for o, t in RS_CASES])
def test_rejection_mask_and_metrics_equal_verls(options, threshold):
    f = rollout_batch(2)
    mask = f["action_mask"]
    kept, metrics = verl_rc.compute_rollout_rejection_mask(log_ratio(f), mask.long(), options, threshold)
    weight, values = gate_output(f, {"name": "rollout_rs", "options": options, "threshold": threshold})
    assert torch.equal(weight > 0, kept.bool())
    assert ((weight == 0) | (weight == 1)).all()
    assert 0 < metrics["rollout_rs_masked_fraction"] < 1, "the batch must exercise the rejection"
    assert_metrics_equal(metrics, values, strip="rollout_rs_")


@pytest.mark.parametrize(
    "options, threshold",
    [
        ("token_k4", 1.0),
        ("", 1.0),
        ("token_k1", "2.0_0.5"),
        ("token_k1", "-1"),
        ("seq_max_k2", "0.1_0.2"),
        ("token_k2,token_k3", "0.1,0.2,0.3"),
        ("token_k2", "abc"),
    ],
)
def test_thresholds_verl_refuses_are_refused(options, threshold):
    f = rollout_batch(3)
    with pytest.raises((ValueError, TypeError)):
        verl_rc.compute_rollout_rejection_mask(log_ratio(f), f["action_mask"].long(), options, threshold)
    with pytest.raises(lossplug.RecipeError, match="rollout_rs"):
        lossplug.Recipe.load(
            {"gates": ["ppo_clip", {"name": "rollout_rs", "options": options, "threshold": threshold}]}
        )


def test_offpolicy_metrics_equal_verls_and_change_nothing():
    f = rollout_batch(4)
    metrics = verl_rc.compute_offpolicy_metrics(f["old_logp"], f["behavior_logp"], f["action_mask"].long())
    weight, values = gate_output(f, {"name": "offpolicy_metrics"})
    assert_metrics_equal(metrics, values)
    assert torch.equal(weight, f["action_mask"].double())
    losses = []
    for gates in (["ppo_clip"], ["ppo_clip", "offpolicy_metrics"]):
        logp = f["logp"].clone().requires_grad_()
        result = lossplug.policy_loss(
            lossplug.PolicyBatch(**{**f, "logp": logp}), {"gates": gates, "reduction": "token"}
        )
        result.loss.backward()
        losses.append((result.loss.detach(), logp.grad))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


def test_whole_batch_weight_equals_verls_driver():
    """verl's unified driver call (IS + chained rejection + off-policy metrics) ↔ whole_batch_weight."""
    f = rollout_batch(5, mismatch=0.1)
    mask = f["action_mask"]
    proto, kept, metrics = verl_rc.compute_rollout_correction_and_rejection_mask(
        f["old_logp"],
        f["behavior_logp"],
        mask.long(),
        rollout_is="sequence",
        rollout_is_threshold=1.5,
        rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k3,token_k1",
        rollout_rs_threshold="0.004,0.8_1.25",
    )
    gates = [
        {"name": "tis_seq", "cap": 1.5, "batch_normalize": True},
        {"name": "rollout_rs", "options": "seq_mean_k3,token_k1", "threshold": "0.004,0.8_1.25"},
        "offpolicy_metrics",
    ]
    corrected = whole_batch_weight(lossplug.PolicyBatch(**f), gates)
    assert torch.equal(corrected.kept_mask, kept.bool())
    verl_weight = proto.batch["rollout_is_weights"] * kept
    torch.testing.assert_close(corrected.weight, verl_weight, rtol=1e-14, atol=0)
    ours = {}
    for key, value in corrected.metrics.items():
        gate, name = key.split("/", 1)
        ours[name if gate != "rollout_rs" else f"rollout_rs_{name}"] = float(value)
    assert_metrics_equal(metrics, ours, strip="rollout_corr/")


# -- loss and gradient ----------------------------------------------------------------------------------------------------


def actor_config(tokens: int, mode: str) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp", rollout_n=ROWS, ppo_micro_batch_size_per_gpu=ROWS, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    config.global_batch_info.update(
        dp_size=DP, batch_num_tokens=tokens, global_batch_size=N_ROWS, loss_scale_factor=LOSS_SCALE_FACTOR
    )
    return config


def micro_batches(f: dict[str, torch.Tensor]) -> list[slice]:
    return [slice(i, i + ROWS) for i in range(0, N_ROWS, ROWS)]


def verl_step(f, mode, is_weights, kept_mask):
    """verl's actor: each micro-batch's vanilla loss with the driver's weights and rejection-modified mask."""
    config = actor_config(int(kept_mask.sum()), mode)
    losses, grads = [], []
    for rows in micro_batches(f):
        log_prob = f["logp"][rows].clone().requires_grad_()
        loss, _ = core_algos.compute_policy_loss_vanilla(
            old_log_prob=f["old_logp"][rows],
            log_prob=log_prob,
            advantages=f["advantage"][rows],
            response_mask=kept_mask[rows].long(),
            loss_agg_mode=mode,
            config=config,
            rollout_is_weights=None if is_weights is None else is_weights[rows],
        )
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.where(f["action_mask"][rows], log_prob.grad, 0))
    return torch.stack(losses), torch.cat(grads)


def lossplug_step(f, recipe, normalizer, weight=None, action_mask=None):
    """Each micro-batch's lossplug loss × dp_size (what the verl adapter returns), and the gradients. With
    ``action_mask`` the batch carries that mask (verl's rejection-modified ``response_mask``) and rows left without an
    action token are dropped, as the verl adapter drops them."""
    losses, grads = [], []
    for rows in micro_batches(f):
        part = {k: v[rows] for k, v in f.items()}
        grad = torch.zeros_like(part["logp"])
        keep = torch.ones(ROWS, dtype=torch.bool)
        if action_mask is not None:
            part["action_mask"] = action_mask[rows]
            keep = part["action_mask"].any(-1)
            part = {k: v[keep] for k, v in part.items()}
        logp = part["logp"].clone().requires_grad_()
        batch = lossplug.PolicyBatch(**{**part, "logp": logp})
        w = None if weight is None else weight[rows][keep]
        result = lossplug.policy_loss(batch, recipe, normalizer, weight=w)
        (result.loss * DP).backward()
        losses.append(result.loss.detach() * DP)
        grad[keep] = logp.grad
        grads.append(grad)
    return torch.stack(losses), torch.cat(grads)


def assert_step_equal(ours, theirs):
    (p_loss, p_grad), (v_loss, v_grad) = ours, theirs
    torch.testing.assert_close(p_loss, v_loss, rtol=RTOL, atol=1e-15)
    torch.testing.assert_close(p_loss.sum(), v_loss.sum(), rtol=RTOL, atol=1e-15)
    torch.testing.assert_close(p_grad, v_grad, rtol=RTOL, atol=1e-15)
    assert v_grad.abs().sum() > 0


PPO = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}


@pytest.mark.parametrize("mode", list(MODE_REDUCTIONS))
@pytest.mark.parametrize(
    "level, threshold, gate",
    [
        ("token", 2.0, {"name": "tis", "cap": 2.0}),
        ("sequence", 1.5, {"name": "tis_seq", "cap": 1.5}),
        ("token", "0.8_1.25", {"name": "icepop", "low": 0.8, "high": 1.25}),
        ("sequence", "0.5_2.0", {"name": "icepop_seq", "low": 0.5, "high": 2.0}),
    ],
    ids=["tis", "tis_seq", "icepop", "icepop_seq"],
)
def test_is_gates_give_verls_loss_and_gradient(level, threshold, gate, mode):
    f = rollout_batch(6, mismatch=0.3 if level == "token" else 0.2)
    mask = f["action_mask"]
    weights, _ = verl_rc.compute_rollout_correction_weights(log_ratio(f), mask.long(), level, threshold)
    tokens = int(mask.sum())
    recipe = {"gates": [PPO, gate], "reduction": MODE_REDUCTIONS[mode]}
    normalizer = lossplug.Normalizer(action_tokens=tokens, sequences=N_ROWS)
    assert_step_equal(lossplug_step(f, recipe, normalizer), verl_step(f, mode, weights, mask))


#: rejection criteria and the loss_agg_modes where a 0/1 weight gives verl's denominators with lossplug's own
#: population (every action token, every response): the whole-response criteria everywhere but token-mean, the
#: token criteria under the sums
RS_LOSS_CASES = [
    *(
        (options, threshold, mode)
        for (options, threshold), mode in itertools.product(
            [("seq_mean_k3", 0.04), ("seq_sum_k1", "0.5_2.0"), ("seq_max_k2", 0.2)],
            ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"],
        )
    ),
    *(
        (options, threshold, mode)
        for (options, threshold), mode in itertools.product(
            [("token_k1", "0.7_1.4"), ("token_k3,seq_mean_k2", "0.04,0.05")],
            ["seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"],
        )
    ),
]


@pytest.mark.parametrize("options, threshold, mode", RS_LOSS_CASES, ids=[f"{o}-{m}" for o, _, m in RS_LOSS_CASES])
def test_rejection_gate_gives_verls_loss_and_gradient(options, threshold, mode):
    f = rollout_batch(7)
    mask = f["action_mask"]
    kept, _ = verl_rc.compute_rollout_rejection_mask(log_ratio(f), mask.long(), options, threshold)
    assert 0 < kept.sum() < mask.sum()
    is_weights, _ = verl_rc.compute_rollout_correction_weights(log_ratio(f), mask.long(), "token", 2.0)
    gates = [PPO, {"name": "tis", "cap": 2.0}, {"name": "rollout_rs", "options": options, "threshold": threshold}]
    recipe = {"gates": gates, "reduction": MODE_REDUCTIONS[mode]}
    normalizer = lossplug.Normalizer(action_tokens=int(mask.sum()), sequences=N_ROWS)
    assert_step_equal(lossplug_step(f, recipe, normalizer), verl_step(f, mode, is_weights, kept.bool()))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("options, threshold", [("token_k1", "0.7_1.4"), ("seq_mean_k3,token_k2", "0.04,0.05")])
def test_rejection_applied_to_the_batch_where_a_weight_cannot_be_exact(options, threshold, mode):
    """token-mean (verl's batch_num_tokens counts the survivors) and token criteria under seq-mean-token-mean (each
    response's own count shrinks): the rejection is applied to the batch, as verl's driver applies it to
    response_mask — whole_batch_weight's kept_mask becomes the action mask, and the Normalizer counts it."""
    f = rollout_batch(8)
    mask = f["action_mask"]
    kept, _ = verl_rc.compute_rollout_rejection_mask(log_ratio(f), mask.long(), options, threshold)
    gate = {"name": "rollout_rs", "options": options, "threshold": threshold}
    corrected = whole_batch_weight(lossplug.PolicyBatch(**f), [gate], metrics=False)
    assert torch.equal(corrected.kept_mask, kept.bool())
    normalizer = lossplug.Normalizer(action_tokens=int(corrected.kept_mask.sum()), sequences=N_ROWS)
    recipe = {"gates": [PPO], "reduction": MODE_REDUCTIONS[mode]}
    ours = lossplug_step(f, recipe, normalizer, action_mask=corrected.kept_mask)
    assert_step_equal(ours, verl_step(f, mode, None, kept.bool()))


@pytest.mark.parametrize("mode", list(MODE_REDUCTIONS))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalized_weights_of_the_whole_batch_across_micro_batches(level, mode):
    """verl normalises over the whole rollout batch in the driver: whole_batch_weight does the same, and each
    micro-batch of each rank gets its rows through policy_loss(weight=...)."""
    f = rollout_batch(9, mismatch=0.3 if level == "token" else 0.2)
    mask = f["action_mask"]
    options, rs_threshold = "seq_max_k3", 0.1
    weights, kept, _ = verl_rc.compute_rollout_correction_and_rejection_mask(
        f["old_logp"],
        f["behavior_logp"],
        mask.long(),
        rollout_is=level,
        rollout_is_threshold=1.5,
        rollout_is_batch_normalize=True,
        rollout_rs=options,
        rollout_rs_threshold=rs_threshold,
    )
    gates = [
        {"name": "tis" if level == "token" else "tis_seq", "cap": 1.5, "batch_normalize": True},
        {"name": "rollout_rs", "options": options, "threshold": rs_threshold},
    ]
    corrected = whole_batch_weight(lossplug.PolicyBatch(**f), gates, metrics=False)
    normalizer = lossplug.Normalizer(action_tokens=int(corrected.kept_mask.sum()), sequences=N_ROWS)
    recipe = {"gates": [PPO], "reduction": MODE_REDUCTIONS[mode]}
    ours = lossplug_step(f, recipe, normalizer, weight=corrected.weight, action_mask=corrected.kept_mask)
    assert_step_equal(ours, verl_step(f, mode, weights.batch["rollout_is_weights"], kept.bool()))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_gate_is_exact_on_the_whole_batch(level):
    """One loss call on the whole rollout batch (dp 1, one micro-batch): the gate's own normalisation is verl's."""
    f = rollout_batch(10, mismatch=0.3 if level == "token" else 0.2)
    mask = f["action_mask"]
    weights, _ = verl_rc.compute_rollout_correction_weights(log_ratio(f), mask.long(), level, "0.5_2.0", True)
    gate = {"name": "icepop" if level == "token" else "icepop_seq", "low": 0.5, "high": 2.0, "batch_normalize": True}
    logp = f["logp"].clone().requires_grad_()
    recipe = {"gates": [PPO, gate], "reduction": "token"}
    result = lossplug.policy_loss(lossplug.PolicyBatch(**{**f, "logp": logp}), recipe)
    result.loss.backward()
    config = actor_config(int(mask.sum()), "token-mean")
    config.global_batch_info.update(dp_size=1)
    log_prob = f["logp"].clone().requires_grad_()
    loss, _ = core_algos.compute_policy_loss_vanilla(
        f["old_logp"], log_prob, f["advantage"], mask.long(), "token-mean", config, weights
    )
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach(), rtol=RTOL, atol=1e-15)
    torch.testing.assert_close(logp.grad, torch.where(mask, log_prob.grad, 0), rtol=RTOL, atol=1e-15)

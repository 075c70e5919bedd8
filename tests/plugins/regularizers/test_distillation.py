"""The ``distillation`` regularizer against the origins' own code, float64, loss and gradient (≤ 1e-8 relative):

* verl 0.9.1's ``distillation_ppo_loss`` itself (``verl/trainer/distillation/losses.py``: the task policy loss via
  ``ppo_loss``, ``distillation_loss``, ``compute_distillation_loss_reverse_kl_estimator``, ``kl_penalty``,
  ``compute_policy_loss_vanilla``, ``agg_loss``) for every estimator, both modes (``use_policy_gradient``), with and
  without ``loss_max_clamp`` (one that bites) and task rewards, three ``loss_agg_mode`` s, on ordinary log-probs and
  on extreme ones (verl's ±20 log-ratio clamps and k3's ±10 clamp bite), and at dp 2 with verl's global counts.
  Stubbed: ``no_padding_2_padding`` (the tensors are already padded ``[B, T]``), the micro-batch ``TensorDict``'s
  ``select`` / ``to_padded_tensor`` (a dict that is already padded) and the actor config (the attributes read);
  the distillation config is verl's own ``DistillationLossConfig``;
* AReaL 1.0.4's pure KD (``grpo_loss_fn`` with ``rl_loss_weight == 0``, executed from its wheel with its logging and
  PPO loss stubbed — the pure-KD branch replaces the PPO loss);
* k1 back-propagated is refused as verl refuses it; bad input names field, rule and position.
"""

from __future__ import annotations

import ast
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import BatchValidationError, PolicyBatch, Recipe
from lossplug.contracts import LossplugError
from lossplug.needs import recipe_needs
from lossplug.plugins.regularizers.distillation import estimate

ESTIMATORS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
#: lossplug reduction → verl loss_agg_mode (seq-mean-token-mean adds 1e-8 to its denominators: not compared here)
VERL_AGG = {"token": "token-mean", "token_sum": "token-sum", "sequence_sum": "seq-mean-token-sum"}
#: the task policy loss's clip (verl's actor clip_ratio_low / high) — apart from the distillation's own 0.2 / 0.2
TASK_EPS = (0.2, 0.28)
RTOL = 1e-8


def tensors(seed=0, B=5, T=7):
    """Student, teacher and old log-probs far enough apart that the ratio clip, the dual clip and k3's spread act."""
    g = torch.Generator().manual_seed(seed)
    logp = -(0.05 + 3.0 * torch.rand(B, T, generator=g, dtype=torch.float64))
    teacher = (logp + 1.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    old = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, teacher, old, mask, adv


def extreme():
    """Teacher − student gaps of ±25 (k3's ±20 log-ratio clamp and ±10 estimate clamp) and update log-ratios of
    ±25 (the ratio's ±20 clamp)."""
    logp, teacher, old, mask, adv = tensors(1)
    logp[0, :4] = torch.tensor([-25.5, -0.5, -15.2, -0.3], dtype=torch.float64)
    teacher[0, :4] = torch.tensor([-0.5, -25.5, -0.2, -0.4], dtype=torch.float64)
    old[1, :3] = logp[1, :3] - torch.tensor([25.0, -25.0, 0.0], dtype=torch.float64).clamp(max=0) - 1e-3
    old[1, 1] = -0.01
    logp[1, 1] = -26.0
    mask[:2, :4] = True
    return logp, teacher, old, mask, adv


BATCHES = {"ordinary": tensors, "extreme": extreme}


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-12)


# --- verl's own distillation_ppo_loss --------------------------------------------------------------------------------


class PaddedData(dict):
    """verl's micro-batch ``TensorDict`` when its tensors are already padded ``[B, T]``: what ``ppo_loss`` and
    ``distillation_loss`` read (``[key]``, ``.get``, ``.select(...).to_padded_tensor()``)."""

    def select(self, *keys: str) -> PaddedData:
        return PaddedData({k: self[k] for k in keys})

    def to_padded_tensor(self) -> PaddedData:
        return self


class ActorStub(SimpleNamespace):
    """The ``ActorConfig`` attributes ``ppo_loss``, ``compute_policy_loss_vanilla`` and ``distillation_loss`` read."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@pytest.fixture
def verl_distill(monkeypatch):
    losses = pytest.importorskip("verl.trainer.distillation.losses")
    worker_losses = pytest.importorskip("verl.workers.utils.losses")
    # the tensors are padded [B, T] already: verl's unpadding of the model's flat output is the identity here
    identity = lambda tensor, data: tensor
    monkeypatch.setattr(losses, "no_padding_2_padding", identity)
    monkeypatch.setattr(worker_losses, "no_padding_2_padding", identity)
    return losses


def verl_loss(losses, logp, teacher, old, mask, adv, *, agg, estimator, pg, clamp, task, coef, dp=1, counts=None):
    """verl's ``distillation_ppo_loss`` on one micro-batch: (loss, gradient wrt logp)."""
    from verl.workers.config import DistillationLossConfig

    leaf = logp.clone().requires_grad_()
    loss_config = DistillationLossConfig(
        loss_mode=estimator,
        use_policy_gradient=pg,
        loss_max_clamp=clamp,
        use_task_rewards=task,
        distillation_loss_coef=coef,
    )
    actor = ActorStub(
        loss_agg_mode=agg,
        global_batch_info={},
        loss_scale_factor=None,
        policy_loss={"loss_mode": "vanilla"},
        clip_ratio=0.2,
        clip_ratio_low=TASK_EPS[0],
        clip_ratio_high=TASK_EPS[1],
        use_kl_loss=False,
    )
    tokens, sequences = counts if counts is not None else (None, None)
    data = PaddedData(
        response_mask=mask,
        old_log_probs=old,
        advantages=adv,
        teacher_logprobs=teacher.unsqueeze(-1),
        dp_size=dp,
        batch_num_tokens=tokens,
        global_batch_size=sequences,
    )
    loss, _ = losses.distillation_ppo_loss(
        actor, SimpleNamespace(distillation_loss=loss_config), {"log_probs": leaf}, data
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def lossplug_loss(logp, teacher, old, mask, adv, *, reduction, estimator, pg, clamp, task, coef, normalizer=None):
    """The same through ``lossplug.policy_loss``: PPO's clip for the task (advantage 0 without task rewards: the
    update gate then adds 0 and no gradient, as verl drops the task loss) and the distillation regularizer."""
    reg = {
        "name": "distillation",
        "estimator": estimator,
        "mode": "policy_gradient" if pg else "supervised",
        "loss_max_clamp": clamp,
        "coef": coef if task else 1.0,  # verl's coefficient is 1 without task rewards
    }
    recipe = Recipe.load(
        {
            "gates": [{"name": "ppo_clip", "eps_low": TASK_EPS[0], "eps_high": TASK_EPS[1], "dual_clip_c": 3.0}],
            "reduction": reduction,
            "regularizers": [reg],
        }
    )
    leaf = logp.clone().requires_grad_()
    batch = PolicyBatch(
        logp=leaf,
        old_logp=old,
        teacher_logp=teacher,
        advantage=adv if task else torch.zeros_like(adv),
        action_mask=mask,
    )
    result = lossplug.policy_loss(batch, recipe, normalizer)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result.loss.detach(), grad, result


def verl_cases(estimator, pg):
    """Every loss_max_clamp (none, verl's 10, 0.3 — which bites on most tokens) × task rewards × loss_agg_mode."""
    for clamp in (None, 10.0, 0.3):
        for task in (True, False):
            for reduction in VERL_AGG:
                yield clamp, task, reduction


MODES = [(e, pg) for e in ESTIMATORS for pg in (True, False) if pg or e not in ("k1", "kl")]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("estimator", "pg"), MODES, ids=[f"{e}-{'pg' if pg else 'supervised'}" for e, pg in MODES])
def test_loss_and_gradient_are_verls_distillation_ppo_loss(verl_distill, estimator, pg, batch):
    logp, teacher, old, mask, adv = BATCHES[batch]()
    coef = 0.37
    for clamp, task, reduction in verl_cases(estimator, pg):
        kw = dict(estimator=estimator, pg=pg, clamp=clamp, task=task, coef=coef)
        expected, expected_grad = verl_loss(verl_distill, logp, teacher, old, mask, adv, agg=VERL_AGG[reduction], **kw)
        loss, grad, _ = lossplug_loss(logp, teacher, old, mask, adv, reduction=reduction, **kw)
        assert_close(loss, expected)
        assert_close(grad, expected_grad)
        assert bool(grad.abs().sum() > 0)  # the comparison is not between two zero gradients


@pytest.mark.parametrize(("estimator", "pg"), [("k3", False), ("k1", True), ("k2", True)])
def test_dp2_with_global_counts_is_verls(verl_distill, estimator, pg):
    """Two ranks, verl's global ``batch_num_tokens`` / ``global_batch_size`` and its loss × dp_size: lossplug's share
    under a Normalizer of the step is verl's rank loss / dp_size, loss and gradient."""
    logp, teacher, old, mask, adv = tensors(3, B=6)
    tokens, sequences = int(mask.sum()), 6
    norm = lossplug.Normalizer(action_tokens=tokens, sequences=sequences)
    for reduction in ("token", "sequence_sum"):
        for rows in (slice(0, 2), slice(2, 6)):
            part = [t[rows] for t in (logp, teacher, old, mask, adv)]
            kw = dict(estimator=estimator, pg=pg, clamp=10.0, task=True, coef=0.5)
            expected, expected_grad = verl_loss(
                verl_distill, *part, agg=VERL_AGG[reduction], dp=2, counts=(tokens, sequences), **kw
            )
            loss, grad, _ = lossplug_loss(*part, reduction=reduction, normalizer=norm, **kw)
            assert_close(loss, expected / 2)
            assert_close(grad, expected_grad / 2)


def test_verl_defaults_are_the_plugins():
    from verl.workers.config import DistillationLossConfig

    verl = DistillationLossConfig()
    ours = lossplug.registry().plugins["regularizer"]["distillation"].params()
    assert (ours.estimator, ours.mode == "policy_gradient", ours.loss_max_clamp, ours.coef) == (
        verl.loss_mode,
        verl.use_policy_gradient,
        verl.loss_max_clamp,
        verl.distillation_loss_coef,
    )
    assert (ours.clip_ratio_low, ours.clip_ratio_high) == (verl.clip_ratio_low, verl.clip_ratio_high)
    assert ours.clip_ratio_c == ActorStub().get("clip_ratio_c", 3.0) == 3.0  # verl's default when unconfigured


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimate_is_verls_kl_penalty(estimator):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, teacher, *_ = extreme()
    assert_close(estimate(logp, teacher, estimator), core_algos.kl_penalty(logp, teacher, estimator))


# --- k1 back-propagated, as verl refuses it --------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "kl"])
def test_backpropagated_k1_is_refused_as_verl_refuses_it(estimator):
    from verl.workers.config import DistillationLossConfig

    if estimator == "k1":
        with pytest.raises(ValueError, match="does not depend on teacher"):
            DistillationLossConfig(loss_mode=estimator, use_policy_gradient=False)
    else:  # verl checks the name "k1" only: its alias "kl" passes, with the same teacher-blind gradient
        DistillationLossConfig(loss_mode=estimator, use_policy_gradient=False)
        logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
        for teacher in (
            torch.tensor([-0.5, -3.0], dtype=torch.float64),
            torch.tensor([-9.0, -0.1], dtype=torch.float64),
        ):
            (grad,) = torch.autograd.grad(estimate(logp, teacher, estimator).sum(), logp)
            assert grad.tolist() == [1.0, 1.0]
    with pytest.raises(LossplugError, match=r"distillation.*cannot be back-propagated.*does not depend on the teacher"):
        Recipe.load(
            {
                "gates": ["ppo_clip"],
                "reduction": "token",
                "regularizers": [{"name": "distillation", "estimator": estimator, "mode": "supervised"}],
            }
        )


def test_one_sided_clip_is_refused():
    with pytest.raises(LossplugError, match="clip_ratio_low and clip_ratio_high"):
        Recipe.load(
            {
                "gates": ["ppo_clip"],
                "reduction": "token",
                "regularizers": [{"name": "distillation", "clip_ratio_low": None}],
            }
        )


# --- AReaL 1.0.4's pure KD -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def areal_grpo_loss_fn(origins):
    """AReaL's ``grpo_loss_fn`` from its wheel; its PPO loss (replaced by the pure-KD branch), logging and
    proximal-log-prob helpers stubbed."""
    path = origins.package("areal") / "trainer" / "ppo" / "actor.py"
    tree = ast.parse(path.read_text(), str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grpo_loss_fn"]
    assert len(nodes) == 1, "AReaL's actor.py no longer defines grpo_loss_fn"
    source = ast.get_source_segment(path.read_text(), nodes[0])
    assert "if rl_loss_weight == 0:" in source and "importance_weight = torch.exp(logprobs - old_logp)" in source

    def ppo_stub(logprobs, old_logprobs, advantages, loss_mask, **_):
        zeros = torch.zeros_like(logprobs)
        flags = torch.zeros_like(loss_mask)
        stat = dict(clip_mask=flags, dual_clip_mask=flags, importance_weight=zeros, approx_kl=zeros, loss=zeros)
        return torch.zeros((), dtype=logprobs.dtype), stat

    noop = lambda *a, **k: None
    namespace = dict(
        torch=torch,
        PROX_LOGP_METHOD_RECOMPUTE="recompute",
        RejectionSamplingConfig=object,
        ppo_actor_loss_fn=ppo_stub,
        _resolve_proximal_logp=lambda prox_logp_gt, old_logp, **_: old_logp,
        stats_tracker=SimpleNamespace(denominator=noop, stat=noop, scalar=noop),
        infer_token_denominator=noop,
        _log_proximal_approximation_stats=noop,
        _log_version_staleness_stats=noop,
    )
    module = types.ModuleType("areal_pure_kd_oracle")
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module.grpo_loss_fn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pure_kd_is_areals(areal_grpo_loss_fn, seed):
    logp, teacher, old, mask, _ = tensors(seed)
    weight = 0.005
    leaf = logp.clone().requires_grad_()
    input_data = dict(
        logprobs=old,
        advantages=torch.zeros_like(logp),
        loss_mask=mask,
        teacher_logp=teacher,
        rl_loss_weight=0.0,
        distill_loss_weight=weight,
    )
    expected = areal_grpo_loss_fn(
        leaf, torch.zeros_like(logp), input_data, eps_clip=0.2, eps_clip_higher=None, c_clip=None
    )
    (expected_grad,) = torch.autograd.grad(expected, leaf)

    reg = dict(
        name="distillation",
        estimator="k1",
        mode="policy_gradient",
        loss_max_clamp=None,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=None,
        coef=weight,
    )
    recipe = Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": [reg]})
    leaf2 = logp.clone().requires_grad_()
    batch = PolicyBatch(
        logp=leaf2, old_logp=old, teacher_logp=teacher, advantage=torch.zeros(5, dtype=logp.dtype), action_mask=mask
    )
    loss = lossplug.policy_loss(batch, recipe).loss
    (grad,) = torch.autograd.grad(loss, leaf2)
    assert_close(loss.detach(), expected.detach())
    assert_close(grad, expected_grad)
    assert bool(grad.abs().sum() > 0)


# --- what it reads, and bad input ------------------------------------------------------------------------------------


def _recipe(**params):
    return Recipe.load(
        {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [{"name": "distillation", **params}]}
    )


def test_it_declares_what_it_reads():
    pg = recipe_needs(_recipe(mode="policy_gradient"))
    sup = recipe_needs(_recipe(mode="supervised", estimator="k3"))
    assert "teacher_logp" in str(pg) and "old_logp" in str(pg)
    assert "teacher_logp" in str(sup)


def _batch(**override):
    logp, teacher, old, mask, adv = tensors(4)
    fields = dict(logp=logp, old_logp=old, teacher_logp=teacher, advantage=adv, action_mask=mask)
    fields.update(override)
    return PolicyBatch(**{k: v for k, v in fields.items() if v is not None})


def test_missing_teacher_is_named():
    with pytest.raises(
        BatchValidationError, match=r"teacher_logp: required by recipe.regularizers\[0\] \(distillation\)"
    ):
        lossplug.policy_loss(_batch(teacher_logp=None), _recipe())


def test_non_finite_teacher_on_an_action_is_named_where_padding_is_not():
    logp, teacher, old, mask, adv = tensors(4)
    padded = teacher.clone()
    padded[~mask] = float("nan")  # off the actions: never read, no NaN reaches the gradient
    leaf = logp.clone().requires_grad_()
    batch = PolicyBatch(logp=leaf, old_logp=old, teacher_logp=padded, advantage=adv, action_mask=mask)
    for mode, estimator in (("policy_gradient", "k3"), ("supervised", "k3"), ("supervised", "k2")):
        loss = lossplug.policy_loss(batch, _recipe(mode=mode, estimator=estimator)).loss
        (grad,) = torch.autograd.grad(loss, leaf)
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())
    bad = teacher.clone()
    bad[2, 0] = float("inf")  # position 0 is always an action
    with pytest.raises(BatchValidationError, match=r"teacher_logp.*\[2, 0\]|teacher_logp.*row 2"):
        lossplug.policy_loss(_batch(teacher_logp=bad), _recipe())


def test_wrong_shape_is_named():
    logp, teacher, *_ = tensors(4)
    with pytest.raises(BatchValidationError, match="teacher_logp"):
        lossplug.policy_loss(_batch(teacher_logp=teacher[:, :-1]), _recipe())


def test_gradient_reaches_logp_only():
    logp, teacher, old, mask, adv = tensors(5)
    teacher = teacher.clone().requires_grad_()
    old = old.clone().requires_grad_()
    for mode in ("policy_gradient", "supervised"):
        leaf = logp.clone().requires_grad_()
        batch = PolicyBatch(logp=leaf, old_logp=old, teacher_logp=teacher, advantage=adv, action_mask=mask)
        loss = lossplug.policy_loss(batch, _recipe(mode=mode)).loss
        grads = torch.autograd.grad(loss, (leaf, teacher, old), allow_unused=True)
        assert grads[0] is not None and all(g is None or not bool(g.any()) for g in grads[1:])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-30, -1e-3), min_size=4, max_size=4),
    st.lists(st.floats(-30, -1e-3), min_size=4, max_size=4),
    st.sampled_from(ESTIMATORS),
    st.sampled_from([None, 10.0, 0.5]),
)
def test_on_policy_gradient_is_the_clamped_divergence_times_grad_logp(student, teacher, estimator, clamp):
    """On policy (old_logp = logp: ratio 1, no clip acts) the policy-gradient term's gradient is
    ``clamp(d(logp, teacher)) · ∇logp`` per token — the Thinking Machines update, whatever the estimator — and its
    value is ``−A · 1 = clamp(d)``; with the teacher equal to the student every estimator gives 0 and no gradient."""
    logp = torch.tensor([student], dtype=torch.float64)
    teacher_t = torch.tensor([teacher], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    reg = {"name": "distillation", "estimator": estimator, "loss_max_clamp": clamp}
    recipe = Recipe.load({"gates": ["ppo_clip"], "reduction": "token_sum", "regularizers": [reg]})
    for target in (teacher_t, logp):
        leaf = logp.clone().requires_grad_()
        batch = PolicyBatch(
            logp=leaf, old_logp=logp, teacher_logp=target, advantage=torch.zeros(1, dtype=logp.dtype), action_mask=mask
        )
        loss = lossplug.policy_loss(batch, recipe).loss
        (grad,) = torch.autograd.grad(loss, leaf)
        d = estimate(logp, target, estimator)
        d = d if clamp is None else d.clamp(-clamp, clamp)
        assert_close(loss.detach(), d.sum())
        assert_close(grad, d)
    assert not bool(grad.any()) and float(loss.detach()) == 0.0  # teacher = student

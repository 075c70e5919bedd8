"""The ``echo`` regularizer, float64, loss AND gradient, against prime-rl (commit 559b4477) transcribed here — prime-rl
is not on a package index and its loss module needs its own configs, jaxtyping and ``torch.compile``, so its code does
not run here:

* the orchestrator's selection (``EchoAlgorithm._weight_observations``): the tokens of every non-sampled chat node of
  an enabled role that follows the branch's first sampled node get that role's α;
* the trainer's loss (``compute_loss`` with ``default_loss_fn`` and ``ce_loss_fn``): ``Σ rl / rl_scale + Σ α·(−logp)
  / ce_scale`` over packed samples, each scale the step's count of its component's tokens.

And the contract's refusals (an observation token that is an action, a wrong shape, a non-finite logp there), the
refused step population, and poison off the trained tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import PolicyBatch, Recipe
from lossplug.contracts.errors import BatchValidationError, LossplugError, RecipeError

F64 = torch.float64
RTOL, ATOL = 1e-12, 1e-14
DPPO = {"name": "dppo_binary_tv", "eps_low": 0.2, "eps_high": 0.2, "adv_tau": 1.0, "kl_tau": 0.001}


# -- prime-rl, transcribed ------------------------------------------------------------------------------------------


def prime_rl_echo_weights(nodes, role_alphas):
    """``_weight_observations`` on one branch: ``nodes`` = [(role, sampled, n_tokens)], ``role_alphas`` the enabled
    roles' α. Returns the ``ce`` weight of every token of the branch (a plain list)."""
    weights, seen_response = [], False
    for role, sampled, span in nodes:
        alpha = role_alphas.get(role) if seen_response and not sampled else None
        weights += [alpha if alpha is not None else 0.0] * span
        if sampled:
            seen_response = True
    return weights


def prime_rl_step_loss(samples, eps=0.2, kl_tau=1e-3):
    """``compute_loss`` summed over the step's micro-batches: ``samples`` = [(trainer, inference, adv, loss_mask,
    ce_weights)] as python floats/bools (one packed sample each). rl = DPPO-Binary-TV + KL on loss_mask; ce = masked
    NLL on ce_weights != 0; each divided by max(its global token count, 1)."""
    rl_scale = max(sum(sum(m) for _, _, _, m, _ in samples), 1)
    ce_scale = max(sum(sum(1 for w in ce if w != 0) for *_, ce in samples), 1)
    rl_total, ce_total = 0.0, 0.0
    for trainer, inference, adv, mask, ce in samples:
        for lp, ilp, a, m, w in zip(trainer, inference, adv, mask, ce):
            if m:
                log_r = lp - ilp
                moved = math.exp(lp) - math.exp(ilp)
                masked = moved > eps if a > 0 else moved < -eps
                pg = 0.0 if masked else a * math.exp(log_r)
                rl_total += -pg + kl_tau * log_r**2
            if w != 0:
                ce_total += w * -lp
    return rl_total / rl_scale + ce_total / ce_scale


def prime_rl_gradient(samples, eps=0.2, kl_tau=1e-3):
    """d(step loss)/d(trainer logp) per token, by hand: rl −keep·A·r + 2·kl_tau·log r over rl_scale, ce −α over
    ce_scale."""
    rl_scale = max(sum(sum(m) for _, _, _, m, _ in samples), 1)
    ce_scale = max(sum(sum(1 for w in ce if w != 0) for *_, ce in samples), 1)
    grads = []
    for trainer, inference, adv, mask, ce in samples:
        row = []
        for lp, ilp, a, m, w in zip(trainer, inference, adv, mask, ce):
            g = 0.0
            if m:
                log_r = lp - ilp
                moved = math.exp(lp) - math.exp(ilp)
                masked = moved > eps if a > 0 else moved < -eps
                g += (0.0 if masked else -a * math.exp(log_r)) / rl_scale + 2 * kl_tau * log_r / rl_scale
            if w != 0:
                g += -w / ce_scale
            row.append(g)
        grads.append(row)
    return grads


# -- lossplug -------------------------------------------------------------------------------------------------------

#: two chat branches: (role, sampled, tokens); the system prompt and the first user turn come before any response
BRANCHES = [
    [("system", False, 2), ("user", False, 3), ("assistant", True, 4), ("tool", False, 3), ("assistant", True, 2)],
    [("user", False, 2), ("assistant", True, 3), ("tool", False, 2), ("user", False, 2), ("assistant", True, 3)],
]


def batch_fields(seed, role_alphas, branches=BRANCHES):
    """Padded rows, one per branch: action_mask = sampled tokens, observation_mask = prime-rl's echo selection."""
    g = torch.Generator().manual_seed(seed)
    T = max(sum(span for *_, span in b) for b in branches) + 1  # one padding column at least
    B = len(branches)
    action, observation = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    alphas = torch.zeros(B, T, dtype=F64)
    for i, nodes in enumerate(branches):
        offset = 0
        for _role, sampled, span in nodes:
            action[i, offset : offset + span] = sampled
            offset += span
        weights = prime_rl_echo_weights(nodes, role_alphas)
        alphas[i, : len(weights)] = torch.tensor(weights, dtype=F64)
        observation[i, : len(weights)] = torch.tensor([w != 0 for w in weights])
    logp = -(0.05 + 2.5 * torch.rand(B, T, generator=g, dtype=F64))
    behavior = (logp + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    advantage = torch.randn(B, generator=g, dtype=F64)
    return {
        "logp": logp,
        "behavior_logp": behavior,
        "old_logp": behavior,
        "advantage": advantage,
        "action_mask": action,
        "observation_mask": observation,
    }, alphas


def samples_of(f, alphas):
    """The padded rows as prime-rl's packed samples (python lists)."""
    return [
        (
            f["logp"][i].tolist(),
            f["behavior_logp"][i].tolist(),
            [float(f["advantage"][i])] * f["logp"].shape[1],
            f["action_mask"][i].tolist(),
            alphas[i].tolist(),
        )
        for i in range(f["logp"].shape[0])
    ]


def recipe(coef=0.1, **params):
    return Recipe.load(
        {"gates": [DPPO], "reduction": "token", "regularizers": [{"name": "echo", "coef": coef, **params}]}
    )


def run(rec, f, normalizer=None, metrics="basic"):
    leaf = f["logp"].clone().requires_grad_()
    result = lossplug.policy_loss(PolicyBatch(**{**f, "logp": leaf}), rec, normalizer, metrics=metrics)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result, grad


def close(actual, expected):
    actual = torch.as_tensor(actual, dtype=F64)  # metrics come back as floats
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=RTOL, atol=ATOL)


def test_the_selection_is_the_non_sampled_nodes_after_the_first_response():
    # prime-rl's default role table (tool at 0.1): only tool output after a response
    weights = prime_rl_echo_weights(BRANCHES[0], {"tool": 0.1})
    assert weights == [0.0] * 9 + [0.1] * 3 + [0.0] * 2
    # its alphabet-sort config (user at 0.1): the first user turn precedes every response, so only the later one
    assert prime_rl_echo_weights(BRANCHES[1], {"user": 0.1}) == [0.0] * 7 + [0.1] * 2 + [0.0] * 3


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("roles", [{"tool": 0.1}, {"user": 0.1}, {"tool": 0.3, "user": 0.3, "system": 0.3}])
def test_matches_prime_rl_grpo_plus_echo(seed, roles):
    f, alphas = batch_fields(seed, roles)
    (alpha,) = set(roles.values())
    result, grad = run(recipe(alpha), f)
    close(result.loss, prime_rl_step_loss(samples_of(f, alphas)))
    close(grad, prime_rl_gradient(samples_of(f, alphas)))
    assert float(result.metrics["reg/echo/coef"]) == alpha


def test_the_term_is_alpha_times_the_mean_nll_of_the_observation_tokens():
    f, alphas = batch_fields(3, {"tool": 1.0, "user": 1.0})
    obs = f["observation_mask"]
    result, _ = run(recipe(0.1), f)
    expected = -(f["logp"][obs]).mean()
    close(result.metrics["reg/echo/value"], expected)
    close(result.metrics["reg/echo/nll"], expected)
    close(result.metrics["policy/loss"] + 0.1 * expected, result.loss)


def test_micro_batches_equal_in_observation_tokens_add_up_to_prime_rls_step():
    # rows 0 and 1 each hold 3 observation tokens (their tool output): one micro-batch per row, the Normalizer's
    # micro_batches = 2 weights each micro-batch's mean by 1/2 — prime-rl's global ce_scale exactly
    branches = [BRANCHES[0], [("user", False, 2), ("assistant", True, 3), ("tool", False, 3), ("assistant", True, 2)]]
    f, alphas = batch_fields(4, {"tool": 0.1}, branches)
    assert f["observation_mask"].sum(-1).tolist() == [3, 3]
    normalizer = lossplug.Normalizer.for_masks([f["action_mask"]], micro_batches=2)
    total, grad = torch.zeros((), dtype=F64), torch.zeros_like(f["logp"])
    for i in range(2):
        result, g = run(recipe(0.1), {k: v[i : i + 1] for k, v in f.items()}, normalizer)
        total, grad[i] = total + result.loss, g[0]
    close(total, prime_rl_step_loss(samples_of(f, alphas)))
    close(grad, prime_rl_gradient(samples_of(f, alphas)))


def test_micro_batches_unequal_in_observation_tokens_take_the_mean_of_their_means():
    # the documented difference: prime-rl divides by the step's observation tokens (3 + 4), echo by each
    # micro-batch's (3, then 4), each weighted 1/2
    f, alphas = batch_fields(5, {"tool": 1.0, "user": 1.0})
    counts = f["observation_mask"].sum(-1).tolist()
    assert counts[0] != counts[1]
    normalizer = lossplug.Normalizer.for_masks([f["action_mask"]], micro_batches=2)
    rec = Recipe.load({"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": "echo", "coef": 1.0}]})
    zero = {**f, "advantage": torch.zeros_like(f["advantage"])}
    total = sum(run(rec, {k: v[i : i + 1] for k, v in zero.items()}, normalizer)[0].loss for i in range(2))
    means = [float(-(f["logp"][i][f["observation_mask"][i]]).mean()) for i in range(2)]
    close(total, sum(means) / 2)
    step_mean = float(-(f["logp"][f["observation_mask"]]).mean())
    assert abs(float(total.detach()) - step_mean) > 1e-3


def test_a_micro_batch_without_observation_tokens_adds_zero():
    f, _ = batch_fields(6, {"tool": 0.1})
    f["observation_mask"] = torch.zeros_like(f["observation_mask"])
    with_echo, g1 = run(recipe(0.1), f)
    without, g2 = run(Recipe.load({"gates": [DPPO], "reduction": "token"}), {**f, "observation_mask": None})
    close(with_echo.loss, without.loss)
    close(g1, g2)


def test_poison_off_the_trained_tokens_never_reaches_loss_or_gradient():
    f, _ = batch_fields(7, {"tool": 0.1, "user": 0.1})
    trained = f["action_mask"] | f["observation_mask"]
    clean, g_clean = run(recipe(0.1), f)
    dirty = dict(f)
    for name in ("logp", "behavior_logp", "old_logp"):
        dirty[name] = torch.where(trained, f[name], float("nan"))
    poisoned, g_dirty = run(recipe(0.1), dirty)
    close(poisoned.loss, clean.loss)
    close(g_dirty, g_clean)
    assert bool((g_dirty[~trained] == 0).all())
    assert bool((g_dirty[f["observation_mask"]] == -0.1 / int(f["observation_mask"].sum())).all())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 3.0, allow_nan=False), st.floats(0.05, 0.95))
def test_echo_adds_coef_times_the_observation_mean_and_leaves_the_actions_alone(seed, coef, share):
    # prime-rl's per-component normalisation: observation tokens never dilute the rl term, on any batch
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    action = torch.rand(B, T, generator=g) < 0.5
    action[:, 0] = True
    observation = ~action & (torch.rand(B, T, generator=g) < share)
    logp = -(0.05 + 2.0 * torch.rand(B, T, generator=g, dtype=F64))
    f = {"logp": logp, "behavior_logp": (logp - 0.3).clamp(max=-1e-3), "action_mask": action}
    f["advantage"] = torch.randn(B, generator=g, dtype=F64)
    with_echo, g1 = run(recipe(coef), {**f, "observation_mask": observation})
    plain, g2 = run(Recipe.load({"gates": [DPPO], "reduction": "token"}), f)
    mean = -logp[observation].mean() if bool(observation.any()) else torch.zeros((), dtype=F64)
    close(with_echo.loss - plain.loss, coef * mean)
    close(g1[action], g2[action])
    close(g1[observation], torch.full((int(observation.sum()),), -coef / max(int(observation.sum()), 1), dtype=F64))
    assert bool((g1[~(action | observation)] == 0).all())


# -- refusals -------------------------------------------------------------------------------------------------------


def test_an_observation_token_that_is_an_action_is_refused_naming_field_rule_and_position():
    f, _ = batch_fields(0, {"tool": 0.1})
    f["observation_mask"] = f["observation_mask"].clone()
    f["observation_mask"][0, 5] = True  # the first token of the first (sampled) assistant turn
    with pytest.raises(BatchValidationError) as err:
        run(recipe(), f)
    text = str(err.value)
    assert "observation_mask: must be False on action positions" in text and "(row 0, pos 5)" in text, text


def test_a_wrong_shape_is_refused_naming_the_field():
    f, _ = batch_fields(0, {"tool": 0.1})
    f["observation_mask"] = f["observation_mask"][:, :-1]
    with pytest.raises(BatchValidationError, match="observation_mask"):
        run(recipe(), f)


def test_a_non_finite_logp_on_an_observation_token_is_refused():
    f, _ = batch_fields(0, {"tool": 0.1})
    (row, col) = f["observation_mask"].nonzero()[0].tolist()
    f["logp"] = f["logp"].clone()
    f["logp"][row, col] = float("-inf")
    with pytest.raises(BatchValidationError) as err:
        run(recipe(), f)
    assert "observation_mask" in str(err.value) and "logp must be finite" in str(err.value), str(err.value)


def test_without_observation_mask_the_recipe_names_what_to_pass():
    f, _ = batch_fields(0, {"tool": 0.1})
    with pytest.raises(LossplugError, match="observation_mask") as err:
        run(recipe(), {**f, "observation_mask": None})
    assert "echo" in str(err.value)


def test_the_step_population_is_refused():
    with pytest.raises(RecipeError, match="population must be 'micro_batch'"):
        recipe(population="step")

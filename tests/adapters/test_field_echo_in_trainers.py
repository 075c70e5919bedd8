"""prime-rl's echo (cross-entropy on the environment's tokens, ``echo``) inside the trainers: a real TRL ``train()`` run
of two CPU steps on the tiny model, whose rollout engine marks tool output in its ``env_mask`` (TRL's ``tool_mask``:
the adapter feeds ``completion_mask & ~tool_mask`` as ``observation_mask``), and TRL's refusal without tools or a
rollout_func, naming what to pass. verl cannot feed it: its ``ppo_loss`` hands a policy loss ``response_mask`` only
(the environment's tokens stay behind, shown on verl's own source) — the seam refuses echo with that reason.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest

from lossplug.contracts.errors import LossplugError

from ._field_trainers import MICRO, train_two_tiny_steps, verl_actor_config, verl_inputs, verl_policy_loss

ECHO = {"name": "echo", "coef": 0.1}


@pytest.mark.slow
def test_trains_inside_trls_grpo_trainer(tmp_path, monkeypatch):
    import lossplug

    seen = []
    policy_loss = lossplug.policy_loss

    def spy(batch, *args, **kwargs):
        seen.append((batch.observation_mask.clone(), batch.action_mask.clone()))
        return policy_loss(batch, *args, **kwargs)

    monkeypatch.setattr(lossplug, "policy_loss", spy)
    recipe = {"preset": "grpo", "regularizers": [ECHO]}
    trainer, _ = train_two_tiny_steps(recipe, tmp_path)
    # the tiny rollout engine's tool output: completion tokens 2 and 3 (env_mask 0) of every other longer row
    assert seen and any(bool(obs.any()) for obs, _ in seen)
    for obs, action in seen:
        assert not bool((obs & action).any())
        assert set(obs.nonzero()[:, 1].tolist()) <= {1, 2}
    logged = [e for e in trainer.state.log_history if "lossplug/reg/echo/nll" in e]
    assert logged, sorted({k for e in trainer.state.log_history for k in e})
    # the tool tokens reached the term: a mean −logp over them, positive and finite, and the term is coef × it
    assert all(0 < e["lossplug/reg/echo/nll"] < 50 for e in logged), logged
    assert all(e["lossplug/reg/echo/coef"] == pytest.approx(0.1) for e in logged)


def test_trl_without_tools_or_a_rollout_func_refuses_naming_what_to_pass(tmp_path):
    pytest.importorskip("trl")
    with pytest.raises(LossplugError) as err:
        train_two_tiny_steps({"preset": "grpo", "regularizers": [ECHO]}, tmp_path, rollout=False)
    text = str(err.value)
    assert "observation_mask" in text and "tools=" in text and "env_mask" in text, text


# -- verl --------------------------------------------------------------------------------------------------------------


def test_verls_ppo_loss_hands_a_policy_loss_no_observation_mask():
    # verl 0.9.1's one call of a registered policy loss (verl/workers/utils/losses.py, ppo_loss): the response's
    # environment tokens (attention_mask & ~response_mask) stay behind, so nothing can feed observation_mask
    pytest.importorskip("verl")
    import ast
    import inspect

    from verl.workers.utils import losses

    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(losses.ppo_loss)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "policy_loss_fn"
    ]
    assert len(calls) == 1
    passed = {k.arg for k in calls[0].keywords}
    assert passed == {
        "old_log_prob",
        "log_prob",
        "advantages",
        "response_mask",
        "loss_agg_mode",
        "config",
        "rollout_is_weights",
    }, passed


def test_echo_under_verls_policy_loss_is_refused_with_the_reason():
    pytest.importorskip("verl")
    x = verl_inputs(seed=1)
    mb = {k: v[:MICRO] for k, v in x.items() if k != "lengths"}
    config = verl_actor_config({"gates": ["ppo_clip"], "reduction": "token", "regularizers": [ECHO]}, MICRO)
    with pytest.raises(LossplugError, match=r"recipe.regularizers\[0\] \(echo\) reads observation_mask: .*Next step: "):
        verl_policy_loss(config, mb)

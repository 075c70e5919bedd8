"""The entropy papers' plugins inside the trainers: ``entropy_advantage`` (Cheng et al., arXiv:2506.14758) and
``gtpo`` (Simoni et al., arXiv:2508.03772) each in a real TRL ``train()`` run of two CPU steps on the tiny model
(TRL's forward pass gives the loss its entropies, its ``completion_ids`` the sampled tokens), each checked on a
micro-batch TRL built — against the paper's shaped advantage, and against the GTPO authors' code transcribed in
``tests/plugins/gates/test_gtpo.py``; and verl's policy-loss seam, which receives no entropies (nor token ids or
prompt groups), refusing both with the reason and the next step.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import math

import pytest
import torch

from ..plugins.gates.test_gtpo import ENT_SCALE, authors_conflict
from ._field_trainers import (
    train_two_tiny_steps,
    trl_first_micro_batch,
    verl_actor_config,
    verl_inputs,
    verl_policy_loss,
)

ENTROPY_ADVANTAGE = {"preset": "grpo", "gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"}


@pytest.mark.slow
def test_entropy_advantage_trains_inside_trls_grpo_trainer(tmp_path):
    trainer, _ = train_two_tiny_steps(ENTROPY_ADVANTAGE, tmp_path, rollout=False)
    capped = [e["lossplug/entropy_advantage/capped_frac"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert capped and all(0.0 <= v <= 1.0 for v in capped), capped


@pytest.mark.slow
def test_entropy_advantage_on_a_trl_micro_batch_is_the_papers_shaped_advantage(tmp_path):
    """One micro-batch as TRL's ``_compute_loss`` builds it (its own forward pass: log-probs and entropies), through
    the adapter, against TRL's clipped surrogate written out on ``A + min(α·H^detach, |A|/κ)``."""
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    trainer = tiny.tiny_grpo_trainer(ENTROPY_ADVANTAGE, tmp_path / "out")
    inputs, params, loss, grads, logps, entropies = trl_first_micro_batch(trainer)
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    adv = inputs["advantages"][:, None]
    shaped = adv + torch.min(0.4 * entropies.detach(), adv.abs() / 2.0)
    ratio = torch.exp(logps - old)
    surrogate = torch.min(ratio * shaped, torch.clamp(ratio, 0.8, 1.2) * shaped)
    # the token reduction over the step's action tokens (TRL's num_items_in_batch), one micro-batch of one step
    expected = -(surrogate * mask).sum() / mask.sum()
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the shaping is visible: the plain surrogate on A differs (some advantages are nonzero, the bonus is not 0)
    plain = -(torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * mask).sum() / mask.sum()
    assert bool((adv != 0).any()) and abs(float(plain - expected.detach())) > 1e-4, (
        float(plain),
        float(expected.detach()),
    )
    for got, want in zip(grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


#: the tiny random model's tokens are near-uniform (mean entropy ≈ log of its vocabulary, far above the authors' 0.7,
#: which would zero every response): a threshold it stays under, so the run trains
THRESHOLD = 100.0
#: GTPO as its authors run it: Dr.GRPO's advantage r − mean (no std), on-policy, whole groups per micro-batch (TRL's
#: tiny config: 4 generations, micro-batches of 4; steps_per_generation=1 makes each micro-batch one generation batch)
GTPO = {
    "advantage": {"name": "grpo", "scale": "none"},
    "gates": [{"name": "gtpo", "group_size": 4, "entropy_threshold": THRESHOLD}],
    "reduction": "response",
}


def gtpo_trainer(tmp_path, max_steps: int = 2):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    return tiny.tiny_grpo_trainer(GTPO, tmp_path / "out", max_steps=max_steps, steps_per_generation=1)


@pytest.mark.slow
def test_gtpo_trains_inside_trls_grpo_trainer(tmp_path):
    trainer = gtpo_trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()  # group_size=4: a micro-batch holding part of a group would have raised
    assert trainer.state.global_step == 2
    logged = [e for e in trainer.state.log_history if "lossplug/loss" in e]
    assert logged and all(math.isfinite(e["lossplug/loss"]) for e in logged)
    assert all(0.0 <= e["lossplug/gtpo/conflict_frac"] <= 1.0 for e in logged), logged
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.slow
def test_gtpo_on_a_trl_micro_batch_is_the_authors_code(tmp_path):
    """One micro-batch (one prompt group) as TRL's ``_compute_loss`` builds it, through the adapter, against the
    authors' ``build_conflict_mask`` (transcribed) and their per-completion loss on the model's own log-probs and
    TRL's entropies: ``−Σ_t ratio·Ã·δ / n_tok / n_conflict``, averaged over the group by the response reduction."""
    trainer = gtpo_trainer(tmp_path, max_steps=1)
    inputs, params, loss, grads, logps, entropies = trl_first_micro_batch(trainer)
    group = inputs["lossplug_group_id"]
    assert bool((group == group[0]).all()) and group.numel() == 4, group  # a whole group in the micro-batch
    mask = inputs["completion_mask"].bool()
    lengths = mask.sum(-1).tolist()
    sentinel = -1  # the code tells padding by its pad id: give the padding one no sampled token has
    token_rows = torch.where(mask, inputs["completion_ids"], sentinel).tolist()
    adv = inputs["advantages"].tolist()
    delta, n_conflict = authors_conflict(token_rows, lengths, adv, pad=sentinel)
    expected = 0.0
    for i in range(len(lengths)):
        mean_entropy = float(entropies[i, : lengths[i]].sum()) / max(lengths[i], 1)
        shaped = adv[i] - ENT_SCALE * mean_entropy if mean_entropy <= THRESHOLD else 0.0
        ratio = torch.exp(logps[i, : lengths[i]] - logps[i, : lengths[i]].detach())
        weights = torch.tensor(delta[i][: lengths[i]], dtype=ratio.dtype)
        expected = expected - (ratio * shaped * weights).sum() / max(lengths[i], 1) / max(n_conflict[i], 1)
    expected = expected / len(lengths)  # the response reduction: the code's sum over the group, over its size
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert any(w is not None and bool((w != 0).any()) for w in expected_grads)


@pytest.mark.parametrize(
    "gate, words",
    [
        ("entropy_advantage", ["entropy_advantage", "entropy", "no entropies", "Next step: run it in TRL"]),
        ({"name": "gtpo", "group_size": 4}, ["gtpo", "entropy", "Next step"]),
    ],
    ids=["entropy_advantage", "gtpo"],
)
def test_verls_policy_loss_seam_refuses_them_naming_the_entropies(gate, words):
    pytest.importorskip("verl")
    from lossplug.contracts import LossplugError

    x = verl_inputs(seed=3)
    mb = {k: v for k, v in x.items() if k != "lengths"}
    gates = ["ppo_clip", gate] if gate == "entropy_advantage" else [gate]
    config = verl_actor_config({"gates": gates, "reduction": "token"}, 8)
    with pytest.raises(LossplugError) as err:
        verl_policy_loss(config, mb)
    message = str(err.value)
    for word in words:
        assert word in message, message

"""MOPD (Multi-Teacher On-Policy Distillation, Ma et al., 2026, arXiv:2606.30406) as a recipe of built-ins, float64.

MOPD's loss, as its authors state it in the MiMo-V2-Flash Technical Report (Xiaomi LLM-Core, 2026,
arXiv:2601.02780, §4.4, Eqs. 7–9; ``paper.pdf`` of XiaomiMiMo/MiMo-V2-Flash, commit b4eaae4), the paradigm
arXiv:2606.30406 names as deployed there. Each prompt ``x`` has a domain, and its domain's teacher
``π_domain(x)`` scores the student's own rollout ``y ∼ μ_θ`` (the rollout engine)::

    L = −E_{x, y∼μ_θ} [ (1/|y|) Σ_t w_t · Â_t · log π_θ(y_t | x, y<t) ]
    w_t = sg[π_θ(y_t) / μ_θ(y_t)]  if ε_low ≤ π_θ/μ_θ ≤ ε_high,  else 0        (IcePop, Zhao et al., 2025)
    Â_t = sg[log π_domain(x)(y_t) − log π_θ(y_t)] + α · Â_ORM                  (Â_ORM: GRPO; α = 0: "MOPD w/o ORM")

No public code of MOPD exists (the MiMo-V2-Flash repository holds the weights, the README and the report), so the
oracle below is Eqs. 7–9 transcribed token by token in loops. In lossplug::

    {advantage: {name: mix, components: [{name: opd, weight: 1.0}, {name: grpo, weight: α}]},
     gates: [reinforce, {name: icepop, low: ε_low, high: ε_high}], reduction: response}

(``{advantage: opd, …}`` for α = 0). The several teachers are the trainer's routing, not the loss's: each row's
``teacher_logp`` is its own domain teacher's log-probs (verl 0.9.1's teacher loop routes each sample to the teacher
of its ``distillation.teacher_key``, ``data_source`` by default), so the per-row ``teacher_logp`` already is the
merged multi-teacher signal; ``test_a_mixed_batch_is_the_sum_of_its_domains`` shows the decomposition.

π_θ inside the stop-gradients is the training engine's policy at the rollout's parameters (``old_logp``): the
tests evaluate the loss at θ = θ_old, where the two are one value (MOPD's on-policy update). After an earlier
mini-batch of the same rollout moved θ, ``opd`` and ``icepop`` keep θ_old's log-probs (slime's and verl's
convention), where Eq. 8 read literally would recompute them at the current θ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

F64 = torch.float64
B, T = 8, 7
#: rows 0–3: one prompt of the math domain (teacher 0), rows 4–7: one prompt of the code domain (teacher 1)
DOMAIN = [0, 0, 0, 0, 1, 1, 1, 1]
GROUP = [0, 0, 0, 0, 1, 1, 1, 1]
EPS_LOW, EPS_HIGH = 0.5, 2.0


def mopd_recipe(alpha, low=EPS_LOW, high=EPS_HIGH):
    advantage = (
        {"name": "opd"}
        if alpha == 0
        else {"name": "mix", "components": [{"name": "opd", "weight": 1.0}, {"name": "grpo", "weight": alpha}]}
    )
    gates = ["reinforce", {"name": "icepop", "low": low, "high": high}]
    return {"advantage": advantage, "gates": gates, "reduction": "response"}


def two_teachers(seed=0):
    """A step whose rows come from two domains: each teacher scores every row (as two servers would), the batch
    carries each row's own domain teacher's log-probs (what verl's teacher loop hands the trainer)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask[2, 1] = False  # a tool observation inside a response: no action there
    old = -(0.05 + 3 * torch.rand(B, T, generator=g, dtype=F64))
    teachers = [(old + torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4) for _ in range(2)]
    # the rollout engine: ρ = π_old/μ spans both sides of [0.5, 2] so IcePop drops some tokens
    behavior = (old + 0.6 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    reward = torch.randint(0, 2, (B,), generator=g).to(F64) + 0.1 * torch.rand(B, generator=g, dtype=F64)
    routed = torch.stack([teachers[DOMAIN[b]][b] for b in range(B)])
    return {
        "old": old,
        "behavior": behavior,
        "teachers": teachers,
        "routed": routed,
        "mask": mask,
        "reward": reward,
    }


def batch_of(s, alpha, rows=slice(None), logp=None):
    """The rows' batch with the recipe's advantage computed first (as a trainer does, before the loss)."""
    old = s["old"][rows]
    batch = lossplug.PolicyBatch(
        logp=old.clone() if logp is None else logp,
        old_logp=old,
        behavior_logp=s["behavior"][rows],
        teacher_logp=s["routed"][rows],
        action_mask=s["mask"][rows],
        reward=s["reward"][rows],
        group_id=torch.tensor(GROUP)[rows],
    )
    return batch.replace(advantage=lossplug.compute_advantages(batch, mopd_recipe(alpha)))


def grpo_transcribed(reward):
    """Â_ORM: GRPO (Shao et al., 2024) per prompt, (r − mean) / (std + 1e-6), std Bessel-corrected (verl's)."""
    out = np.zeros(len(reward))
    for b in range(len(reward)):
        same = [float(reward[j]) for j in range(len(reward)) if GROUP[j] == GROUP[b]]
        out[b] = (float(reward[b]) - np.mean(same)) / (np.std(same, ddof=1) + 1e-6)
    return out


def mopd_transcribed(s, alpha, low=EPS_LOW, high=EPS_HIGH):
    """Eqs. 7–9 token by token: the loss and its gradient with respect to log π_θ (at θ = θ_old)."""
    a_orm = grpo_transcribed(s["reward"])
    loss, grad = 0.0, np.zeros((B, T))
    for b in range(B):
        teacher = s["teachers"][DOMAIN[b]]  # π_domain(x): the teacher of this row's domain
        tokens = [t for t in range(T) if s["mask"][b, t]]
        row = 0.0
        for t in tokens:
            student = float(s["old"][b, t])  # log π_θ(y_t) at θ = θ_old, under sg[·]
            ratio = np.exp(student - float(s["behavior"][b, t]))  # π_θ / μ_θ
            w = ratio if low <= ratio <= high else 0.0
            advantage = (float(teacher[b, t]) - student) + alpha * a_orm[b]
            row += w * advantage * student
            grad[b, t] = -w * advantage / len(tokens) / B  # ∂L/∂log π_θ(y_t): w and Â are stop-gradients
        loss += -row / len(tokens) / B
    return loss, grad


@pytest.mark.parametrize("alpha", [0.0, 0.5, 2.0])
def test_the_recipe_is_mopds_loss_and_gradient_over_two_teachers(alpha):
    s = two_teachers(1)
    logp = s["old"].clone().requires_grad_()
    result = lossplug.policy_loss(batch_of(s, alpha, logp=logp), mopd_recipe(alpha))
    result.loss.backward()
    expected_loss, expected_grad = mopd_transcribed(s, alpha)
    ratio = (s["old"] - s["behavior"]).exp()[s["mask"]]
    assert bool(((ratio < EPS_LOW) | (ratio > EPS_HIGH)).any()), "IcePop must drop some tokens here"
    loss = float(result.loss.detach())
    assert abs(loss - expected_loss) < 1e-13, (loss, expected_loss)
    grad = torch.where(s["mask"], logp.grad, 0).numpy()
    np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=1e-15)
    assert np.abs(expected_grad).max() > 0.01


def test_each_row_reads_its_own_domains_teacher():
    """Changing the code teacher moves the code rows' gradient only; the math rows' stays bit for bit."""
    s = two_teachers(2)
    other = dict(s, teachers=[s["teachers"][0], s["teachers"][1] - 0.7])
    other["routed"] = torch.stack([other["teachers"][DOMAIN[b]][b] for b in range(B)])
    grads = []
    for step in (s, other):
        logp = step["old"].clone().requires_grad_()
        lossplug.policy_loss(batch_of(step, 0.5, logp=logp), mopd_recipe(0.5)).loss.backward()
        grads.append(torch.where(step["mask"], logp.grad, 0))
    math, code = slice(0, 4), slice(4, 8)
    assert torch.equal(grads[0][math], grads[1][math])
    assert not torch.allclose(grads[0][code], grads[1][code])
    np.testing.assert_allclose(grads[1].numpy(), mopd_transcribed(other, 0.5)[1], rtol=0, atol=1e-15)


@settings(deadline=None, max_examples=20)
@given(seed=st.integers(0, 10_000), alpha=st.sampled_from([0.0, 0.3, 1.0]))
def test_a_mixed_batch_is_the_sum_of_its_domains(seed, alpha):
    """MOPD over a step of two domains = each domain distilled from its one teacher on its own rows, weighted by
    its share of the responses (the response mean; GRPO's groups never cross domains): several teachers need
    nothing beyond each row's own ``teacher_logp``."""
    s = two_teachers(seed)
    whole = float(lossplug.policy_loss(batch_of(s, alpha), mopd_recipe(alpha)).loss)
    parts = 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        one_teacher = batch_of(s, alpha, rows)
        assert torch.equal(one_teacher.teacher_logp, s["teachers"][DOMAIN[rows.start]][rows])
        parts += 4 / B * float(lossplug.policy_loss(one_teacher, mopd_recipe(alpha)).loss)
    assert abs(whole - parts) < 1e-12, (whole, parts)

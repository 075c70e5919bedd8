"""KTAE (arXiv:2505.16826, xiaolizh1/KTAE): A_it = GRPO_i + scale·tanh((α·F + β·IG)·x / (2(α + β))) of token v_it.

Paper: Sun et al., 2025, *KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation in Mathematical
Reasoning*, arXiv:2505.16826. Reference code re-derived from: github.com/xiaolizh1/KTAE,
``verl/workers/actor/compute_key_tokens.py`` (``ComputeKeyTokens``, ``fisher_exact_test``, ``calculate_ig``,
``compute_tf``, ``compute_Cohen``) and ``verl/trainer/ppo/core_algos.py``
``compute_ktae_outcome_advantage_and_keytokens`` (commit ea9fb77f366216d754e2368653911724e73a7376).

Within each prompt group (``group_id``), a rollout is *correct* when its score ``R > correct_above`` (the authors':
``> 0``). With ``N_c`` correct and ``N_w`` wrong rollouts, every token id ``v`` sampled on an action position of the
group gets a 2×2 contingency table of rollouts — ``a`` correct and ``b`` wrong rollouts that contain ``v``, ``c = N_c −
a`` and ``d = N_w − b`` that do not — and a key-token score::

    F   = exp(−2p) if p < 1 else 0       p: two-sided Fisher exact test of [[a, b], [c, d]]
    IG  = H(N_c/n) − ((a+b)/n)·H(a/(a+b)) − ((c+d)/n)·H(c/(c+d))          information gain, bits (n = N_c + N_w)
    h   = asin √(a/(N_c + 1e-10)) − asin √(b/(N_w + 1e-10))              (half Cohen's h of the two rates)
    x   = h + tf_c/(tf_w + 1e-5) − tf_w/(tf_c + 1e-5)                     (``term_frequency``; else x = h)
    tf_s = f_s·(k1 + 1)/(f_s + k1·(1 − b + b·L_s/L̄))                     BM25 saturation, k1 = 2, b = 0.5
    score(v) = scale · (2·sigmoid((α·F + β·IG)·x / (α + β)) − 1)

with ``f_s`` the frequency of ``v`` among the action tokens of the correct (``s = c``) or wrong (``s = w``) rollouts,
``L_s`` their action-token count and ``L̄ = (L_c + L_w)/2``. A group with no correct or no wrong rollout scores 0 for
every token. The advantage adds the token's score to the GRPO advantage on the action positions::

    A_it = (R_i − mean_g R) / (std_g R + eps) + score_g(token_ids_it)

(sample std, ``eps`` 1e-6: verl's GRPO, which the authors' code reuses; DAPO+KTAE is the same advantage under
DAPO's loss). Defaults are the authors': ``alpha = beta = 1``, ``term_frequency`` on, ``scale = 1`` (their
``top``).

Choices the paper leaves open, taken from the authors' code, and where this module differs from its float32 numerics:

* the table counts *rollouts* containing the token (document frequency), the tf term *occurrences*;
* the authors zero the score of token id 151643 (Qwen2.5's ``<|endoftext|>``, the EOS/pad token) whatever the model:
  here ``neutral_token_ids`` (default none; ``[151643]`` reproduces their Qwen2.5 runs);
* ``p`` is the two-sided p-value of Fisher's exact test, as the code computes it (the paper writes the probability
  of the observed table alone). It is computed exactly: the hypergeometric terms are compared as integers
  (``math.comb``), so a table as probable as the observed one always counts (as ``scipy.stats.fisher_exact``
  does, up to its 1e-7 relative tolerance) and ``p = 1`` holds exactly when no table is more probable. The authors
  sum float32 ``exp(lgamma …)`` terms compared with ``<=`` and test ``p != 1.0``. Their sums rarely come to exactly
  1.0: over every table with N_c, N_w ≤ 16, 91% of the tables with exact p = 1 get exp(−2·0.99999…) ≈ 0.135 in
  their code instead of 0 (``zero_at_p_one: false`` computes that, exp(−2p) everywhere), and 0.9% of the others
  differ where two tables are equally probable up to rounding;
* singleton groups get the GRPO advantage of ``lossplug``'s ``grpo`` (0); the authors' code gives ``R/(1 + eps)``.

Token ids must be ≥ 0 on the action positions; what the batch holds elsewhere is never read. The advantage is
``[B, T]``, zero off the actions, and carries no gradient. Cost: one pass over each group's action tokens, and a
Fisher test per distinct ``(a, b)`` table (at most ``(N_c + 1)(N_w + 1)`` per group, cached across groups and steps).

Examples:

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.zeros(4, 2), action_mask=torch.ones(4, 2, dtype=torch.bool),
...     reward=torch.tensor([1.0, 1.0, 0.0, 0.0]), group_id=torch.zeros(4, dtype=torch.long),
...     token_ids=torch.tensor([[7, 5], [7, 5], [9, 5], [9, 5]]))
>>> recipe = {"advantage": "ktae", "gates": ["ppo_clip"], "reduction": "token"}
>>> adv = lossplug.estimate_advantages(batch, recipe).advantage  # GRPO ±0.866; token 7 only in correct rollouts
>>> [round(v, 4) for v in adv[0].tolist()], [round(v, 4) for v in adv[2].tolist()]
([1.866, 0.866], [-1.866, -0.866])
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.contracts import LossplugError
from lossplug.ops import Groups

from .group_relative import GRPOParams, grpo, sequence_scores

#: BM25's term-frequency saturation constants, fixed in the authors' ``compute_tf``
BM25_K1, BM25_B = 2.0, 0.5


class KTAEParams(lossplug.Params):
    alpha: float = Field(1.0, ge=0, description="weight of the Fisher exact test's exp(−2p) (the authors': 1)")
    beta: float = Field(1.0, ge=0, description="weight of the information gain (the authors' beta_ig: 1)")
    term_frequency: bool = Field(
        True, description="add the BM25 term-frequency contrast to Cohen's h (the authors' gamma_tf=1)"
    )
    scale: float = Field(
        1.0, gt=0, description="bound of the key-token score: −scale < score < scale (the authors' top: 1)"
    )
    correct_above: float = Field(0.0, description="a rollout is correct when its score exceeds this (the authors': 0)")
    zero_at_p_one: bool = Field(
        True,
        description="F = 0 where the Fisher p-value is exactly 1 (the authors' written rule); false: exp(−2p) "
        "everywhere, what their float32 code computes for most such tables",
    )
    neutral_token_ids: tuple[int, ...] = Field(
        (), description="token ids whose score is 0 (the authors': 151643, Qwen2.5's end-of-text token)"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon of the GRPO part's (R − mean)/(std + eps) (verl: 1e-6)")

    @model_validator(mode="after")
    def _some_weight(self) -> KTAEParams:
        if self.alpha + self.beta <= 0:
            raise ValueError("alpha + beta must be > 0 (the score divides by it)")
        return self


@functools.lru_cache(maxsize=1 << 16)
def fisher_weight(a: int, b: int, n_correct: int, n_wrong: int, zero_at_p_one: bool = True) -> float:
    """exp(−2p) for the two-sided Fisher exact p-value of ``[[a, b], [N_c − a, N_w − b]]``; 0 when p = 1 (and
    ``zero_at_p_one``).

    The hypergeometric terms ``C(N_c, k)·C(N_w, r − k)`` (``r = a + b`` rollouts contain the token) share the
    denominator ``C(n, r)``, so the test compares them as integers: exact ties count, ``p = 1`` is exact."""
    r = a + b
    observed = math.comb(n_correct, a) * math.comb(n_wrong, b)
    as_extreme = 0
    everything = 0
    for k in range(max(0, r - n_wrong), min(r, n_correct) + 1):
        term = math.comb(n_correct, k) * math.comb(n_wrong, r - k)
        everything += term
        if term <= observed:
            as_extreme += term
    if as_extreme == everything and zero_at_p_one:
        return 0.0
    return math.exp(-2.0 * as_extreme / everything)


def _entropy_bits(*counts: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (bits) of the distribution ``counts / Σ counts``; 0 where the total is 0 (0·log 0 = 0)."""
    total = sum(counts, torch.zeros_like(counts[0]))
    out = torch.zeros_like(total)
    for c in counts:
        share = torch.where(total > 0, c / total.clamp(min=1), 0)
        out = out - torch.where(share > 0, share * torch.log2(share.clamp(min=1e-300)), 0)
    return out


def group_scores(
    tokens: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor, p: KTAEParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """One group: ``(vocab, score)`` — the distinct token ids on its action positions and their key-token scores
    (float64). ``tokens``/``mask`` ``[n, T]``, ``correct`` ``[n]`` bool."""
    n_correct, n_wrong = int(correct.sum()), int((~correct).sum())
    vocab, where = torch.unique(tokens[mask], return_inverse=True)
    if n_correct == 0 or n_wrong == 0:
        return vocab, torch.zeros(vocab.numel(), dtype=torch.float64, device=tokens.device)
    rows = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(-1).expand_as(tokens)[mask]
    f64 = torch.float64
    # occurrences of each id per rollout, [n, V]: presence (document frequency) and the tf counts
    per_row = torch.zeros(tokens.shape[0], vocab.numel(), dtype=f64, device=tokens.device)
    per_row.index_put_((rows, where), torch.ones_like(where, dtype=f64), accumulate=True)
    present = (per_row > 0).to(f64)
    a, b = present[correct].sum(0), present[~correct].sum(0)
    c, d = n_correct - a, n_wrong - b
    n = float(n_correct + n_wrong)
    information_gain = (
        _entropy_bits(torch.full_like(a, n_correct), torch.full_like(a, n_wrong))
        - (a + b) / n * _entropy_bits(a, b)
        - (c + d) / n * _entropy_bits(c, d)
    )
    cohen = torch.asin((a / (n_correct + 1e-10)).clamp(0, 1).sqrt()) - torch.asin(
        (b / (n_wrong + 1e-10)).clamp(0, 1).sqrt()
    )
    x = cohen
    if p.term_frequency:
        occurrences = per_row[correct].sum(0), per_row[~correct].sum(0)
        lengths = float(occurrences[0].sum()), float(occurrences[1].sum())
        mean_length = (lengths[0] + lengths[1]) / 2
        tf = [
            (occ / length) * (BM25_K1 + 1) / (occ / length + BM25_K1 * (1 - BM25_B + BM25_B * length / mean_length))
            for occ, length in zip(occurrences, lengths)
        ]
        x = x + tf[0] / (tf[1] + 1e-5) - tf[1] / (tf[0] + 1e-5)
    fisher = torch.zeros_like(a)
    if p.alpha:
        pairs = torch.stack([a, b], -1).to(torch.int64).tolist()
        fisher = torch.tensor(
            [fisher_weight(ai, bi, n_correct, n_wrong, p.zero_at_p_one) for ai, bi in pairs],
            dtype=f64,
            device=tokens.device,
        )
    key = (p.alpha * fisher + p.beta * information_gain) * x / (p.alpha + p.beta)
    score = (torch.sigmoid(key) - 0.5) * 2 * p.scale
    if p.neutral_token_ids:
        neutral = torch.isin(vocab, torch.tensor(p.neutral_token_ids, dtype=vocab.dtype, device=vocab.device))
        score = torch.where(neutral, 0.0, score)
    return vocab, score


def _check_token_ids(token_ids: torch.Tensor, mask: torch.Tensor) -> None:
    negative = (token_ids < 0) & mask
    if bool(negative.any()):
        row, pos = (int(i) for i in negative.nonzero()[0])
        raise LossplugError(
            f"advantage 'ktae': token_ids must be vocabulary ids ≥ 0 on the action positions; "
            f"{int(token_ids[row, pos])} at (row {row}, pos {pos}) ({int(negative.sum())} in all)"
        )


@lossplug.advantage("ktae", params=KTAEParams, requires=("reward", "group_id", "token_ids"))
def ktae(batch: lossplug.PolicyBatch, p: KTAEParams) -> torch.Tensor:
    """KTAE: the GRPO advantage plus each action token's key-token score from its group's correct and wrong rollouts."""
    token_ids = cast(torch.Tensor, batch.token_ids)  # set: required
    mask = batch.action_mask
    _check_token_ids(token_ids, mask)
    reward = sequence_scores(batch)
    # [B]: (R − mean) / (std + eps), 0 for constant groups (grpo returns a tensor)
    sequence = cast(torch.Tensor, grpo.fn(batch, GRPOParams(eps=p.eps)))
    groups = Groups.from_ids(cast(torch.Tensor, batch.group_id))
    correct = reward > p.correct_above
    scores = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    order = torch.argsort(groups.inverse, stable=True)
    for members in torch.split(order, groups.counts.tolist()):
        vocab, score = group_scores(token_ids[members], mask[members], correct[members], p)
        if vocab.numel():
            at = torch.searchsorted(vocab, token_ids[members].clamp(min=0)).clamp(max=vocab.numel() - 1)
            scores[members] = torch.where(mask[members], score[at], 0.0)
    dtype = sequence.dtype if sequence.is_floating_point() else torch.float32
    return torch.where(mask, sequence.unsqueeze(-1) + scores.to(dtype), 0).to(dtype)

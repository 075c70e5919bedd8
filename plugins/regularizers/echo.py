"""Echo: cross-entropy on the environment's tokens, ``loss += α · Σ_{o ∈ obs} −logp_o / |obs|`` over the batch's
``observation_mask`` (tool output, user feedback of later turns), beside the policy term on the actions — prime-rl's
``echo`` algorithm (no arXiv id cited by its code or docs; they call α "ECHO's λ"), re-derived from prime-rl commit
``559b44772e471d1538537b8805cc77f3824a5e64``: ``src/prime_rl/orchestrator/algo/echo.py`` (``EchoAlgorithm``),
``src/prime_rl/trainer/rl/loss.py`` (``ce_loss_fn``, ``compute_loss``), ``src/prime_rl/trainer/rl/train.py``
(``ce_scale``) and ``packages/prime-rl-configs/src/prime_rl/configs/algorithm.py`` (``EchoAlgoConfig``).

What prime-rl computes: its orchestrator gives every non-sampled token that follows the first model response of a
branch (a chat message of an enabled role: ``tool`` by default, at ``alpha = 0.1``) a ``ce`` weight α, its ``loss_mask``
False — so those tokens stay outside the rl term and its denominator. The trainer adds the ``ce`` component
``Σ α·(−logp) / ce_scale`` to the rl component ``Σ rl / rl_scale``, ``ce_scale`` the count of tokens with a nonzero
``ce`` weight; the gradient is ``−α / ce_scale`` on each such token's log-prob, 0 elsewhere.

Here the trainer (or the user) marks those tokens in ``observation_mask`` (never actions: the contract refuses an
overlap, and checks that ``logp`` there is finite and ≤ 0), and ``coef`` is α. The term is ``−logp`` on the
observation tokens; the pipeline reduces it over them (``token``: their mean) and adds ``coef · reduce(term)``.

Two differences from prime-rl, both stated where they matter:

* **one weight**: ``observation_mask`` is a bool, so every marked token has weight ``coef``; prime-rl's role table
  gives each role its own α. A table whose enabled roles share one α (its default: tool at 0.1; its
  ``alphabet-sort`` config: user at 0.1) is exact; distinct α per role needs two batches' worth of masks, which no
  trainer carries.
* **the denominator**: prime-rl divides by the observation tokens of the whole optimizer step (all micro-batches and
  ranks). lossplug's ``Normalizer`` counts action tokens only, so echo divides by its micro-batch's observation
  tokens, the value weighted by ``1 / Normalizer.micro_batches`` (``population: micro_batch``, the only one allowed):
  exact when the step is one micro-batch, or when every micro-batch holds as many observation tokens (then the mean
  of the micro-batch means is the step's mean). A micro-batch without an observation token adds 0, as prime-rl's
  ``max(ce_scale, 1)`` does.

Example — two observation tokens with log-probs −1 and −3, ``coef`` 0.1: ``0.1 · (1 + 3) / 2 = 0.2``.

>>> import torch, lossplug
>>> logp = torch.tensor([[-0.5, -1.0, -3.0, -0.2]], dtype=torch.float64)
>>> batch = lossplug.PolicyBatch(
...     logp=logp, old_logp=logp, advantage=torch.zeros(1, dtype=torch.float64),
...     action_mask=torch.tensor([[True, False, False, True]]),
...     observation_mask=torch.tensor([[False, True, True, False]]))
>>> recipe = {"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": "echo", "coef": 0.1}]}
>>> float(lossplug.policy_loss(batch, recipe).loss)
0.2
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from pydantic import Field, model_validator

import lossplug

Tensor = torch.Tensor


class EchoParams(lossplug.RegularizerParams):
    coef: float = Field(
        0.1,
        allow_inf_nan=False,
        description="α: the loss gains α · mean(−logp) over the observation tokens (prime-rl's echo role alpha, 0.1)",
    )
    reduction: str | dict[str, object] | None = Field(
        "token",
        description="the reduction of −logp over the observation tokens; token: their mean (prime-rl's "
        "Σ α·(−logp) / ce_scale)",
    )
    # the one value echo accepts is its type (so a sweep over the choices of a Literal never meets a refused one);
    # the before-validator names the reason a 'step' population is refused, beyond pydantic's literal error
    population: Literal["micro_batch"] = Field(
        "micro_batch",
        description="micro_batch only: the Normalizer counts the step's action tokens, not its observation tokens, so "
        "the denominator is the micro-batch's own (its value weighted by 1 / Normalizer.micro_batches)",
    )

    @model_validator(mode="before")
    @classmethod
    def _own_population(cls, data: Any) -> Any:
        population = data.get("population", "micro_batch") if isinstance(data, dict) else "micro_batch"
        if population != "micro_batch":
            raise ValueError(
                f"population must be 'micro_batch', got {population!r}: the step's population (the Normalizer) "
                "counts action tokens, and echo's denominator is the observation tokens"
            )
        return data


@lossplug.regularizer("echo", params=EchoParams, requires=("observation_mask",))
def echo(inp: lossplug.GateInput, p: EchoParams) -> lossplug.RegularizerOutput:
    """``α · reduce(−logp)`` over the observation tokens (prime-rl's echo: cross-entropy on tool output and feedback).

    Reference: prime-rl ``ce_loss_fn`` / ``compute_loss`` (``src/prime_rl/trainer/rl/loss.py``).
    """
    tokens = cast(Tensor, inp.batch.observation_mask)  # declared in requires=; the contract keeps it off the actions
    # GateInput's logp is zero off the actions: read the batch's, where the contract checked it, and clean it with
    # torch.where (not a product) so that whatever lies off the observation tokens never reaches the gradient
    logp = torch.where(tokens, inp.batch.logp.to(inp.compute_dtype), 0)
    term = -logp
    count = tokens.sum()

    def nll() -> Tensor:  # prime-rl's ce metric "nll": the mean −logp over the observation tokens
        return term.detach().sum() / count.clamp(min=1).to(term.dtype)

    return lossplug.RegularizerOutput(term=term, token_mask=tokens, metrics={"nll": nll})

"""Results returned by the loss pipeline."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr


class LossResult(BaseModel):
    """The scalar loss (to minimise, carries the gradient) and its metrics.

    Metrics are kept as 0-d tensors and converted to floats on first access of :attr:`metrics`, in a single
    device→host transfer, so that computing a loss never forces a synchronisation by itself.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    loss: torch.Tensor
    metric_tensors: dict[str, torch.Tensor] = {}
    _metrics: dict[str, float] | None = PrivateAttr(default=None)

    @property
    def metrics(self) -> dict[str, float]:
        if self._metrics is None:
            names = list(self.metric_tensors)
            if names:
                # float64 (float32 on Apple's MPS, which has none): a perplexity of e^100 is a number, not inf
                first = self.metric_tensors[names[0]]
                wide = torch.float32 if first.device.type == "mps" else torch.float64
                values = torch.stack(
                    [self.metric_tensors[n].detach().reshape(()).to(device=first.device, dtype=wide) for n in names]
                ).tolist()
            else:
                values = []
            self._metrics = dict(zip(names, values))
        return self._metrics


class AdvantageResult(BaseModel):
    """Advantages, and the critic targets (returns ``A + V_old``) where the estimator has a critic.

    When the recipe has shapers or filters (the rollout side), also the ``reward`` the advantage saw (shaped) and
    the ``action_mask`` the filters left: an adapter hands that mask back to the trainer, so that what was filtered
    leaves every denominator of the loss. Responses out of play have advantage 0."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    advantage: torch.Tensor
    returns: torch.Tensor | None = None
    metric_tensors: dict[str, torch.Tensor] = {}
    reward: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None


class RolloutResult(BaseModel):
    """What a recipe's shapers and filters leave of a rollout batch: the ``reward`` (``[B]`` or ``[B, T]``), the
    ``action_mask`` ``[B, T]`` narrowed by the filters, the responses still in play (``rows`` ``[B]`` bool: at least
    one action token left) and the stages' metrics."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    reward: torch.Tensor
    action_mask: torch.Tensor
    rows: torch.Tensor
    metric_tensors: dict[str, torch.Tensor] = {}

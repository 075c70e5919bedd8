"""TRL 1.16's own ``GRPOTrainer._compute_loss`` run on given tensors: the method itself, unbound, with a stand-in
``self`` that holds exactly the attributes it reads (one process, the model's forward replaced by the given
log-probs and entropies). The KL and entropy terms are then TRL's code, not a transcription of it."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch


class FakeGRPOTrainer:
    """The attributes ``GRPOTrainer._compute_loss`` reads, for ``loss_type`` with one process; entropy controller
    state (``entropy_coef``, ``_last_world_entropy``, ``_entropy_window_stats``) lives across calls as in TRL."""

    def __init__(self, *, gradient_accumulation_steps: int = 1, **config: Any):
        args = dict(
            loss_type="dapo",
            beta=0.0,
            epsilon=0.2,
            epsilon_high=0.2,
            importance_sampling_level="token",
            use_bias_correction_kl=False,
            delta=None,
            entropy_coef=0.0,
            use_adaptive_entropy=False,
            entropy_coef_min=0.0,
            entropy_coef_max=1.0,
            entropy_coef_delta=0.005,
            entropy_target=0.2,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            steps_per_generation=gradient_accumulation_steps,
        )
        args.update(config)
        self.args = SimpleNamespace(**args)
        self.loss_type = args["loss_type"]
        self.beta = args["beta"]
        self.epsilon_low, self.epsilon_high = args["epsilon"], args["epsilon_high"]
        self.importance_sampling_level = args["importance_sampling_level"]
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = False
        self.entropy_coef = args["entropy_coef"]
        self.use_adaptive_entropy = args["use_adaptive_entropy"]
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy = float("inf")
        self._entropy_window_stats = None
        self.current_gradient_accumulation_steps = gradient_accumulation_steps
        self.model = SimpleNamespace(training=True)
        self._metrics: dict[str, Any] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.accelerator = SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=lambda t: t,
            gather_for_metrics=lambda t: t,
            reduce=lambda t, reduction="sum": t,
        )
        self._forward: tuple[torch.Tensor, torch.Tensor] | None = None

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._forward is not None
        return self._forward[0], self._forward[1], None

    def compute_loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        advantage: torch.Tensor,
        *,
        old_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        sync_gradients: bool = True,
        num_items_in_batch: int | None = None,
    ) -> torch.Tensor:
        """TRL's ``_compute_loss`` for one micro-batch; ``sync_gradients``: this micro-batch ends the window."""
        from trl.trainer.grpo_trainer import GRPOTrainer

        B, T = logp.shape
        self._forward = (logp, entropy)
        self.max_completion_length = T  # dr_grpo's budget
        self.accelerator.sync_gradients = sync_gradients
        inputs = {
            "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
            "prompt_mask": torch.ones(B, 1, dtype=torch.long),
            "completion_ids": torch.zeros(B, T, dtype=torch.long),
            "completion_mask": mask.to(logp.dtype),
            "advantages": advantage,
            "num_items_in_batch": torch.tensor(
                float(mask.sum() if num_items_in_batch is None else num_items_in_batch), dtype=logp.dtype
            ),
        }
        if old_logp is not None:
            inputs["old_per_token_logps"] = old_logp
        if ref_logp is not None:
            inputs["ref_per_token_logps"] = ref_logp
        return GRPOTrainer._compute_loss(self, None, inputs)  # type: ignore[arg-type]


@pytest.fixture
def fake_grpo():
    """``FakeGRPOTrainer``: build one per run (``fake_grpo(loss_type=..., beta=...)``); skipped without TRL."""
    pytest.importorskip("trl")
    return FakeGRPOTrainer

"""The settings that decide a demo run: :class:`DemoSettings`, the defaults (:data:`DEFAULT`) and the test settings
(:data:`FAST`, ``lossplug demo --fast``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_RECIPE = "dapo"
#: a run "learned" when its reward (mean of the last logs minus mean of the first) rose by more than this and its
#: held-out score improved
LEARNED_MARGIN = 0.2


@dataclass(frozen=True)
class DemoSettings:
    """Everything that decides a demo run (recorded in ``summary.json``)."""

    steps: int = 200  # optimizer steps
    seed: int = 0  # model init, prompt order, sampling
    prompts_per_generation: int = 16  # prompts per rollout batch
    num_generations: int = 16  # completions per prompt (the group)
    steps_per_generation: int = 2  # optimizer steps per rollout batch: the 2nd is off-policy (ratios ≠ 1)
    max_completion_length: int = 3
    learning_rate: float = 3e-3
    hidden_size: int = 64
    layers: int = 2
    temperature: float = 1.0
    eval_every: int = 10  # held-out evaluation every … optimizer steps
    heldout_prompts: int = 100
    train_prompts: int = 2000
    threads: int = 1  # torch intra-op threads: 1 is fastest for this model size

    def __post_init__(self) -> None:
        if (self.prompts_per_generation * self.num_generations) % self.steps_per_generation:
            raise ValueError("prompts_per_generation × num_generations must be divisible by steps_per_generation")

    @property
    def logging_steps(self) -> int:
        return self.steps_per_generation  # every log holds exactly one rollout batch (so always a reward)

    def replace(self, **changes: Any) -> DemoSettings:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


DEFAULT = DemoSettings()
#: the test settings (``--fast``): a few dozen steps, well under a minute
FAST = DemoSettings(steps=60, eval_every=20, heldout_prompts=50)

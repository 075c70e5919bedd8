"""The demo's task and its held-out evaluation: :class:`SuccessorTask`, its reward (:func:`score`,
:func:`successor_reward`) and greedy decoding on prompts whose filler letters never occur in training.

A prompt is one to three filler letters followed by a digit ``d`` (``"c k 7"``); the reward is 1 when the first word
of the completion is ``(d + 1) mod 10`` and 0 otherwise. Training prompts use the fillers ``a``–``m``, held-out
prompts ``n``–``z``, so the held-out score measures ability apart from the learning signal.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

TRAIN_FILLERS = tuple(chr(c) for c in range(ord("a"), ord("n")))  # a … m
HELDOUT_FILLERS = tuple(chr(c) for c in range(ord("n"), ord("z") + 1))  # n … z


def score(prompt: str, completion: str) -> float:
    """The reward of one completion: 1 if its first word is the successor of the prompt's last digit, else 0."""
    digit = int(prompt.split()[-1])
    words = str(completion).split()
    return 1.0 if words and words[0] == str((digit + 1) % 10) else 0.0


def successor_reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: :func:`score` for every (prompt, completion)."""
    return [
        score(p if isinstance(p, str) else p[-1]["content"], c if isinstance(c, str) else c[-1]["content"])
        for p, c in zip(prompts, completions)
    ]


class SuccessorTask:
    """Prompts ``"<1–3 filler letters> <digit d>"``; answer ``(d + 1) mod 10`` as the first completion word."""

    name = "successor"
    description = (
        "prompt: 1-3 filler letters then a digit d; reward 1 if the first word of the completion is "
        "(d+1) mod 10, else 0. Held-out: greedy decoding on prompts whose filler letters (n-z) never "
        "occur in training (a-m), fraction answered correctly"
    )

    def __init__(self, seed: int = 0):
        self.seed = seed

    @staticmethod
    def _prompt(rng: random.Random, fillers: Sequence[str], digit: int) -> str:
        return " ".join([rng.choice(fillers) for _ in range(rng.randint(1, 3))] + [str(digit)])

    def train_prompts(self, n: int) -> list[str]:
        rng = random.Random(self.seed)
        return [self._prompt(rng, TRAIN_FILLERS, rng.randrange(10)) for _ in range(n)]

    def heldout_prompts(self, n: int) -> list[str]:
        rng = random.Random(10_000 + self.seed)  # balanced over digits
        return [self._prompt(rng, HELDOUT_FILLERS, i % 10) for i in range(n)]

    reward = staticmethod(successor_reward)

    @staticmethod
    def evaluate(model: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int = 1) -> float:
        """Greedy decoding on ``prompts``: the mean reward, i.e. the fraction answered correctly."""
        import torch

        was_training = model.training
        model.eval()
        try:
            enc = tok(list(prompts), return_tensors="pt", padding=True)
            enc = {k: v.to(model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
        finally:
            model.train(was_training)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(score(p, t) for p, t in zip(prompts, texts)) / len(prompts)

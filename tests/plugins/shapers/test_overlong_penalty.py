"""DAPO's soft overlong penalty equals verl 0.9.1's DAPORewardManager (the installed package, run on a DataProto with
a stand-in tokenizer and score function), per response and at the response's last token."""

from __future__ import annotations

import ast
import typing

import numpy as np
import pytest
import torch

import lossplug

verl = pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.workers.reward_manager.dapo import DAPORewardManager  # noqa: E402

MAX_LEN, BUFFER, FACTOR = 12, 4, 1.5


class _Tokenizer:
    eos_token = "<eos>"

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class _Buffer:
    enable, len, penalty_factor, log = True, BUFFER, FACTOR, True


def verl_rewards(scores: list[float], lengths: list[int], prompt_len: int = 3) -> torch.Tensor:
    """verl's token_level_scores ([B, MAX_LEN], float32) for responses of ``lengths`` scored ``scores``."""
    B = len(scores)
    attention = torch.zeros(B, prompt_len + MAX_LEN, dtype=torch.long)
    attention[:, :prompt_len] = 1
    for i, n in enumerate(lengths):
        attention[i, prompt_len : prompt_len + n] = 1
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(B, prompt_len, dtype=torch.long),
            "responses": torch.ones(B, MAX_LEN, dtype=torch.long),
            "attention_mask": attention,
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": str(i)} for i in range(B)], dtype=object),
            "data_source": np.array(["test"] * B, dtype=object),
        },
    )
    by_truth = {str(i): s for i, s in enumerate(scores)}
    manager = DAPORewardManager(
        tokenizer=_Tokenizer(),
        num_examine=0,
        compute_score=lambda data_source, solution_str, ground_truth, extra_info=None: by_truth[ground_truth],
        max_resp_len=MAX_LEN,
        overlong_buffer_cfg=_Buffer(),
    )
    return manager(data)


def batch(scores, lengths, token_reward=False):
    B = len(scores)
    mask = torch.arange(MAX_LEN).expand(B, MAX_LEN) < torch.tensor(lengths).unsqueeze(-1)
    reward = torch.tensor(scores, dtype=torch.float32)
    if token_reward:  # the score on the last action token, as verl's reward managers place it
        reward = torch.zeros(B, MAX_LEN).scatter(-1, (torch.tensor(lengths) - 1).unsqueeze(-1), reward.unsqueeze(-1))
    return lossplug.PolicyBatch(
        logp=torch.full((B, MAX_LEN), -1.0), action_mask=mask, reward=reward, group_id=torch.arange(B) // 2
    )


RECIPE = {
    "shapers": [{"name": "overlong_penalty", "max_response_length": MAX_LEN, "buffer": BUFFER, "factor": FACTOR}],
    "advantage": "grpo",
    "gates": ["ppo_clip"],
    "reduction": "token",
}
# short (no penalty), at the start of the buffer, inside it, at the limit; rewards of both signs
SCORES = [1.0, 0.0, 1.0, -0.5, 0.25, 1.0]
LENGTHS = [3, 8, 9, 11, 12, 10]


def test_a_per_response_reward_equals_verls_dapo_reward_manager_bitwise():
    expected = verl_rewards(SCORES, LENGTHS).sum(-1)
    shaped = lossplug.estimate_advantages(batch(SCORES, LENGTHS), RECIPE).reward
    assert shaped.dtype == torch.float32 and torch.equal(shaped, expected)
    # the formula, by hand: no penalty up to max − buffer tokens, −factor at the limit
    assert shaped[0] == 1.0 and shaped[1] == 0.0 and shaped[4] == pytest.approx(0.25 - FACTOR)


def test_a_per_token_reward_gains_the_penalty_on_the_last_action_token_as_verl_places_it():
    expected = verl_rewards(SCORES, LENGTHS)
    shaped = lossplug.estimate_advantages(batch(SCORES, LENGTHS, token_reward=True), RECIPE).reward
    assert torch.equal(shaped, expected)


def test_the_metrics_say_how_many_responses_were_penalised():
    res = lossplug.estimate_advantages(batch(SCORES, LENGTHS), RECIPE)
    assert float(res.metric_tensors["shaper/overlong_penalty/overlong_fraction"]) == pytest.approx(4 / 6)


def test_a_buffer_longer_than_the_limit_is_refused():
    with pytest.raises(lossplug.RecipeError, match="buffer"):
        lossplug.Recipe.model_validate(
            {**RECIPE, "shapers": [{"name": "overlong_penalty", "max_response_length": 4, "buffer": 8}]}
        )


def _areal_function(origins, path: str, name: str):
    """One function of AReaL's published wheel, compiled alone from its source (its module imports AReaL's whole
    runtime; the function needs only torch)."""
    source = (origins.package("areal") / path).read_text()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace = {"torch": torch, "Any": typing.Any}
    exec(compile(ast.Module([node], type_ignores=[]), f"areal/{path}", "exec"), namespace)
    return namespace[name]


def test_it_is_areals_reward_overlong_penalty(origins):
    """AReaL's own function, from its published wheel: the same formula, the length being the loss-mask count."""
    reward_overlong_penalty = _areal_function(origins, "utils/functional/functional.py", "reward_overlong_penalty")
    b = batch(SCORES, LENGTHS)
    data = {
        "rewards": b.reward.clone(),
        "input_ids": torch.zeros(len(SCORES), MAX_LEN, dtype=torch.long),
        "loss_mask": b.action_mask.long(),
    }
    expected = reward_overlong_penalty(data, BUFFER, FACTOR, MAX_LEN)["rewards"]
    shaped = lossplug.estimate_advantages(b, RECIPE).reward
    assert torch.equal(shaped, expected)


def test_a_float64_reward_gets_the_penalty_in_float64_as_verl_computes_it_in_python_floats():
    """A buffer and factor whose quotients float32 cannot hold: the penalty is computed in the reward's dtype, not in
    torch's default float32 (which put a ~1e-8 error on float64 rewards)."""
    buffer, factor = 7, 0.3
    scores, lengths = [1.0, 0.5, -0.25, 1.0, 0.0, 0.75], [3, 6, 7, 9, 11, 12]
    b = batch(scores, lengths)
    b = lossplug.PolicyBatch(logp=b.logp, action_mask=b.action_mask, reward=b.reward.double(), group_id=b.group_id)
    recipe = {
        **RECIPE,
        "shapers": [{"name": "overlong_penalty", "max_response_length": MAX_LEN, "buffer": buffer, "factor": factor}],
    }
    shaped = lossplug.estimate_advantages(b, recipe).reward
    # verl's DAPORewardManager, in Python floats: reward + min(−exceed / buffer · factor, 0)
    expected = [s + min(-(n - (MAX_LEN - buffer)) / buffer * factor, 0) for s, n in zip(scores, lengths)]
    assert shaped.dtype == torch.float64
    assert shaped.tolist() == expected
    # what float32 division gave: off in the last bits, which the exact comparison above rules out
    exceed = torch.tensor(lengths) - (MAX_LEN - buffer)
    float32_way = torch.tensor(scores, dtype=torch.float64) + (-exceed / buffer * factor).double().clamp(max=0)
    assert float32_way.tolist() != expected

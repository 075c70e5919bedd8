"""The bench's TRL cases time the recipe ``trl_equivalent`` gives for TRL's setting — the recipe a TRL user runs —
not a hand-tuned one: the same gates with the same parameters, and the same reduction."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import lossplug
from bench import loss_bench
from lossplug.adapters.trl import trl_equivalent
from lossplug.testing import tiny

#: bench case → the GRPOConfig settings whose TRL loss the case replicates
SETTINGS = {
    "sapo": {"loss_type": "sapo"},
    "cispo+tis": {
        "loss_type": "cispo",
        "epsilon_high": 5.0,
        "use_vllm": True,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": loss_bench.TIS_CAP,
    },
}


def _stages(recipe: lossplug.Recipe) -> tuple[list[dict], dict]:
    data = recipe.to_dict()
    return data["gates"], data["reduction"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_bench_times_trl_equivalents_recipe(name, tmp_path):
    (case,) = [c for c in loss_bench.trl_cases() if c.name == name]
    args = tiny.tiny_grpo_config(tmp_path, **SETTINGS[name])
    theirs, _ = trl_equivalent(args, sampling_logprobs=True)
    assert _stages(lossplug.Recipe.model_validate(case.recipe)) == _stages(theirs)

"""Turn ids on two data-parallel processes (torchrun, gloo on CPU): each prompt group spans both processes (2
completions each, ``num_generations`` 4), each process's rollout_func returns its own trajectory (two turns, a string
id) — so ``step_reinforce`` and ``gigpo`` are right only if the ids were gathered with the rewards, in TRL's order.
The advantages both processes keep equal ``lossplug.estimate_advantages`` on the gathered rewards with the ids
numbered by hand."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import lossplug

from .._torchrun import SCRIPT_HELPERS, rank_results, run_on_two_processes

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

RECIPES = {
    "step_reinforce": {
        "advantage": {"name": "step_reinforce", "gamma": 0.5, "grouping": "group", "mean": "group", "std": "group"},
        "gates": ["ppo_clip"],
        "reduction": "token",
    },
    "gigpo": {
        "advantage": {"name": "gigpo", "gamma": 0.9, "step_weight": 1.0},
        "gates": ["ppo_clip"],
        "reduction": "token",
    },
}

SCRIPT = SCRIPT_HELPERS + textwrap.dedent("""
    import json, os, sys, torch
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    class TurnRollout(tiny.TinyRollout):
        def __call__(self, prompts, trainer):
            out = super().__call__(prompts, trainer)
            # this process's rows are the two turns of one trajectory
            out["trajectory_id"] = [f"rank{RANK}-call{self.calls}"] * len(prompts)
            out["anchor_id"] = list(range(len(prompts)))
            return out

    out_dir, recipes = sys.argv[1], json.loads(sys.argv[2])
    RANK = int(os.environ["RANK"])
    result = {}
    for name, recipe in recipes.items():
        tok = tiny.tiny_tokenizer()
        args = tiny.tiny_grpo_config(os.path.join(out_dir, name), per_device_train_batch_size=2, num_iterations=1)
        trainer = LossplugGRPOTrainer(model=tiny.tiny_model(tok), reward_funcs=[tiny.length_reward], args=args,
                                      train_dataset=tiny.tiny_dataset(16), processing_class=tok, recipe=recipe,
                                      rollout_func=TurnRollout(tok, seed=11 + RANK, tools=False))
        assert trainer.accelerator.num_processes == 2
        output = first_generation(trainer)
        result[name] = {"advantages": output["advantages"].tolist(), "rewards": output["lossplug_reward"].tolist()}
    write_rank_result_and_exit(out_dir, result)
""")


def test_turn_ids_are_gathered_with_the_rewards_over_two_processes(tmp_path):
    from lossplug.testing.tiny import OFFLINE_ENV

    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    run_on_two_processes(script, str(tmp_path), json.dumps(RECIPES), env=OFFLINE_ENV)
    ranks = rank_results(tmp_path)
    for name, recipe in RECIPES.items():
        rewards = torch.tensor([v for r in ranks for v in r[name]["rewards"]], dtype=torch.float64)
        got = torch.tensor([v for r in ranks for v in r[name]["advantages"]], dtype=torch.float64)
        assert rewards.shape == (4,)
        expected = by_hand(rewards, recipe, trajectory=[0, 0, 1, 1])  # rank 0's trajectory, then rank 1's
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        # the two trajectories taken as one (ids not told apart over the processes) would give another advantage
        assert not torch.allclose(by_hand(rewards, recipe, trajectory=[0, 0, 0, 0]), expected, atol=1e-4), name


def by_hand(rewards, recipe, trajectory):
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(4, 1, dtype=torch.float64),
        action_mask=torch.ones(4, 1, dtype=torch.bool),
        reward=rewards,
        group_id=torch.zeros(4, dtype=torch.long),  # one prompt group over both processes
        trajectory_id=torch.tensor(trajectory),
        anchor_id=torch.tensor([0, 1, 0, 1]),
    )
    return lossplug.estimate_advantages(batch, recipe).advantage

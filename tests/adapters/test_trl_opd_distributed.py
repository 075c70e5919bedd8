"""``opd`` as TRL's advantage on two data-parallel processes (torchrun, gloo on CPU): each prompt group spans both
processes (2 completions each, ``num_generations`` 4). The task part (``grpo``) is right only if it ran on the rewards
gathered over the processes; the per-token part (``coef·(teacher_logp − old_logp)``) on each process's own
completions. Each process writes its advantages ``[2, T]`` and, computed in the script by plain forwards, its
teacher's and student's log-probs of its completions; the test recomputes the advantages by hand (float64, the group
advantage written out) and compares (float32, 1e-6)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from .._torchrun import SCRIPT_HELPERS, rank_results, run_on_two_processes

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

COEF = 0.5
TEMPERATURE = 0.7

SCRIPT = SCRIPT_HELPERS + textwrap.dedent("""
    import os, sys, torch
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    out_dir, coef, temperature = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])

    def direct(model, out):
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        T = out["completion_ids"].shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -T - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)

    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    args = tiny.tiny_grpo_config(os.path.join(out_dir, "run"), per_device_train_batch_size=2, num_iterations=1,
                                 temperature=temperature)
    recipe = {"advantage": {"name": "opd", "coef": coef, "task": "grpo"}, "gates": ["ppo_clip"], "reduction": "token"}
    trainer = LossplugGRPOTrainer(model=tiny.tiny_model(tok), reward_funcs=[tiny.length_reward], args=args,
                                  train_dataset=tiny.tiny_dataset(16), processing_class=tok, recipe=recipe,
                                  teacher_model=teacher)
    assert trainer.accelerator.num_processes == 2
    output = first_generation(trainer)
    result = {
        "advantages": output["advantages"].tolist(),
        "rewards": output["lossplug_reward"].tolist(),
        "mask": output["completion_mask"].tolist(),
        "teacher": direct(teacher, output).tolist(),
        "student": direct(trainer.model, output).tolist(),
        "old": output["old_per_token_logps"].tolist(),
    }
    write_rank_result_and_exit(out_dir, result)
""")


def test_opd_gathers_its_task_and_keeps_its_per_token_signal_per_process(tmp_path):
    from lossplug.testing.tiny import OFFLINE_ENV

    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    run_on_two_processes(script, str(tmp_path), str(COEF), str(TEMPERATURE), env=OFFLINE_ENV)
    ranks = rank_results(tmp_path)
    rewards = torch.tensor([v for r in ranks for v in r["rewards"]], dtype=torch.float64)
    assert rewards.shape == (4,) and not bool((rewards == rewards[0]).all())
    task = (rewards - rewards.mean()) / (rewards.std(unbiased=True) + 1e-6)  # one group over both processes
    for rank, r in enumerate(ranks):
        got = torch.tensor(r["advantages"], dtype=torch.float32)
        action = torch.tensor(r["mask"]).bool()
        teacher, student = (torch.tensor(r[k], dtype=torch.float64) for k in ("teacher", "student"))
        assert got.shape == action.shape
        expected = torch.where(action, COEF * (teacher - student) + task[2 * rank : 2 * rank + 2].unsqueeze(-1), 0)
        torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=1e-6)
        # the old log-probs the loss reads are the student's the advantage read
        old = torch.tensor(r["old"], dtype=torch.float64)
        torch.testing.assert_close(torch.where(action, old, 0), torch.where(action, student, 0), atol=1e-6, rtol=0)
        # the task part alone (the signal lost) would be another advantage
        assert not torch.allclose(
            got[action].double(), task[2 * rank : 2 * rank + 2].unsqueeze(-1).expand_as(expected)[action], atol=1e-3
        )

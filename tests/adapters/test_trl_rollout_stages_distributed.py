"""Shapers and filters on two data-parallel processes (torchrun, gloo on CPU): both run the stages on the same
gathered batch and agree on what is filtered, each zeroes its own filtered rows, ``num_items_in_batch`` and the
loss seam's sequence count are those of the kept rows of both, and the step's loss equals the recipe's loss over
the kept rows of both processes."""

from __future__ import annotations

import json
import textwrap

import pytest

from .._torchrun import run_on_two_processes

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.adapters.trl.loss import step_scaling
    from lossplug.testing import tiny

    def reward(completions, prompts, **kwargs):  # constant for "say" prompts; the clip makes more groups constant
        return [5.0 if "say" in p else float(len(str(c).split())) for p, c in zip(prompts, completions)]

    recipe = {"advantage": "grpo", "shapers": [{"name": "reward_clip", "low": 0.0, "high": 4.0}],
              "filters": ["zero_variance"], "gates": ["ppo_clip"], "reduction": "token"}

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    tok = tiny.tiny_tokenizer()
    # on-policy (num_iterations=1): the ratio is 1, so the recipe's loss is a closed form of the advantages
    args = tiny.tiny_grpo_config(os.path.join(out_dir, "run"), gradient_accumulation_steps=2, num_iterations=1)
    trainer = LossplugGRPOTrainer(model=tiny.tiny_model(tok), reward_funcs=[reward], args=args,
                                  train_dataset=tiny.tiny_dataset(16), processing_class=tok, recipe=recipe,
                                  rollout_func=tiny.TinyRollout(tok, seed=11 + rank, tools=False))
    assert trainer.accelerator.num_processes == 2
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    micro_batches = list(trainer._buffered_inputs)
    cat = lambda key: torch.cat([mb[key] for mb in micro_batches])
    result = {
        "in_play": cat("lossplug_in_play").tolist(),
        "tokens": cat("completion_mask").sum(-1).tolist(),
        "advantages": cat("advantages").tolist(),
        "num_items_in_batch": int(micro_batches[0]["num_items_in_batch"]),
        "kept_sequences": int(micro_batches[0]["lossplug_kept_sequences"]),
        "normalizers": [
            step_scaling(trainer, trainer._lossplug, "train", mb["completion_mask"].bool(), mb).normalizer.model_dump()
            for mb in micro_batches
        ],
    }
    with torch.no_grad():
        result["loss"] = float(sum(trainer._compute_loss(trainer.model, mb) for mb in micro_batches))
    trainer.train()  # two steps on two processes: no collective waits for a process that filtered everything
    result["keys"] = sorted(k for e in trainer.state.log_history for k in e if k.startswith("lossplug/"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


def test_two_processes_filter_the_same_completions_and_count_them_once(tmp_path):
    from lossplug.testing.tiny import OFFLINE_ENV

    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    run_on_two_processes(script, str(tmp_path), env=OFFLINE_ENV)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    in_play = [k for r in ranks for k in r["in_play"]]
    tokens = [n for r in ranks for n in r["tokens"]]
    advantages = [a for r in ranks for a in r["advantages"]]
    assert 0 < sum(in_play) < len(in_play)  # something filtered, something kept
    assert all(n == 0 for n, k in zip(tokens, in_play) if not k) and all(n > 0 for n, k in zip(tokens, in_play) if k)
    assert all(a == 0 for a, k in zip(advantages, in_play) if not k)
    kept = [(a, n) for a, n, k in zip(advantages, tokens, in_play) if k]
    for r in ranks:
        assert r["num_items_in_batch"] == sum(tokens) and r["kept_sequences"] == len(kept)
        for normalizer in r["normalizers"]:  # every micro-batch reduces over the kept rows of the whole step
            assert (normalizer["action_tokens"], normalizer["sequences"]) == (sum(tokens), len(kept))
        assert "lossplug/filter/zero_variance/dropped_responses" in r["keys"]
    # DDP averages the processes' gradients: the step's loss is the mean of theirs. With ratio 1 the ppo_clip
    # objective is A on every token: the token mean over the kept tokens of both processes
    step = sum(r["loss"] for r in ranks) / 2
    assert abs(sum(a * n for a, n in kept)) > 0.1  # (a denominator that counted the filtered tokens would show)
    assert step == pytest.approx(-sum(a * n for a, n in kept) / sum(n for _, n in kept), abs=1e-6)

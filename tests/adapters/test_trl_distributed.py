"""Two data-parallel processes (torchrun, gloo on CPU): the adapter's population (num_items_in_batch over all
processes, responses × processes) and its × num_processes scaling reproduce TRL's per-process loss, each process
gets its own groups' advantages, and lossplug metrics are agreed on across processes (no collective hangs)."""

from __future__ import annotations

import json
import textwrap

import pytest

from .._torchrun import run_on_two_processes

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from lossplug.adapters.trl import LossplugGRPOTrainer, attach, trl_equivalent
    from lossplug.testing import tiny
    from trl import GRPOTrainer

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    model, tok = tiny.tiny_model_and_tokenizer(os.path.join(out_dir, f"model{rank}"))  # same seed: same weights
    args = tiny.tiny_grpo_config(os.path.join(out_dir, "run"), gradient_accumulation_steps=2, num_iterations=2,
                                 beta=0.04, loss_type="dapo", epsilon_high=0.28, mask_truncated_completions=True)
    trainer = LossplugGRPOTrainer(model=model, reward_funcs=[tiny.length_reward], args=args,
                                  train_dataset=tiny.tiny_dataset(16), processing_class=tok, recipe="dapo",
                                  rollout_func=tiny.TinyRollout(tok, seed=11 + rank))
    assert trainer.accelerator.num_processes == 2
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    micro_batches = list(trainer._buffered_inputs)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    result = {"groups": sorted({g for mb in micro_batches for g in mb["lossplug_group_id"].tolist()}), "diff": {}}
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        trainer.loss_type = trainer.args.loss_type = loss_type
        recipe, population = trl_equivalent(trainer.args)
        attach(trainer, recipe, population=population)
        with torch.no_grad():
            native = sum(GRPOTrainer._compute_loss(trainer, trainer.model, mb) for mb in micro_batches)
            ours = sum(trainer._compute_loss(trainer.model, mb) for mb in micro_batches)
        result["diff"][loss_type] = abs(float(native - ours))
    attach(trainer, "dapo")
    trainer.train()
    result["keys"] = sorted(k for e in trainer.state.log_history for k in e if k.startswith("lossplug/"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # the result is written: leave without the interpreter's teardown, where a native thread still being joined
    # (gloo, OpenMP) can abort a process whose work succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


def test_two_processes(tmp_path):
    from lossplug.testing.tiny import OFFLINE_ENV

    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    run_on_two_processes(script, str(tmp_path), env=OFFLINE_ENV)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert not set(ranks[0]["groups"]) & set(ranks[1]["groups"])  # each process holds its own groups
    for r in ranks:
        assert max(r["diff"].values()) <= 1e-6, r["diff"]
        assert "lossplug/loss" in r["keys"] and "lossplug/advantage/mean" in r["keys"]

"""One rank of the 2-process gloo run of ``test_field_papers_gates_in_trainers.py``'s BAPO test (a script, not a test
module): verl's policy-loss seam (``get_policy_loss_fn("lossplug")``) under a real ``torch.distributed`` process
group, so that the verl adapter pools BAPO's statistic over the ranks (``Peers.torch_distributed``) as the authors'
``all_reduce`` does. Rank ``r`` takes rows ``[r·B/W, (r+1)·B/W)`` of the step of ``_field_trainers.verl_inputs`` in
micro-batches of ``MICRO`` rows (the ranks' i-th micro-batches run at the same time) and writes each micro-batch's
loss, gradient and chosen bounds to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist

RECIPE = {"gates": [{"name": "bapo", "target": 0.8}], "reduction": "token"}
SEED, NOISE = 6, 0.5


def field_trainers():
    spec = importlib.util.spec_from_file_location("_field_trainers", Path(__file__).with_name("_field_trainers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", default="")  # (_verl_ranks.run_ranks passes one; unused)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    ft = field_trainers()
    x = ft.verl_inputs(seed=SEED, update_noise=NOISE)
    mask = x["response_mask"]
    config = ft.verl_actor_config(RECIPE, ft.MICRO)
    config.global_batch_info.update(
        {
            "dp_size": args.world,
            "batch_num_tokens": int(mask.sum()),
            "global_batch_size": ft.B,
            "loss_scale_factor": None,
        }
    )
    per_rank = ft.B // args.world
    results = []
    for start in range(args.rank * per_rank, (args.rank + 1) * per_rank, ft.MICRO):
        rows = slice(start, start + ft.MICRO)
        width = int(x["lengths"][rows].max())
        mb = {k: v[rows, :width] for k, v in x.items() if k != "lengths"}
        log_prob = mb["log_prob"].clone().requires_grad_()
        loss, metrics = ft.verl_policy_loss(config, mb, log_prob)
        loss.backward()
        results.append(
            {
                "start": start,
                "width": width,
                "loss": loss.detach(),
                "grad": log_prob.grad,
                "bounds": (metrics["actor/lossplug/bapo/clip_low"], metrics["actor/lossplug/bapo/clip_high"]),
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out / f"rank{args.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of the 2-process gloo run of ``test_distributed.py`` (a script, not a test module).

Every rank trains a tiny policy under real ``DistributedDataParallel`` (gradients averaged over ranks) with gradient
accumulation over ``GA`` micro-batches (``no_sync`` on all but the last), for every reduction and both trainer
conventions:

* ``trl`` — TRL's ``_compute_loss`` returns a loss *already scaled for gradient accumulation* (the Trainer adds the
  micro-batch gradients without dividing by GA) and DDP averages over the ``W`` processes. lossplug's TRL adapter
  (``adapters/trl/loss.py``, ``step_scaling``) hands ``policy_loss`` the population of the whole step and multiplies the
  micro-batch share by ``num_processes × steps_per_generation / gradient_accumulation_steps`` (= W with TRL's default
  ``steps_per_generation == GA``). The adapter builds that population from a trainer's attributes (``step_scaling`` reads a
  ``GRPOTrainer``), so this worker reproduces it: each rank counts its own micro-batches of the step
  (``Normalizer.for_masks``) and ``Normalizer.all_reduce`` sums them over the ranks.
* ``verl`` — verl fills ``config.global_batch_info = {dp_size, batch_num_tokens, global_batch_size,
  loss_scale_factor}`` (all-reduced counts of the mini-batch); a policy loss normalises each micro-batch by those
  global counts and multiplies by ``dp_size`` (``agg_loss``), and FSDP/DDP averages. This worker all-reduces the counts
  the way verl does and turns them into ``(Normalizer, dp_size)`` with the formula of the verl adapter's
  ``verl_normalizer``. Importing verl costs ~5 s of CPU per process, so the workers do not; they record every
  ``(global_batch_info, normaliser, dp_size)`` they used, and the test checks in its own process that
  ``lossplug.adapters.verl.verl_normalizer`` returns exactly those.

Every (convention, reduction) runs twice: the policy loss alone, and with regularizers — a KL to a reference
(``low_var_kl``) and an entropy bonus whose gradient flows through the policy's entropy — each term reduced over the
step's population like the policy term (``population: step``), so they too must be exact under data parallelism and
accumulation.

Rank 0 also computes the single-process, full-batch reference gradient and writes every comparison to
``<out>/result.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import lossplug  # noqa: E402
from lossplug import Normalizer, PolicyBatch, Recipe  # noqa: E402

GA = 2
BUDGET = 7.0
REDUCTIONS = ("token", "response", "fixed", "sequence_sum")
#: rows of each micro-batch: rank 0 holds (3, 1), rank 1 holds (2, 4) — unequal on purpose
ROWS = ((3, 1), (2, 4))
T, D, V = 6, 5, 11
DT = torch.float64


REGULARIZERS = [
    {"name": "kl", "coef": 0.3, "estimator": "low_var_kl"},
    {"name": "entropy", "coef": 0.05},
]


class TinyPolicy(torch.nn.Module):
    """Per-position features → logits → log-prob of the sampled token, and the entropy of the distribution."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.proj = torch.nn.Parameter(0.5 * torch.randn(D, V, generator=g, dtype=DT))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(V, generator=g, dtype=DT))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ self.proj + self.bias
        logprobs = torch.log_softmax(logits, -1)
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def micro_batches() -> list[list[dict]]:
    """``[rank][k]`` → the data of micro-batch ``k`` of ``rank`` (identical on every process)."""
    g = torch.Generator().manual_seed(99)
    init = TinyPolicy()
    out = []
    for sizes in ROWS:
        mine = []
        for b in sizes:
            x = torch.randn(b, T, D, generator=g, dtype=DT)
            tokens = torch.randint(0, V, (b, T), generator=g)
            start = torch.randint(0, 2, (b, 1), generator=g)  # some rows open with a masked prompt-like position
            length = torch.randint(1, T, (b, 1), generator=g)
            pos = torch.arange(T)
            mask = (pos >= start) & (pos < start + length)
            mask[:, 3] &= torch.rand(b, generator=g) > 0.3  # interior holes (tool tokens) in some rows
            mask[torch.arange(b), start.squeeze(-1)] = True
            with torch.no_grad():
                old = (init(x, tokens)[0] + 0.3 * torch.randn(b, T, generator=g, dtype=DT)).clamp(max=0)
            adv = torch.randn(b, generator=g, dtype=DT)
            ref = (old + 0.4 * torch.randn(b, T, generator=g, dtype=DT)).clamp(max=0)
            mine.append(dict(x=x, tokens=tokens, mask=mask, old=old, adv=adv, ref=ref))
        out.append(mine)
    return out


def recipe(reduction: str, *, budget: bool, regularized: bool = False) -> Recipe:
    red = {"name": "fixed", "budget": BUDGET} if reduction == "fixed" and budget else reduction
    spec = {"gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}], "reduction": red}
    if regularized:
        spec["regularizers"] = REGULARIZERS
    return Recipe.model_validate(spec)


def batch(model, mb: dict, regularized: bool = False) -> PolicyBatch:
    logp, entropy = model(mb["x"], mb["tokens"])
    extra = dict(ref_logp=mb["ref"], entropy=entropy) if regularized else {}
    return PolicyBatch(logp=logp, old_logp=mb["old"], action_mask=mb["mask"], advantage=mb["adv"], **extra)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def reference(data, reduction: str, regularized: bool = False) -> torch.Tensor:
    """Single process, the whole step as one batch, no normaliser: the definition of the reduction."""
    model = TinyPolicy()
    mbs = [mb for mine in data for mb in mine]
    full = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
    rec = recipe(reduction, budget=True, regularized=regularized)
    lossplug.policy_loss(batch(model, full, regularized), rec).loss.backward()
    return grads(model)


def all_reduce_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


#: every (global_batch_info, action mask, normaliser, dp_size) the verl convention used on this rank
VERL_CALLS: list[dict] = []


def verl_normalizer(info: dict, mask: torch.Tensor) -> tuple[Normalizer, int]:
    """The verl adapter's formula (checked against ``lossplug.adapters.verl.verl_normalizer`` by the test)."""
    normalizer = Normalizer(
        action_tokens=info["batch_num_tokens"],
        sequences=info["global_batch_size"],
        budget=float(info["loss_scale_factor"]),
    )
    VERL_CALLS.append(
        {"info": dict(info), "mask": mask.tolist(), "normalizer": normalizer.model_dump(), "dp_size": info["dp_size"]}
    )
    return normalizer, info["dp_size"]


def train_step(
    convention: str, reduction: str, mine: list[dict], world: int, regularized: bool = False
) -> torch.Tensor:
    model = TinyPolicy()
    ddp = DDP(model)
    # 'fixed' takes its budget from the normaliser, as in both trainers
    rec = recipe(reduction, budget=False, regularized=regularized)
    local = Normalizer.for_masks([mb["mask"] for mb in mine], budget=BUDGET)
    if convention == "trl":
        normalizer = Normalizer.all_reduce(local)
        steps_per_generation = GA  # TRL's default
        scale = world * steps_per_generation / GA
    elif convention == "verl":
        info = {
            "dp_size": world,
            "batch_num_tokens": all_reduce_int(local.action_tokens),
            "global_batch_size": all_reduce_int(local.sequences),
            "loss_scale_factor": BUDGET,
        }
    elif convention == "naive":  # the bug class: every micro-batch its own population, averaged over GA
        normalizer, scale = None, 1.0 / GA
    for k, mb in enumerate(mine):
        sync = contextlib.nullcontext() if k == len(mine) - 1 else ddp.no_sync()
        with sync:
            if convention == "verl":
                normalizer, scale = verl_normalizer(info, mb["mask"])
            b = batch(ddp, mb, regularized)
            loss = (
                lossplug.policy_loss(
                    b,
                    rec if normalizer is not None else recipe(reduction, budget=True, regularized=regularized),
                    normalizer,
                ).loss
                * scale
            )
            loss.backward()
    return grads(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t_import = time.perf_counter() - T0
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=datetime.timedelta(seconds=60))
    t_init = time.perf_counter() - T0
    data = micro_batches()
    mine = data[args.rank]
    result: dict = {"errors": {}, "cross_rank": {}, "naive_token_error": None}
    for regularized in (False, True):
        for convention in ("trl", "verl"):
            for reduction in REDUCTIONS:
                g = train_step(convention, reduction, mine, args.world, regularized)
                gathered = [torch.empty_like(g) for _ in range(args.world)]
                dist.all_gather(gathered, g)
                if args.rank == 0:
                    ref = reference(data, reduction, regularized)
                    key = f"{convention}/{reduction}" + ("+regularizers" if regularized else "")
                    result["errors"][key] = float((g - ref).abs().max())
                    result["cross_rank"][key] = float(max((x - g).abs().max() for x in gathered))
                    ref_key = reduction + ("+regularizers" if regularized else "")
                    result.setdefault("ref_norm", {})[ref_key] = float(ref.norm())
                    if regularized:  # the regularizers must move the gradient, or the variant tests nothing
                        plain = reference(data, reduction)
                        result.setdefault("regularizer_share", {})[reduction] = float((ref - plain).norm())
    g = train_step("naive", "token", mine, args.world)
    if args.rank == 0:
        result["naive_token_error"] = float((g - reference(data, "token")).abs().max())
        result["verl_calls"] = VERL_CALLS
        result["seconds"] = {"import": t_import, "init": t_init, "total": time.perf_counter() - T0}
        with open(os.path.join(args.out, "result.json"), "w") as fh:
            json.dump(result, fh, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every result is written and the group is torn down: leave without the interpreter's own teardown, where a
    # native thread still being joined (gloo, OpenMP) can abort the process ("terminate called without an active
    # exception", exit −6) on a busy machine after the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

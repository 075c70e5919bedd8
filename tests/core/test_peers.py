"""lossplug.peers: the pool of a gate's batch-level statistic — identity on one rank, the trainer's collectives over
several (two gloo processes here), and join_peers for a rank whose micro-batch holds no action token."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import lossplug
from lossplug.peers import LOCAL, Peers
from lossplug.pipeline import join_peers

from .._torchrun import run_on_two_processes

TOP_ENTROPY = {"gates": ["reinforce", {"name": "top_entropy", "quantile": 0.3}], "reduction": "token"}


def _batch(seed: int, rows: int, width: int, empty: bool = False) -> lossplug.PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    if empty:
        mask[:] = False
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.1
    fields = {
        "logp": logp.requires_grad_(),
        "old_logp": logp.detach() + 0.05 * torch.randn(rows, width, generator=g, dtype=torch.float64),
        "advantage": torch.randn(rows, generator=g, dtype=torch.float64),
        "entropy": torch.rand(rows, width, generator=g, dtype=torch.float64) * 3,
        "action_mask": mask,
    }
    return lossplug.PolicyBatch.unchecked(**fields) if empty else lossplug.PolicyBatch(**fields)


def _kept(result: lossplug.LossResult) -> float:
    return float(result.metrics["top_entropy/keep_frac"])


def test_local_peers_are_the_identity_and_call_nothing():
    values = torch.tensor([3.0, 1.0, 2.0])
    assert LOCAL.local and LOCAL.gather(values).tolist() == [3.0, 1.0, 2.0]
    assert LOCAL.sum(values).tolist() == [3.0, 1.0, 2.0]
    assert Peers.torch_distributed() is LOCAL  # torch.distributed is not initialised in this process
    # without peers, the gate is the micro-batch's own quantile, as before
    batch = _batch(0, 6, 9)
    assert lossplug.policy_loss(batch, TOP_ENTROPY).loss == lossplug.policy_loss(batch, TOP_ENTROPY, peers=LOCAL).loss


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "Peers.size: must be a whole number ≥ 1"),
        ({"size": True}, "Peers.size"),
        ({"size": 2, "all_gather": torch.cat}, "all_sum is None"),
        ({"size": 2}, "all_gather and all_sum is None"),
    ],
)
def test_peers_refuse_what_cannot_pool(kwargs, message):
    with pytest.raises(lossplug.LossplugError, match=message):
        Peers(**kwargs)


def test_bad_peers_argument_and_values_are_named():
    with pytest.raises(lossplug.LossplugError, match="policy_loss: peers must be a lossplug.peers.Peers"):
        lossplug.policy_loss(_batch(0, 2, 3), TOP_ENTROPY, peers=dist)  # type: ignore[arg-type]
    with pytest.raises(lossplug.LossplugError, match=r"Peers.gather: expected a 1-D tensor .* shape \(2, 2\)"):
        LOCAL.gather(torch.zeros(2, 2))


def test_a_simulated_peer_sets_the_threshold_of_the_pooled_entropies():
    """Two ranks played by one process: rank 0 gathers its own entropies and a peer's fixed ones."""
    peer_entropies = torch.linspace(0.0, 4.0, 37)  # high entropies elsewhere: few of this rank's tokens pass

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.long:  # the lengths
            return torch.cat([tensor, torch.tensor([peer_entropies.numel()])])
        other = torch.cat([peer_entropies, peer_entropies.new_zeros(tensor.numel() - peer_entropies.numel())])
        return torch.cat([tensor, other.to(tensor.dtype)])

    peers = Peers(size=2, all_gather=all_gather, all_sum=lambda t: t * 2)
    batch = _batch(3, 5, 11)
    ours = lossplug.policy_loss(batch, TOP_ENTROPY, peers=peers)
    entropy = batch.entropy[batch.action_mask].float()  # type: ignore[index]
    threshold = torch.quantile(torch.cat([entropy, peer_entropies]), 0.7)  # TRL's get_high_entropy_mask
    keep = (batch.entropy.float() >= threshold) & batch.action_mask  # type: ignore[union-attr]
    assert _kept(ours) == pytest.approx(float(keep.sum() / batch.action_mask.sum()))
    assert _kept(ours) < _kept(lossplug.policy_loss(batch, TOP_ENTROPY))  # pooling changed the threshold


def test_join_peers_runs_only_the_pooling_gates_and_only_with_peers():
    calls: list[torch.Tensor] = []

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        return torch.cat([tensor, tensor])

    peers = Peers(size=2, all_gather=all_gather, all_sum=lambda t: t)
    join_peers(TOP_ENTROPY, LOCAL, torch.zeros(1))
    join_peers("dapo", peers, torch.zeros(1))  # no gate pools: nothing to join
    assert calls == []
    join_peers(TOP_ENTROPY, peers, torch.zeros(1, dtype=torch.bfloat16))
    assert [c.tolist() for c in calls] == [[0], []]  # this rank's length (0), then its (empty) values
    with pytest.raises(lossplug.LossplugError, match="join_peers: peers must be"):
        join_peers(TOP_ENTROPY, None, torch.zeros(1))  # type: ignore[arg-type]


def test_pooling_gates_are_declared():
    gates = lossplug.registry().plugins["gate"]
    pooling = sorted(name for name, plugin in gates.items() if plugin.pools)
    assert pooling == ["bapo", "bypass_is", "bypass_is_seq", "gvpo", "top_entropy", "tpo"]


# -- two real processes (gloo) -------------------------------------------------------------------------------------


WORKER = """
import os, sys, torch
import torch.distributed as dist
import lossplug
from lossplug.peers import Peers
from lossplug.pipeline import join_peers

TOP_ENTROPY = {top_entropy!r}
{batch_source}

def _kept(result):
    return float(result.metrics["top_entropy/keep_frac"])

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
peers = Peers.torch_distributed()
# unequal lengths: rank 0 holds 3 values, rank 1 five
gathered = peers.gather(torch.arange(3.0) if rank == 0 else torch.arange(10.0, 15.0))
summed = peers.sum(torch.tensor([1.0, float(rank)]))
batches = [_batch(seed, 4 + seed, 7 + 2 * seed) for seed in (0, 1)]
pooled = lossplug.policy_loss(batches[rank], TOP_ENTROPY, peers=peers)
# a rank with nothing to learn from joins its peer's gather; the peer's threshold is then its own values'
if rank == 1:
    join_peers(TOP_ENTROPY, peers, torch.zeros(1))
    alone = None
else:
    alone = _kept(lossplug.policy_loss(batches[0], TOP_ENTROPY, peers=peers))
torch.save({{"gathered": gathered, "summed": summed, "pooled": _kept(pooled), "alone": alone}},
           os.path.join(sys.argv[1], f"rank{{rank}}.pt"))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_two_gloo_processes_pool_like_trl(tmp_path):
    script = tmp_path / "peers.py"
    script.write_text(WORKER.format(top_entropy=TOP_ENTROPY, batch_source=inspect.getsource(_batch)))
    run_on_two_processes(script, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    batches = [_batch(seed, 4 + seed, 7 + 2 * seed) for seed in (0, 1)]
    entropies = [b.entropy[b.action_mask].float() for b in batches]  # type: ignore[index]
    for rank, result in enumerate(results):
        assert result["gathered"].tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 14.0]
        assert result["summed"].tolist() == [2.0, 1.0]
        # TRL's get_high_entropy_mask: the quantile of every process's action entropies
        threshold = torch.quantile(torch.cat(entropies), 0.7)
        batch = batches[rank]
        keep = (batch.entropy.float() >= threshold) & batch.action_mask  # type: ignore[union-attr]
        assert result["pooled"] == pytest.approx(float(keep.sum() / batch.action_mask.sum()))
    own = torch.quantile(entropies[0], 0.7)
    keep = (batches[0].entropy.float() >= own) & batches[0].action_mask  # type: ignore[union-attr]
    assert results[0]["alone"] == pytest.approx(float(keep.sum() / batches[0].action_mask.sum()))

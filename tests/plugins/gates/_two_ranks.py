"""Two ranks simulated in one process, for the tests of gates that pool over their peers (gvpo, tpo): each rank's
``Peers`` meet the other's at a barrier, as torch.distributed's collectives do, and each rank runs on its own thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from lossplug.peers import Peers


def two_rank_peers() -> tuple[Peers, Peers]:
    """Two in-process peers whose collectives meet at a barrier (what torch.distributed's all_gather does)."""
    barrier, slots = threading.Barrier(2), [None, None]

    def make(rank: int) -> Peers:
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            slots[rank] = t
            barrier.wait()
            out = torch.cat([slots[0], slots[1]])
            barrier.wait()
            return out

        def all_sum(t: torch.Tensor) -> torch.Tensor:
            slots[rank] = t
            barrier.wait()
            out = slots[0] + slots[1]
            barrier.wait()
            return out

        return Peers(size=2, all_gather=all_gather, all_sum=all_sum)

    return make(0), make(1)


def run_on_two_ranks(run: Callable[[int], None]) -> None:
    """``run(0)`` and ``run(1)`` on two threads at once (their peers' collectives wait for each other); asserts that
    neither raised, naming what was raised."""
    errors: list[Exception] = []

    def guarded(k: int) -> None:
        try:
            run(k)
        except Exception as err:  # pragma: no cover - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

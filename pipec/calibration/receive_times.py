"""What a receive costs when its input was sent before the receiver asked for it.

torch.distributed.pipelining posts an action's receive just before the action, and gloo's
send is a rendezvous: the sender's transport thread writes the tensor once the receiver has
asked for it. When the sender is computing on cores every process shares, that thread waits
for a core (on a 2-core AMD EPYC VM with 4 processes, a median 2–4 ms from the receive's post).

So the probe sends micro-batches down a chain of every process, each computing the relay's pass
(pipec.calibration.relay) per micro-batch, and the median time from a late receive's post (one
whose input was sent before) to its arrival is the simulation's ``late_receive_s``
(pipec.planning.simulate). Every process's clock is the machine's monotonic one.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist

from pipec.calibration.relay import operands, work_pass

MICRO_BATCHES = 8
# The first warms up; six are timed, since the waits are bimodal and two rounds' median spreads
# twice as widely (docs/cost-model.md).
ROUNDS = 7

# Per round and micro-batch: (receive posted, input arrived, pass ended) in seconds.
Records = list[tuple[float, float, float]]


def chain_records(rank: int, world: int) -> Records:
    """Run the chain (every process of the group calls it): each rank receives each
    micro-batch from the rank before, computes a pass, sends it on without waiting."""
    pair, token = operands(), torch.zeros(1)
    work_pass(pair)  # warm
    records: Records = []
    for _ in range(ROUNDS):
        dist.barrier()
        sends = []
        for _ in range(MICRO_BATCHES):
            posted = arrived = time.perf_counter()
            if rank > 0:
                dist.irecv(token, rank - 1).wait()
                arrived = time.perf_counter()
            work_pass(pair)
            records.append((posted, arrived, time.perf_counter()))
            if rank < world - 1:
                sends.append(dist.isend(token.clone(), rank + 1))
        for send in sends:
            send.wait()
    return records


def late_receive_s(records: list[Records]) -> float:
    """The median seconds from a late receive's post to its input's arrival over every rank
    but the first (``records`` in rank order; the first round left out); 0 where no receive
    came late."""
    waits = [arrived - posted
             for sender, receiver in itertools.pairwise(records)
             for i, (posted, arrived, _) in enumerate(receiver)
             if i >= MICRO_BATCHES and sender[i][2] < posted]
    return statistics.median(waits) if waits else 0.0

"""What a receive costs when its input was sent before the receiver asked for it.

torch.distributed.pipelining posts an action's receive just before the action, and gloo's
send is a rendezvous: the sender's transport thread writes the tensor once the receiver has
asked for it. When the sender is computing on cores every process shares, that thread waits
for a core. Measured on the 2-core development machine, a 4-byte tensor sent down a chain of
processes, each computing the relay's ~5 ms pass (pipec.relay) per micro-batch, took a median
0.2–0.4 ms from the receive's post with 2 processes but 2.0–4.0 ms with 4 (a receive posted
while its sender was still computing got its input 0.3–0.5 ms after the send). The training's
critical paths showed the same: middle stages of a 4-stage GPT pipeline waited a median
2.6–4.4 ms between their own actions though their input had been sent (pipec.critical).

So the probe sends micro-batches down a chain of every process, and the median time from a
late receive's post (one whose input was sent before) to its arrival is the simulation's
``late_receive_s`` (pipec.simulate). Every process's clock is the machine's monotonic one.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist

from pipec.relay import operands, work_pass

MICRO_BATCHES = 8
# The first warms up. Six timed rounds, not two: twelve probes gave 0.1 to 3.4 ms with two
# (standard deviation 1.3 ms), twelve 1.3 to 3.3 ms with six (0.6 ms), for about 0.4 s more; a
# later probe gave 0.43 ms: the waits are bimodal (docs/cost-model.md).
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

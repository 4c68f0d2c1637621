"""How fast a process computes while only some of the machine's processes compute and the
others wait for their turn in a gloo receive, as a pipeline's devices do in its bubbles.

Processor sharing (pipec.cost.cores) says that n of P processes computing on P / c cores' worth
run as fast as alone while n ≤ P / c, but the waiting processes are not free (their wake-ups,
gloo's threads, the caches they share): on a 2-core AMD EPYC VM with P = 4, a relayed pass ran
about 1.2 × its time alone with one process computing, where processor sharing says 1.0. So the
probe measures it: the P processes pass n tokens round a ring, each computing a fixed pass when
it holds one, for n = 1 … P − 1, and the pass's median time is set against the same pass timed
alone in the first process while the others wait in a gloo barrier (holding no core).

It does so in ROUNDS rounds, the pass alone then relayed at every n in each, and keeps the
median over rounds of each round's ratio, so that the machine's drift from one second to the
next falls on both sides of a ratio alike (docs/cost-model.md).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from pipec.calibration.timers import median_s, span_s

# The pass: WORK_PRODUCTS products of two WORK_SIZE² fp32 matrices, ~5 ms on a 2-core AMD EPYC VM.
WORK_SIZE = 192
WORK_PRODUCTS = 30
PASSES = 10  # per process, token count and round
ROUNDS = 6


def work_pass(operands: tuple[torch.Tensor, torch.Tensor]) -> None:
    for _ in range(WORK_PRODUCTS):
        torch.mm(*operands)


def operands() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(WORK_SIZE, WORK_SIZE, generator=generator),
            torch.randn(WORK_SIZE, WORK_SIZE, generator=generator))


def relayed_s(rank: int, world: int) -> list[list[float]]:
    """Per round, the pass's median seconds alone (in rank 0, the others waiting; 0 elsewhere),
    then this process's with n = 1 … world − 1 of the ``world`` processes computing at once
    (every process of the group calls it)."""
    pair = operands()
    work_pass(pair)  # warm
    rounds = []
    for _ in range(ROUNDS):
        dist.barrier()
        alone = median_s(lambda: work_pass(pair), PASSES) if rank == 0 else 0.0
        rounds.append([alone] + [statistics.median(_relay(rank, world, computing, pair))
                                 for computing in range(1, world)])
    return rounds


def _relay(rank: int, world: int, computing: int,
           pair: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """``computing`` tokens go round the ring of processes; each computes a pass when it holds
    one, then passes it on. Returns this process's pass times."""
    token = torch.zeros(1)
    before, after = (rank - 1) % world, (rank + 1) % world
    holds = rank < computing
    dist.barrier()
    times = []
    for _ in range(PASSES):
        if not holds:
            dist.recv(token, before)
        times.append(span_s(lambda: work_pass(pair), 1))
        dist.send(token, after)
        holds = False
    if rank < computing:  # the token the last holder passed back round
        dist.recv(token, before)
    return times


def slowdowns(relayed: list[list[list[float]]]) -> tuple[float, ...]:
    """Per n = 1 … P − 1 processes computing, over rounds the median of the median process's
    pass ÷ the pass alone in that round (``relayed``: relayed_s of each process, rank 0
    first)."""
    if not relayed or not relayed[0]:
        return ()
    ratios = [[statistics.median(process[r][n] for process in relayed) / relayed[0][r][0]
               for r in range(len(relayed[0])) if relayed[0][r][0] > 0]
              for n in range(1, len(relayed[0][0]))]
    return tuple(statistics.median(per_round) for per_round in ratios if per_round)

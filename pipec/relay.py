"""How fast a process computes while only some of the machine's processes compute and the others
wait for their turn in a gloo receive, as a pipeline's devices do in its bubbles.

Processor sharing (pipec.cores) says that n of P processes computing on P / c cores' worth run
as fast as alone while n ≤ P / c. Measured on the 2-core development machine with P = 4 and
c = 2.36, a pass relayed from process to process (a matrix-product loop, or the GPT sample's
forward and backward) ran 1.16–1.27 × its time alone with one process computing and
1.18–1.44 × with two (several runs), where processor sharing says 1.0 and 1.18: the waiting
processes are not free (their wake-ups, gloo's threads, the caches they share). So the probe
measures it: the P processes pass n tokens round a ring, each computing a fixed pass when it
holds one, for n = 1 … P − 1, and the pass's median time is set against the same pass timed
alone, in the parent before the workers start and after they end (pipec.probe).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from pipec.timers import median_s, span_s

WORK_SIZE = 192  # the pass: WORK_PRODUCTS products of two WORK_SIZE² fp32 matrices, ~5 ms here
WORK_PRODUCTS = 30
PASSES = 20  # per process and token count


def work_pass(operands: tuple[torch.Tensor, torch.Tensor]) -> None:
    for _ in range(WORK_PRODUCTS):
        torch.mm(*operands)


def operands() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(WORK_SIZE, WORK_SIZE, generator=generator),
            torch.randn(WORK_SIZE, WORK_SIZE, generator=generator))


def alone_s() -> float:
    """The pass's median seconds in this process, with nothing relayed."""
    pair = operands()
    return median_s(lambda: work_pass(pair), PASSES)


def relayed_s(rank: int, world: int) -> list[float]:
    """This process's median pass seconds with n = 1 … world − 1 of the ``world`` processes
    computing at once (every process of the group calls it)."""
    pair = operands()
    work_pass(pair)  # warm
    return [statistics.median(_relay(rank, world, computing, pair))
            for computing in range(1, world)]


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


def slowdowns(relayed: list[list[float]], alone: float) -> tuple[float, ...]:
    """Per n = 1 … P − 1 processes computing, the median process's pass ÷ the pass alone."""
    if alone <= 0 or not relayed:
        return ()
    return tuple(statistics.median(process[n] for process in relayed) / alone
                 for n in range(len(relayed[0])))

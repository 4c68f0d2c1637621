"""The choice under the model's error: a more complex plan (interleaving, a split backward, more
stages, a smaller micro-batch, sharding) must beat a simpler one by more than the time model's
measured error to win, since a smaller predicted margin says nothing about which measures faster
(docs/fidelity.md). The runner-up and its predicted margin are reported either way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pipec.planning.evaluate import Evaluated, rank
from pipec.planning.points import Costs
from pipec.planning.schedules import ZERO_BUBBLE
from pipec.planning.values import Candidate, Decision, PlanRequest

T = TypeVar("T")

# MEASURED_MARGIN: the time model's median relative error between two plans of one model, with
# compute times measured on the device: each plan's measured ÷ predicted step time against the
# median ratio of its model's other plans, over every saved fidelity run re-predicted on one
# cache by benchmarks/studies/repredict.py: 5.2 % over 316 plans, measured on a 2-core AMD EPYC VM.
# Below it a predicted gain says nothing about which plan measures faster. ROOFLINE_MARGIN, for
# a preset's roofline, which knows neither the kernels' real speed nor their overheads and was
# not measured apart: about the measured runs' 75th-percentile error. Evidence:
# docs/fidelity.md ("The decision margin").
MEASURED_MARGIN = 0.052
ROOFLINE_MARGIN = 0.13


def decision_margin(request: PlanRequest) -> float:
    if request.margin is not None:
        return request.margin
    return ROOFLINE_MARGIN if request.calibration is None else MEASURED_MARGIN


def choose(costs: Costs, best: Evaluated, alternatives: list[Evaluated]
           ) -> tuple[Evaluated, Decision]:
    """The fastest of the simplest plans predicted within the margin of ``best`` (the fastest;
    one of ``alternatives``), and why. The simplest: those no other plan within the margin is
    simpler than. Complexity is a partial order, so there may be several; walking down from
    ``best`` to ever simpler plans could end at a slower one of them (e.g. from ZB-V to
    interleaving, past a faster 1F1B plan at a smaller micro-batch that nothing within the
    margin is simpler than: tests/planning/test_choice.py)."""
    margin = decision_margin(costs.request)
    chosen = simplest_fastest([e for e in alternatives
                               if e.iteration_s <= best.iteration_s * (1 + margin)])
    others = [e for e in alternatives if not _same_plan(e, chosen)]
    runner_up = min(others, key=rank, default=None)
    if runner_up is None:
        return chosen, Decision(margin, None, 0.0, False)
    return chosen, Decision(margin, candidate(costs, runner_up),
                            runner_up.iteration_s / chosen.iteration_s - 1,
                            rank(runner_up) < rank(chosen))


def simplest_fastest(within: list[Evaluated]) -> Evaluated:
    """The fastest of the plans in ``within`` that no other plan there is simpler than."""
    return min(simplest(within, _complexity), key=rank)


def simplest(within: Sequence[T], complexity_of: Callable[[T], Complexity]) -> list[T]:
    """The plans in ``within`` that no other plan there is simpler than
    (benchmarks/studies/repredict.py applies the rule to saved plans too)."""
    keys = [complexity_of(e) for e in within]
    return [e for e, key in zip(within, keys, strict=True)
            if not any(simpler(other, key) for other in keys)]


def _same_plan(a: Evaluated, b: Evaluated) -> bool:
    """The same point (one stage runs every schedule alike), whatever its boundaries."""
    return a.layout == b.layout and a.micro_batch == b.micro_batch and (
        a.schedule == b.schedule or a.layout.pp == 1)


# A plan's place in the complexity order: stages per device, a split backward (zero bubble),
# pipeline devices, the micro-batch (negated: smaller is more complex), sharding (a unit per
# stage, then a unit per block, which adds collectives for every block and micro-batch).
Complexity = tuple[int, int, int, int, int]
SHARDING_COMPLEXITY = {"off": 0, "zero2": 1, "zero3": 1, "block": 2}


def complexity(virtual: int, schedule: str, pp: int, micro_batch: int, fsdp: str) -> Complexity:
    return (virtual, int(schedule in ZERO_BUBBLE), pp, -micro_batch, SHARDING_COMPLEXITY[fsdp])


def simpler(a: Complexity, b: Complexity) -> bool:
    """``a`` is simpler than ``b``: no more stages per device, no split backward where ``b``
    has none, no more pipeline devices, no smaller micro-batch, no sharding where ``b`` has
    none, and not the same in all five."""
    return a != b and all(x <= y for x, y in zip(a, b, strict=True))


def _complexity(e: Evaluated) -> Complexity:
    return complexity(e.layout.virtual, e.schedule, e.layout.pp, e.micro_batch, e.layout.fsdp)


def candidate(costs: Costs, e: Evaluated) -> Candidate:
    layout = e.layout
    return Candidate(e.micro_batch, e.num_micro_batches, e.schedule,
                     costs.request.global_batch / e.iteration_s, max(e.memory), e.fits(),
                     layout.pp, layout.dp, layout.virtual, layout.replicas_inner, layout.fsdp)

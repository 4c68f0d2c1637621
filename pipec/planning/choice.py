"""The choice under the model's error: a more complex plan (interleaving, a split backward, more
stages, a smaller micro-batch, sharding) must beat a simpler one by more than the time model's
measured error to win, since a smaller predicted margin says nothing about which measures faster
(docs/fidelity.md). The runner-up and its predicted margin are reported either way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pipec.planning.costs import Costs
from pipec.planning.evaluate import Evaluated, rank
from pipec.planning.values import Candidate, PlanRequest
from pipec.schedule import ZERO_BUBBLE

T = TypeVar("T")

# The time model's relative error between two plans of one model, measured by
# benchmarks/fidelity.py (docs/fidelity.md) with compute times measured on the device: each plan's
# measured ÷ predicted step time against the median ratio of its model's other plans. Since the
# sixteenth session (2026-12-03) the margin is that error of the present model over every saved
# run, re-predicted on one cache (benchmarks/repredict.py): a median 5.2 % (75th percentile
# 9.4 %) over 316 plans of 9 runs (4.8 % and 8.1 % over their 87 4-process plans). Re-predicting
# those runs, the plan the choice keeps among the measured ones measured a regret above 3 % in
# 14 of 53 case-runs at this margin (mean 2.3 %), 16 at the 9.9 % set in the ninth session
# (2.8 %), 13 with none (2.8 %), 17 at 13 % (3.0 %); 9 at 2 % (1.8 %), but below the model's
# error a predicted gain says nothing about which plan measures faster. The 9.9 % guarded gpt pp4
# against a 4-stage plan predicted 6.7 % faster and measured 1.154 × slower (twelfth
# session), a misjudgment of its 2 × 2 plans' all-reduces that the data-parallel groups'
# own figures mended (predicted 1.14 × slower, measured 1.11 ×). With the seventeenth session's
# whole run added (10 runs, 62 case-runs, re-predicted on that day's measurements) the error was
# 7.0 %, and no margin from 4 to 9.9 % kept fewer regrets above 3 % than 5.2 % did (11; 13 at
# 7 % and at 9.9 %), so it stays. Earlier margins and the runs
# behind them: docs/fidelity.md ("The decision margin"). A preset's roofline knows neither the
# kernels' real speed nor their overheads, and was not measured apart: it keeps 13 %, about the
# measured runs' 75th percentiles (9.9 % to 14.7 % in the ninth to twelfth sessions).
MEASURED_MARGIN = 0.052
ROOFLINE_MARGIN = 0.13


@dataclass(frozen=True)
class Decision:
    """Why the plan won: the margin a more complex plan needed, and the closest alternative."""

    margin: float
    runner_up: Candidate | None  # None: no other plan fits
    runner_up_relative: float  # its predicted step time ÷ the plan's − 1 (negative: faster)
    # The runner-up predicts faster, but a plan simpler than it is within the margin.
    kept_simpler: bool


def decision_margin(request: PlanRequest) -> float:
    if request.margin is not None:
        return request.margin
    return ROOFLINE_MARGIN if request.calibration is None else MEASURED_MARGIN


def choose(costs: Costs, best: Evaluated, alternatives: list[Evaluated]
           ) -> tuple[Evaluated, Decision]:
    """The fastest of the simplest plans predicted within the margin of ``best`` (the fastest;
    one of ``alternatives``), and why. The simplest: those no other plan within the margin is
    simpler than. Complexity is a partial order, so there may be several; walking down from
    ``best`` to ever simpler plans could end at a slower one of them (the sixth fidelity run's
    ResNet: from ZB-V to interleaving at a predicted 140 ms, past 1F1B at a smaller
    micro-batch at 137 ms, which nothing within the margin is simpler than)."""
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
    """The plans in ``within`` that no other plan there is simpler than (benchmarks/repredict.py
    applies the rule to saved plans too)."""
    keys = [complexity_of(e) for e in within]
    return [e for e, key in zip(within, keys, strict=True)
            if not any(simpler(other, key) for other in keys)]


def _same_plan(a: Evaluated, b: Evaluated) -> bool:
    """The same point (one stage runs every schedule alike), whatever its boundaries."""
    return a.layout == b.layout and a.micro_batch == b.micro_batch and (
        a.schedule == b.schedule or a.layout.pp == 1)


# A plan's place in the complexity order: stages per device, a split backward (zero bubble),
# pipeline devices, the micro-batch (negated: smaller is more complex), sharding.
Complexity = tuple[int, int, int, int, int]


def complexity(virtual: int, schedule: str, pp: int, micro_batch: int, fsdp: str) -> Complexity:
    return (virtual, int(schedule in ZERO_BUBBLE), pp, -micro_batch, int(fsdp != "off"))


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

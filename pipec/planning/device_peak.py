"""The peak of a device that holds several stages (interleaved, zero bubble's V): each stage's
activations, and under a split backward the gradients awaiting the weights' pass, rise and fall
with the device's order of actions, so the device's peak is the most of their sum at one
moment, not the sum of each stage's own most; and one backward runs at a time, so of the
stages' working sets only the largest is ever alive (benchmarks/memory_fidelity.py: a U-Net's
interleaved zero-bubble plan, docs/cost-model.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipec.cost.stage_memory import StageMemory
from pipec.planning.schedules import awaiting_weights, in_flight, order_changes


def apart_bytes(schedule: str, pp: int, num_micro_batches: int, virtual: int,
                stages: Sequence[StageMemory], recompute: Sequence[str]) -> tuple[float, ...]:
    """Per device, what its stages' own peaks count that the device never holds at once (0
    with one stage per device, or where a stage recomputes: its activations are not per
    micro-batch in flight, and its working set is its recomputed forward's too)."""
    if virtual == 1:
        return (0.0,) * pp
    flights = in_flight(schedule, pp, num_micro_batches, virtual)
    awaiting = awaiting_weights(schedule, pp, num_micro_batches, virtual)
    per_flight = np.array([m.activations / f if f else 0.0 for m, f in zip(stages, flights,
                                                                           strict=True)])
    per_wait = np.array([m.awaiting_weights / w if w else 0.0 for m, w in zip(stages, awaiting,
                                                                             strict=True)])
    apart = []
    for order, held, waits in order_changes(schedule, pp, num_micro_batches, virtual):
        mine = np.unique(order)
        if any(recompute[k] != "none" for k in mine):
            apart.append(0.0)
            continue
        peak = np.cumsum(held * per_flight[order] + waits * per_wait[order]).max(initial=0.0)
        own_peaks = sum(stages[k].activations + stages[k].awaiting_weights for k in mine)
        workings = [stages[k].working for k in mine]
        apart.append(max(float(own_peaks - peak), 0.0) + sum(workings) - max(workings))
    return tuple(apart)

"""A device holding several stages peaks at the most its stages hold together at one moment of
its order: pipec.planning.device_peak against a walk of the order action by action."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.cost.stage_memory import StageMemory
from pipec.planning.device_peak import apart_bytes
from pipec.planning.schedules import action_order, awaiting_weights, in_flight


def _memory(activations: float, awaiting: float, working: float = 0.0) -> StageMemory:
    return StageMemory(static=1.0, activations=activations, held_outputs=0.0,
                       receive_buffers=0.0, data=0.0, loss=0.0, working=working,
                       awaiting_weights=awaiting)


def _walked_peak(schedule: str, device: int, pp: int, m: int, virtual: int,
                 per_flight: list[float], per_wait: list[float]) -> float:
    flights = [0] * len(per_flight)
    waits = [0] * len(per_flight)
    peak = 0.0
    for kind, stage, _ in action_order(schedule, device, pp, m, virtual):
        flights[stage] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        waits[stage] += {"I": 1, "W": -1}.get(kind, 0)
        peak = max(peak, sum(f * a + w * g for f, a, w, g in
                             zip(flights, per_flight, waits, per_wait, strict=True)))
    return peak


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(("interleaved", "interleaved-zb", "zbv")), st.sampled_from((2, 4)),
       st.integers(1, 3), st.data())
def test_the_device_peak_is_the_most_held_at_once(schedule: str, pp: int, rounds: int,
                                                  data: st.DataObject) -> None:
    m, virtual = pp * rounds, 2
    sizes = st.floats(0.0, 1e6, allow_nan=False)
    per_flight = [data.draw(sizes) for _ in range(pp * virtual)]
    per_wait = [data.draw(sizes) for _ in per_flight]
    flights = in_flight(schedule, pp, m, virtual)
    awaiting = awaiting_weights(schedule, pp, m, virtual)
    stages = [_memory(f * a, w * g) for f, a, w, g in
              zip(flights, per_flight, awaiting, per_wait, strict=True)]
    apart = apart_bytes(schedule, pp, m, virtual, stages, ["none"] * len(stages))
    for device in range(pp):
        mine = {stage for _, stage, _ in action_order(schedule, device, pp, m, virtual)}
        own = sum(stages[k].activations + stages[k].awaiting_weights for k in mine)
        peak = _walked_peak(schedule, device, pp, m, virtual, per_flight, per_wait)
        assert apart[device] == pytest.approx(own - peak, rel=1e-9, abs=1e-6)


def test_stages_at_their_peaks_together_hold_nothing_apart() -> None:
    # Interleaved 1F1B on 2 devices with 2 micro-batches runs every forward first.
    stages = [_memory(10.0, 0.0)] * 4
    assert apart_bytes("interleaved", 2, 2, 2, stages, ["none"] * 4) == (0.0, 0.0)


def test_one_stage_per_device_or_a_recomputing_stage_counts_its_own_peak() -> None:
    stages = [_memory(10.0, 5.0)] * 4
    assert apart_bytes("1f1b", 4, 8, 1, stages, ["none"] * 4) == (0.0,) * 4
    assert apart_bytes("interleaved-zb", 2, 4, 2, stages, ["none"] * 4) != (0.0, 0.0)
    assert apart_bytes("interleaved-zb", 2, 4, 2, stages, ["full", "none", "none", "none"]
                       )[0] == 0.0


def test_of_the_stages_working_sets_only_the_largest_is_alive() -> None:
    """One backward runs at a time on a device: the stages' other working sets are apart."""
    stages = [_memory(0.0, 0.0, working) for working in (3.0, 5.0, 7.0, 2.0)]
    assert apart_bytes("interleaved", 2, 2, 2, stages, ["none"] * 4) == (3.0, 2.0)

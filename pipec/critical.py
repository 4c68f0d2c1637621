"""Where a measured step's time went: its critical path through the actions train.py --metrics
recorded (the ``timelines`` of metrics.json, every rank on one machine's clock).

The path is walked back from the action that ended last. Each action waited for whichever
ended later of the action before it on its own rank and the action whose output it needs: a
forward the previous stage's forward of its micro-batch, a backward the next stage's backward
(the last stage's: its own forward), a weights' gradient its backward. The step then splits
exactly into the path's compute, its waits for another rank's output (a link: the transfer,
and the receiver waking), its waits after its own rank's previous action (the runtime between
two actions: posting sends and receives, the loss), the wait before its first action (the
step's data, receives) and the time after its last (the loss's broadcast, the gradient
all-reduce, the optimizer step). A model that misses a term shows it here, measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# An action as recorded: kind ("forward", "backward", "weight"), stage, micro-batch, start, end
# (seconds from the step's first start on any rank).
Action = tuple[str, int, int, float, float]
_Key = tuple[tuple[int, int], str, int, int]  # (replica, tp rank), kind, stage, micro-batch


@dataclass(frozen=True)
class Breakdown:
    """One step's critical path, seconds; the five parts sum to ``step_s``."""

    step_s: float
    compute_s: float
    input_waits_s: float  # waits for another rank's output
    between_s: float  # waits after the rank's own previous action
    before_s: float  # the step's start to the path's first action, on its rank
    after_s: float  # the path's last action to the step's end, on its rank
    actions: int  # on the path
    hops: int  # waits for another rank's output on the path

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute_s, "waits for inputs": self.input_waits_s,
                "between own actions": self.between_s, "before the first action":
                self.before_s, "after the last action": self.after_s}


def step_breakdown(ranks: list[dict[str, Any]], stages: int) -> Breakdown:
    """The critical path of one step: ``ranks`` as in metrics.json's ``timelines[i]``. Ranks
    begin and end their steps at other times (the last stage starts its next step while the
    first still updates), so the step runs from the start of the path's first rank's to the end
    of its last's."""
    actions = {r["rank"]: sorted((tuple(a) for a in r["actions"]), key=lambda a: a[3])
               for r in ranks}
    # A rank's copy of the pipeline: its replica and, under tensor parallelism, its tp rank
    # (metrics files without one: 0).
    replica = {r["rank"]: (r["replica"], r.get("tp", 0)) for r in ranks}
    where = {(replica[rank], a[0], a[1], a[2]): (rank, i)
             for rank, listed in actions.items() for i, a in enumerate(listed)}
    starts = {r["rank"]: r["start"] for r in ranks}
    ends = {r["rank"]: r["end"] for r in ranks}
    last = max(((rank, len(listed) - 1) for rank, listed in actions.items() if listed),
               key=lambda ri: actions[ri[0]][ri[1]][4], default=None)
    if last is None:
        step = max(ends[r] - starts[r] for r in starts)
        return Breakdown(step, 0.0, 0.0, 0.0, step, 0.0, 0, 0)
    compute = waits = between = 0.0
    hops = count = 0
    rank, i = last
    end = ends[rank]
    after = end - actions[rank][i][4]
    while True:
        action = actions[rank][i]
        compute += action[4] - action[3]
        count += 1
        before = _predecessor(actions, where, replica[rank], rank, i, stages)
        if before is None:
            start = starts[rank]
            return Breakdown(end - start, compute, waits, between, action[3] - start, after,
                             count, hops)
        gap = action[3] - actions[before[0]][before[1]][4]
        if before[0] == rank:
            between += gap
        else:
            waits, hops = waits + gap, hops + 1
        rank, i = before


def _predecessor(actions: dict[int, list[Action]], where: dict[_Key, tuple[int, int]],
                 replica: tuple[int, int], rank: int, i: int, stages: int
                 ) -> tuple[int, int] | None:
    """Of the rank's previous action and the action whose output this one needs, the one that
    ended later (None: neither was recorded)."""
    kind, stage, micro_batch = actions[rank][i][:3]
    needed = {"forward": ("forward", stage - 1),
              "backward": ("backward", stage + 1) if stage + 1 < stages else ("forward", stage),
              "weight": ("backward", stage)}.get(kind)
    candidates = [(rank, i - 1)] if i > 0 else []
    if needed is not None and needed[1] >= 0:
        source = where.get((replica, needed[0], needed[1], micro_batch))
        if source is not None and actions[source[0]][source[1]][4] <= actions[rank][i][3]:
            candidates.append(source)
    if not candidates:
        return None
    return max(candidates, key=lambda ri: actions[ri[0]][ri[1]][4])


def mean_breakdown(timelines: list[list[dict[str, Any]]], stages: int) -> Breakdown | None:
    """The mean over the recorded steps (None: none recorded): its parts still sum to its step."""
    steps = [step_breakdown(ranks, stages) for ranks in timelines]
    if not steps:
        return None
    def mean(field: str) -> float:
        return float(sum(getattr(s, field) for s in steps)) / len(steps)

    return Breakdown(mean("step_s"), mean("compute_s"), mean("input_waits_s"), mean("between_s"),
                     mean("before_s"), mean("after_s"), round(mean("actions")), round(mean("hops")))

"""pipec.critical: a measured step's critical path, split exactly into its parts."""

from __future__ import annotations

from typing import Any

import pytest

from pipec.critical import mean_breakdown, step_breakdown


def _rank(rank: int, actions: list[list[Any]], start: float = 0.0, end: float = 20.0,
          replica: int = 0) -> dict[str, Any]:
    return {"rank": rank, "device": rank, "replica": replica, "start": start, "end": end,
            "actions": actions}


# Two stages, GPipe over two micro-batches: rank 1's second forward waits 1 after its first
# (the runtime between actions), each hand-off between ranks takes 0.5.
GPIPE = [
    _rank(0, [["forward", 0, 0, 1.0, 3.0], ["forward", 0, 1, 3.2, 5.2],
              ["backward", 0, 0, 12.0, 13.8], ["backward", 0, 1, 14.5, 16.5]], 0.0, 19.0),
    _rank(1, [["forward", 1, 0, 3.5, 5.5], ["forward", 1, 1, 6.5, 8.5],
              ["backward", 1, 0, 9.0, 11.5], ["backward", 1, 1, 11.6, 14.0]], 0.5, 18.0),
]


def test_the_path_follows_the_latest_of_own_and_needed_action() -> None:
    path = step_breakdown(GPIPE, stages=2)
    # Back from rank 0's last backward (ends 16.5; its rank ends the step at 19): it waited for
    # rank 1's second backward (14.0 → 14.5), which followed its first (11.5 → 11.6), which
    # followed rank 1's own forward of micro-batch 0 only through its own order: the last
    # stage's backward needs its forward (8.5 → 9.0), whose input came at 5.2 but which
    # waited for rank 1's first forward (5.5 → 6.5), which waited for rank 0 (3.0 → 3.5),
    # whose first forward started 1.0 into rank 0's step.
    assert path.compute_s == pytest.approx(2 + 2.4 + 2.5 + 2 + 2 + 2)
    assert path.input_waits_s == pytest.approx(0.5 + 0.5)
    assert path.between_s == pytest.approx(0.1 + 0.5 + 1.0)
    assert (path.before_s, path.after_s) == pytest.approx((1.0, 2.5))
    assert (path.actions, path.hops) == (6, 2)
    assert sum(path.parts().values()) == pytest.approx(path.step_s) == pytest.approx(19.0)


def test_the_step_runs_from_the_first_ranks_start_to_the_last_ranks_end() -> None:
    # The path's first action is rank 0's, its last rank 1's: rank 1 started its step early.
    ranks = [_rank(0, [["forward", 0, 0, 2.0, 4.0]], 1.0, 9.0),
             _rank(1, [["forward", 1, 0, 4.5, 6.0], ["backward", 1, 0, 6.0, 8.0]], 0.0, 10.0)]
    path = step_breakdown(ranks, stages=2)
    assert (path.before_s, path.after_s, path.step_s) == pytest.approx((1.0, 2.0, 9.0))
    assert path.input_waits_s == pytest.approx(0.5) and path.between_s == 0.0


def test_replicas_are_followed_apart_and_a_turn_on_one_device_is_no_hop() -> None:
    # Two replicas of a V: stages 0 and 1 on one device each; replica 1 ends last.
    ranks = [_rank(0, [["forward", 0, 0, 0.0, 1.0], ["forward", 1, 0, 1.2, 2.0]], end=3.0),
             _rank(1, [["forward", 0, 0, 0.0, 1.0], ["forward", 1, 0, 1.5, 2.5]], end=3.0,
                   replica=1)]
    path = step_breakdown(ranks, stages=2)
    assert path.hops == 0 and path.between_s == pytest.approx(0.5)
    assert path.compute_s == pytest.approx(2.0) and path.after_s == pytest.approx(0.5)


def test_a_weights_gradient_follows_its_backward() -> None:
    ranks = [_rank(0, [["backward", 0, 0, 0.0, 1.0], ["forward", 0, 1, 1.0, 1.5],
                       ["weight", 0, 0, 2.0, 2.5]], end=3.0)]
    path = step_breakdown(ranks, stages=1)
    # The weights' gradient waited on its rank's forward (which ended later than its backward).
    assert path.actions == 3 and path.between_s == pytest.approx(0.5)


def test_no_timelines_no_breakdown_and_the_mean_keeps_the_sum() -> None:
    assert mean_breakdown([], stages=2) is None
    idle = step_breakdown([_rank(0, [], 0.0, 2.0)], stages=1)
    assert idle.before_s == idle.step_s == 2.0 and idle.actions == 0
    mean = mean_breakdown([GPIPE, GPIPE], stages=2)
    assert mean is not None and sum(mean.parts().values()) == pytest.approx(mean.step_s)


def test_tensor_parallel_ranks_are_apart_copies_of_the_pipeline() -> None:
    # tp 2: each pipeline rank has a twin with its own clock (here 0.3 later); without the tp
    # rank in the key, one rank's actions would stand for its twin's.
    twins = [{**rank, "rank": rank["rank"] + 2, "tp": 1,
              "actions": [[*a[:3], a[3] + 0.3, a[4] + 0.3] for a in rank["actions"]]}
             for rank in GPIPE]
    path = step_breakdown([*twins, *({**r, "tp": 0} for r in GPIPE)], stages=2)
    alone = step_breakdown(GPIPE, stages=2)
    assert (path.actions, path.hops) == (alone.actions, alone.hops)
    assert (path.compute_s, path.input_waits_s, path.between_s) == pytest.approx(
        (alone.compute_s, alone.input_waits_s, alone.between_s))

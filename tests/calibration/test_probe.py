"""pipec.calibration.probe: the training runtime's figures on this machine's CPU processes."""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipec.calibration.allreduce_times import (
    DATA_PARALLEL_SHAPES,
    group_data_parallel_s,
    replica_counts,
)
from pipec.calibration.probe import (
    RuntimeFigures,
    fit_link,
    free_port,
    probe_runtime,
    side_by_side,
)
from pipec.calibration.receive_times import MICRO_BATCHES, late_receive_s
from pipec.calibration.relay import slowdowns
from pipec.calibration.timers import median_in_turns
from pipec.planning.schedules import SCHEDULES, posted_links

UNMEASURED = ((0.0, 0.0),) * len(DATA_PARALLEL_SHAPES)  # the data-parallel steps, not probed


def test_one_process_measures_nothing_it_cannot_use() -> None:
    """Only what one process pays by itself: selective recomputation's policy, about 11 µs per
    operation and pass here (an operation's own time is a few µs: far below a millisecond)."""
    figures = probe_runtime(1, 1)
    assert replace(figures, selective_node_s=0.0) == RuntimeFigures(
        1, 0.0, 0.0, 0.0, 0.0, 0.0, {}, 0.0, UNMEASURED, 0.0, ())
    assert 1e-7 < figures.selective_node_s < 1e-3
    assert side_by_side(lambda: None, 1) == 1.0


def _busy() -> None:
    """About 20 ms of one core's work."""
    x = torch.ones(1 << 20)
    for _ in range(40):
        x = x * 1.0001 + 1.0


@pytest.mark.skipif((os.cpu_count() or 1) > 2, reason="4 processes share 2 cores only here")
def test_four_processes_on_two_cores_compute_at_half_speed_or_less() -> None:
    # About 2 run alone; forked from a whole test session's process, less (under 1.6), still
    # clearly above 1.0.
    assert any(side_by_side(_busy, 4, rounds=3) > 1.3 for _ in range(3))


def test_side_by_side_reports_the_slowest_process() -> None:
    """Training in step waits for its slowest rank: copies twice as slow as this process give
    × 2 (the median of two processes would say × 1.5). Sleeps, so the cores' load is moot."""
    parent = os.getpid()

    def run() -> None:
        time.sleep(0.002 if os.getpid() == parent else 0.004)

    assert side_by_side(run, 2, rounds=3, min_seconds=0.05) == pytest.approx(2.0, rel=0.15)


def test_schedules_are_timed_in_turns_and_medians_skip_the_warm_up() -> None:
    """Each run once a round, in turn (a drift of the machine's speed lands on every schedule
    alike), the first round not counted."""
    calls: list[str] = []
    durations = {"slow": iter([0.05, 0.004, 0.004, 0.004]), "fast": iter([0.05, 0.0, 0.0, 0.0])}

    def run(name: str) -> Callable[[], None]:
        return lambda: (calls.append(name), time.sleep(next(durations[name])))[0]

    medians = median_in_turns({"slow": run("slow"), "fast": run("fast")}, rounds=3)
    assert calls == ["slow", "fast"] * 4
    assert 0.004 <= medians["slow"] < 0.04 and medians["fast"] < 0.004


def test_the_link_fit_recovers_latency_and_bandwidth() -> None:
    latency, bandwidth = 150e-6, 2e9
    one_way = {size: latency + size / bandwidth for size in (4, 65536, 2**20, 2**22)}
    fitted = fit_link(one_way)
    assert fitted[0] == pytest.approx(latency) and fitted[1] == pytest.approx(bandwidth)


def test_four_processes_on_this_machine() -> None:
    """Every figure is measured (links between ranks 0 and 1, the runtime's action on them)."""
    figures = probe_runtime(4, 1)
    assert figures.processes == 4
    assert figures.latency_s > 0 and figures.bandwidth > 1e7
    assert math.isfinite(figures.action_overhead_s) and figures.action_overhead_s >= 0
    assert figures.allreduce_bandwidth > 1e7 and figures.step_overhead_s > 0
    # Every schedule's step of the probe's pipeline; the runtime schedules (torch's
    # _PipelineScheduleRuntime, twice the stages) take longer than 1F1B's.
    steps = figures.schedule_step_s
    assert set(steps) == set(SCHEDULES) and all(s > 0 for s in steps.values())
    assert min(steps["interleaved"], steps["zbv"]) > steps["1f1b"]
    # Splitting a backward walks its autograd graph in Python: microseconds per operation.
    assert 0 < figures.split_backward_node_s < 1e-3
    # Data parallelism adds to a step, more with more gradient bytes (4 MiB against 16 KiB).
    # The 88 more gradient tensors of the third (about the same bytes) add 3-4 ms, within the
    # noise of 4 processes on 2 cores: only that it adds. The fit's own test holds the rest.
    (small_s, small), (large_s, large), (many_s, many) = figures.data_parallel_s
    assert 0 < small < large and many > 0
    assert 0 < small_s < min(large_s, many_s)  # without DDP: wider or more layers, more time
    # And again on 2 of the 4 processes while the others wait: its own three steps.
    assert [d for d, _ in figures.group_data_parallel_s] == [2]
    assert all(compute > 0 and extra > 0 for compute, extra in figures.group_data_parallel_s[0][1])
    # An all-reduce blocking a pass adds to it (16² against 64² images). More after more
    # compute on 2 processes, but with 4 sharing 2 cores the two may come either way round:
    # blocking_fit then fits no growth.
    (short_s, short_extra), (long_s, long_extra) = figures.blocking_s
    assert 0 < short_s < long_s and short_extra > 0 and long_extra > 0
    # A pass relayed with 1, 2 and 3 of the 4 computing, against it alone: about 1.2 with one
    # or two on a 2-core AMD EPYC VM, whose speed drifts between the two timings: loose bounds.
    assert len(figures.relay_slowdowns) == 3
    assert all(0.5 < s < 4 for s in figures.relay_slowdowns)
    # A receive posted after its input was sent waits for the busy sender's thread: a few ms
    # with 4 processes on 2 cores.
    assert 0 < figures.late_receive_s < 0.05


def test_a_late_receive_counts_only_inputs_sent_before_the_post() -> None:
    # Two ranks, the first round left out: rank 1's receives posted at 10 (input sent at 9:
    # late, 2 s to arrive) and at 20 (sent at 21: waiting for it, not counted).
    first = [(0.0, 0.0, 0.5)] * MICRO_BATCHES
    sender = [*first, (0.0, 0.0, 9.0), (0.0, 0.0, 21.0), *first[2:]]
    receiver = [*first, (10.0, 12.0, 13.0), (20.0, 21.5, 22.0), *first[2:]]
    assert late_receive_s([sender, receiver]) == 2.0
    assert late_receive_s([sender]) == 0.0


def test_relay_slowdowns_take_each_rounds_median_process_against_alone_then_the_median() -> None:
    # Three processes, three rounds: [alone (rank 0's only), n = 1, n = 2] per round.
    relayed = [[[2.0, 2.0, 3.0], [1.0, 1.0, 1.0], [4.0, 9.0, 9.0]],
               [[0.0, 4.0, 3.0], [0.0, 2.0, 3.0], [0.0, 9.0, 9.0]],
               [[0.0, 2.0, 5.0], [0.0, 1.0, 1.0], [0.0, 9.0, 9.0]]]
    # Round by round: n = 1 gives 2/2, 1/1, 9/4; n = 2 gives 3/2, 1/1, 9/4.
    assert slowdowns(relayed) == (1.0, 1.5)
    assert slowdowns([]) == () and slowdowns([[]]) == ()
    # A round whose alone timing is missing is left out, not divided by.
    assert slowdowns([[[0.0, 1.0], [2.0, 3.0]]]) == (1.5,)


def _run_group_probe(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results.put((rank, group_data_parallel_s(rank, 2)))
    except Exception as exc:  # the parent fails the test instead of waiting for the others
        results.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def test_the_group_probe_measures_on_its_replicas_while_the_others_wait() -> None:
    """Real gloo processes: ranks 0 and 1 time the three data-parallel steps over their group
    (a step, and what DDP adds to it); ranks 2 and 3 only wait."""
    assert replica_counts(4) == [2] and replica_counts(2) == [] and replica_counts(8) == [2, 4]
    context = mp.get_context("fork")
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=_run_group_probe, args=(rank, port, results))
               for rank in range(4)]
    for worker in workers:
        worker.start()
    try:
        steps = dict(results.get(timeout=120) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    assert steps[2] == steps[3] == []
    for rank in (0, 1):
        assert len(steps[rank]) == len(DATA_PARALLEL_SHAPES)
        assert all(compute > 0 and extra > 0 for compute, extra in steps[rank])


def test_a_stage_posts_a_send_or_receive_for_each_boundary_to_another_device() -> None:
    assert posted_links([0, 1]) == [1, 1]
    assert posted_links([0, 1, 0, 1]) == [1, 2, 2, 1]
    assert posted_links([0, 1, 1, 0]) == [1, 1, 1, 1]  # ZB-V's turn is in place
    assert posted_links([0]) == [0]

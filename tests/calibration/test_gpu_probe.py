"""pipec.calibration.gpu_probe: the training runtime measured one device a process. Here its
probes run on gloo CPU processes (``device_type="cpu"``), spawned as on a GPU machine;
benchmarks/gpu_check.py runs them on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipec.calibration.by_default import _with_gpu_runtime, _with_runtime
from pipec.calibration.gpu_probe import probe_gpu_runtime, rank_device
from pipec.calibration.probe import RuntimeFigures
from pipec.calibration.runtime_fit import runtime_action_fit
from pipec.calibration.timers import synchronized
from pipec.cost.hardware import load_hardware
from pipec.planning.schedules import SCHEDULES


@pytest.fixture(scope="module")
def figures() -> RuntimeFigures:
    return probe_gpu_runtime(2, device_type="cpu")


def test_two_spawned_processes_measure_links_all_reduce_and_the_runtime(
        figures: RuntimeFigures) -> None:
    assert figures.processes == 2 and figures.device_type == "cpu"
    assert figures.latency_s > 0 and figures.bandwidth > 1e7
    assert figures.allreduce_bandwidth > 1e7 and figures.step_overhead_s > 0
    assert 0 <= figures.action_overhead_s < 0.01
    steps = figures.schedule_step_s
    assert set(steps) == set(SCHEDULES) and all(0 < s < 1 for s in steps.values())
    # What only processes sharing cores pay is not measured: the preset keeps those terms.
    assert figures.data_parallel_s == () and figures.blocking_s == ()
    assert figures.relay_slowdowns == () and figures.late_receive_s == 0.0


def test_gpu_figures_replace_the_presets_links_and_runtime_terms_only(figures: RuntimeFigures
                                                                    ) -> None:
    preset = load_hardware("h100-80g")
    gpu = replace(figures, device_type="cuda")
    measured = _with_runtime(preset, gpu)
    assert measured == _with_gpu_runtime(preset, gpu)
    assert (measured.intra_node_latency_s, measured.intra_node_bandwidth) \
        == (gpu.latency_s, gpu.bandwidth)
    assert measured.allreduce_bandwidth == gpu.allreduce_bandwidth
    assert measured.step_overhead_s == gpu.step_overhead_s > 0
    action, post = runtime_action_fit(gpu)
    assert dict(measured.schedule_action_s) == dict.fromkeys(SCHEDULES, action)
    assert measured.p2p_post_s == post
    # DDP's and a blocking all-reduce's terms, and the compute, stay the preset's.
    assert measured.step_collective_s == preset.step_collective_s
    assert measured.blocking_collective_s == preset.blocking_collective_s
    assert measured.fp32_flops == preset.fp32_flops


def test_one_process_is_not_a_probe() -> None:
    with pytest.raises(ValueError, match="2 processes or more"):
        probe_gpu_runtime(1, device_type="cpu")


def test_a_rank_takes_its_gpu_and_shares_one_only_where_too_few() -> None:
    assert rank_device(3, "cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert rank_device(count, "cuda") == torch.device("cuda", 0)


def test_a_synchronized_run_runs_once_and_returns_after_it() -> None:
    calls: list[int] = []
    synchronized(lambda: calls.append(1), torch.device("cpu"))()
    assert calls == [1]

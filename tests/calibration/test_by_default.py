"""Measured by default: compile times the model on this machine when the devices are its kind,
caches the times, and reads them back without measuring again."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS, SAMPLES, compile_to
from pipec.calibration import heap
from pipec.calibration.by_default import Target, cache_key, training_threads
from pipec.calibration.probe import RuntimeFigures
from pipec.calibration.profile import profile_model
from pipec.calibration.runtime_fit import blocking_fit, data_parallel_fit, runtime_action_fit
from pipec.cost.calibration_file import save_calibration
from pipec.errors import ConfigError, InfeasibleError
from pipec.frontend.loader import load_model_file
from pipec.planning.planner import Plan

MLP = SAMPLES / "mlp.py"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache; measurements as short as pipec profile's default (10 passes), not spread
    over seconds to average a drifting machine."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PIPEC_CACHE_DIR", str(folder))
    monkeypatch.setattr("pipec.calibration.by_default.MIN_SECONDS", 0.0)
    return folder


def _compile(out: Path, **options: Any) -> Plan:
    options.setdefault("measure", "auto")
    options.setdefault("gpus", 1)
    return compile_to(MLP, out, batch_size=8, **options)


def test_compile_measures_here_once_then_reads_the_cache(tmp_path: Path, cache: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    with caplog.at_level(logging.DEBUG, logger="pipec.calibration.by_default"):
        first = _compile(tmp_path / "a")
        entries = list(cache.glob("*.json"))
        assert len(entries) == 1 and "measured 11 nodes" in caplog.text
        caplog.clear()
        second = _compile(tmp_path / "b")
    assert "read from the cache" in caplog.text and "measuring" not in caplog.text
    calibration = first.request.calibration
    assert calibration is not None and calibration.device == "cpu"
    assert len(calibration.nodes) == 11 and str(entries[0]) in calibration.source
    assert second.request.calibration == calibration
    # Making the data is measured too (fixed + per sample: one of them is positive), and is a
    # term of the step.
    assert sum(calibration.data_s) > 0 and first.step_terms["data"] > 0
    # So is the optimizer step: fixed, per tensor and per byte, over the one device's weights.
    (fixed, per_tensor, per_byte), = [rest for name, *rest in calibration.optimizer_s
                                      if name == "sgd"]
    weights = list(load_model_file(MLP).build_model().parameters())
    assert first.step_terms["optimizer"] == pytest.approx(
        fixed + per_tensor * len(weights) + per_byte * sum(4 * w.numel() for w in weights))
    predicted = json.loads((tmp_path / "a" / "plan.json").read_text())["predicted"]
    assert set(predicted["step_terms"]) == {"all_reduce", "optimizer", "data", "runtime"}
    report = (tmp_path / "a" / "report.md").read_text()
    assert "measured on this machine" in report
    assert report == (tmp_path / "b" / "report.md").read_text()  # compiling twice: same files
    assert (tmp_path / "a" / "plan.json").read_text() == (tmp_path / "b" / "plan.json").read_text()


def test_several_processes_measure_the_training_runtime_too(tmp_path: Path, cache: Path
                                                           ) -> None:
    """Two processes: links, all-reduce, the runtime's time per action and per step, and the
    slowdown of computing side by side, measured once and cached beside the compute times."""
    plan = _compile(tmp_path / "a", gpus=2)
    runtime = json.loads(next(cache.glob("runtime-*.json")).read_text())
    assert runtime["processes"] == 2
    assert 0 < runtime["latency_s"] < 0.1 and runtime["bandwidth"] > 1e7
    assert runtime["allreduce_bandwidth"] > 1e7 and runtime["step_overhead_s"] > 0
    device = plan.request.devices[0]
    assert device.intra_node_latency_s == runtime["latency_s"]
    assert min(runtime["data_parallel_s"][0]) > 0  # its step without DDP, and what DDP adds
    assert len(runtime["blocking_s"]) == 2 and runtime["blocking_s"][1][1] > 0
    assert (device.blocking_collective_s, device.blocking_drift) == \
        blocking_fit(RuntimeFigures(**runtime))
    # The data-parallel terms are the fit of the cached figures, not the probe's lone all-reduce.
    assert (device.step_collective_s, device.allreduce_bandwidth, device.gradient_tensor_s) \
        == data_parallel_fit(RuntimeFigures(**runtime))
    assert device.action_overhead_s == runtime["action_overhead_s"]
    # One time per action for every schedule, and one per send or receive: the fit of the
    # cached steps.
    action, post = runtime_action_fit(RuntimeFigures(**runtime))
    schedules = sorted(runtime["schedule_step_s"])
    assert device.schedule_action_s == tuple((s, action) for s in schedules)
    assert device.p2p_post_s == post
    # A receive posted after its input was sent (pipec.calibration.receive_times): in plan.json
    # and the report.
    # With 2 processes none may come late (the last rank sends nothing, so it can post each
    # receive before its sender's pass ends); the 4-process probe test
    # (test_probe) checks that one is measured.
    assert device.late_receive_s == runtime["late_receive_s"] >= 0
    predicted = json.loads((tmp_path / "a" / "plan.json").read_text())["predicted"]
    assert predicted["runtime_overhead_s"]["per_late_receive"] == device.late_receive_s
    assert predicted["runtime_overhead_s"]["per_post"] == device.p2p_post_s
    # 2 processes have no data-parallel group smaller than all of them.
    assert runtime["group_data_parallel_s"] == [] and device.replica_collectives == ()
    assert predicted["data_parallel"]["measured_on"] == (
        "every process" if plan.dp > 1 else "no replicas")
    assert "per input sent before its receiver asked for it" in \
        (tmp_path / "a" / "report.md").read_text()
    calibration = plan.request.calibration
    assert calibration is not None and calibration.contention >= 1.0
    assert "with 2 processes computing side by side" in calibration.source
    assert "measured with 2 processes" in calibration.source
    again = _compile(tmp_path / "b", gpus=2)  # from the cache: the same figures
    assert again.request.devices == plan.request.devices
    assert len(list(cache.glob("runtime-*.json"))) == 1


def test_another_kind_of_device_plans_from_its_preset(tmp_path: Path, cache: Path) -> None:
    plan = _compile(tmp_path / "out", hardware="a100-80g")
    assert plan.request.calibration is None and not cache.exists()


def test_off_and_a_calibration_file_measure_nothing(tmp_path: Path, cache: Path) -> None:
    assert _compile(tmp_path / "off", measure="off").request.calibration is None
    calibration, _ = profile_model(MLP, 4, repeats=1)
    save_calibration(calibration, tmp_path / "calib.json")
    plan = _compile(tmp_path / "file", calibration=tmp_path / "calib.json")
    assert plan.request.calibration is not None
    assert plan.request.calibration.source == "pipec profile" and not cache.exists()


def test_a_damaged_cache_entry_is_measured_again(tmp_path: Path, cache: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    _compile(tmp_path / "a")
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pipec.calibration.by_default"):
        plan = _compile(tmp_path / "b")
    assert "ignoring the cached measurement" in caplog.text
    assert plan.request.calibration is not None and plan.request.calibration.nodes
    assert entry.read_text().startswith("{\n")  # rewritten whole


def test_the_key_follows_what_the_times_depend_on(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.py"
    model.write_text(MLP.read_text())
    target = Target("cpu", "a cpu", 1, 8, "fp32", "group")
    key = cache_key(model, target)
    assert key == cache_key(model, target)
    for changed in (Target("cpu", "a cpu", 2, 8, "fp32", "group"),
                    Target("cpu", "a cpu", 1, 16, "fp32", "group"),
                    Target("cpu", "a cpu", 1, 8, "bf16", "group"),
                    Target("cpu", "other", 1, 8, "fp32", "group")):
        assert cache_key(model, changed) != key
    for setting in ("MAPPED_BLOCK", "HEAP_GROWTH"):  # times measured in another heap
        with monkeypatch.context() as patch:
            patch.setattr(heap, setting, getattr(heap, setting) // 2)
            assert cache_key(model, target) != key
    with monkeypatch.context() as patch:  # times measured under another allocator
        allocator = heap.running_allocator()
        patch.setattr(heap, "running_allocator",
                      lambda: "glibc" if allocator == "tcmalloc" else "tcmalloc")
        assert cache_key(model, target) != key
    assert cache_key(model, target) == key
    model.write_text(MLP.read_text() + "\n# edited\n")
    assert cache_key(model, target) != key


def test_threads_are_those_training_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert training_threads(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert training_threads(4) == 1  # torchrun's default with several processes per node


def test_user_errors_come_before_the_measurement(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ConfigError, match="--pp 3 does not divide --gpus 4"):
        _compile(tmp_path / "out", gpus=4, pp=3)
    assert not cache.exists()


def test_an_unknown_measure_choice_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--measure 'always' \(or PIPEC_MEASURE\)"):
        _compile(tmp_path / "out", measure="always")


def test_bf16_times_run_under_autocast() -> None:
    calibration, samples = profile_model(MLP, 2, repeats=1, precision="bf16")
    assert len(calibration.nodes) == 11 and all(s.fwd_s >= 0 for s in samples)
    with pytest.raises(ConfigError, match="--precision 'fp16'"):
        profile_model(MLP, 2, repeats=1, precision="fp16")


def test_a_model_too_big_to_measure_here_is_planned_from_the_preset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """Two Linear layers of 4.3 B parameters, built on meta: measuring would hold them whole
    (tens of GiB with gradients), which this host has not, and there is no run of identical
    blocks to measure one at a time; the compile says so and plans from the preset instead of
    being killed for memory."""
    monkeypatch.setenv("PIPEC_CACHE_DIR", str(tmp_path / "cache"))
    # This host's free memory, fixed: on a larger host the model would be measured whole.
    monkeypatch.setattr("pipec.calibration.by_default.free_bytes", lambda _: 16 * 2**30)
    caplog.set_level(logging.WARNING)
    with contextlib.suppress(InfeasibleError):  # planned from the preset: it may not fit
        compile_to(MODELS / "huge_linear.py", tmp_path / "o", gpus=8, batch_size=8,
                   measure="auto", pp=None)
    assert re.search(r"not measuring .*huge_linear\.py here: its passes would hold the whole "
                     r"model, [\d.]+ GiB .* and this host has [\d.]+ GiB free, and its graph "
                     r"has no run of identical blocks to time one at a time; planning from the "
                     r"preset", caplog.text)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())

"""Activation recomputation (--recompute): stages that recompute train exactly like one
process, hold what the plan predicts, and never hold a BatchNorm that would update its
statistics twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MODELS, SAMPLES, compile_to, device_file, measured_peaks, run_forked
from pipec.cost.hardware import PRESETS
from pipec.cost.model import usable_memory
from pipec.driver import CompileOptions, analyze
from pipec.errors import ConfigError, InfeasibleError
from pipec.planning import planner


def test_recomputing_stages_train_like_one_process(tmp_path: Path) -> None:
    reference = compile_to(SAMPLES / "gpt.py", tmp_path / "one", gpus=1, batch_size=16,
                           micro_batch=4)
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "two", gpus=2, batch_size=16,
                      micro_batch=4, schedule="1f1b", recompute="full")
    assert reference.stages[0].recompute == "none"
    assert all(s.recompute == "full" for s in plan.stages)
    stages = json.loads((tmp_path / "two" / "plan.json").read_text())["stages"]
    assert [s["recompute"] for s in stages] == ["full", "full"]
    expected = run_forked(tmp_path / "one", 1, "--steps", "4", "--seed", "1")
    assert run_forked(tmp_path / "two", 2, "--steps", "4", "--seed", "1") == expected


GPIPE_8 = {"gpus": 2, "batch_size": 32, "micro_batch": 4, "schedule": "gpipe"}


def test_recomputation_lowers_the_measured_peak_as_predicted(tmp_path: Path) -> None:
    """GPipe keeps all 8 micro-batches' activations; recomputing keeps one, and the autograd
    graph of every one. On a 2-core AMD EPYC VM: 12.5 → 5.8 MiB and 14.9 → 7.0 MiB measured
    against 12.0 → 5.4 and 14.3 → 7.3 predicted."""
    assert_drop_as_predicted(SAMPLES / "gpt.py", "full", tmp_path)


def assert_drop_as_predicted(model: Path, mode: str, tmp_path: Path) -> None:
    """Compiled without recomputation and with ``mode`` (GPipe, 8 micro-batches of 4 on 2
    devices) and run: each device's measured drop in peak is its predicted drop ±20 %, and
    that is more than 4 MiB."""
    plain = compile_to(model, tmp_path / "plain", recompute="none", **GPIPE_8)
    again = compile_to(model, tmp_path / "again", recompute=mode, **GPIPE_8)
    measured_drop = [a - b for a, b in zip(measured_peaks(tmp_path / "plain"),
                                           measured_peaks(tmp_path / "again"),
                                           strict=True)]
    predicted_drop = [a - b for a, b in zip(plain.device_memory_bytes, again.device_memory_bytes,
                                            strict=True)]
    for measured, predicted in zip(measured_drop, predicted_drop, strict=True):
        assert predicted > 4 * 2**20 and 0.8 * predicted <= measured <= 1.2 * predicted, (
            measured_drop, predicted_drop)


def test_a_stage_with_a_batch_norm_it_keeps_does_not_recompute(tmp_path: Path) -> None:
    """On 2 data-parallel replicas ResNet's BatchNorms become synchronized and stay: running
    its forward twice would update their statistics twice, so even --recompute full keeps the
    stage as it is. Pipelined, they become GroupNorm, and the stages recompute."""
    replicas = compile_to(SAMPLES / "resnet.py", tmp_path / "dp", gpus=2, pp=1, batch_size=16,
                          recompute="full")
    assert [s.recompute for s in replicas.stages] == ["none"]
    piped = compile_to(SAMPLES / "resnet.py", tmp_path / "pp", gpus=2, batch_size=16,
                       recompute="full")
    assert all(s.recompute == "full" for s in piped.stages)


def test_an_unknown_recompute_mode_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--recompute 'partial': use one of auto, none, full, "
                                          "selective"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=1, recompute="partial")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_zero_bubble_schedules_do_not_recompute(mode: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"--schedule zbv with --recompute {mode}"):
        compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=2, batch_size=16, schedule="zbv",
                   recompute=mode)


ATTENTION = MODELS / "manual_attention.py"
ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo"


def test_selectively_recomputing_stages_train_like_one_process(tmp_path: Path) -> None:
    compile_to(ATTENTION, tmp_path / "one", gpus=1, batch_size=16, micro_batch=4)
    plan = compile_to(ATTENTION, tmp_path / "two", gpus=2, batch_size=16, micro_batch=4,
                      schedule="1f1b", recompute="selective")
    assert [s.recompute for s in plan.stages] == ["selective", "selective"]
    stages = json.loads((tmp_path / "two" / "plan.json").read_text())["stages"]
    assert [s["recompute"] for s in stages] == ["selective", "selective"]
    expected = run_forked(tmp_path / "one", 1, "--steps", "4", "--seed", "1")
    assert run_forked(tmp_path / "two", 2, "--steps", "4", "--seed", "1") == expected


def test_selective_recomputation_lowers_the_measured_peak_as_predicted(tmp_path: Path) -> None:
    """The written-out attention saves its T × T scores and probabilities: kept for all 8
    micro-batches under GPipe, then, recomputing selectively, made again one micro-batch at a
    time (the products' outputs stay). On a 2-core AMD EPYC VM, as compiled below: 20.2 → 10.9
    and 21.9 → 12.3 MiB measured against 21.0 → 11.3 and 22.6 → 13.5 predicted."""
    assert_drop_as_predicted(ATTENTION, "selective", tmp_path)


def test_auto_takes_the_fastest_recomputation_that_fits(tmp_path: Path) -> None:
    """On a GPU-like device (selective recomputation's Python overhead hidden behind the
    kernels) it runs less again than full recomputation: auto takes it where it fits, and full
    recomputation where only that fits."""
    peak = {mode: max(compile_to(ATTENTION, tmp_path / mode, recompute=mode,
                                 hardware=device_file(tmp_path), **GPIPE_8).device_memory_bytes)
            for mode in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]
    for between, expected in (((peak["selective"] + peak["none"]) / 2, "selective"),
                              ((peak["full"] + peak["selective"]) / 2, "full")):
        plan = compile_to(ATTENTION, tmp_path / f"auto-{expected}", recompute="auto",
                          hardware=device_file(tmp_path, between), **GPIPE_8)
        modes = {s.recompute for s in plan.stages}
        assert expected in modes and (expected == "full" or "full" not in modes), modes


def test_llama_70b_plans_on_32_a100s_by_recomputing(tmp_path: Path) -> None:
    """LLaMA-2-70B's shape, AdamW, bf16, batch 64 on 32 × a100-80g over 4 nodes (docs/planner.md):
    nothing fits without recomputation; with it every device fits, most stages recomputing,
    some in full and some selectively."""
    options = {"model": ZOO / "llama2_70b.py", "out": tmp_path / "o", "gpus": 32, "nodes": 4,
               "batch_size": 64, "hardware": "a100-80g", "optimizer": "adamw",
               "precision": "bf16", "measure": "off", "pp": 32}
    analyzed = analyze(CompileOptions(**options))  # type: ignore[arg-type]
    plan = planner.plan(analyzed.graph, analyzed.request)
    assert max(plan.device_memory_bytes) <= usable_memory(PRESETS["a100-80g"])
    modes = [s.recompute for s in plan.stages]
    assert modes.count("none") < len(modes) / 2 and {"full", "selective"} <= set(modes)
    bare = analyze(CompileOptions(**{**options, "recompute": "none"}))  # type: ignore[arg-type]
    with pytest.raises(InfeasibleError, match="no split fits"):
        planner.plan(bare.graph, bare.request)

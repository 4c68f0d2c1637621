"""Tracing on the device the plan trains on: device-dependent model code takes the branch the
run takes, the trace allocates nothing, and the report says where the code read a device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import MODELS, compile_apart, compile_to, composed_stages, run_forked
from pipec.frontend.fakedevice import short_read, trace_device
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model

BRANCHES = MODELS / "device_branch.py"


def test_a_cpu_plan_takes_the_branches_a_cpu_run_takes(tmp_path: Path) -> None:
    compile_apart(BRANCHES, tmp_path / "o", gpus=2, batch_size=8)
    staged, eager = composed_stages(tmp_path / "o")
    torch.testing.assert_close(staged, eager, rtol=1e-6, atol=1e-6)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["traced_on"] == "cpu"
    assert plan["device_reads"] == ["device_branch.py:18", "device_branch.py:20"]
    report = (tmp_path / "o" / "report.md").read_text()
    assert "reads a tensor's device at 2 place(s) (`device_branch.py:18`" in report
    assert "traced on cpu, the device this plan trains on" in report


def test_device_branches_train_on_2_stages_as_on_one_process(tmp_path: Path) -> None:
    compile_apart(BRANCHES, tmp_path / "one", gpus=1, batch_size=16)
    compile_apart(BRANCHES, tmp_path / "two", gpus=2, batch_size=16)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)


def test_fx_sees_the_traced_device_in_concrete_code(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model_file(BRANCHES)
    monkeypatch.setattr(spec.module, "build_model", spec.module.WeightBranchOnly)
    traced = trace_model(spec, "fx", "cpu")
    assert traced.frontend == "fx" and traced.device == "cpu"
    assert "add" not in traced.graph_module.code  # the non-CPU branch adds 1
    assert [short_read(r) for r in traced.device_reads] == ["device_branch.py:27"]
    weights = list(traced.graph_module.parameters())
    assert weights and all(w.device.type == "meta" for w in weights)


def test_a_gpu_plan_is_traced_on_cuda_where_a_gpu_is_visible(tmp_path: Path) -> None:
    compile_apart(BRANCHES, tmp_path / "o", gpus=2, batch_size=8, hardware="a100-80g")
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    source = (tmp_path / "o" / "stages.py").read_text()
    report = (tmp_path / "o" / "report.md").read_text()
    assert "mul.Tensor(relu, 2.0)" in source or "add.Tensor(relu, 1.0)" in source
    if torch.cuda.is_available():
        assert plan["traced_on"] == "cuda" and trace_device("cuda") == "cuda"
        assert "traced on cuda" in report
    else:
        assert plan["traced_on"] == "meta" and trace_device("cuda") == "meta"
        assert "No GPU is visible here, so the model was traced on meta tensors" in report


def test_a_model_that_reads_no_device_gets_no_note(tmp_path: Path) -> None:
    compile_to(MODELS / "optional_args.py", tmp_path / "o", gpus=1, batch_size=8)
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["device_reads"] == []
    assert "reads a tensor's device" not in (tmp_path / "o" / "report.md").read_text()

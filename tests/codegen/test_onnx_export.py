"""`pipec compile --onnx`: one checked ONNX file per stage, equal to the PyTorch stage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from conftest import SAMPLES, compile_to, emitted_modules
from pipec.codegen.onnx_export import example_inputs
from pipec.errors import ConfigError, ExportError


@pytest.mark.parametrize("sample", ["gpt", "resnet"])
def test_each_onnx_stage_computes_what_the_pytorch_stage_computes(sample: str,
                                                                  tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / f"{sample}.py", tmp_path / "o", gpus=2, batch_size=8,
                      micro_batch=4, schedule="1f1b", onnx=True)
    with emitted_modules(tmp_path / "o") as (user_model, stages):
        torch.manual_seed(0)
        model = user_model.build_model()
        stages.rewrite_norms(model)
        for k, stage_class in enumerate(stages.STAGES):
            stage = stage_class(model).eval()
            inputs = example_inputs(stage_class.INPUTS)
            session = onnxruntime.InferenceSession(str(tmp_path / "o" / f"stage_{k}.onnx"))
            feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)}
            with torch.no_grad():
                expected = stage(*inputs)
            expected = expected if isinstance(expected, tuple) else (expected,)
            for got, want in zip(session.run(None, feed), expected, strict=True):
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)
    assert len(plan.stages) == 2


def test_onnx_output_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        compile_to(SAMPLES / "mlp.py", tmp_path / name, gpus=2, batch_size=8, onnx=True)
    for k in range(2):
        first = (tmp_path / "a" / f"stage_{k}.onnx").read_bytes()
        assert first == (tmp_path / "b" / f"stage_{k}.onnx").read_bytes()


def test_missing_onnx_package_is_a_clear_error(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--onnx needs the onnxscript package; install"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=2, batch_size=8, onnx=True)
    assert not (tmp_path / "o").exists()


def test_a_stage_that_does_not_export_leaves_no_output(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=2, batch_size=8)
    before = sorted(p.name for p in (tmp_path / "o").iterdir())

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unsupported operator aten::frobnicate\nmore detail")
    monkeypatch.setattr(torch.onnx, "export", refuse)
    with pytest.raises(ExportError, match="stage 0 cannot be exported to ONNX: unsupported "
                                          "operator aten::frobnicate; compile without --onnx"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=2, batch_size=8, onnx=True)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == before  # the old output stays
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left

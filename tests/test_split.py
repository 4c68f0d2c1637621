"""Stages composed in order compute exactly what the original model computes."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from conftest import MODELS, SAMPLES, compile_to, emitted_modules

MODEL_FILES = [SAMPLES / "mlp.py", SAMPLES / "resnet.py", SAMPLES / "gpt.py",
               MODELS / "skip_two_inputs.py", MODELS / "shared_module.py",
               MODELS / "unused_input.py"]


def composed(stages_module: object, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
             ) -> torch.Tensor:
    values: object = inputs
    for stage_class in stages_module.STAGES:  # type: ignore[attr-defined]
        stage = stage_class(model)
        values = stage(*values) if isinstance(values, tuple) else stage(values)
    return values  # type: ignore[return-value]


@pytest.mark.parametrize("model_file", MODEL_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stages_composed_equal_original(model_file: Path, num_stages: int, tmp_path: Path) -> None:
    compile_to(model_file, tmp_path / "out", gpus=num_stages, batch_size=8, norm="keep")
    with emitted_modules(tmp_path / "out") as (user, stages):
        torch.manual_seed(0)
        model = user.build_model().eval()  # eval: BatchNorm uses running statistics
        inputs, _ = user.sample_batch(8)
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        expected = model(*inputs)
        torch.testing.assert_close(composed(stages, model, inputs), expected, rtol=0, atol=0)


def test_gradients_of_composed_stages_equal_original(tmp_path: Path) -> None:
    compile_to(MODELS / "skip_two_inputs.py", tmp_path / "out", gpus=4, batch_size=8)
    with emitted_modules(tmp_path / "out") as (user, stages):
        torch.manual_seed(0)
        model = user.build_model()
        inputs, _ = user.sample_batch(8)
        model(*inputs).square().sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        composed(stages, model, tuple(inputs)).square().sum().backward()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter.grad, expected[name], msg=name)


def test_skip_connection_is_forwarded_across_stages(tmp_path: Path) -> None:
    compile_to(MODELS / "skip_two_inputs.py", tmp_path / "out", gpus=4, batch_size=8)
    with emitted_modules(tmp_path / "out") as (_, stages):
        signatures = [list(inspect.signature(cls.forward).parameters)[1:]
                      for cls in stages.STAGES]
    assert signatures[0] == ["image", "text"]
    # The first layer's output (image_1) and the raw second input are used by the last stage
    # only, so every later stage receives them.
    for later in signatures[1:]:
        assert "image_1" in later and "text" in later


def test_shared_parameters_are_listed_with_each_stages_name(tmp_path: Path) -> None:
    compile_to(MODELS / "tied_gpt.py", tmp_path / "out", gpus=4, batch_size=8)
    with emitted_modules(tmp_path / "out") as (_, stages):
        assert stages.TIED == (((0, "tok_emb.weight"), (3, "head.weight")),)
    compile_to(MODELS / "tied_gpt.py", tmp_path / "one", gpus=1, batch_size=8)
    with emitted_modules(tmp_path / "one") as (_, stages):
        assert stages.TIED == ()  # one stage holds both uses


def test_stage_state_dict_keys_are_the_models(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "out", gpus=3, batch_size=8)
    with emitted_modules(tmp_path / "out") as (user, stages):
        model = user.build_model()
        stages.rewrite_norms(model)
        keys = [k for cls in stages.STAGES for k in cls(model).state_dict()]
    assert sorted(keys) == sorted(model.state_dict())

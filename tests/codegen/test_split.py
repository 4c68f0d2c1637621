"""Stages composed in order compute exactly what the original model computes."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from conftest import MODELS, SAMPLES, compile_to, emitted_modules, run_as_pipeline
from pipec.frontend.annotate import annotate
from pipec.frontend.costgraph import CostGraph
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model

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


def test_the_cost_models_tensor_count_is_what_each_stage_receives(tmp_path: Path) -> None:
    """Each tensor of a boundary is its own send (pipec.cost.model.boundary_s charges each a
    latency): the count the planner uses is the emitted stage's inputs."""
    plan = compile_to(MODELS / "skip_two_inputs.py", tmp_path / "out", gpus=4, batch_size=8)
    counts = plan_graph(MODELS / "skip_two_inputs.py").cut_tensors()
    with emitted_modules(tmp_path / "out") as (_, stages):
        received = [len(inspect.signature(cls.forward).parameters) - 1
                    for cls in stages.STAGES]
    assert received[1:] == [counts[s.start] for s in plan.stages[1:]]
    assert max(received[1:]) >= 2


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


def test_a_stage_clones_the_received_inputs_it_overwrites_in_place(tmp_path: Path) -> None:
    """One stage per node: nn.ReLU(inplace=True), y.add_(x) and F.relu(y, inplace=True) each
    begin a stage whose input is, under torch.distributed.pipelining, a leaf that requires grad
    (which autograd refuses to overwrite). Only overwritten inputs are cloned, and all of
    them: the second model input too, which needs no gradient, passed on by every stage and
    overwritten by the last (torch 2.11 hands every received float over as such a leaf)."""
    probe = compile_to(MODELS / "inplace_cnn.py", tmp_path / "probe", gpus=1, batch_size=8)
    compile_to(MODELS / "inplace_cnn.py", tmp_path / "out", gpus=probe.stages[0].end,
               batch_size=8)
    with emitted_modules(tmp_path / "out") as (user, stages):
        sources = [inspect.getsource(cls.forward) for cls in stages.STAGES]
        torch.manual_seed(0)
        model = user.build_model()
        inputs, _ = user.sample_batch(8)
        expected = model(*(t.clone() for t in inputs))
        expected.square().sum().backward()
        gradients = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        output = run_as_pipeline(stages, model, tuple(t.clone() for t in inputs))
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, gradients[name], msg=name)
    cloned = [k for k, source in enumerate(sources) if ".clone()" in source]
    in_place = [k for k, source in enumerate(sources)
                if "self.relu(" in source or ".add_(" in source or "inplace = True" in source]
    overwrites_data = [k for k, source in enumerate(sources) if ".mul_(" in source]
    assert len(in_place) == 3 and len(overwrites_data) == 1
    assert cloned == sorted(in_place + overwrites_data)


def test_a_value_an_in_place_op_gives_a_gradient_is_sent_with_it(tmp_path: Path) -> None:
    """``x.add_(h)`` with x the data and h a layer's output: x requires grad from then on, so
    the boundaries after it declare it (or PipelineStage would drop its gradient)."""
    path = tmp_path / "data_add.py"
    path.write_text("\n".join([
        "import torch", "from torch import nn", "", "",
        "class DataAdd(nn.Module):", "    def __init__(self):", "        super().__init__()",
        "        self.a = nn.Linear(4, 4)", "        self.b = nn.Linear(4, 3)", "",
        "    def forward(self, x):", "        h = self.a(torch.tanh(x))", "        x.add_(h)",
        "        return self.b(torch.tanh(x))", "", "",
        "def build_model():", "    return DataAdd()", "", "",
        "def sample_batch(batch_size):",
        "    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))", ""]))
    compile_to(path, tmp_path / "out", gpus=5, batch_size=8)  # tanh, a, add_, tanh, b
    with emitted_modules(tmp_path / "out") as (user, stages):
        # Each stage's first input is x, then the tanh of x.add_(h).
        assert [cls.INPUTS[0][2] for cls in stages.STAGES] == [False, False, False, True, True]
        torch.manual_seed(0)
        model = user.build_model()
        inputs = (user.sample_batch(8)[0],)
        model(inputs[0].clone()).square().sum().backward()
        gradients = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        run_as_pipeline(stages, model, tuple(t.clone() for t in inputs))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, gradients[name], msg=name)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_bf16_boundaries_carry_the_dtype_of_the_single_device_autocast_run(
        num_stages: int, tmp_path: Path) -> None:
    """An fp32 residual stream x = x + f(x) crosses the cuts in fp32, as it is on one device
    under autocast (a Linear's output in bf16): the stages, run with their casts, give exactly
    the single-stage output. Rounding the stream to bf16 at the cuts would not."""
    outputs = []
    for name, stages_count in (("one", 1), ("split", num_stages)):
        compile_to(MODELS / "residual_mlp.py", tmp_path / name, gpus=stages_count, batch_size=8,
                   precision="bf16")
        with emitted_modules(tmp_path / name) as (user, stages):
            torch.manual_seed(0)
            model = user.build_model()
            inputs, _ = user.sample_batch(8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs.append(composed(stages, model, (inputs,)))
            received = [dtype for cls in stages.STAGES[1:] for _, dtype, _ in cls.INPUTS]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    assert len(stages.STAGES) == num_stages
    # Every cut carries the residual stream, in fp32; one inside a block also a bf16 output.
    assert received.count("float32") == num_stages - 1
    assert set(received) <= {"float32", "bfloat16"}


def plan_graph(model: Path) -> CostGraph:
    spec = load_model_file(model)
    return annotate(trace_model(spec), spec)

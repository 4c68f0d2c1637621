"""Each value's dtype under bf16 autocast, found on fake tensors: equal to a real autocast run,
with each device type's rules, and the bytes that then cross each cut."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from conftest import MODELS, SAMPLES
from pipec.frontend.annotate import annotate
from pipec.frontend.autocast import autocast_dtypes, run_under_autocast
from pipec.frontend.costgraph import Linear
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs, trace_model


class _Dtypes(fx.Interpreter):
    """A real run that records each tensor value's dtype."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.dtypes: dict[str, str] = {}

    def run_node(self, n: fx.Node) -> object:
        value = super().run_node(n)
        if isinstance(value, torch.Tensor) and n.op != "output":
            self.dtypes[n.name] = str(value.dtype).removeprefix("torch.")
        return value


@pytest.mark.parametrize("path", [SAMPLES / "gpt.py", SAMPLES / "resnet.py",
                                  MODELS / "residual_mlp.py", MODELS / "skip_two_inputs.py"],
                         ids=lambda p: p.stem)
def test_fake_dtypes_equal_a_real_cpu_autocast_run(path: Path) -> None:
    spec = load_model_file(path)
    traced = trace_model(spec)
    inputs = batch_inputs(spec, 2)[0]
    torch.manual_seed(0)
    real = _Dtypes(fx.GraphModule(spec.build_model(), traced.graph_module.graph))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real.run(*inputs)
    found = autocast_dtypes(traced.graph_module, inputs, "cpu")
    assert found == real.dtypes and "bfloat16" in found.values()


class _NormOfLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(self.linear(x), (4,)) + x


def test_the_device_types_rules_apply() -> None:
    """CUDA's autocast runs layer_norm in fp32; CPU's keeps its bf16 input's dtype. The CUDA
    rules apply on this machine without CUDA."""
    with torch.device("meta"):
        gm = fx.symbolic_trace(_NormOfLinear())
    x = torch.randn(2, 4)
    assert autocast_dtypes(gm, [x], "cuda") == {
        "x": "float32", "linear": "bfloat16", "layer_norm": "float32", "add": "float32"}
    assert autocast_dtypes(gm, [x], "cpu")["layer_norm"] == "bfloat16"
    assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")


def test_a_graph_fake_tensors_cannot_run_keeps_its_dtypes(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.sum().item()

    gm = fx.symbolic_trace(DataDependent())
    with caplog.at_level(logging.WARNING, logger="pipec.frontend.autocast"):
        assert autocast_dtypes(gm, [torch.randn(2, 4)], "cpu") == {}
    assert "fp32 dtype" in caplog.text


def test_cut_bytes_under_bf16_count_each_value_in_its_autocast_dtype() -> None:
    spec = load_model_file(MODELS / "residual_mlp.py")
    graph = annotate(trace_model(spec), spec, autocast_device="cpu")
    width = 16
    linear = next(i for i, n in enumerate(graph.nodes) if n.module == "blocks.0.linear")
    assert graph.value(graph.nodes[linear].name).autocast_dtype == "bfloat16"
    assert graph.value("x").autocast_dtype == graph.value("x").dtype == "float32"
    # Before the first block's Linear: the fp32 stream only, not half of it.
    assert graph.cut_bytes_bf16[linear].per_sample == width * 4
    assert graph.cut_bytes[linear].per_sample == width * 4
    # After it: the fp32 stream and the Linear's bf16 output.
    assert graph.cut_bytes[linear + 1].per_sample == 2 * width * 4
    assert graph.cut_bytes_bf16[linear + 1].per_sample == width * 4 + width * 2
    assert graph.cut_bytes_at("bf16") == graph.cut_bytes_bf16
    assert graph.cut_bytes_at("fp32") == graph.cut_bytes


def _weight_or_its_copy(tensor: torch.Tensor) -> bool:
    """A weight, or autocast's bf16 copy of one (transposed for a matmul's backward)."""
    step = tensor.grad_fn
    while step is not None and type(step).__name__ in ("ToCopyBackward0", "TBackward0"):
        step = step.next_functions[0][0]
    return (tensor.is_leaf and tensor.requires_grad) or type(step).__name__ == "AccumulateGrad"


class _SavedBytes(fx.Interpreter):
    """A real run that sums the distinct storages autograd saves, beside the graph's inputs,
    its weights and autocast's bf16 copies of them."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: set[int] = set()
        self.storages: dict[int, int] = {}

    def run_node(self, n: fx.Node) -> object:
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = super().run_node(n)
        if n.op == "placeholder":
            self.inputs.add(value.untyped_storage().data_ptr())
        for tensor in saved:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.inputs and not _weight_or_its_copy(tensor):
                self.storages[pointer] = tensor.untyped_storage().nbytes()
        return value


@pytest.mark.parametrize("path", [SAMPLES / "gpt.py", MODELS / "residual_mlp.py"],
                         ids=lambda p: p.stem)
def test_saved_bytes_under_autocast_equal_a_real_cpu_autocast_run(path: Path) -> None:
    spec = load_model_file(path)
    traced = trace_model(spec)
    batches = [batch_inputs(spec, size) for size in (2, 4)]
    run = run_under_autocast(traced.graph_module, batches, "cpu")
    torch.manual_seed(0)
    for (inputs, _), found in zip(batches, run.saved, strict=True):
        real = _SavedBytes(fx.GraphModule(spec.build_model(), traced.graph_module.graph))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            real.run(*inputs)
        assert sum(found.values()) == sum(real.storages.values()) > 0


def test_a_bf16_plan_counts_what_autocast_saves() -> None:
    """Each block's Linear saves a bf16 copy of the fp32 stream it reads (a copy fp32 training
    does not make), tanh its bf16 output; the stream itself stays fp32."""
    spec = load_model_file(MODELS / "residual_mlp.py")
    graph = annotate(trace_model(spec), spec, autocast_device="cpu")
    width = 16
    for block in range(4):
        linear = next(n for n in graph.nodes if n.module == f"blocks.{block}.linear")
        assert linear.bf16.saved_bytes == Linear(0.0, width * 2)
        assert linear.bf16.output_ratio == 0.5
    tanh = [n for n in graph.nodes if n.target == "tanh"]
    assert [n.bf16.saved_bytes for n in tanh] == [Linear(0.0, width * 2)] * 4
    # Autocast runs cross-entropy in fp32: it saves an fp32 log-softmax of the bf16 logits
    # (5 classes), not half of it.
    assert graph.loss.saved_bytes_bf16 == graph.loss.saved_bytes == Linear(4.0, 5 * 4)


def test_a_loss_fake_tensors_cannot_run_keeps_the_graphs_figures(
        caplog: pytest.LogCaptureFixture) -> None:
    spec = load_model_file(MODELS / "residual_mlp.py")
    traced = trace_model(spec)
    batches = [batch_inputs(spec, size) for size in (2, 4)]

    def data_dependent(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits.sum() * logits.max().item()

    with caplog.at_level(logging.WARNING, logger="pipec.frontend.autocast"):
        run = run_under_autocast(traced.graph_module, batches, "cpu", data_dependent)
    assert run.dtypes and len(run.saved) == 2 and run.loss_saved == ()
    assert "loss_fn could not run" in caplog.text

"""Per-node costs on meta tensors: exact FLOPs and bytes, legal cuts, nothing allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import MODELS, SAMPLES
from pipec.calibration.profile import measured_saved_bytes
from pipec.frontend.annotate import CostGraph, annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.node_costs import autograd_nodes
from pipec.frontend.trace import Traced, batch_inputs, trace_model


def analyse(path: Path) -> tuple[Traced, CostGraph]:
    spec = load_model_file(path)
    traced = trace_model(spec)
    return traced, annotate(traced, spec)


def test_nothing_is_allocated() -> None:
    traced, _ = analyse(SAMPLES / "gpt.py")
    tensors = [*traced.graph_module.parameters(), *traced.graph_module.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)


def test_linear_flops_and_bytes_are_exact() -> None:
    _, graph = analyse(SAMPLES / "mlp.py")
    first = graph.nodes[0]  # Linear(64, 256)
    assert first.fwd_flops.per_sample == 2 * 64 * 256 and first.fwd_flops.fixed == 0
    assert first.output_bytes.per_sample == 256 * 4 and first.output_bytes.fixed == 0
    assert first.params == 64 * 256 + 256 and first.param_bytes == 4 * first.params
    assert first.shape == (1, 256)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_parameters_are_counted_once_and_exactly(name: str) -> None:
    traced, graph = analyse(SAMPLES / f"{name}.py")
    assert graph.total_params == sum(p.numel() for p in traced.graph_module.parameters())
    # And the tensors among them, each a gradient DDP handles.
    assert sum(n.param_tensors for n in graph.nodes) == \
        len(list(traced.graph_module.parameters()))


def test_batch_independent_values_are_not_scaled() -> None:
    _, graph = analyse(SAMPLES / "gpt.py")
    arange = next(n for n in graph.nodes if n.target == "arange")
    assert arange.output_bytes.per_sample == 0 and arange.output_bytes.fixed == 32 * 8


def test_cut_bytes_count_every_live_value() -> None:
    _, graph = analyse(MODELS / "skip_two_inputs.py")
    # Before anything runs, the two inputs are live: 16 + 8 floats per sample.
    assert graph.cut_bytes[0].per_sample == (16 + 8) * 4
    # In the body, x, the skip value and the text input are live: 32 + 32 + 8 floats.
    body = next(i for i, n in enumerate(graph.nodes) if n.module == "body.2")
    assert graph.cut_bytes[body].per_sample == (32 + 32 + 8) * 4


def test_cuts_inside_a_shape_computation_are_illegal() -> None:
    _, graph = analyse(SAMPLES / "gpt.py")
    # `batch, tokens, width = x.shape` makes ints that live until the attention's reshape.
    shape_reads = [i for i, n in enumerate(graph.nodes) if not n.is_tensor]
    assert shape_reads and all(not graph.legal_cuts[i + 1] for i in shape_reads)


def test_a_shared_module_may_be_cut_and_its_copy_is_counted() -> None:
    _, graph = analyse(MODELS / "shared_module.py")
    uses = [i for i, n in enumerate(graph.nodes) if n.module == "twice"]
    assert len(uses) == 2
    assert all(graph.legal_cuts[uses[0] + 1:uses[1] + 1])
    # Counted once in the model's parameters; the last user carries the bytes of a second copy.
    assert graph.nodes[uses[0]].params == 8 * 8 + 8 and graph.nodes[uses[1]].params == 0
    assert (graph.nodes[uses[0]].param_tensors, graph.nodes[uses[1]].param_tensors) == (2, 0)
    assert graph.nodes[uses[1]].shared_bytes == (8 * 8 + 8) * 4
    assert sum(n.shared_bytes for n in graph.nodes) == (8 * 8 + 8) * 4


@pytest.mark.parametrize("path", [SAMPLES / "mlp.py", SAMPLES / "resnet.py", SAMPLES / "gpt.py",
                                  MODELS / "skip_two_inputs.py", MODELS / "transposed.py",
                                  MODELS / "gqa_lm.py"],
                         ids=lambda p: p.stem)
def test_per_node_totals_equal_the_whole_model(path: Path) -> None:
    """FLOPs forward and backward equal FlopCounterMode on the whole model (on meta, where
    attention has a FLOP formula); saved bytes are within 10 % of what autograd saves on CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = load_model_file(path)
    traced, graph = analyse(path)
    batch = 6
    meta_inputs = tuple(t.to("meta") for t in batch_inputs(spec, batch)[0])
    with FlopCounterMode(display=False) as forward:
        output = traced.graph_module(*meta_inputs)
    parameters = [p for p in traced.graph_module.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(output, parameters, torch.ones_like(output))
    assert sum(n.fwd_flops.at(batch) for n in graph.nodes) == forward.get_total_flops()
    assert sum(n.bwd_flops.at(batch) for n in graph.nodes) == backward.get_total_flops()
    torch.manual_seed(0)
    real = measured_saved_bytes(spec.build_model(), batch_inputs(spec, batch)[0])
    predicted = sum(n.saved_bytes.at(batch) for n in graph.nodes)
    assert abs(predicted - real) <= 0.10 * real, (predicted, real)


def test_backward_is_counted_not_assumed() -> None:
    _, graph = analyse(SAMPLES / "mlp.py")
    first, hidden = graph.nodes[0], graph.nodes[2]  # Linear(64, 256), Linear(256, 256)
    # The first layer's input is data: only the weight gradient, 2·64·256 per sample.
    assert first.bwd_flops.per_sample == 2 * 64 * 256
    # A hidden layer computes the input gradient too: 2 × 2·256·256.
    assert hidden.bwd_flops.per_sample == 2 * 2 * 256 * 256


def test_a_saved_tensor_counts_once_at_the_node_that_made_it() -> None:
    _, graph = analyse(SAMPLES / "mlp.py")
    saved = [n.saved_bytes.per_sample for n in graph.nodes]
    # The input (64 floats) at the first Linear; each ReLU output (256 floats) once, at the
    # ReLU, although the next Linear saves it too; nothing else.
    assert saved == [64 * 4] + [256 * 4, 0] * 5


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_autograd_nodes_add_up_to_the_real_models_graph(name: str) -> None:
    spec = load_model_file(SAMPLES / f"{name}.py")
    graph = annotate(trace_model(spec), spec)
    torch.manual_seed(0)
    inputs, _ = batch_inputs(spec, 2)
    real = autograd_nodes(spec.build_model().train()(*inputs))
    assert real > len(graph.nodes) // 2  # a real graph, not an empty count
    assert sum(n.autograd_nodes for n in graph.nodes) == real


def test_products_and_convolutions_are_logged_by_shape() -> None:
    # The kernels a CPU keeps (pipec.frontend.kernels): attention runs two products; equal layers
    # run the same calls; a convolution's stride makes a call of its own.
    _, graph = analyse(MODELS / "kernel_calls.py")
    calls = {n.name: n.kernels for n in graph.nodes}
    kinds = {name: [call[0][0] for call in runs] for name, runs in calls.items()}
    assert kinds["a"] == kinds["b"] == kinds["head"] == ["matmul"]
    assert kinds["c1"] == kinds["c2"] == ["conv"]
    assert kinds["scaled_dot_product_attention"] == ["matmul", "matmul"]
    assert calls["a"] == calls["b"] and calls["c1"] != calls["c2"] and calls["a"] != calls["head"]

"""The memory terms: the DP's view of a stage (its span plus what its ends hold) is exactly
stage_memory.stage_memory, term for term summed, for any stage of any pipeline."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SAMPLES
from pipec.cost.hardware import PRESETS
from pipec.cost.kernel_cache import KernelRuns
from pipec.cost.model import NodeArrays, Training, boundary_s, node_arrays, node_efficiency
from pipec.cost.stage_memory import StageRole, ends_bytes, stage_memory, working_bytes
from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model
from pipec.planning.spans import make_problem
from pipec.planning.spans import stage_memory as dp_stage_memory
from pipec.torchcompat import backward_input


@st.composite
def stages(draw: st.DrawFn) -> tuple[NodeArrays, int, int, StageRole]:
    n = draw(st.integers(3, 8))
    values = st.floats(0.0, 1e6, allow_nan=False)

    def array(length: int) -> np.ndarray:
        return np.array(draw(st.lists(values, min_size=length, max_size=length)))

    static = array(n)
    runs = sorted(draw(st.lists(st.integers(0, n - 1), max_size=2 * n)))
    calls = [draw(st.integers(0, 2)) for _ in runs]
    kernels = KernelRuns.of(runs, calls, [float(c + 1) * 1e5 for c in calls])
    arrays = NodeArrays(array(n), array(n), static, array(n), array(n + 1), array(n + 1),
                        array(n), draw(values), draw(values), static / 3, kernels=kernels,
                        weight_output_bytes=array(n))
    num_stages = draw(st.integers(1, 4))
    index = draw(st.integers(0, num_stages - 1))
    # Where the stage can sit: only the first starts at cut 0, only the last ends at n.
    last = index == num_stages - 1
    start = 0 if index == 0 else draw(st.integers(1, n - 1 if last else n - 2))
    end = n if last else draw(st.integers(start + 1, n - 1))
    # Micro-batches from 1: often all in flight on one replica (a peak before the gradients).
    role = StageRole(index, num_stages, draw(st.integers(1, 16)), draw(st.integers(1, 8)),
                     draw(st.sampled_from((1, 1, 2, 4))), draw(st.booleans()),
                     draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 4)))
    return arrays, start, end, role


@settings(max_examples=300, deadline=None)
@given(stages())
def test_the_dp_counts_exactly_the_stage_memory_terms(case: tuple) -> None:
    arrays, start, end, role = case
    enter, leave = ends_bytes(arrays, role)
    problem = make_problem(arrays.fwd_s, arrays.static_bytes, arrays.activation_bytes,
                           arrays.cut_bytes, np.ones(len(arrays.fwd_s) + 1, bool),
                           (float("inf"),), (role.in_flight,), enter, leave,
                           working_bytes(arrays, role), arrays.gradient_bytes,
                           (role.peaks_before_gradients,), kernels=arrays.kernels)
    expected = stage_memory(arrays, start, end, role).total
    assert abs(dp_stage_memory(problem, 0, start, end) - expected) <= 1e-9 * max(1.0, expected)


def test_whole_batch_data_is_counted_once_on_a_single_stage() -> None:
    n = 2
    arrays = NodeArrays(*(np.zeros(n),) * 4, np.array([100.0, 0.0, 0.0]), np.zeros(n + 1),
                        np.zeros(n), 0.0, 10.0)
    one = stage_memory(arrays, 0, n, StageRole(0, 1, 4, 4, replicas=2, whole_batch=True))
    assert one.data == 4 * 2 * (100 + 10)  # the global batch's inputs and targets, once
    share = stage_memory(arrays, 0, n, StageRole(0, 1, 4, 4, replicas=2))
    assert share.data == 4 * (100 + 10)  # the replica's share


def _two_nodes(gradients: list[float], activations: list[float]) -> NodeArrays:
    n = 2
    return NodeArrays(*(np.zeros(n),) * 2, np.full(n, 30.0), np.array(activations),
                      np.zeros(n + 1), np.zeros(n + 1), np.zeros(n), 0.0, 0.0,
                      np.array(gradients))


def test_a_stage_peaking_before_its_gradients_does_not_hold_them_all() -> None:
    """GPipe on one replica: every micro-batch is in flight before the first backward, and
    train.py sets the gradients to None each step. That backward runs from the last node:
    when node i's runs, the gradients of nodes ≥ i exist and the activations saved after i
    are freed, so the stage holds static + f·A less min(G, min over i of G[<i] + A[>i])."""
    # Gradients early, activations late: by the time node 0's gradient is made, node 1's
    # activations are freed: the whole 20 of gradients is never held with all activations.
    early = stage_memory(_two_nodes([20.0, 0.0], [0.0, 20.0]), 0, 2, StageRole(0, 1, 4, 4))
    assert early.unmade_gradients == -20.0
    # Its working set: node 0's gradient of a later micro-batch, before it is added to .grad.
    assert early.working == 20.0
    assert early.total == 60 + 4 * 20 - 20 + 20
    # Gradients late (a language model's head), activations early: the head's gradient is
    # made before anything is freed, so nothing is saved.
    late = stage_memory(_two_nodes([0.0, 20.0], [20.0, 0.0]), 0, 2, StageRole(0, 1, 4, 4))
    assert late.unmade_gradients == 0.0
    mixed = stage_memory(_two_nodes([10.0, 10.0], [5.0, 15.0]), 0, 2, StageRole(0, 1, 4, 4))
    assert mixed.unmade_gradients == -10.0  # node 1's 10 exist before its 15 are freed
    # Not under 1F1B with more micro-batches than in flight, nor under data parallelism
    # (DDP's buckets hold the gradients all along).
    arrays = _two_nodes([20.0, 0.0], [0.0, 20.0])
    assert stage_memory(arrays, 0, 2, StageRole(0, 1, 8, 2)).unmade_gradients == 0.0
    assert stage_memory(arrays, 0, 2, StageRole(0, 1, 4, 4, replicas=2)).unmade_gradients == 0.0


def test_accumulating_micro_batches_hold_one_more_gradient_of_a_node() -> None:
    """From the second micro-batch of a step (or under DDP, which copies each gradient into
    its bucket), a node's backward makes its parameters' gradient before autograd adds it to
    .grad: the stage's working set is at least its largest node's gradient."""
    arrays = _two_nodes([20.0, 5.0], [1.0, 1.0])
    assert stage_memory(arrays, 0, 2, StageRole(0, 1, 1, 1)).working == 0.0
    assert stage_memory(arrays, 0, 2, StageRole(0, 1, 8, 1)).working == 20.0
    assert stage_memory(arrays, 0, 2, StageRole(0, 1, 1, 1, replicas=2)).working == 20.0


def test_an_interleaved_stage_holds_what_it_sent_until_the_step_ends() -> None:
    """_PipelineScheduleRuntime waits for its sends when the step ends: at a middle stage's
    peak (its last forward run, f micro-batches still in flight) every output it sent and
    the M − f input gradients of the backwards run so far are alive."""
    arrays = NodeArrays(*(np.zeros(2),) * 4, np.array([0.0, 7.0, 0.0]),
                        np.array([0.0, 3.0, 0.0]), np.zeros(2), 0.0, 0.0)
    m, f = 8, 3
    first = stage_memory(arrays, 0, 1, StageRole(0, 2, m, f, holds_sends=True))
    last = stage_memory(arrays, 1, 2, StageRole(1, 2, m, f, holds_sends=True))
    assert first.sent == m * 7 - f * 3  # its outputs, beyond the f held ones; no gradient
    assert last.sent == (m - f) * 7  # the gradients of its input; it sends no output
    assert first.held_outputs == f * 3
    waited = stage_memory(arrays, 0, 1, StageRole(0, 2, m, f))  # GPipe and 1F1B wait
    assert waited.sent == 0.0 and first.total - waited.total == m * 7 - f * 3


def test_autograd_graph_is_device_memory_on_a_cpu_only() -> None:
    spec = load_model_file(SAMPLES / "mlp.py")
    graph = annotate(trace_model(spec), spec)
    training = Training("sgd", "fp32")
    cpu = node_arrays(graph, PRESETS["cpu"], 4, training)
    gpu = node_arrays(graph, PRESETS["h100-80g"], 4, training)
    nodes = np.array([n.autograd_nodes for n in graph.nodes])
    assert nodes.sum() > 0
    assert np.allclose(cpu.activation_bytes - gpu.activation_bytes,
                       nodes * PRESETS["cpu"].graph_node_bytes)


def test_a_cpu_stage_holds_one_kernel_per_distinct_product_or_convolution() -> None:
    # On a CPU whose math library keeps compiled kernels: the GPT sample repeats its blocks, so
    # a stage over the whole model holds its distinct products' kernels once each, under bf16
    # only (fp32 products go to a BLAS that keeps none); the ResNet its distinct convolutions.
    cpu = replace(PRESETS["cpu"], bf16_matmul_kernel_bytes=1000.0, conv_kernel_bytes=10.0)
    whole = StageRole(0, 1, 1, 1)
    for sample, precision, kind, per_call in (("gpt.py", "bf16", "matmul", 1000.0),
                                              ("gpt.py", "fp32", "matmul", 0.0),
                                              ("resnet.py", "fp32", "conv", 10.0)):
        spec = load_model_file(SAMPLES / sample)
        graph = annotate(trace_model(spec), spec, autocast_device="cpu")
        calls = [call for n in graph.nodes for call in n.kernels if call[0][0] == kind]
        assert len(set(calls)) < len(calls)  # repeated layers run the same calls
        training = Training("sgd", precision)
        memory = stage_memory(node_arrays(graph, cpu, 4, training), 0, len(graph.nodes), whole)
        assert memory.kernels == per_call * len(set(calls))
        gpu = node_arrays(graph, PRESETS["h100-80g"], 4, training)
        assert stage_memory(gpu, 0, len(graph.nodes), whole).kernels == 0.0


def test_a_split_backward_keeps_the_weight_operations_output_gradients() -> None:
    """Between a micro-batch's input gradient and its weights' (a zero-bubble schedule), torch's
    stage_backward_input keeps the gradient of every weight operation's output: the bytes the
    model counts per node are the ones torch keeps, for a convolutional model on a stage that
    receives its input."""
    torch.manual_seed(0)
    spec = load_model_file(SAMPLES / "resnet.py")
    graph = annotate(trace_model(spec), spec)
    arrays = node_arrays(graph, PRESETS["cpu"], 2, Training("sgd", "fp32"))
    model = spec.build_model()
    inputs = spec.sample_batch(2)[0].requires_grad_(True)
    output = model(inputs)
    groups = backward_input([output], [torch.ones_like(output)], [inputs], model.parameters())
    grads = [t for g in groups for t in _tensors(g["grads"])]
    assert arrays.weight_output_bytes.sum() == sum(t.numel() * t.element_size() for t in grads)
    # A residual add hands one gradient tensor to both branches: counted per operation, the
    # model over-counts those few (by 4 % here), never under.
    distinct = {id(t): t.numel() * t.element_size() for t in grads}
    assert 0.95 * arrays.weight_output_bytes.sum() < sum(distinct.values())


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (tuple, list)) else []


def test_a_stage_awaiting_weights_keeps_their_gradients_and_the_one_received() -> None:
    """Each micro-batch awaiting its weights' pass keeps its weight operations' output
    gradients and the output gradient it received; a first stage runs no input backward and
    keeps only the latter, a last stage receives none."""
    arrays = NodeArrays(*(np.zeros(2),) * 4, np.array([0.0, 7.0, 0.0]), np.zeros(3),
                        np.zeros(2), 0.0, 0.0, weight_output_bytes=np.array([5.0, 11.0]))
    assert stage_memory(arrays, 0, 1, StageRole(0, 2, 4, 2, awaiting_weights=2)
                        ).awaiting_weights == 2 * 7
    assert stage_memory(arrays, 1, 2, StageRole(1, 2, 4, 2, awaiting_weights=2)
                        ).awaiting_weights == 2 * 11
    assert stage_memory(arrays, 0, 2, StageRole(1, 3, 4, 2, awaiting_weights=3)
                        ).awaiting_weights == 3 * (5 + 11)
    assert stage_memory(arrays, 0, 2, StageRole(1, 3, 4, 2)).awaiting_weights == 0.0


def test_each_tensor_of_a_boundary_pays_the_links_latency() -> None:
    """The runtime sends a boundary's tensors one by one (each a rendezvous with its own
    latency); the bytes cost the same however they are split."""
    device = PRESETS["cpu"]
    latency, bandwidth = device.intra_node_latency_s, device.intra_node_bandwidth
    cut_bytes = np.array([0.0, 1e6, 1e6, 0.0])
    one_each = boundary_s(cut_bytes, device, False)
    sent = 2 * (latency + 1e6 / bandwidth)
    assert one_each == pytest.approx([0.0, sent, sent, 0.0])
    counted = boundary_s(cut_bytes, device, False, np.array([1.0, 1.0, 3.0, 1.0]))
    assert counted[2] - counted[1] == pytest.approx(2 * 2 * latency)
    assert counted[1] == one_each[1] and counted[0] == counted[3] == 0.0


def test_gpu_presets_rate_products_attention_and_the_rest_apart() -> None:
    """On a GPU preset a Linear runs at the products' efficiency, fused attention at its own,
    a LayerNorm at the device's one figure; the CPU preset has one figure for all, and the
    compute time of a product scales with it."""
    spec = load_model_file(SAMPLES / "gpt.py")
    graph = annotate(trace_model(spec, "fx", "meta"), spec)
    gpu, cpu = PRESETS["h200"], PRESETS["cpu"]
    by_kind = {}
    for node in graph.nodes:
        kind = ("attention" if "scaled_dot_product" in node.target
                else node.module.rsplit(".", 1)[-1] if node.op == "call_module" else None)
        if kind is not None:
            by_kind.setdefault(kind, set()).add(node_efficiency(node, gpu))
    assert by_kind["attention"] == {0.5} and by_kind["qkv"] == {0.75}
    assert by_kind["head"] == {0.75} and by_kind["ln1"] == {gpu.efficiency}
    assert {node_efficiency(n, cpu) for n in graph.nodes} == {cpu.efficiency}
    training = Training()
    faster = replace(gpu, matmul_efficiency=1.0, kernel_overhead_s=0.0)
    slower = replace(gpu, matmul_efficiency=0.5, kernel_overhead_s=0.0)
    head = next(i for i, n in enumerate(graph.nodes) if n.module == "head")
    times = [node_arrays(graph, d, 64, training).fwd_s[head] for d in (faster, slower)]
    assert times[1] == pytest.approx(2 * times[0])

"""Time and memory of nodes and boundaries at micro-batch size m (a stage's memory:
pipec.cost.stage_memory).

Per node a roofline, ``max(flops / (peak · efficiency), bytes / bandwidth)``, plus a fixed
per-kernel overhead (Megatron-LM's ``t(b)`` has the same shape: small micro-batches are
inefficient). On a GPU a matrix product's efficiency also falls with its wave quantization
(``wave_efficiency``), which smaller products, a tensor-parallel rank's among them, pay more.
A boundary costs ``tensors · latency + bytes / link bandwidth`` forward and the same again for the
gradients: each tensor crossing it is a send of its own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from pipec.cost.hardware import Device
from pipec.cost.kernel_cache import KernelRuns
from pipec.frontend.costgraph import (
    MEASURED_BATCHES,
    CostGraph,
    KernelCall,
    LossCost,
    NodeCost,
)

# Per fp32 parameter byte, what training keeps besides the weight itself: its gradient, the
# optimizer state (SGD's momentum buffer; AdamW's two moments) and, under bf16 autocast, the
# cached bf16 copy of each weight a matmul or convolution uses (half the bytes). Master weights,
# gradients and optimizer state stay fp32 under autocast.
GRADIENT_RATIO = 1.0
OPTIMIZER_STATE_RATIO = {"sgd": 1.0, "adamw": 2.0}
# Bytes an optimizer step reads and writes per parameter byte: SGD with momentum reads the
# weight, gradient and momentum and writes the weight and momentum (5); PyTorch's foreach AdamW
# does the same with two moments (7) plus its temporaries: 0.85-1.6 ns per parameter byte at
# 10 GB/s on a 2-core AMD EPYC VM, about 12.
OPTIMIZER_TRAFFIC = {"sgd": 5.0, "adamw": 12.0}
AUTOCAST_COPY_RATIO = {"fp32": 0.0, "bf16": 0.5}


OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Training:
    """What the cost model needs of the training configuration."""

    optimizer: str = "sgd"
    precision: str = "fp32"


@dataclass(frozen=True)
class Fit:
    """A measured time model: ``overhead + flops · seconds_per_flop + bytes · seconds_per_byte``."""

    overhead_s: float
    seconds_per_flop: float
    seconds_per_byte: float

    def seconds(self, flops: np.ndarray, moved_bytes: np.ndarray) -> np.ndarray:
        return self.overhead_s + flops * self.seconds_per_flop + moved_bytes * self.seconds_per_byte


@dataclass(frozen=True)
class NodeTiming:
    """One node's measured seconds, in the context of its model's training pass, at each
    profiled micro-batch size (ascending)."""

    node: str
    target: str
    sizes: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]

    def at(self, micro_batch: int) -> tuple[float, float]:
        return _interpolate(self.sizes, self.fwd_s, micro_batch), _interpolate(
            self.sizes, self.bwd_s, micro_batch)


@dataclass(frozen=True)
class Calibration:
    """Time measured on one device (`pipec profile`); it replaces the preset's roofline for
    compute time. ``nodes``: the profiled model's own per-node timings, used when the compiled
    graph is that model's; other graphs get the forward and backward fits."""

    device: str
    forward: Fit
    backward: Fit
    nodes: tuple[NodeTiming, ...] = ()
    # A stage's own cost per micro-batch, forward and backward, besides its nodes' (calling
    # it, starting autograd's engine): paid once per stage, however the model is split.
    stage_overhead_s: tuple[float, float] = (0.0, 0.0)
    # Where the times come from, for the report: the command that measured them, and where.
    source: str = "pipec profile"
    # Measured times alone × this: the slowdown when every local training process computes at
    # once (they share the machine's cores and memory bandwidth; pipec.calibration.probe
    # measures it).
    contention: float = 1.0
    # Making one step's data (the model file's sample_batch): fixed seconds, seconds per sample.
    data_s: tuple[float, float] = (0.0, 0.0)
    # The model file's loss on the profiled model's output, forward and backward (None: not
    # measured); the last stage runs it after its nodes.
    loss: NodeTiming | None = None
    # Per BatchNorm node timed as the GroupNorm of a pipelined plan (--norm auto): what its
    # BatchNorm takes more, forward and backward (pipec.calibration.norm_times), for plans that
    # keep it.
    kept_norm: tuple[NodeTiming, ...] = ()
    # What splitting the whole model's backward (a zero-bubble schedule's stages but the first)
    # adds to its one backward, as ``bwd_s`` at the sizes measured
    # (pipec.calibration.split_backward_times; None: not measured).
    split_backward: NodeTiming | None = None
    # Per optimizer ("sgd", "adamw"), its step as train.py runs it, out of the caches: fixed
    # seconds, seconds per parameter tensor and per parameter byte (pipec.calibration.step_times;
    # () not measured: the roofline's bytes, optimizer_s).
    optimizer_s: tuple[tuple[str, float, float, float], ...] = ()

    def bind(self, graph: CostGraph) -> Calibration:
        """This calibration for ``graph``: its node timings (and its model's loss, data,
        BatchNorms and split backward) kept only if they are of ``graph`` (the same nodes, in
        the same order)."""
        same = [(n.name, n.target) for n in graph.nodes] == [(t.node, t.target)
                                                             for t in self.nodes]
        return self if same else replace(self.fitted(), data_s=(0.0, 0.0))

    def fitted(self) -> Calibration:
        """This calibration without the profiled graph's own node timings (its loss, kept
        BatchNorms and split backward): the fitted constants alone."""
        return replace(self, nodes=(), loss=None, kept_norm=(), split_backward=None)


def _interpolate(sizes: tuple[int, ...], seconds: tuple[float, ...], micro_batch: int) -> float:
    """Piecewise linear in the micro-batch size; past the largest size, the last segment's
    slope continues (time per sample is steady at large sizes)."""
    if len(sizes) == 1:
        return seconds[0] * micro_batch / sizes[0]
    if micro_batch <= sizes[-1]:
        return float(np.interp(micro_batch, sizes, seconds))
    slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
    return seconds[-1] + slope * (micro_batch - sizes[-1])


@dataclass(frozen=True)
class NodeArrays:
    """Per-node costs at one micro-batch size, as arrays (length n) for the solver."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    static_bytes: np.ndarray  # params + grads + optimizer state + buffers
    # Saved for backward (on a CPU, with autograd's graph), per micro-batch in flight.
    activation_bytes: np.ndarray
    boundary_bytes: np.ndarray  # length n + 1: bytes live across each cut, the ends included
    held_bytes: np.ndarray  # length n + 1: of those, what no node saves for backward
    working_bytes: np.ndarray  # per node, alive during its backward; the loss's on the last
    loss_bytes: float  # saved by loss_fn, per micro-batch in flight
    target_bytes: float  # one micro-batch's targets
    # Per node, the gradients of its parameters (part of static_bytes).
    gradient_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Per node, autograd's graph (part of activation_bytes): a recomputing stage still keeps
    # it for every micro-batch in flight, only the saved tensors go, and makes another for the
    # micro-batch it recomputes.
    graph_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # The kernels the device's math library keeps, each distinct call's once per stage.
    kernels: KernelRuns = field(default_factory=KernelRuns)
    # Per node, what selective recomputation keeps per micro-batch in flight
    # (pipec.frontend.kernels): the outputs of its weight products, convolutions and fused
    # attention; bf16 under autocast, which runs them in bf16.
    selective_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Per node with trainable parameters, its output's size: a split backward (the zero-bubble
    # schedules' stage_backward_input) keeps the gradient of that output until the weights'
    # gradient is made from it (torch's param_groups "grads").
    weight_output_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @functools.cached_property
    def selective_shared(self) -> np.ndarray:
        """Per node, what selective recomputation keeps that autograd saves anyway: the
        recomputed micro-batch finds it kept and does not make it again."""
        if self.selective_bytes.size == 0:
            return self.selective_bytes
        saved = self.activation_bytes - (self.graph_bytes if self.graph_bytes.size else 0.0)
        shared: np.ndarray = np.minimum(self.selective_bytes, saved)
        return shared

    @functools.cached_property
    def selective_held(self) -> np.ndarray:
        """Per cut (length n + 1), what selective recomputation keeps of a stage's outputs
        ending there, which the runtime holds anyway (held_bytes): the same tensor."""
        held = np.zeros(len(self.held_bytes))
        if self.selective_bytes.size:
            held[1:] = np.minimum(self.held_bytes[1:], self.selective_bytes)
        return held

    @functools.cached_property
    def accumulating_working_bytes(self) -> np.ndarray:
        """working_bytes with each node's parameter gradient (stage_memory.working_bytes), made
        once: the planner asks for it at every stage it weighs."""
        if self.gradient_bytes.size == 0:
            return self.working_bytes
        accumulated: np.ndarray = self.working_bytes + self.gradient_bytes
        return accumulated

    @property
    def cut_bytes(self) -> np.ndarray:
        """Bytes sent across each cut: the graph's ends (its inputs and outputs) send nothing."""
        sent = self.boundary_bytes.copy()
        sent[0] = sent[-1] = 0.0
        return sent


def node_efficiency(node: NodeCost, device: Device) -> float:
    """The fraction of peak FLOP/s ``node``'s kernels reach on ``device``: fused attention's,
    a product's or a convolution's where the device has a figure of its own, else its one
    figure (Device.efficiency)."""
    if device.attention_efficiency is not None and "scaled_dot_product" in node.target:
        return device.attention_efficiency
    kinds = {calls[0][0] for calls in node.kernels}
    if device.matmul_efficiency is not None and kinds & {"matmul", "conv"}:
        return device.matmul_efficiency
    return device.efficiency


# The output tile of a GPU matrix product: cuBLAS's large bf16/TF32 kernels compute 128 × 128
# (or larger) tiles, one per streaming multiprocessor at a time (NVIDIA, "Matrix Multiplication
# Background User's Guide", tile and wave quantization).
PRODUCT_TILE = 128


def wave_efficiency(node: NodeCost, device: Device, micro_batch: int) -> float:
    """The share of its streaming multiprocessors' time ``node``'s products use: a product of
    t output tiles runs ⌈t / SMs⌉ waves, the last one partly idle (NVIDIA's wave
    quantization). Weighted by each product's tiles; 1 where the device does not model it
    (a CPU) or the node runs no product. The backward's products take the forward's figure
    (their outputs have other shapes: an approximation)."""
    if device.compute_units <= 0:
        return 1.0
    tiles = [_tiles(calls, micro_batch, node.product_split) for calls in node.kernels
             if calls[0][0] == "matmul"]
    if not tiles:
        return 1.0
    units = device.compute_units
    return sum(tiles) / sum(math.ceil(t / units) * units for t in tiles)


def _tiles(calls: tuple[KernelCall, KernelCall], micro_batch: int, split: int) -> int:
    """One product's output tiles at ``micro_batch``, its (batch, rows, columns) read from its
    calls at MEASURED_BATCHES and taken along the line through them; ``split``: tensor
    parallelism divides its columns (or, for a batched product, its batch) that many ways."""
    (b1, at_b1), (b2, at_b2) = zip(MEASURED_BATCHES, (_product_dims(c) for c in calls),
                                   strict=True)
    batch, rows, columns = (round(x + (y - x) * (micro_batch - b1) / (b2 - b1))
                            for x, y in zip(at_b1, at_b2, strict=True))
    if batch > 1:
        batch = math.ceil(batch / split)
    else:
        columns = math.ceil(columns / split)
    return (max(batch, 1) * max(math.ceil(rows / PRODUCT_TILE), 1)
            * max(math.ceil(columns / PRODUCT_TILE), 1))


def _product_dims(call: KernelCall) -> tuple[int, int, int]:
    """(batch, rows, columns) of an mm/addmm/bmm/baddbmm call's output, from its arguments'
    shapes (the last two are the factors; addmm and baddbmm put the bias first)."""
    left, right = [a for a in call[1] if isinstance(a, tuple)][-2:]
    if len(left) == 3:
        return left[0], left[1], right[2]
    return 1, left[0], right[1]


def node_arrays(graph: CostGraph, device: Device, micro_batch: int, training: Training,
                calibration: Calibration | None = None) -> NodeArrays:
    peak = device.bf16_flops if training.precision == "bf16" else device.fp32_flops
    flops_rate = peak * np.array([node_efficiency(n, device)
                                  * wave_efficiency(n, device, micro_batch)
                                  for n in graph.nodes])
    bf16 = training.precision == "bf16"
    fwd_flops = np.array([n.fwd_flops.at(micro_batch) for n in graph.nodes])
    bwd_flops = np.array([n.bwd_flops.at(micro_batch) for n in graph.nodes])
    out_bytes = np.array([n.output_bytes.at(micro_batch) * (n.bf16.output_ratio if bf16 else 1)
                          for n in graph.nodes])
    graph_bytes = np.array([n.autograd_nodes * device.graph_node_bytes for n in graph.nodes],
                           dtype=float)
    saved_bytes = np.array([_saved_bytes(n, micro_batch, bf16) for n in graph.nodes]) \
        + graph_bytes
    param_bytes = np.array([n.param_bytes for n in graph.nodes], dtype=float)
    moved = out_bytes + param_bytes
    overhead = device.kernel_overhead_s
    fwd = np.maximum(fwd_flops / flops_rate, moved / device.memory_bandwidth) + overhead
    bwd = np.maximum(bwd_flops / flops_rate, 2 * moved / device.memory_bandwidth) + overhead
    if calibration is not None:
        fwd, bwd = _calibrated(graph, calibration, micro_batch, fwd_flops, bwd_flops, moved)
    if graph.tp > 1:
        collective_fwd, collective_bwd = tp_collectives_s(graph, device, micro_batch, bf16,
                                                          (fwd, bwd))
        fwd, bwd = fwd + collective_fwd, bwd + collective_bwd
    shared = np.array([n.shared_bytes for n in graph.nodes], dtype=float)
    static = ((param_bytes + shared) * static_ratio(training)
              + np.array([n.buffer_bytes for n in graph.nodes], dtype=float))
    # Each boundary value in its own dtype under autocast (an fp32 residual stream stays fp32).
    boundary = np.array([c.at(micro_batch) for c in graph.cut_bytes_at(training.precision)])
    held = np.array([c.at(micro_batch) for c in graph.held_cut_bytes_at(training.precision)])
    working = np.array([n.working_bytes.at(micro_batch) * (n.bf16.working_ratio if bf16 else 1)
                        for n in graph.nodes])
    # The loss runs after the last node, on the last stage, which always holds that node.
    loss_saved = _loss_saved_bytes(graph.loss, micro_batch, bf16)
    working[-1] = max(working[-1], _loss_working_bytes(graph, micro_batch, bf16, loss_saved))
    return NodeArrays(fwd, bwd, static, saved_bytes, boundary, held, working, loss_saved,
                      graph.loss.target_bytes.at(micro_batch),
                      (param_bytes + shared) * GRADIENT_RATIO, graph_bytes,
                      kernel_runs(graph, device, bf16),
                      np.array([n.selective_bytes.at(micro_batch) * (0.5 if bf16 else 1.0)
                                for n in graph.nodes]),
                      np.where(param_bytes + shared > 0, out_bytes, 0.0))


def tp_collectives_s(graph: CostGraph, device: Device, micro_batch: int, bf16: bool,
                     compute: tuple[np.ndarray, np.ndarray] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each node's tensor-parallel all-reduces, forward and backward, within a node (its
    activations in bf16 under autocast). Each blocks the pass, as a synchronized BatchNorm's
    does: where the device's blocking all-reduce is measured and ``compute`` (each node's
    forward and backward seconds) is given, it waits Device.blocking_collective_s +
    blocking_drift · √(compute since the one before) in place of the link's latency."""
    ratio = 0.5 if bf16 else 1.0
    forward = np.array([n.tp_forward_bytes.at(micro_batch) * ratio for n in graph.nodes])
    backward = np.array([n.tp_backward_bytes.at(micro_batch) * ratio for n in graph.nodes])
    wait_fwd = wait_bwd = np.zeros(len(graph.nodes))
    latency = 0.0
    if compute is not None and (device.blocking_collective_s or device.blocking_drift):
        between_fwd, between_bwd = compute_between(*compute, (forward > 0) | (backward > 0))
        wait_fwd = device.blocking_collective_s + device.blocking_drift * np.sqrt(between_fwd)
        wait_bwd = device.blocking_collective_s + device.blocking_drift * np.sqrt(between_bwd)
        latency = allreduce_s(0.0, graph.tp, device)

    def seconds(moved: np.ndarray, wait: np.ndarray) -> np.ndarray:
        return np.array([allreduce_s(b, graph.tp, device) - latency + w if b else 0.0
                         for b, w in zip(moved, wait, strict=True)])

    return seconds(forward, wait_fwd), seconds(backward, wait_bwd)


def compute_between(fwd: np.ndarray, bwd: np.ndarray, blocking: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per node that blocks (``blocking``), the compute since the block before it, forward and
    backward. A micro-batch runs the nodes forward then backward, in reverse, and the next
    micro-batch follows: the first block's compute wraps around from the last's (a plan with
    no blocking node has none)."""
    order = [(float(t), i, 0) for i, t in enumerate(fwd)] + \
        [(float(bwd[i]), i, 1) for i in reversed(range(len(bwd)))]
    between = np.zeros((2, len(fwd)))
    blocks = [k for k, (_, i, _) in enumerate(order) if blocking[i]]
    if not blocks:
        return between[0], between[1]
    for previous, current in zip([blocks[-1], *blocks[:-1]], blocks, strict=True):
        span = range(previous + 1, current + 1) if previous < current else \
            [*range(previous + 1, len(order)), *range(current + 1)]
        _, i, pass_ = order[current]
        between[pass_, i] = sum(order[k][0] for k in span)
    return between[0], between[1]


def kernel_runs(graph: CostGraph, device: Device, bf16: bool) -> KernelRuns:
    """The graph's products and convolutions in order, each with the node of the same call's
    run before and the bytes its kernels keep on ``device`` (pipec.cost.hardware.Device)."""
    per_kind = {"matmul": device.bf16_matmul_kernel_bytes if bf16 else 0.0,
                "conv": device.conv_kernel_bytes}
    runs = [(i, call) for i, n in enumerate(graph.nodes) for call in n.kernels]
    return KernelRuns.of([i for i, _ in runs], [call for _, call in runs],
                         [per_kind[call[0][0]] for _, call in runs])


def _loss_working_bytes(graph: CostGraph, micro_batch: int, bf16: bool,
                        loss_saved: float) -> float:
    """What the loss's backward holds: what it saved and the gradient of the model's output.
    A loss that autocast runs in fp32 on a bf16 output (cross-entropy: it saves an fp32
    log-softmax) makes that gradient in fp32, then casts it to the output's bf16."""
    output_grad = graph.loss.working_bytes.at(micro_batch) - graph.loss.saved_bytes.at(micro_batch)
    ratio = graph.nodes[-1].bf16.output_ratio if bf16 else 1.0
    upcast = ratio < 1.0 and loss_saved > ratio * graph.loss.saved_bytes.at(micro_batch)
    return loss_saved + output_grad * (1.0 + ratio if upcast else ratio)


def _saved_bytes(node: NodeCost, micro_batch: int, bf16: bool) -> float:
    """What the node saves for backward, under bf16 autocast as measured (half, unmeasured)."""
    if bf16 and node.bf16.saved_bytes is not None:
        return node.bf16.saved_bytes.at(micro_batch)
    return node.saved_bytes.at(micro_batch) * (0.5 if bf16 else 1.0)


def _loss_saved_bytes(loss: LossCost, micro_batch: int, bf16: bool) -> float:
    if bf16 and loss.saved_bytes_bf16 is not None:
        return loss.saved_bytes_bf16.at(micro_batch)
    return loss.saved_bytes.at(micro_batch) * (0.5 if bf16 else 1.0)


def _calibrated(graph: CostGraph, calibration: Calibration, micro_batch: int,
                fwd_flops: np.ndarray, bwd_flops: np.ndarray, moved: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds per node: measured on this graph, or fitted."""
    timings = calibration.bind(graph).nodes
    scale = calibration.contention
    if timings:
        fwd, bwd = (np.array(times) for times in zip(*(t.at(micro_batch) for t in timings),
                                                        strict=True))
        if calibration.loss is not None:  # the profiled model's own loss, on the last stage
            loss_fwd, loss_bwd = calibration.loss.at(micro_batch)
            fwd[-1] += loss_fwd
            bwd[-1] += loss_bwd
        return fwd * scale, bwd * scale
    return (calibration.forward.seconds(fwd_flops, moved) * scale,
            calibration.backward.seconds(bwd_flops, moved) * scale)


def boundary_s(cut_bytes: np.ndarray, device: Device, inter_node: bool,
               cut_tensors: np.ndarray | None = None) -> np.ndarray:
    """Forward send of the activations plus backward send of their gradients, per cut: a
    latency per tensor (``cut_tensors``, default 1: the runtime sends each tensor of a boundary
    on its own) and the bytes over the link's bandwidth."""
    latency, bandwidth = ((device.inter_node_latency_s, device.inter_node_bandwidth) if inter_node
                          else (device.intra_node_latency_s, device.intra_node_bandwidth))
    tensors = np.ones_like(cut_bytes) if cut_tensors is None else cut_tensors
    return np.where(cut_bytes > 0, 2 * (tensors * latency + cut_bytes / bandwidth), 0.0)


def rank_of(position: int, replica: int, pp: int, replicas: int,
            replicas_inner: bool = False) -> int:
    """The rank of pipeline ``position`` in ``replica``: positions innermost (rank = replica ·
    pp + position, a replica's pipeline on neighbouring ranks) or replicas innermost (rank =
    position · replicas + replica, a position's replicas on neighbouring ranks)."""
    return position * replicas + replica if replicas_inner else replica * pp + position


def crosses_nodes(source: int, target: int, pp: int, replicas: int,
                  devices_per_node: int, replicas_inner: bool = False) -> bool:
    """Whether pipeline position ``source`` → ``target`` crosses a node in some replica."""
    def node(position: int, replica: int) -> int:
        return rank_of(position, replica, pp, replicas, replicas_inner) // devices_per_node
    return any(node(source, r) != node(target, r) for r in range(replicas))


def spans_nodes(position: int, pp: int, replicas: int, devices_per_node: int,
                replicas_inner: bool = False) -> bool:
    """Whether a position's data-parallel group has members on different nodes."""
    return len({rank_of(position, r, pp, replicas, replicas_inner) // devices_per_node
                for r in range(replicas)}) > 1


def static_ratio(training: Training) -> float:
    """Bytes kept per fp32 parameter byte: weight, gradient, optimizer state, autocast copy."""
    return (1.0 + GRADIENT_RATIO + OPTIMIZER_STATE_RATIO[training.optimizer]
            + AUTOCAST_COPY_RATIO[training.precision])


def usable_memory(device: Device, pairs: int = 0, groups: int = 0) -> float:
    """What a device has for the model's terms and the runtime's: its memory less what each
    process holds before training (context, its first communicator), the further
    communicators its rank uses (``pairs`` of two ranks, ``groups`` of more) and the
    allocator's fragmentation."""
    outside = (device.process_bytes + pairs * device.communicator_bytes
               + groups * device.group_communicator_bytes)
    return (device.memory_bytes - outside) * (1 - device.fragmentation)


def allreduce_bandwidth(device: Device) -> float:
    """An all-reduce's bus bandwidth within a node: measured, else the intra-node link's."""
    return device.allreduce_bandwidth or device.intra_node_bandwidth


def allreduce_s(grad_bytes: float, replicas: int, device: Device, inter_node: bool = False
                ) -> float:
    """Ring all-reduce over ``replicas`` devices: 2(d−1) steps, each paying the link's latency,
    moving 2(d−1)/d · bytes in all (Patarasuk & Yuan 2009), over the inter-node links when the
    group spans nodes; within a node, at the device's measured all-reduce bus bandwidth where
    known (gloo reduces on the CPU: slower than its links)."""
    if replicas == 1:
        return 0.0
    latency = device.inter_node_latency_s if inter_node else device.intra_node_latency_s
    bandwidth = (device.inter_node_bandwidth if inter_node
                 else allreduce_bandwidth(device))
    steps = 2 * (replicas - 1)
    return steps * latency + steps / replicas * grad_bytes / bandwidth


# DistributedDataParallel's buckets: the first closes at 1 MiB, the others at 25 MiB (its
# bucket_cap_mb default); each is one all-reduce.
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 25 * 2**20


def data_parallel_collectives(grad_bytes: float) -> int:
    """The all-reduces of a data-parallel step: one per DDP bucket of the gradients, and the
    loss's (train.py's global_loss)."""
    rest = max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0.0)
    return 2 + math.ceil(rest / DDP_BUCKET_BYTES)


def optimizer_s(param_bytes: float, optimizer: str, device: Device,
                tensors: float = 0.0, measured: Calibration | None = None) -> float:
    """One optimizer step over ``param_bytes`` of fp32 weights in ``tensors`` tensors: as
    ``measured`` timed it where it did (its Python's time per step and per tensor, and its
    bytes out of the caches), else memory-bound."""
    timed = dict((name, rest) for name, *rest in measured.optimizer_s) if measured else {}
    if not tensors and not param_bytes:
        return 0.0  # train.py's optimizer of a device without weights does nothing
    if optimizer in timed:
        fixed, per_tensor, per_byte = timed[optimizer]
        return fixed + per_tensor * tensors + per_byte * param_bytes
    return param_bytes * OPTIMIZER_TRAFFIC[optimizer] / device.memory_bandwidth

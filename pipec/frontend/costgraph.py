"""The cost graph: what the annotate pass measures, per compute node and per cut, as values
linear in the micro-batch size (the planner's input)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A product or convolution a node runs: ("matmul" or "conv", what its kernel depends on, the
# operands' shapes and the call's options; pipec.frontend.kernels).
KernelCall = tuple[str, tuple[Any, ...]]

COMPUTE_OPS = ("call_module", "call_function", "call_method")

MEASURED_BATCHES = (2, 4)

@dataclass(frozen=True)
class Linear:
    """A quantity that is ``fixed + per_sample · m`` at micro-batch size m."""

    fixed: float
    per_sample: float

    def at(self, micro_batch: int) -> float:
        return self.fixed + self.per_sample * micro_batch

@dataclass(frozen=True)
class Bf16Costs:
    """A node's bytes under bf16 autocast, measured by pipec.frontend.autocast: what it saves (a
    Linear saves a bf16 copy of its fp32 input, a LayerNorm its fp32 input), and its output and
    backward working set as fractions of their fp32 bytes. The defaults, half of the fp32
    bytes, stand for a graph that was not measured under autocast."""

    saved_bytes: Linear | None = None
    output_ratio: float = 0.5
    working_ratio: float = 0.5


@dataclass(frozen=True)
class NodeCost:
    """What one compute node of the graph costs (one micro-batch of size m)."""

    name: str
    op: str
    target: str
    module: str  # qualified name of the innermost module the node belongs to ("" for the root)
    shape: tuple[int, ...]  # output shape at batch 1 (empty when the output is not a tensor)
    is_tensor: bool
    fwd_flops: Linear
    bwd_flops: Linear  # counted on the node's real backward (input and weight gradients)
    output_bytes: Linear  # what the node returns (sent when a boundary follows it)
    saved_bytes: Linear  # what autograd keeps for backward, allocated by this node
    params: int  # parameters this node is the first user of
    param_bytes: int
    buffer_bytes: int
    # Parameters an earlier node used too (tied weights), counted at their last user: a stage
    # boundary between the two users gives the later stage a copy of its own.
    shared_bytes: int = 0
    # Alive while the node's backward runs: the gradient of its output and those of its inputs.
    working_bytes: Linear = Linear(0.0, 0.0)
    bf16: Bf16Costs = Bf16Costs()  # under --precision bf16
    # A BatchNorm's channels (0: not a BatchNorm): synchronized across replicas, it all-reduces
    # its statistics forward and their gradients backward, once per micro-batch.
    batch_norm_channels: int = 0
    # The operations autograd records for the node's backward, per micro-batch in flight: each
    # holds host memory (Device.graph_node_bytes) until the backward runs.
    autograd_nodes: int = 0
    # Its forward's products and convolutions, each as run at both MEASURED_BATCHES (so that
    # shapes that agree at one batch size only stay apart): a CPU keeps a kernel for each
    # distinct one (pipec.frontend.kernels).
    kernels: tuple[tuple[KernelCall, KernelCall], ...] = ()
    # What selective recomputation keeps for every micro-batch in flight (fp32): the outputs
    # of the node's weight products, convolutions and fused attention (pipec.frontend.kernels).
    selective_bytes: Linear = Linear(0.0, 0.0)
    # The parameter tensors among ``params``: DDP does work for each one's gradient.
    param_tensors: int = 0
    # Under tensor parallelism (CostGraph.tp > 1): the bytes one rank all-reduces after the
    # node's forward and in its backward (pipec.cost.sharded_costs).
    tp_forward_bytes: Linear = Linear(0.0, 0.0)
    tp_backward_bytes: Linear = Linear(0.0, 0.0)
    # Into how many parts tensor parallelism splits the output tiles of the node's products
    # (a column-parallel linear's features, the heads of a product inside attention); 1: whole.
    product_split: int = 1

@dataclass(frozen=True)
class LossCost:
    """``loss_fn`` on the model's output (it runs on the last stage, outside the traced graph)."""

    saved_bytes: Linear  # kept for backward besides its inputs (cross-entropy: log-softmax)
    working_bytes: Linear  # alive in its backward: gradients of the output and of saved values
    target_bytes: Linear  # the targets the last stage receives for a micro-batch
    saved_bytes_bf16: Linear | None = None  # under bf16 autocast (None: half of saved_bytes)

@dataclass(frozen=True)
class ValueSpec:
    """A tensor that may cross a stage boundary: what the receiving stage must allocate."""

    name: str
    shape_low: tuple[int, ...]  # at the first of MEASURED_BATCHES
    shape_high: tuple[int, ...]  # at the second
    dtype: str  # torch dtype name, e.g. "float32"
    requires_grad: bool
    # Its dtype in the whole model's run under bf16 autocast ("" given: ``dtype``): what a stage
    # boundary carries under --precision bf16 (a Linear's bf16 output, an fp32 residual stream).
    autocast_dtype: str = ""

    def __post_init__(self) -> None:
        if not self.autocast_dtype:
            object.__setattr__(self, "autocast_dtype", self.dtype)

    def shape_at(self, micro_batch: int) -> tuple[int, ...]:
        """Shapes are linear in the batch: the batch dimension grows, the others do not."""
        low, high = MEASURED_BATCHES
        return tuple(a + (b - a) * (micro_batch - low) // (high - low)
                     for a, b in zip(self.shape_low, self.shape_high, strict=True))

@dataclass(frozen=True)
class CostGraph:
    """Costs of the compute nodes in topological order, and of every possible cut.

    Cut i separates ``nodes[:i]`` from ``nodes[i:]``; cuts 0 and n are the graph's ends.
    """

    nodes: tuple[NodeCost, ...]
    cut_bytes: tuple[Linear, ...]  # bytes of the values live across each cut (n + 1 entries)
    legal_cuts: tuple[bool, ...]  # a stage boundary may sit at this cut
    values: tuple[ValueSpec, ...]  # inputs and tensor-valued nodes, in graph order
    # Of cut_bytes, the values no node saves for backward: a stage that sends them keeps them
    # anyway until their backward (torch.distributed.pipelining caches a stage's outputs).
    held_cut_bytes: tuple[Linear, ...] = ()
    loss: LossCost = LossCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.0))
    # cut_bytes and held_cut_bytes with each value in its dtype under bf16 autocast
    # (ValueSpec.autocast_dtype).
    cut_bytes_bf16: tuple[Linear, ...] = ()
    held_cut_bytes_bf16: tuple[Linear, ...] = ()
    # The names of the values live across each cut, in graph order (what a boundary sends).
    live: tuple[tuple[str, ...], ...] = ()
    # The training data is made by sample_batch() (the model file has no train_dataset()):
    # each end stage makes the whole global batch, then keeps its replica's share.
    synthetic_data: bool = True
    # One tensor-parallel rank's costs over this many ranks (1: no tensor parallelism).
    tp: int = 1

    def value(self, name: str) -> ValueSpec:
        return next(v for v in self.values if v.name == name)

    def cut_bytes_at(self, precision: str) -> tuple[Linear, ...]:
        """The bytes crossing each cut when training at ``precision`` ("fp32" or "bf16")."""
        bf16 = precision == "bf16" and self.cut_bytes_bf16
        return self.cut_bytes_bf16 if bf16 else self.cut_bytes

    def held_cut_bytes_at(self, precision: str) -> tuple[Linear, ...]:
        """Of those, the bytes a sending stage holds until their backward."""
        bf16 = precision == "bf16" and self.held_cut_bytes_bf16
        return self.held_cut_bytes_bf16 if bf16 else self.held_cut_bytes

    def cut_tensors(self) -> tuple[int, ...]:
        """The tensors crossing each cut, each sent on its own (1 where liveness was not
        recorded)."""
        if not self.live:
            return (1,) * len(self.cut_bytes)
        return tuple(max(len(names), 1) for names in self.live)

    @property
    def total_params(self) -> int:
        return sum(n.params for n in self.nodes)

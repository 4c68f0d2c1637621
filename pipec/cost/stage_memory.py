"""Memory per stage (docs/cost-model.md, "Memory per device"): what each stage holds at its
peak, term by term, and the same terms as the partition DP sees them (its span and its ends)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipec.cost.model import NodeArrays


@dataclass(frozen=True)
class StageMemory:
    """One stage's peak bytes, by term (docs/cost-model.md)."""

    static: float  # weights, gradients, optimizer state, buffers
    activations: float  # saved for backward, times the micro-batches in flight
    held_outputs: float  # outputs no node saves, kept by the runtime until their backward
    # One per micro-batch in flight for the input, one for the output's gradient.
    receive_buffers: float
    data: float  # the step's inputs (first stage) and targets (last stage)
    loss: float  # what loss_fn saves, times the micro-batches in flight (last stage)
    working: float  # the largest backward working set among the stage's nodes (and the loss's)
    # What the schedule's unfinished sends keep alive (StageRole.holds_sends), beyond the
    # outputs already counted as held.
    sent: float = 0.0
    # Zero or negative: when every micro-batch is in flight before the first backward (GPipe),
    # the peak comes before the gradients exist (train.py zeroes them to None each step), or
    # after one micro-batch's activations are freed: the smaller of the two is not held.
    unmade_gradients: float = 0.0
    # The math library's compiled kernels, one per distinct product or convolution (on CPUs).
    kernels: float = 0.0
    # Under a split backward (zero bubble), what each micro-batch awaiting its weights' gradient
    # keeps: its weight operations' output gradients and the gradient it received.
    awaiting_weights: float = 0.0

    @property
    def total(self) -> float:
        return (self.static + self.activations + self.held_outputs + self.receive_buffers
                + self.data + self.loss + self.working + self.sent + self.unmade_gradients
                + self.kernels + self.awaiting_weights)


@dataclass(frozen=True)
class StageRole:
    """Where a stage sits and how much of the step it holds at once."""

    index: int
    num_stages: int
    micro_batches: int  # per step and replica: the runtime allocates buffers for each
    in_flight: int  # micro-batches whose activations it holds at once
    replicas: int = 1  # data-parallel replicas of the stage
    # The end stages hold the step's whole global batch, inputs and targets: the data is made
    # by sample_batch() in the process's own (host) memory, which is the device's on a CPU.
    whole_batch: bool = False
    # torch's _PipelineScheduleRuntime (interleaved 1F1B) waits for its sends only when the
    # step ends, and each send's Work keeps its tensor: every output the stage sent and every
    # input gradient stay alive until then (schedules.HOLDS_SENDS).
    holds_sends: bool = False
    # The stage sits on the first stage's device (the last stage of a V): the whole batch made
    # there is counted once, on the first stage.
    on_first_device: bool = False
    # The most micro-batches whose input gradient ran and whose weights' gradient has not
    # (schedules.awaiting_weights; zero-bubble schedules only).
    awaiting_weights: int = 0

    @property
    def peaks_before_gradients(self) -> bool:
        """Every micro-batch is in flight before the first backward, and the gradients are
        the stage's own (DDP's buckets, under data parallelism, exist all along)."""
        return self.in_flight >= self.micro_batches and self.replicas == 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_memory(arrays: NodeArrays, start: int, end: int, role: StageRole,
                 recompute: str = "none") -> StageMemory:
    """The peak of the stage over nodes [start, end) under torch.distributed.pipelining, as
    the emitted pipeline.py runs it: a receive buffer is made when its receive is posted and
    dropped after the micro-batch's backward (pipeline.receive_into_fresh_buffers; torch's
    ``PipelineStage`` alone would keep one per micro-batch of the step), so the stage holds
    one input per micro-batch in flight and one output gradient; it caches each micro-batch's
    outputs until its backward, and the schedule splits the step's whole batch into
    micro-batches up front. A stage that ``recompute``s (torch.utils.checkpoint over its
    forward) keeps only its inputs, which are its receive buffers, and holds one micro-batch's
    activations while its backward makes them again; recomputing selectively, it also keeps
    the outputs of its expensive operations for every micro-batch in flight."""
    f = role.in_flight
    received = 0.0 if role.first else f * arrays.boundary_bytes[start]
    gradients = 0.0 if role.last else arrays.boundary_bytes[end]
    return StageMemory(
        static=float(arrays.static_bytes[start:end].sum()),
        activations=_activations(arrays, start, end, f, recompute),
        held_outputs=f * float(arrays.held_bytes[end]),
        receive_buffers=float(received + gradients),
        data=sum(_data_bytes(arrays, role)),
        loss=f * arrays.loss_bytes if role.last else 0.0,
        working=float(working_bytes(arrays, role)[start:end].max(initial=0.0)),
        sent=_sent_bytes(arrays, start, end, role),
        unmade_gradients=-unmade_gradients(arrays, start, end)
        if role.peaks_before_gradients and recompute == "none" else 0.0,
        kernels=arrays.kernels.span_bytes(start, end),
        awaiting_weights=_awaited_bytes(arrays, start, end, role))


def _awaited_bytes(arrays: NodeArrays, start: int, end: int, role: StageRole) -> float:
    """What the micro-batches awaiting their weights' gradient keep (Qi et al. 2024's "W"
    deferred): torch's stage_backward_input keeps the gradient of every weight operation's
    output for stage_backward_weight, and the stage keeps the output gradient it received.
    The first stage runs no input backward (its inputs need no gradient): its whole backward
    waits for "W", keeping only the gradient it received."""
    if not role.awaiting_weights:
        return 0.0
    kept = 0.0 if role.first else _weight_outputs(arrays)[start:end].sum()
    received = 0.0 if role.last else arrays.boundary_bytes[end]
    return float(role.awaiting_weights * (kept + received))


def _weight_outputs(arrays: NodeArrays) -> np.ndarray:
    n = len(arrays.static_bytes)
    return arrays.weight_output_bytes if arrays.weight_output_bytes.size else np.zeros(n)


def _activations(arrays: NodeArrays, start: int, end: int, in_flight: int,
                 recompute: str) -> float:
    """What the stage saves for backward: every micro-batch in flight's activations, or, when
    it recomputes, one micro-batch's (made again, with their own autograd graph) and the graph
    of every micro-batch in flight, which stays (on a CPU), and (selective) what it keeps."""
    activations = float(arrays.activation_bytes[start:end].sum())
    if recompute == "none":
        return in_flight * activations
    kept = float(arrays.graph_bytes[start:end].sum()) if arrays.graph_bytes.size else 0.0
    if recompute == "selective" and arrays.selective_bytes.size:
        # Kept: the expensive outputs, less the stage's outputs the runtime holds anyway; made
        # again: the rest of one micro-batch's activations.
        activations -= float(arrays.selective_shared[start:end].sum())
        kept += float(arrays.selective_bytes[start:end].sum()) - arrays.selective_held[end]
    return activations + in_flight * kept


def unmade_gradients(arrays: NodeArrays, start: int, end: int) -> float:
    """What a stage peaking before its gradients does not hold, over nodes [start, end).

    Its first backward runs node by node from the end: when node i's runs, the gradients of
    nodes ≥ i exist and the activations saved by nodes > i are freed. Before it the stage holds
    static − G + f·A; at node i, static − G + f·A + G[≥i] − A[>i]; after it, static + (f−1)·A.
    So the stage always holds static + f·A less at most min over i of (G[<i] + A[>i]), and
    less G."""
    if end <= start:
        return 0.0
    gradients = arrays.gradient_bytes[start:end]
    before = np.concatenate(([0.0], np.cumsum(gradients)[:-1]))  # G[<i]
    after = np.cumsum(arrays.activation_bytes[start:end][::-1])[::-1] - \
        arrays.activation_bytes[start:end]  # A[>i]
    return float(min(gradients.sum(), (before + after).min()))


def working_bytes(arrays: NodeArrays, role: StageRole) -> np.ndarray:
    """Per node, what its backward holds besides what stays: the gradients of its output and
    inputs and, when gradients accumulate (more than one micro-batch per step, or DDP copying
    into its buckets), the micro-batch's own gradient of the node's parameters, made before
    autograd adds it to .grad. The same for every stage of a point (the DP's array)."""
    accumulates = role.micro_batches > 1 or role.replicas > 1
    return arrays.accumulating_working_bytes if accumulates else arrays.working_bytes


def ends_bytes(arrays: NodeArrays, role: StageRole) -> tuple[np.ndarray, np.ndarray]:
    """For the partition DP, per cut: what a stage starting there holds for its input (receive
    buffers; at cut 0, the step's inputs) and what a stage ending there holds for its output
    (gradient buffers and outputs kept for backward; the loss and targets on the last stage),
    both with what unfinished sends keep (``StageRole.holds_sends``), and the gradients awaiting
    the weights' pass split over the two ends (``_awaited_ends``: the start's share is taken
    away, so an entry may be negative). With the span's own terms they add up to
    ``stage_memory(...).total``."""
    m, f = role.micro_batches, role.in_flight
    at_start, at_end = _data_bytes(arrays, role)
    # Receive buffers for the inputs in flight; the input gradients already sent (M − f).
    enter = (m if role.holds_sends else f) * arrays.boundary_bytes
    if role.last:
        leave = f * (arrays.held_bytes + arrays.loss_bytes) + at_end
    elif role.holds_sends:  # a gradient buffer, and every output kept by its send
        leave = (m + 1) * arrays.boundary_bytes
    else:
        leave = f * arrays.held_bytes + arrays.boundary_bytes
    awaited_enter, awaited_leave = _awaited_ends(arrays, role)
    enter, leave = enter - awaited_enter, leave + awaited_leave
    enter[0] = at_start  # only the first stage starts at cut 0
    return enter, leave


def _awaited_ends(arrays: NodeArrays, role: StageRole) -> tuple[np.ndarray, np.ndarray]:
    """``_awaited_bytes`` split over a stage's ends: a span's sum is a difference of prefix
    sums, the later one counted where it ends, the earlier one taken away where it starts."""
    a = role.awaiting_weights
    prefix = np.concatenate(([0.0], np.cumsum(_weight_outputs(arrays))))
    kept = np.zeros_like(prefix) if role.first else a * prefix
    received = 0.0 if role.last else a * arrays.boundary_bytes
    return kept, kept + received


def _sent_bytes(arrays: NodeArrays, start: int, end: int, role: StageRole) -> float:
    """What the stage's sends keep at its peak, when its last forward has run (f micro-batches
    still in flight): every output sent, less the f held outputs counted apart, and the input
    gradients of the M − f backwards run so far."""
    if not role.holds_sends:
        return 0.0
    m, f = role.micro_batches, role.in_flight
    outputs = 0.0 if role.last else m * arrays.boundary_bytes[end] - f * arrays.held_bytes[end]
    return float(outputs + (0.0 if role.first else (m - f) * arrays.boundary_bytes[start]))


def _data_bytes(arrays: NodeArrays, role: StageRole) -> tuple[float, float]:
    """The step's data a stage holds, counted (at its start, at its end): the first stage its
    replica's inputs, the last its targets; or, with the whole batch made on the device, both
    in full on each end stage (once on a stage that is both)."""
    m, inputs, targets = role.micro_batches, arrays.boundary_bytes[0], arrays.target_bytes
    if role.whole_batch:
        whole = float(m * role.replicas * (inputs + targets))
        return (whole if role.first else 0.0,
                whole if role.last and not (role.first or role.on_first_device) else 0.0)
    return (float(m * inputs) if role.first else 0.0, float(m * targets) if role.last else 0.0)

"""The points of the search, and the cost arrays they share, computed once (``Costs``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipec.cost.cores import SharedCores
from pipec.cost.hardware import Device, action_s
from pipec.cost.model import (
    NodeArrays,
    allreduce_bandwidth,
    allreduce_s,
    boundary_s,
    compute_between,
    crosses_nodes,
    node_arrays,
    rank_of,
    spans_nodes,
    usable_memory,
)
from pipec.frontend.costgraph import CostGraph
from pipec.frontend.normalization import resolve_norm
from pipec.planning.schedules import SCHEDULES, posted_links, stage_device
from pipec.planning.sharding import (
    BLOCK,
    HOST_BYTES,
    SHARDED,
    block_units,
    shard_arrays,
    unit_working_ratio,
)
from pipec.planning.values import PlanRequest


@dataclass(frozen=True)
class Layout:
    """pp pipeline positions × dp replicas, v stages per position (interleaved), stage k on
    position k mod pp (a loop) or, under ZB-V, in a V (pipec.planning.zero_bubble)."""

    pp: int
    dp: int
    virtual: int = 1
    v_shape: bool = False
    # Ranks: a replica's positions on neighbouring ranks (False), or a position's replicas
    # (True: data parallelism within a node, the pipeline across nodes).
    replicas_inner: bool = False
    fsdp: str = "off"  # or "zero2"/"zero3"/"block": FSDP over a position's replicas (sharding.py)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def position(self, stage: int) -> int:
        return stage_device("zbv" if self.v_shape else "loop", stage, self.pp)

    def stages_on(self, position: int) -> list[int]:
        return [k for k in range(self.stages) if self.position(k) == position]


@dataclass(frozen=True)
class Point:
    """One point of the search: a layout, a micro-batch size and a schedule."""

    layout: Layout
    micro_batch: int
    schedule: str


@dataclass(frozen=True)
class StageCosts:
    """Per-node costs as each stage sees them on the devices it lands on (rows: stages)."""

    time_s: np.ndarray  # (stages, n): forward + backward
    fwd_s: np.ndarray  # (stages, n)
    bwd_s: np.ndarray  # (stages, n)
    arrays: NodeArrays  # device-independent bytes
    cut_s: np.ndarray  # (stages, n + 1): sending across each cut to the next stage
    capacity: tuple[float, ...]  # per position: usable bytes of its smallest device
    runtime: tuple[float, ...]  # per position: the runtime's own bytes beside the stages
    # What every stage pays per micro-batch besides its nodes (calling it, starting autograd's
    # engine), forward and backward: the same for all stages, so the partition ignores it.
    overhead_s: tuple[float, float] = (0.0, 0.0)
    # (stages, n): the part of bwd_s that makes the weights' gradient, which a zero-bubble
    # schedule runs apart (None: half of each node's backward).
    weight_s: np.ndarray | None = None
    # The runtime's own time per action that overhead_s holds, and per schedule where it was
    # measured apart (Device.schedule_action_s).
    action_s: float = 0.0
    schedule_action_s: tuple[tuple[str, float], ...] = ()
    # (n,): what splitting a node's backward (zero bubble) adds: its share of the model's
    # measured extra, else its autograd operations × Device.split_backward_node_s (None:
    # nothing).
    split_s: np.ndarray | None = None
    # (n,): what selective recomputation adds to each pass over a node, forward and
    # recomputing: its autograd operations × Device.selective_node_s (None: nothing).
    selective_pass_s: np.ndarray | None = None
    # The CPU cores the plan's processes share (pipec.cost.cores); None: each device computes alone.
    cores: SharedCores | None = None
    # (n,): what a micro-batch's node waits for its synchronized BatchNorm's all-reduces,
    # forward and backward, inside fwd_s and bwd_s (None: no BatchNorm synchronized).
    synchronized_norm_s: np.ndarray | None = None
    # What an input sent before its receiver asked for it costs (pipec.calibration.receive_times).
    late_receive_s: float = 0.0
    # Per stage, what each of its forwards and backwards pays for the sends and receives it
    # posts to other devices (Device.p2p_post_s × schedules.posted_links); () : nothing.
    posts_s: tuple[float, ...] = ()

    @functools.cached_property
    def selective_again_s(self) -> np.ndarray:
        """(stages, n): what selective recomputation runs again in the backward: the forward
        of each node none of whose outputs it keeps (NodeArrays.selective_bytes), and its
        pass over every node."""
        again: np.ndarray = self.fwd_s * (self.arrays.selective_bytes == 0)
        return again if self.selective_pass_s is None else again + self.selective_pass_s

    @functools.cached_property
    def selective_s(self) -> np.ndarray:
        """(stages, n): all selective recomputation adds to a step's node: its pass in the
        forward and what its backward runs again (the partition's cost of it)."""
        extra = self.selective_again_s
        return extra if self.selective_pass_s is None else extra + self.selective_pass_s

    def extra_action_s(self, schedule: str) -> float:
        """What an action of ``schedule`` costs the runtime beyond ``action_s``."""
        return dict(self.schedule_action_s).get(schedule, self.action_s) - self.action_s

    def between_s(self, schedule: str, stage: int) -> float:
        """What the runtime takes around a forward or backward call of ``stage`` under
        ``schedule``, beyond the call (overhead_s): its time per action and the sends and
        receives the action posts. Nothing without a schedule: the call alone, as train.py
        --metrics times it."""
        if not schedule:
            return 0.0
        return self.extra_action_s(schedule) + (self.posts_s[stage] if self.posts_s else 0.0)

    def stage_capacity(self, layout: Layout) -> tuple[float, ...]:
        """Per stage, the bytes it may use: its device's, less the runtime's own, shared
        equally by the device's stages (interleaved)."""
        return tuple((self.capacity[p] - self.runtime[p]) / layout.virtual
                     for p in map(layout.position, range(layout.stages)))


# What a boundary rule's answer depends on (balance.py builds it): the layout, the balance,
# and for some rules the micro-batch size and the stages' roles.
BoundaryKey = tuple[object, ...]
# A boundary rule's answer: the stage boundaries, and per stage its recomputation
# (spans.RECOMPUTE_MODES).
Placement = tuple[tuple[int, ...], tuple[str, ...]]


def weight_shares(graph: CostGraph) -> np.ndarray:
    """Per node, the share of its backward that makes its weights' gradient: a product's (a
    Linear's, a convolution's) is one more product of the forward's size, so its forward's
    FLOPs of the backward's (all of them where no gradient flows to its input); none where it
    has no parameters."""
    shares = [min(n.fwd_flops.at(1), n.bwd_flops.at(1)) / n.bwd_flops.at(1)
              if n.params and n.bwd_flops.at(1) > 0 else 0.0 for n in graph.nodes]
    return np.array(shares)


def shared_cores(request: PlanRequest, replicas: int) -> SharedCores | None:
    """The cores a CPU plan's processes share (pipec.cost.cores), the pipeline ``replicas`` times
    over; None where none was measured (each device computes alone) or the plan spans
    machines."""
    calibration = request.calibration
    if calibration is None or calibration.contention <= 1 or request.nodes > 1:
        return None
    relayed = max((d.relay_slowdowns for d in request.devices), key=len, default=())
    return SharedCores(calibration.contention, request.gpus, replicas, relayed)


class Costs:
    """The graph and the request, with every cost array cached: points share them."""

    def __init__(self, graph: CostGraph, request: PlanRequest) -> None:
        self.graph, self.request = graph, request
        self.legal = np.array(graph.legal_cuts)
        self.max_stages = int(self.legal[1:-1].sum()) + 1
        self.params = np.array([n.params for n in graph.nodes], dtype=float)
        self.weight_share = weight_shares(graph)
        self.graph_has_batch_norm = any(n.batch_norm_channels for n in graph.nodes)
        self.autograd_nodes = np.array([n.autograd_nodes for n in graph.nodes], dtype=float)
        self.param_bytes = np.array([n.param_bytes for n in graph.nodes], dtype=float)
        self.param_tensors = np.array([n.param_tensors for n in graph.nodes], dtype=float)
        self.cut_tensors = np.array(graph.cut_tensors(), dtype=float)
        # Per node, the fp32 bytes of its parameters, shared ones included (what FSDP shards).
        self.weight_bytes = self.param_bytes + np.array([n.shared_bytes for n in graph.nodes],
                                                        dtype=float)
        self._block_units(graph)
        self._units: dict[tuple[tuple[int, int], ...], int] = {}
        self._nodes: dict[tuple[Device, int], NodeArrays] = {}
        self._stages: dict[tuple[Layout, int], StageCosts] = {}
        # Filled and read by balance.boundaries only: points that differ in what a boundary
        # rule ignores share one partition.
        self.boundary_cache: dict[BoundaryKey, Placement | None] = {}

    def _block_units(self, graph: CostGraph) -> None:
        """Per node, its ``--fsdp block`` unit ("" for the stage's own: sharding.block_units,
        over the calls of modules that hold parameters), and the largest unit's fp32 bytes."""
        holders = {n.target for n in graph.nodes if n.op == "call_module" and n.param_bytes}
        units = block_units([n.target for n in graph.nodes
                             if n.op == "call_module" and n.target in holders])
        self.block_unit = [units.get(n.target, "") if n.op == "call_module" else ""
                           for n in graph.nodes]
        self.in_block = np.array([bool(u) for u in self.block_unit])
        totals: dict[str, float] = {}
        for unit, weight in zip(self.block_unit, self.weight_bytes, strict=True):
            totals[unit] = totals.get(unit, 0.0) + float(weight)
        self.largest_block_bytes = max((v for u, v in totals.items() if u), default=0.0)

    def units_in(self, spans: Sequence[tuple[int, int]]) -> int:
        """The FSDP units of a ``block`` position over ``spans``: its blocks and its own
        (cached: the search asks again for every schedule and micro-batch of a partition)."""
        key = tuple(spans)
        if key not in self._units:
            self._units[key] = len({self.block_unit[i] for a, b in spans for i in range(a, b)}
                                   | {""})
        return self._units[key]

    def nodes(self, device: Device, micro_batch: int) -> NodeArrays:
        key = (device, micro_batch)
        if key not in self._nodes:
            self._nodes[key] = node_arrays(self.graph, device, micro_batch,
                                           self.request.training, self.request.calibration)
        return self._nodes[key]

    def devices(self, layout: Layout, position: int) -> list[Device]:
        """The distinct devices that run a pipeline position, one per replica."""
        ranks = [rank_of(position, r, layout.pp, layout.dp, layout.replicas_inner)
                 for r in range(layout.dp)]
        return list(dict.fromkeys(self.request.devices[r] for r in ranks))

    def stages(self, layout: Layout, micro_batch: int) -> StageCosts:
        key = (layout, micro_batch)
        if key not in self._stages:
            self._stages[key] = self._stage_costs(layout, micro_batch)
        return self._stages[key]

    def _stage_costs(self, layout: Layout, micro_batch: int) -> StageCosts:
        # A position's replicas wait for each other (the all-reduce): node by node, the slowest.
        positions = [self.devices(layout, p) for p in range(layout.pp)]
        slowest = [[np.max([getattr(self.nodes(d, micro_batch), field) for d in devices], axis=0)
                    for field in ("fwd_s", "bwd_s")] for devices in positions]
        fwd = np.stack([slowest[layout.position(k)][0] for k in range(layout.stages)])
        bwd = np.stack([slowest[layout.position(k)][1] for k in range(layout.stages)])
        norm = resolve_norm(self.request.norm, layout.pp, layout.dp)
        if norm != "group":  # BatchNorm kept: beyond the GroupNorm a profile may have timed
            kept_fwd, kept_bwd = self._kept_norm_s(micro_batch)
            fwd, bwd = np.maximum(fwd + kept_fwd, 0.0), np.maximum(bwd + kept_bwd, 0.0)
        synchronized = None
        if norm == "sync" and layout.dp > 1:
            sync_fwd, sync_bwd = self._synchronized_norm_s(layout, positions, fwd.max(axis=0),
                                                           bwd.max(axis=0))
            fwd, bwd, synchronized = fwd + sync_fwd, bwd + sync_bwd, sync_fwd + sync_bwd
        arrays = self.nodes(positions[0][0], micro_batch)
        if layout.fsdp in SHARDED:
            arrays = shard_arrays(arrays, self.weight_bytes, self.request.training, layout.dp,
                                  layout.fsdp, self.in_block)
        cores = self.shared_cores(layout)
        # The probe measured the links and the runtime's time per action with two processes
        # computing (the split backward and selective passes with all of them); the model's
        # times are every process's at once.
        paired = cores.paired if cores else 1.0
        cut = paired * np.stack([self._cut_s(layout, arrays, k) for k in range(layout.stages)])
        capacity = tuple(min(usable_memory(d, *communicators(layout, position,
                                                             self.request.tp))
                             for d in devices) for position, devices in enumerate(positions))
        runtime = tuple(max(d.runtime_bytes + self._sharding_host_bytes(layout, d)
                            for d in devices) for devices in positions)
        calibration = self.request.calibration
        measured = calibration.stage_overhead_s if calibration else (0.0, 0.0)
        scale = calibration.contention if calibration else 1.0
        action = paired * max(d.action_overhead_s for d in self.request.devices)
        overhead = (measured[0] * scale + action, measured[1] * scale + action)
        selective = max(d.selective_node_s for d in self.request.devices)
        return StageCosts(fwd + bwd, fwd, bwd, arrays, cut, capacity, runtime, overhead,
                          bwd * self.weight_share, action, self._schedule_action_s(paired),
                          self._split_backward_s(micro_batch, bwd.max(axis=0)),
                          selective * self.autograd_nodes, cores, synchronized,
                          max(d.late_receive_s for d in self.request.devices),
                          self._posts_s(layout, cores))

    def _posts_s(self, layout: Layout, cores: SharedCores | None) -> tuple[float, ...]:
        """Per stage, what its actions' sends and receives to other devices cost, × the
        contention of every process computing rather than the probe's two: a post waits for
        gloo's thread to get a core, which every computing process competes for (checked
        against saved runs by benchmarks/studies/repredict.py: docs/fidelity.md)."""
        post = (cores.contention if cores else 1.0) * max(d.p2p_post_s
                                                          for d in self.request.devices)
        links = posted_links([layout.position(k) for k in range(layout.stages)])
        return tuple(post * n for n in links)

    def _sharding_host_bytes(self, layout: Layout, device: Device) -> float:
        """FSDP's own host memory, where the host's memory is the device's (a CPU); under
        ``block``, what the largest block holds while it computes (sharding.unit_working_ratio:
        a position holds one block's at a time, whichever it is)."""
        working = (self.largest_block_bytes * unit_working_ratio(self.request.training)
                   if layout.fsdp == BLOCK else 0.0)
        host = HOST_BYTES if layout.fsdp in SHARDED and device.device_type == "cpu" else 0.0
        return working + host

    def _schedule_action_s(self, paired: float) -> tuple[tuple[str, float], ...]:
        """Per schedule, the slowest device's runtime time per action (× ``paired``)."""
        return tuple((schedule, paired * action_s(self.request.devices, schedule))
                     for schedule in SCHEDULES)

    def _split_backward_s(self, micro_batch: int, bwd: np.ndarray) -> np.ndarray:
        """Per node, what splitting its backward adds (zero bubble): the model's own measured
        extra (Calibration.split_backward) shared out by the nodes' backward times ``bwd``,
        with the contention; else the runtime's per autograd operation
        (Device.split_backward_node_s)."""
        calibration = self.request.calibration
        timing = calibration.bind(self.graph).split_backward if calibration else None
        if calibration is None or timing is None or bwd.sum() <= 0:
            split = max(d.split_backward_node_s for d in self.request.devices)
            return split * self.autograd_nodes
        extra: np.ndarray = timing.at(micro_batch)[1] * calibration.contention * bwd / bwd.sum()
        return extra

    def _kept_norm_s(self, micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Per node, what a kept BatchNorm takes beyond the GroupNorm the profile timed in its
        place (Calibration.kept_norm; none where it timed BatchNorm), with the contention."""
        fwd, bwd = np.zeros(len(self.graph.nodes)), np.zeros(len(self.graph.nodes))
        calibration = self.request.calibration
        if calibration is None:
            return fwd, bwd
        index = {n.name: i for i, n in enumerate(self.graph.nodes)}
        for timing in calibration.bind(self.graph).kept_norm:
            fwd[index[timing.node]], bwd[index[timing.node]] = timing.at(micro_batch)
        return fwd * calibration.contention, bwd * calibration.contention

    def _synchronized_norm_s(self, layout: Layout, positions: list[list[Device]],
                             fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per node, a synchronized BatchNorm's all-reduces over the replicas, per micro-batch:
        its mean, variance and count forward, the gradients of its weight and bias backward
        (fp32). Small: they cost the wait, as measured within a node for an all-reduce that
        blocks a pass (Device.blocking_collective_s, blocking_drift; ``fwd`` and ``bwd``, per
        node, are the compute between two), else the all-reduce's latency and the wait of one
        after compute (step_collective_s)."""
        channels = np.array([n.batch_norm_channels for n in self.graph.nodes], dtype=float)
        device = min((d for devices in positions for d in devices),
                     key=allreduce_bandwidth)
        per_node = self.request.gpus // self.request.nodes
        spans = spans_nodes(0, layout.pp, layout.dp, per_node, layout.replicas_inner)
        measured = not spans and (device.blocking_collective_s or device.blocking_drift)
        if measured:
            fwd_compute, bwd_compute = compute_between(fwd, bwd, channels > 0)
            wait_fwd = device.blocking_collective_s + device.blocking_drift * np.sqrt(fwd_compute)
            wait_bwd = device.blocking_collective_s + device.blocking_drift * np.sqrt(bwd_compute)
        else:  # each all-reduce starts after compute, as DDP's do: it pays the step's wait
            wait = 0.0 if spans else device.step_collective_s
            wait_fwd = wait_bwd = np.full(len(channels), wait)
        latency = 0.0 if measured else allreduce_s(0.0, layout.dp, device, spans)
        fwd_s = [allreduce_s((2 * c + 1) * 4, layout.dp, device, spans) - latency + w if c
                 else 0.0 for c, w in zip(channels, wait_fwd, strict=True)]
        bwd_s = [allreduce_s(2 * c * 4, layout.dp, device, spans) - latency + w if c else 0.0
                 for c, w in zip(channels, wait_bwd, strict=True)]
        return np.array(fwd_s), np.array(bwd_s)

    def _cut_s(self, layout: Layout, arrays: NodeArrays, stage: int) -> np.ndarray:
        """Stage → stage + 1 over the slowest link between the two positions' devices; nothing
        where both sit on one device (ZB-V's turn: torch passes the tensor on in place)."""
        source = layout.position(stage)
        target = layout.position(min(stage + 1, layout.stages - 1))
        if source == target and stage < layout.stages - 1:
            return np.zeros(len(arrays.cut_bytes))
        link = min(self.devices(layout, source) + self.devices(layout, target),
                   key=lambda d: d.intra_node_bandwidth)
        per_node = self.request.gpus // self.request.nodes
        return boundary_s(arrays.cut_bytes, link,
                          crosses_nodes(source, target, layout.pp, layout.dp, per_node,
                                        layout.replicas_inner), self.cut_tensors)

    def unrecomputable(self, layout: Layout) -> np.ndarray:
        """Per node, 1 where a stage must not recompute it: a BatchNorm that the layout keeps
        (or makes synchronized) would update its running statistics twice."""
        kept = resolve_norm(self.request.norm, layout.pp, layout.dp) != "group"
        return np.array([float(kept and n.batch_norm_channels > 0) for n in self.graph.nodes])

    def shared_cores(self, layout: Layout) -> SharedCores | None:
        return shared_cores(self.request, layout.dp)

    def fastest_work_s(self, micro_batch: int) -> float:
        """One micro-batch's forward + backward, every node on the fastest device for it."""
        times = [self.nodes(d, micro_batch) for d in set(self.request.devices)]
        return float(np.min([a.fwd_s + a.bwd_s for a in times], axis=0).sum())

    def fastest_chain_s(self, micro_batch: int) -> float:
        """fastest_work_s without the weights' gradients: what a zero-bubble schedule's chain
        of forwards and input gradients through every stage takes at least."""
        times = [self.nodes(d, micro_batch) for d in set(self.request.devices)]
        return float(np.min([a.fwd_s + a.bwd_s * (1 - self.weight_share) for a in times],
                            axis=0).sum())


def communicators(layout: Layout, position: int, tp: int = 1) -> tuple[int, int]:
    """The communicators a rank at ``position`` uses beyond its job's default one, as (pairs of
    two ranks, groups of more): one per pipeline neighbour it sends to or receives from
    (torch's NCCL backend pairs each two ranks that exchange point to point), and the
    pipeline, replica and tensor-parallel groups of more than one rank where none spans the
    whole job (a dimension that does is the default group). Tied weights' groups are not
    counted."""
    neighbours = {layout.position(k + step) for k in layout.stages_on(position)
                  for step in (-1, 1) if 0 <= k + step < layout.stages} - {position}
    sizes = [size for size in (layout.pp, layout.dp, tp) if size > 1]
    sizes = sizes if len(sizes) > 1 else []
    pairs = len(neighbours) + sum(size == 2 for size in sizes)
    return pairs, sum(size > 2 for size in sizes)

"""What the plan pass takes and returns (re-exported by ``pipec.planning.planner``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipec.cost.hardware import Device
from pipec.cost.model import Calibration, Training
from pipec.cost.stage_memory import StageMemory
from pipec.planning.simulate import Simulation


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    nodes: int
    global_batch: int
    pp: int | None  # None: searched
    micro_batch: int | None  # None: searched
    schedule: str  # "auto" or one of SCHEDULES
    hardware: str
    devices: tuple[Device, ...]  # one per rank, in rank order
    training: Training
    calibration: Calibration | None = None  # measured compute times (pipec profile)
    strategy: str = "pipec"  # or a baseline's: plan as that baseline would
    virtual_stages: int | None = None  # interleaved: stages per device; None: searched
    # A more complex plan must be predicted this much faster (a fraction) to win; None: the
    # time model's measured error for its time source (pipec.planning.choice).
    margin: float | None = None
    norm: str = "auto"  # --norm: a synchronized BatchNorm costs an all-reduce per layer
    recompute: str = "auto"  # --recompute: auto (where a stage must), none, full or selective
    mesh: str = "auto"  # --mesh: "dp,pp" (a replica's pipeline innermost), "pp,dp", or searched
    fsdp: str = "auto"  # --fsdp: off, zero2, zero3, block, or searched (auto: off, zero2, block)
    # --boundaries: pipec's stage boundaries pinned, the first node of each stage after the
    # first (plan.json's stages[k].nodes[0]); None: solved (planning.balance).
    boundaries: tuple[int, ...] | None = None
    # Tensor-parallel ranks per device of this request (pipec.planning.tp_search.tp_groups):
    # each holds one more communicator.
    tp: int = 1
    # The nodes between tp regions split along the sequence (pipec.codegen.sequence_parallel).
    sequence_parallel: bool = False


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    start: int  # first node (position in CostGraph.nodes)
    end: int  # one past the last node
    modules: tuple[str, ...]
    params: int
    fwd_flops: float  # one micro-batch
    bwd_flops: float
    activation_bytes: float  # one micro-batch
    memory_bytes: float  # its peak: every term of ``memory`` (this stage alone)
    time_s: float  # forward + backward + boundary, one micro-batch
    compute_s: float  # forward + backward alone, one micro-batch
    boundary_bytes: float  # sent to the next stage, one micro-batch
    device: int = 0  # pipeline position (rank mod pp) that runs it
    fwd_s: float = 0.0  # forward compute alone, one micro-batch
    bwd_s: float = 0.0  # backward compute alone, one micro-batch
    memory: StageMemory | None = None  # memory_bytes by term
    # "full": keeps only its inputs, its backward runs its forward again; "selective": keeps the
    # outputs of its expensive operations too and runs only the others again; or "none".
    recompute: str = "none"


@dataclass(frozen=True)
class Candidate:
    """One point of the search: its predicted throughput and whether it fits."""

    micro_batch: int
    num_micro_batches: int
    schedule: str
    samples_per_s: float
    peak_memory_bytes: float
    feasible: bool
    pp: int
    dp: int
    virtual_stages: int = 1
    replicas_inner: bool = False  # a position's replicas on neighbouring ranks
    fsdp: str = "off"  # sharded data parallelism: "zero2", "zero3", "block" (planning.sharding)


@dataclass(frozen=True)
class Decision:
    """Why the plan won: the margin a more complex plan needed, and the closest alternative."""

    margin: float
    runner_up: Candidate | None  # None: no other plan fits
    runner_up_relative: float  # its predicted step time ÷ the plan's − 1 (negative: faster)
    # The runner-up predicts faster, but a plan simpler than it is within the margin.
    kept_simpler: bool


@dataclass(frozen=True)
class Baseline:
    """A baseline strategy's own plan on the same devices, predicted by the same cost model."""

    strategy: str  # plan.json: baselines[].name
    micro_batch: int
    schedule: str
    samples_per_s: float
    feasible: bool


@dataclass(frozen=True)
class MaxBatch:
    """The largest global batch a strategy trains within memory on the given devices."""

    strategy: str  # plan.json: max_batch.pipec, or a key of max_batch.baselines
    batch: int  # 0: not even the smallest batch fits
    capped: bool  # still fits at the search limit: memory does not bound it


@dataclass(frozen=True, kw_only=True)
class Plan:
    request: PlanRequest
    pp: int  # pipeline devices
    dp: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    stages: tuple[StagePlan, ...]  # pp · virtual_stages of them
    simulation: Simulation  # with the timeline (every action)
    iteration_s: float
    samples_per_s: float
    candidates: tuple[Candidate, ...]  # every candidate evaluated
    baselines: tuple[Baseline, ...]
    max_batch: tuple[MaxBatch, ...]  # pipec first, then each baseline
    max_batch_limit: int  # the search stops here
    virtual_stages: int = 1
    pruned: int = 0  # candidates skipped: their lower bound was slower than the plan

    @property
    def idle_share(self) -> float:
        """The share of the step a device is predicted idle: the schedule's bubble, then the
        gradient all-reduce and the runtime's per-step time, which the schedule does not show
        (what train.py --metrics measures as idle)."""
        if self.iteration_s <= 0:
            return self.simulation.bubble
        return 1 - (1 - self.simulation.bubble) * self.simulation.iteration_s / self.iteration_s
    device_memory_bytes: tuple[float, ...] = ()  # per pipeline position, at its peak
    decision: Decision | None = None  # pipec's choice and its runner-up; None under --strategy
    # Seconds a step takes besides its schedule, by term (all_reduce, optimizer, data, runtime).
    step_terms: dict[str, float] = field(default_factory=dict)
    # Seconds of a step (the pipeline's, per replica) its synchronized BatchNorms wait for
    # their all-reduces, inside the stages' times (0: none synchronized).
    synchronized_norm_s: float = 0.0
    # Ranks: a position's replicas on neighbouring ranks (True) or a replica's positions.
    replicas_inner: bool = False
    fsdp: str = "off"  # "zero2"/"zero3"/"block": FSDP over each stage's replicas, not DDP
    # Under --tp auto: each degree tried and its predicted samples/s (None: nothing fits).
    tp_tried: tuple[tuple[int, float | None], ...] = ()

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per stage replica: the request's devices are then the tp
        groups (one rank's costs on each)."""
        return self.request.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.request.sequence_parallel and self.request.tp > 1

    @property
    def processes(self) -> int:
        """The job's processes: one per device of every tp group."""
        return self.request.gpus * self.tp

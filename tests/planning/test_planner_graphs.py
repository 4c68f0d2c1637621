"""plan() on hand-built cost graphs: boundaries, memory and the maximum batch by hand.

The graphs are chains of nodes whose costs are round numbers on a device without overheads,
latencies or fragmentation, so that every expected value below is computed by hand from the
terms of ``pipec.cost.stage_memory.stage_memory`` (docs/cost-model.md), not by the planner's code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipec.cost.hardware import Device
from pipec.cost.model import Training, compute_between
from pipec.cost.stage_memory import StageMemory
from pipec.errors import InfeasibleError
from pipec.frontend.annotate import CostGraph, Linear, LossCost, NodeCost
from pipec.planning.planner import MaxBatch, Plan, PlanRequest, plan

KIB, MIB = 2**10, 2**20
ZERO = Linear(0.0, 0.0)


def _device(memory_bytes: float = 1024 * MIB, flops: float = 1e12) -> Device:
    """Compute bound (memory bandwidth out of the way), no fixed costs: a node's forward takes
    flops / ``flops`` seconds, its backward twice that."""
    return Device("test", fp32_flops=flops, bf16_flops=flops, memory_bandwidth=1e18,
                  memory_bytes=memory_bytes, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9,
                  intra_node_latency_s=0.0, inter_node_latency_s=0.0, kernel_overhead_s=0.0,
                  efficiency=1.0)


def _chain(flops: Sequence[float], param_bytes: Sequence[int] | None = None,
           saved_per_sample: float = 0.0, cut_per_sample: float = 0.0,
           held: dict[int, float] | None = None, legal: Sequence[bool] | None = None,
           target_per_sample: float = 0.0, loss_per_sample: float = 0.0,
           working: dict[int, float] | None = None) -> CostGraph:
    """A chain of len(flops) nodes: node i does flops[i] per sample forward (twice that
    backward), holds param_bytes[i] of fp32 weights, saves ``saved_per_sample`` bytes for
    backward and needs ``working[i]`` during its backward; every cut (the input and the output
    too) carries ``cut_per_sample`` bytes, of which ``held[cut]`` no node saves."""
    n = len(flops)
    param_bytes = param_bytes or [0] * n
    working = working or {}
    nodes = tuple(NodeCost(
        name=f"n{i}", op="call_function", target="f", module=f"layer{i}", shape=(1,),
        is_tensor=True, fwd_flops=Linear(0.0, flops[i]), bwd_flops=Linear(0.0, 2 * flops[i]),
        output_bytes=Linear(0.0, cut_per_sample), saved_bytes=Linear(0.0, saved_per_sample),
        params=param_bytes[i] // 4, param_bytes=param_bytes[i], buffer_bytes=0,
        working_bytes=Linear(0.0, working.get(i, 0.0)))
        for i in range(n))
    held = held or {}
    return CostGraph(
        nodes=nodes, cut_bytes=(Linear(0.0, cut_per_sample),) * (n + 1),
        legal_cuts=tuple(legal) if legal is not None else (True,) * (n + 1), values=(),
        held_cut_bytes=tuple(Linear(0.0, held.get(i, 0.0)) for i in range(n + 1)),
        loss=LossCost(saved_bytes=Linear(0.0, loss_per_sample), working_bytes=ZERO,
                      target_bytes=Linear(0.0, target_per_sample)))


def _request(devices: Sequence[Device], global_batch: int = 16, pp: int | None = None,
             micro_batch: int | None = None, schedule: str = "auto",
             strategy: str = "pipec", recompute: str = "none") -> PlanRequest:
    """Without recomputation unless asked: most tests here check the memory terms by hand."""
    return PlanRequest(gpus=len(devices), nodes=1, global_batch=global_batch, pp=pp,
                       micro_batch=micro_batch, schedule=schedule, hardware="test",
                       devices=tuple(devices), training=Training("sgd", "fp32"),
                       strategy=strategy, recompute=recompute)


def _boundaries(chosen: Plan) -> tuple[int, ...]:
    return (*(s.start for s in chosen.stages), chosen.stages[-1].end)


def test_identical_nodes_on_two_devices_split_evenly() -> None:
    chosen = plan(_chain([1e9] * 8), _request([_device()] * 2, pp=2, schedule="1f1b"))
    assert _boundaries(chosen) == (0, 4, 8)
    assert chosen.stages[0].compute_s == pytest.approx(chosen.stages[1].compute_s)


def test_a_heavy_node_gets_a_stage_of_its_own() -> None:
    # Splits after node 1 (4 against 4 units of time), not in the middle (5 against 3).
    chosen = plan(_chain([4e9, 1e9, 1e9, 1e9, 1e9]), _request([_device()] * 2, pp=2,
                                                              schedule="1f1b"))
    assert _boundaries(chosen) == (0, 1, 5)


def test_a_device_half_as_fast_gets_half_the_nodes() -> None:
    fast, slow = _device(flops=1e12), _device(flops=5e11)
    # 6 equal nodes: 4 on the fast device and 2 on the slow one take 4 units each.
    chosen = plan(_chain([1e9] * 6), _request([fast, slow], pp=2, schedule="1f1b"))
    assert _boundaries(chosen) == (0, 4, 6)
    chosen = plan(_chain([1e9] * 6), _request([slow, fast], pp=2, schedule="1f1b"))
    assert _boundaries(chosen) == (0, 2, 6)


@pytest.mark.parametrize(("strategy", "expected"), [
    ("pipec", (0, 1, 6)), ("torchgpipe", (0, 1, 6)), ("conventional", (0, 1, 6)),
    ("parameters", (0, 5, 6)), ("uniform", (0, 3, 6))])
def test_each_strategy_places_boundaries_by_its_balance(strategy: str,
                                                        expected: tuple[int, ...]) -> None:
    # Time: node 0 does half the work. Parameters: all in nodes 4 and 5. Nodes: 3 and 3.
    graph = _chain([5e9] + [1e9] * 5, param_bytes=[0, 0, 0, 0, MIB, MIB])
    chosen = plan(graph, _request([_device()] * 2, pp=2, schedule="1f1b", strategy=strategy))
    assert _boundaries(chosen) == expected
    assert [b.strategy for b in chosen.baselines] == ["uniform", "parameters", "torchgpipe",
                                                      "conventional"]


def _front_heavy() -> CostGraph:
    """8 equal nodes; the first 4 hold 1 MiB of weights each: 3 MiB with gradient and SGD
    momentum (static_ratio 3.0)."""
    return _chain([1e9] * 8, param_bytes=[MIB] * 4 + [0] * 4)


def test_memory_that_binds_moves_the_boundary() -> None:
    request = _request([_device(10 * MIB)] * 2, pp=2, micro_batch=4, schedule="gpipe")
    # Unbounded, the even split; in 10 MiB the first stage holds at most 3 of the heavy nodes
    # (9 MiB, and 1 MiB for a later micro-batch's gradient of one of them; 13 MiB for 4), so
    # the boundary moves one node earlier.
    unbounded = plan(_front_heavy(), replace(request, devices=(_device(),) * 2))
    assert _boundaries(unbounded) == (0, 4, 8)
    bound = plan(_front_heavy(), request)
    assert _boundaries(bound) == (0, 3, 8)
    assert bound.stages[0].memory_bytes == 10 * MIB
    assert bound.device_memory_bytes == (10 * MIB, 4 * MIB)  # node 3: 3 MiB, and its gradient


def test_a_strategy_that_does_not_fit_is_refused() -> None:
    # uniform keeps the even split, 12 MiB on the first device.
    request = _request([_device(10 * MIB)] * 2, pp=2, micro_batch=4, schedule="gpipe",
                       strategy="uniform")
    with pytest.raises(InfeasibleError, match=r"--strategy uniform does not fit: it needs 0\.01"):
        plan(_front_heavy(), request)


def test_memory_that_nothing_fits_is_infeasible() -> None:
    # One node alone needs 3 MiB; no stage of any split fits in 2 MiB.
    with pytest.raises(InfeasibleError, match=r"the nearest, \d pipeline device\(s\) × \d "
                       r"replica\(s\) at micro-batch 1 .* more than the 0\.00 GiB usable"):
        plan(_front_heavy(), _request([_device(2 * MIB)] * 2))


def test_fixed_pp_and_micro_batch_are_honoured() -> None:
    graph, devices = _chain([1e9] * 8), [_device()] * 4
    free = plan(graph, _request(devices, global_batch=32))
    # Without weights to all-reduce, pure data parallelism has no bubble and wins.
    assert (free.pp, free.dp) == (1, 4)
    fixed = plan(graph, _request(devices, global_batch=32, pp=2, micro_batch=4))
    assert (fixed.pp, fixed.dp, fixed.micro_batch, fixed.num_micro_batches) == (2, 2, 4, 4)
    assert {(c.pp, c.micro_batch) for c in fixed.candidates} == {(2, 4)}


def test_the_plan_carries_the_timeline_of_its_iteration() -> None:
    chosen = plan(_chain([1e9] * 8), _request([_device()] * 2, pp=2, micro_batch=4,
                                              schedule="gpipe"))
    # 4 micro-batches, forward and backward, on 2 stages; one replica: no all-reduce.
    assert len(chosen.simulation.actions) == 2 * 4 * 2
    assert chosen.simulation.iteration_s == chosen.iteration_s
    # GPipe on balanced stages: (M + S − 1)(t_f + t_b), 4 nodes per stage
    # (micro-batch 4: 4 ms forward, 8 ms backward per node).
    assert chosen.iteration_s == pytest.approx((4 + 2 - 1) * 4 * 12e-3)


def _two_stages() -> CostGraph:
    """One legal boundary (after node 4). Per sample: each node saves 10 KiB, every cut carries
    8 KiB (2 KiB of cut 4 saved by no node), node 2 needs 3 KiB during its backward, targets
    take 1 KiB and the loss saves 4 KiB. Stage 0 holds 1 MiB of weights (3 MiB static), stage 1
    2 MiB (6 MiB)."""
    return _chain([1e9] * 8, param_bytes=[0, MIB, 0, 0, 0, 2 * MIB, 0, 0],
                  saved_per_sample=10 * KIB, cut_per_sample=8 * KIB, held={4: 2 * KIB},
                  legal=[True, False, False, False, True, False, False, False, True],
                  target_per_sample=KIB, loss_per_sample=4 * KIB, working={2: 3 * KIB})


def test_stage_memory_by_term() -> None:
    """Micro-batch 2, 8 micro-batches under 1F1B: stage 0 holds 2 in flight, stage 1 one."""
    chosen = plan(_two_stages(), _request([_device()] * 2, pp=2, micro_batch=2, schedule="1f1b"))
    first, last = (s.memory for s in chosen.stages)
    assert first == StageMemory(
        static=3 * MIB, activations=2 * 4 * 20 * KIB, held_outputs=2 * 4 * KIB,
        receive_buffers=16 * KIB,  # the output's gradient, one buffer at a time
        data=8 * 16 * KIB,  # the step's inputs
        loss=0.0, working=MIB)  # node 1's gradient of a micro-batch, before it is accumulated
    assert last == StageMemory(
        static=6 * MIB, activations=1 * 4 * 20 * KIB, held_outputs=0.0,
        receive_buffers=16 * KIB,  # the input, one buffer per micro-batch in flight
        data=8 * 2 * KIB,  # the step's targets
        loss=1 * 8 * KIB, working=2 * MIB)  # node 5's
    assert chosen.device_memory_bytes == (first.total, last.total)


@pytest.mark.parametrize(("schedule", "device_mib", "expected"),
                         [("gpipe", 16, 154), ("auto", 12, 1012)])
def test_max_batch_equals_the_memory_terms_by_hand(schedule: str, device_mib: int,
                                                   expected: int) -> None:
    """_two_stages() on 2 devices. At micro-batch 1, batch B is B micro-batches, f of them in
    flight on a stage:
    stage 0: static + working (node 1's gradient, 1 MiB) + f · (activations 40 + held 2) KiB +
    a gradient buffer 8 KiB + B · inputs 8 KiB; stage 1: static + working (node 5's gradient,
    2 MiB) + f · (activations 40 + loss 4 + receive buffer 8) KiB + B · targets 1 KiB.
    GPipe (f = B) on 16 MiB: stage 0: 4 MiB + 8 KiB + 50 KiB · B ≤ 16 MiB: B ≤ 245; stage 1:
    8 MiB + 53 KiB · B: B ≤ 154. 1F1B (f = 2, then 1) on 12 MiB: stage 0: 4 MiB + 92 KiB +
    8 KiB · B: B ≤ 1,012; stage 1: 8 MiB + 52 KiB + 1 KiB · B: B ≤ 4,044. The search tries
    multiples of the 2 devices."""
    chosen = plan(_two_stages(), _request([_device(device_mib * MIB)] * 2, pp=2,
                                          schedule=schedule))
    assert chosen.max_batch_limit == 64 * 16
    assert chosen.max_batch[0] == MaxBatch("pipec", expected, False)


def test_recomputation_raises_the_max_batch_by_the_terms_by_hand() -> None:
    """As above under GPipe, with the stages recomputing: each holds one micro-batch's
    activations (40 KiB) instead of B, and no gradient is left unmade; the rest stays per
    micro-batch. Stage 0: 4 MiB + 48 KiB (a gradient buffer) + B · (held 2 + inputs 8) KiB:
    B ≤ 1,224; stage 1: 8 MiB + 40 KiB + B · (loss 4 + receive buffers 8 + targets 1) KiB:
    B ≤ 627. The search tries multiples of the 2 devices: 626 (154 without)."""
    for mode in ("auto", "full"):
        chosen = plan(_two_stages(), _request([_device(16 * MIB)] * 2, pp=2, schedule="gpipe",
                                              recompute=mode))
        assert chosen.max_batch[0] == MaxBatch("pipec", 626, False), mode
    quick = plan(_two_stages(), _request([_device(16 * MIB)] * 2, pp=2, schedule="gpipe",
                                         recompute="auto"))
    assert [s.recompute for s in quick.stages] == ["none", "none"]  # batch 16 fits as it is
    full = plan(_two_stages(), _request([_device(16 * MIB)] * 2, pp=2, schedule="gpipe",
                                        recompute="full"))
    assert [s.recompute for s in full.stages] == ["full", "full"]
    assert [s.bwd_s for s in full.stages] == pytest.approx(
        [q.bwd_s + q.fwd_s for q in quick.stages])


@pytest.mark.parametrize(("device_mib", "expected", "capped"), [(14, 1268, False),
                                                                  (24, 1536, True)])
def test_max_batch_between_the_last_doubling_and_the_limit(device_mib: int, expected: int,
                                                           capped: bool) -> None:
    """--batch-size 24: the limit, 1,536, is 768 units of 2, not a power of two. On 14 MiB,
    1F1B's stage 0 allows B ≤ (14 MiB − 4 MiB − 92 KiB) / 8 KiB = 1,268 (see above), between
    the last doubling (1,024) and the limit; on 24 MiB the limit itself fits."""
    chosen = plan(_two_stages(), _request([_device(device_mib * MIB)] * 2, global_batch=24,
                                          pp=2))
    assert chosen.max_batch_limit == 64 * 24
    assert chosen.max_batch[0] == MaxBatch("pipec", expected, capped)


def test_the_runtimes_own_time_is_added_per_action_and_per_step() -> None:
    """One stage, 4 micro-batches of 4 (GPipe): each forward and backward action pays the
    device's action_overhead_s, the step its step_overhead_s, on top of the compute."""
    graph = _chain([1e9] * 2)  # per sample: 2 GFLOP forward, 4 backward → 6 ms on 1 TFLOP/s
    request = _request([_device()], global_batch=16, pp=1, schedule="gpipe")
    bare = plan(graph, replace(request, micro_batch=4))
    slow = replace(_device(), action_overhead_s=1e-3, step_overhead_s=5e-3)
    overheads = plan(graph, replace(request, devices=(slow,), micro_batch=4))
    assert bare.iteration_s == pytest.approx(16 * 6e-3)
    assert overheads.iteration_s == pytest.approx(16 * 6e-3 + 2 * 4 * 1e-3 + 5e-3)
    # One stage has no bubble: the device is idle only for the per-step time.
    assert bare.idle_share == pytest.approx(0.0)
    assert overheads.idle_share == pytest.approx(5e-3 / overheads.iteration_s)


def test_a_late_receive_costs_what_the_device_measured() -> None:
    """Two equal stages, GPipe, 2 micro-batches of 8 (forward 8 ms, backward 16): stage 0's
    forwards end at 16, stage 1's forwards and backwards at 56, stage 0's backwards at 72.
    Stage 1's second forward and stage 0's second backward find their input sent as they ask
    for it (the sender ends as the receiver does: not waiting for it), each paying
    late_receive_s."""
    graph = _chain([1e9] * 2)
    request = _request([_device()] * 2, global_batch=16, micro_batch=8, pp=2,
                       schedule="gpipe")
    prompt = plan(graph, request)
    late = replace(_device(), late_receive_s=3e-3)
    waiting = plan(graph, replace(request, devices=(late,) * 2))
    assert prompt.iteration_s == pytest.approx(72e-3)
    assert waiting.iteration_s == pytest.approx(prompt.iteration_s + 2 * 3e-3)


def test_an_action_pays_for_each_send_or_receive_to_another_device() -> None:
    """The same two stages (forward 8 ms, backward 16), each action posting one send or
    receive across the boundary at 1 ms: every action on the critical path (stage 0's two
    forwards, stage 1's four actions, stage 0's two backwards: six of them, the second forward
    and backward of each stage overlapping the other's) is 1 ms longer. One stage posts none."""
    graph = _chain([1e9] * 2)
    request = _request([_device()] * 2, global_batch=16, micro_batch=8, pp=2,
                       schedule="gpipe")
    posting = replace(_device(), p2p_post_s=1e-3)
    assert plan(graph, replace(request, devices=(posting,) * 2)).iteration_s \
        == pytest.approx(72e-3 + 6e-3)
    alone = _request([posting], global_batch=8, micro_batch=8, pp=1, schedule="gpipe")
    assert plan(graph, alone).iteration_s == pytest.approx(
        plan(graph, replace(alone, devices=(_device(),))).iteration_s)


def test_a_data_parallel_step_pays_each_all_reduces_wait() -> None:
    """2 replicas of one stage holding 5 MiB of weights (latency 0, 10 GB/s links): the step's
    all-reduces are DDP's 1 MiB bucket, one for the 4 MiB left and the loss's, each paying the
    device's step_collective_s; a 2-stage pipeline, without replicas, pays none."""
    graph = _chain([1e9] * 2, param_bytes=[5 * MIB, 0])
    device = replace(_device(), step_collective_s=7e-3)
    request = _request([device] * 2, global_batch=16, micro_batch=8, schedule="gpipe")
    replicas = plan(graph, replace(request, pp=1))
    ring = 5 * MIB / 1e10  # 2(d − 1)/d = 1 of the bytes, over the bus
    assert replicas.iteration_s == pytest.approx(8 * 6e-3 + ring + 3 * 7e-3, rel=1e-3)
    pipeline = plan(graph, replace(request, pp=2))
    assert pipeline.iteration_s == pytest.approx(plan(
        graph, replace(request, pp=2, devices=(_device(),) * 2)).iteration_s)


def test_a_data_parallel_step_pays_ddps_work_per_gradient_tensor() -> None:
    """The same 2 replicas with the weights in 3 tensors on the first node and 2 on the second:
    DDP's work per gradient tensor (30 µs here) is paid for each of the 5; a pipeline of the
    two nodes without replicas pays none."""
    graph = _chain([1e9] * 2, param_bytes=[5 * MIB, 0])
    nodes = tuple(replace(n, param_tensors=t) for n, t in zip(graph.nodes, (3, 2), strict=True))
    graph = replace(graph, nodes=nodes)
    request = _request([_device()] * 2, global_batch=16, micro_batch=8, schedule="gpipe")
    per_tensor = replace(request, devices=(replace(_device(), gradient_tensor_s=30e-6),) * 2)
    base = plan(graph, replace(request, pp=1)).iteration_s
    assert plan(graph, replace(per_tensor, pp=1)).iteration_s == pytest.approx(base + 5 * 30e-6)
    assert plan(graph, replace(per_tensor, pp=2)).iteration_s == pytest.approx(
        plan(graph, replace(request, pp=2)).iteration_s)
    # 2 pipeline devices × 2 replicas: each position all-reduces its own stage's gradients, at
    # once; the step waits for the slower, node 0's 5 MiB in 3 tensors.
    four = replace(request, gpus=4, global_batch=32, devices=(_device(),) * 4, pp=2)
    assert plan(graph, replace(four, devices=per_tensor.devices * 2)).iteration_s == \
        pytest.approx(plan(graph, four).iteration_s + 3 * 30e-6)


def test_replicas_fewer_than_the_processes_pay_their_groups_measured_figures() -> None:
    """4 processes, 5 MiB of weights on the first node: 2 pipeline devices × 2 replicas pay the
    wait measured on 2 processes while the other 2 waited (2 ms, Device.replica_collectives),
    and its time per gradient tensor; 4 replicas of one stage, the figures measured on all 4
    (7 ms). Each pays the 3 all-reduces of its 5 MiB (two DDP buckets and the loss's), the
    first for its 3 gradient tensors too."""
    graph = _chain([1e9] * 2, param_bytes=[5 * MIB, 0])
    nodes = tuple(replace(n, param_tensors=t) for n, t in zip(graph.nodes, (3, 2), strict=True))
    graph = replace(graph, nodes=nodes)
    every = replace(_device(), step_collective_s=7e-3)
    grouped = replace(every, replica_collectives=((2, 2e-3, 1e10, 30e-6),))
    request = _request([_device()] * 4, global_batch=32, micro_batch=8, schedule="gpipe")
    for pp, extra in ((2, 3 * 2e-3 + 3 * 30e-6), (1, 3 * 7e-3)):
        plain = plan(graph, replace(request, pp=pp)).iteration_s
        assert plan(graph, replace(request, pp=pp, devices=(grouped,) * 4)).iteration_s \
            == pytest.approx(plain + extra)


def test_a_data_parallel_step_pays_the_lead_one_replica_takes_over_its_compute() -> None:
    """The same 2 replicas, one micro-batch of 8 each: 16 ms forward and 32 ms backward without
    a wait for the other replica, whose lead at the step's all-reduces is measured as 10 ms/√s
    × √T (Device.blocking_drift, T that compute)."""
    graph = _chain([1e9] * 2, param_bytes=[5 * MIB, 0])
    request = _request([_device()] * 2, global_batch=16, pp=1, micro_batch=8, schedule="gpipe")
    drifting = replace(request, devices=(replace(_device(), blocking_drift=0.01),) * 2)
    assert plan(graph, drifting).iteration_s == pytest.approx(
        plan(graph, request).iteration_s + 0.01 * math.sqrt(0.048))


def test_a_sharded_step_pays_the_per_tensor_work_and_the_lead_as_ddps_does() -> None:
    """FSDP2 (zero2) over the same 2 replicas, the weights in 5 tensors: the work per gradient
    tensor (30 µs) and the lead (10 ms/√s × √T, T the 48 ms of compute) add what they add to
    DDP's step: FSDP2 pays them as DDP does (docs/fidelity.md)."""
    graph = _chain([1e9] * 2, param_bytes=[5 * MIB, 0])
    nodes = tuple(replace(n, param_tensors=t) for n, t in zip(graph.nodes, (3, 2), strict=True))
    graph = replace(graph, nodes=nodes)
    request = _request([_device()] * 2, global_batch=16, pp=1, micro_batch=8, schedule="gpipe")
    charged = (replace(_device(), gradient_tensor_s=30e-6, blocking_drift=0.01),) * 2
    extra = 5 * 30e-6 + 0.01 * math.sqrt(0.048)
    for mode in ("off", "zero2"):
        sharding = replace(request, fsdp=mode)
        chosen = plan(graph, replace(sharding, devices=charged))
        assert chosen.fsdp == mode
        assert chosen.iteration_s == pytest.approx(plan(graph, sharding).iteration_s + extra)


def test_a_device_holds_the_batch_and_each_kernel_once_whatever_its_stages() -> None:
    """ZB-V on 2 CPU processes: device 0 runs the first and the last stage. The synthetic batch
    (16 samples of 1 KiB inputs, 16 × 1 KiB targets) is made once in its process, and the math
    library keeps one kernel per distinct convolution per process (1 MiB each here): every
    node runs convolution C, node 0 also D."""
    conv_c = (("conv", ((2, 8),)), ("conv", ((4, 8),)))
    conv_d = (("conv", ((2, 3),)), ("conv", ((4, 3),)))
    graph = _chain([1e9] * 8, cut_per_sample=KIB, target_per_sample=KIB)
    nodes = tuple(replace(n, kernels=(conv_c, conv_d) if i == 0 else (conv_c,))
                  for i, n in enumerate(graph.nodes))
    graph = replace(graph, nodes=nodes, synthetic_data=True)
    cpu = replace(_device(), device_type="cpu", conv_kernel_bytes=MIB)
    chosen = plan(graph, _request([cpu] * 2, pp=2, micro_batch=2, schedule="zbv"))
    assert [s.device for s in chosen.stages] == [0, 1, 1, 0]
    data = [s.memory.data for s in chosen.stages]
    assert data == [16 * 2 * KIB, 0.0, 0.0, 0.0]  # the last stage's targets: made on device 0
    kernels = [sum(s.memory.kernels for s in chosen.stages if s.device == d) for d in (0, 1)]
    assert kernels == [2 * MIB, MIB]  # C and D on device 0, C on device 1: once each


def test_a_synchronized_batch_norm_waits_as_measured_for_the_compute_before_it() -> None:
    """2 replicas of a 4-node chain, one micro-batch of 8 each (8 ms forward, 16 ms backward per
    node); nodes 1 and 3 BatchNorms of 4 channels, synchronized. Measured, an all-reduce blocking
    a pass costs 1 ms + 10 ms/√s × √(compute since the one before): forward, node 1 after
    node 0's backward and nodes 0 and 1's forward (32 ms), node 3 after 16 ms; backward the
    same, in reverse. Unmeasured, only the bytes (no latency here)."""
    channels = {1: 4, 3: 4}
    graph = _chain([1e9] * 4)
    graph = replace(graph, nodes=tuple(replace(n, batch_norm_channels=channels.get(i, 0))
                                       for i, n in enumerate(graph.nodes)))
    measured = replace(_device(), blocking_collective_s=1e-3, blocking_drift=0.01)
    request = _request([measured] * 2, global_batch=16, pp=1, micro_batch=8, schedule="1f1b")
    chosen = plan(graph, request)
    waits = 4e-3 + 2 * 0.01 * (math.sqrt(0.032) + math.sqrt(0.016))
    bytes_s = 2 * ((2 * 4 + 1) * 4 + 2 * 4 * 4) / 1e10  # 2(d − 1)/d = 1 of the bytes, per node
    assert chosen.synchronized_norm_s == pytest.approx(waits + bytes_s)
    unmeasured = plan(graph, replace(request, devices=(_device(),) * 2))
    assert unmeasured.synchronized_norm_s == pytest.approx(bytes_s)
    assert chosen.iteration_s - unmeasured.iteration_s == pytest.approx(waits)


def test_the_compute_between_blocking_nodes_wraps_around_a_micro_batch() -> None:
    fwd, bwd = np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 20.0, 30.0, 40.0])
    between = compute_between(fwd, bwd, np.array([False, True, False, True]))
    assert [list(b) for b in between] == [[0, 13, 0, 7], [0, 50, 0, 40]]
    assert [list(b) for b in compute_between(fwd, bwd, np.zeros(4, dtype=bool))] == \
        [[0.0] * 4, [0.0] * 4]


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.booleans()), min_size=1,
                max_size=12))
def test_the_compute_between_blocking_nodes_adds_up_to_a_micro_batch(
        nodes: list[tuple[float, float, bool]]) -> None:
    fwd, bwd, blocking = (np.array(column) for column in zip(*nodes, strict=True))
    between = np.array(compute_between(fwd, bwd, blocking))
    total = fwd.sum() + bwd.sum() if blocking.any() else 0.0
    assert between.sum() == pytest.approx(total)
    assert not between[:, ~blocking].any()

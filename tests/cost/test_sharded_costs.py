"""One tensor-parallel rank's costs: its parameters are the ones its shard of the weights holds,
its sharded nodes' FLOPs are 1/tp, and its collectives move each row-parallel output forward and
each region's input gradient backward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import SAMPLES
from pipec.codegen.local_shards import local_weights
from pipec.cost.hardware import load_hardware
from pipec.cost.model import allreduce_s, tp_collectives_s, wave_efficiency
from pipec.cost.sharded_costs import shard_costs
from pipec.frontend.loader import load_model_file
from pipec.inspection import TpInspection, shardable_model

# samples/gpt.py: 32 tokens of width 64, vocabulary 256, fp32
TOKEN_ROW = 32 * 64 * 4
LOGITS = 32 * 256 * 4


@pytest.fixture(scope="module")
def gpt() -> TpInspection:
    return shardable_model(SAMPLES / "gpt.py")


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_parameters_are_those_of_its_shard(gpt: TpInspection, tp: int) -> None:
    costs = shard_costs(gpt.graph, gpt.shardable.regions, tp)
    with torch.device("meta"):
        state = load_model_file(SAMPLES / "gpt.py").build_model().state_dict()
    shard = local_weights(state, gpt.shardable.regions, tp, rank=tp - 1)
    assert sum(n.params for n in costs.graph.nodes) == sum(t.numel() for t in shard.values())
    assert sum(n.params for n in gpt.graph.nodes) == sum(t.numel() for t in state.values())


def test_sharded_nodes_do_a_tp_th_of_the_work(gpt: TpInspection) -> None:
    costs = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    inside = {name for r in gpt.shardable.regions for name in r.nodes}
    for whole, rank in zip(gpt.graph.nodes, costs.graph.nodes, strict=True):
        share = 0.5 if whole.name in inside else 1.0
        assert rank.fwd_flops.at(4) == pytest.approx(whole.fwd_flops.at(4) * share)
    proj = next(n for n in costs.graph.nodes if n.name == "blocks_0_attn_proj")
    assert proj.output_bytes.per_sample == TOKEN_ROW  # whole after its all-reduce


def test_the_collectives_move_row_outputs_forward_and_input_gradients_back(
        gpt: TpInspection) -> None:
    costs = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    forward, backward = costs.per_sample_bytes()
    # 4 attention + 4 MLP rows; the gathered logits as an all-reduce of half their bytes
    assert forward == 8 * TOKEN_ROW + LOGITS / 2
    assert backward == 9 * TOKEN_ROW  # each region's input: a LayerNorm's output
    device = load_hardware("a100-80g")
    fwd_s, bwd_s = tp_collectives_s(costs.graph, device, 8, bf16=False)
    names = [n.name for n in gpt.graph.nodes]
    assert fwd_s[names.index("blocks_0_attn_proj")] > 0 and fwd_s[names.index("head")] > 0
    assert bwd_s[names.index("blocks_0_attn_qkv")] > 0
    assert (fwd_s > 0).sum() == 9 and (bwd_s > 0).sum() == 9
    alone = tp_collectives_s(shard_costs(gpt.graph, gpt.shardable.regions, 1).graph, device, 8,
                             bf16=False)
    assert not alone[0].any() and not alone[1].any()


def test_a_stage_boundary_may_not_cut_a_region(gpt: TpInspection) -> None:
    """A cut across which a split value is live is illegal; the others keep their rule."""
    costs = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    regions = gpt.shardable.regions
    split = ({n for r in regions for n in r.nodes} - {n for r in regions for n in r.row_nodes}
             - {n for r in regions for n in r.gathered})
    crossing = [bool(split & set(live)) for live in gpt.graph.live]
    expected = [legal and not cut for legal, cut in zip(gpt.graph.legal_cuts, crossing,
                                                        strict=True)]
    assert list(costs.graph.legal_cuts) == expected
    assert sum(expected) < sum(gpt.graph.legal_cuts)  # some legal cut was inside a region
    assert sum(expected) >= 4  # between the blocks
    assert costs.graph.legal_cuts[0] and costs.graph.legal_cuts[-1]


def test_a_vocabulary_parallel_embedding_holds_its_rows_and_all_reduces_its_output(
        gpt: TpInspection) -> None:
    embeddings = gpt.shardable.embeddings_at(2)
    assert embeddings == ("tok_emb", "pos_emb")
    regions_only = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    costs = shard_costs(gpt.graph, gpt.shardable.regions, 2, embeddings)
    rows = {n.name: n.params for n in costs.graph.nodes}
    assert rows["tok_emb"] == 256 * 64 // 2 and rows["pos_emb"] == 32 * 64 // 2
    forward, _ = costs.per_sample_bytes()
    # the token embedding's output per sample; the positions' output is one row for the batch
    assert forward == regions_only.per_sample_bytes()[0] + TOKEN_ROW
    assert gpt.shardable.embeddings_at(3) == ()


def test_sequence_parallelism_splits_the_rest_and_the_boundaries(gpt: TpInspection) -> None:
    """Nodes outside the regions hold half their activations, less their output where only a
    region reads it (a norm's: the region keeps the sequence gathered from it instead, whole,
    at its first column linear); a split value crossing a stage boundary is half its bytes
    (the emitted stages send each rank's part)."""
    plain = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    sequence = shard_costs(gpt.graph, gpt.shardable.regions, 2, sequence_parallel=True)
    # Each region with a row-parallel linear moves the bytes of its all-reduces, as an
    # all-gather and a reduce-scatter each way: twice the collectives, the same bytes.
    before = {n.name: n for n in plain.graph.nodes}
    after = {n.name: n for n in sequence.graph.nodes}
    for region in gpt.shardable.regions:
        if not region.row_nodes:
            continue
        entry, row = region.column_nodes[0], region.row_nodes[0]
        for way in ("tp_forward_bytes", "tp_backward_bytes"):
            moved = [getattr(after[name], way).at(4) for name in (entry, row)]
            assert all(moved) and sum(moved) == pytest.approx(
                getattr(before[entry], way).at(4) + getattr(before[row], way).at(4))
    inside = {name for r in gpt.shardable.regions for name in r.nodes}
    outputs = {n.name: n.output_bytes.at(4) for n in gpt.graph.nodes}
    gathered = {r.column_nodes[0]: sum(outputs.get(v, 0.0) for v in r.inputs)
                for r in gpt.shardable.regions}
    entered = {v for r in gpt.shardable.regions for v in r.inputs}
    for node, rank in zip(plain.graph.nodes, sequence.graph.nodes, strict=True):
        share = 1.0 if node.name in inside else 0.5
        freed = node.output_bytes.at(4) * share if node.name in entered else 0.0
        assert rank.saved_bytes.at(4) == pytest.approx(
            node.saved_bytes.at(4) * share - freed + gathered.get(node.name, 0.0))
        assert rank.params == node.params  # norm weights stay whole
    assert all(gathered.values())
    # Between blocks only the residual stream crosses (cut 0 is the graph's input, whole).
    residual = [i for i, names in enumerate(gpt.graph.live)
                if names and all(v in outputs and v not in inside for v in names)]
    assert residual
    for i in residual:
        assert sequence.graph.cut_bytes[i].at(4) == pytest.approx(
            gpt.graph.cut_bytes[i].at(4) / 2)
    assert sequence.graph.cut_bytes[0] == gpt.graph.cut_bytes[0]
    # A rank calls F.linear on a row-parallel weight, not its module: no FSDP block holds it.
    rows = {name for r in gpt.shardable.regions for name in r.row_nodes}
    assert rows and all(n.op == "call_function" for n in plain.graph.nodes if n.name in rows)
    # Only the nodes named split, where the model allows: the rest as without.
    named = shard_costs(gpt.graph, gpt.shardable.regions, 2, sequence_parallel={"ln_f"})
    for node, rank in zip(plain.graph.nodes, named.graph.nodes, strict=True):
        if node.name not in gathered:
            assert rank.fwd_flops.at(4) == pytest.approx(
                node.fwd_flops.at(4) / (2 if node.name == "ln_f" else 1))


def test_a_tp_collective_waits_as_a_measured_blocking_all_reduce(gpt: TpInspection) -> None:
    # Each blocks its pass as a synchronized BatchNorm's all-reduce does: where the device's
    # blocking all-reduce is measured, its wait replaces the link's latency.
    costs = shard_costs(gpt.graph, gpt.shardable.regions_at(2), 2).graph
    device = dataclasses.replace(load_hardware("cpu"), blocking_collective_s=1e-3,
                                 blocking_drift=0.0)
    compute = (np.full(len(costs.nodes), 1e-4), np.full(len(costs.nodes), 2e-4))
    plain = tp_collectives_s(costs, device, 4, bf16=False)
    blocking = tp_collectives_s(costs, device, 4, bf16=False, compute=compute)
    latency = allreduce_s(0.0, 2, device)
    for before, after in zip(plain, blocking, strict=True):
        assert np.count_nonzero(before) == np.count_nonzero(after) > 0
        assert after[before > 0] == pytest.approx(before[before > 0] - latency + 1e-3)
    drifting = dataclasses.replace(device, blocking_drift=0.01)
    later = tp_collectives_s(costs, drifting, 4, bf16=False, compute=compute)
    assert all((b[b > 0] > a[a > 0]).all() for a, b in zip(blocking, later, strict=True))


def test_a_gpu_product_pays_its_last_waves_idle_multiprocessors(gpt: TpInspection) -> None:
    """samples/gpt.py's MLP input linear at micro-batch 4: 4 · 32 rows × 256 features, 2 tiles
    of 128 × 128 on 108 A100 multiprocessors: one wave, 2 of 108 busy; none on a CPU."""
    fc = next(n for n in gpt.graph.nodes if n.name == "blocks_0_mlp_0")
    assert wave_efficiency(fc, load_hardware("a100-80g"), 4) == pytest.approx(2 / 108)
    assert wave_efficiency(fc, load_hardware("cpu"), 4) == 1.0
    # 27 waves' worth of rows: 108 · 27 / 2 tiles of rows, 2 of columns, every unit busy
    assert wave_efficiency(fc, load_hardware("a100-80g"), 27 * 108 * 128 // (2 * 32)) == 1.0


def test_tensor_parallelism_divides_a_column_products_tiles_not_a_rows(
        gpt: TpInspection) -> None:
    costs = shard_costs(gpt.graph, gpt.shardable.regions, 2)
    node = {n.name: n for n in costs.graph.nodes}
    assert node["blocks_0_mlp_0"].product_split == 2
    assert node["blocks_0_mlp_2"].product_split == 1  # row-parallel: its output is whole
    a100 = load_hardware("a100-80g")
    rows = 108 * 128 // 32  # a micro-batch of 108 row tiles: 216 tiles whole, 108 on a rank
    assert wave_efficiency(gpt.graph.nodes[_index(gpt, "blocks_0_mlp_0")], a100, rows) == 1.0
    assert wave_efficiency(node["blocks_0_mlp_0"], a100, rows) == 1.0
    # 4 samples more: 109 row tiles, one past a wave, on the rank
    assert wave_efficiency(node["blocks_0_mlp_0"], a100, rows + 4) == pytest.approx(
        109 / 216)


def _index(inspection: TpInspection, name: str) -> int:
    return [n.name for n in inspection.graph.nodes].index(name)

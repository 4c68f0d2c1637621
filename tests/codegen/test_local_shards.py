"""Each rank's local graph and weights, run in lockstep with the all-reduces and all-gathers of
its regions done by hand, give the whole model's output: the sample GPT (fused q/k/v) at tp 2
and 4, the LLaMA-shaped model (grouped-query attention, fused k/v, SwiGLU) at tp 2."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from conftest import MODELS, SAMPLES
from pipec.codegen.local_shards import local_graph, local_weights
from pipec.frontend.loader import load_model_file
from pipec.frontend.shardable import Region, Shardable, find_shardable


def traced(path: Path, batch: int = 3
           ) -> tuple[fx.GraphModule, Shardable, tuple[torch.Tensor, ...]]:
    spec = load_model_file(path)
    torch.manual_seed(0)
    gm = fx.symbolic_trace(spec.build_model())
    inputs = spec.sample_batch(batch)[:-1]
    ShapeProp(gm).propagate(*inputs)
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    return gm, find_shardable(gm, shapes), inputs


def rank_modules(gm: fx.GraphModule, regions: tuple[Region, ...], tp: int) -> list[fx.GraphModule]:
    shared = local_graph(gm, regions, tp)
    ranks = []
    for rank in range(tp):
        module = copy.deepcopy(shared)
        for name, tensor in local_weights(gm.state_dict(), regions, tp, rank).items():
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, nn.Parameter(tensor))
        ranks.append(module)
    return ranks


def run_in_lockstep(ranks: list[fx.GraphModule], regions: tuple[Region, ...],
                    inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every rank's graph node by node; a row-parallel linear's outputs summed (all-reduce), a
    gathered output concatenated along its last dimension (all-gather)."""
    reduced = {row for r in regions for row in r.rows}
    gathered = {name for r in regions for name in r.gathered}
    interpreters = [fx.Interpreter(m) for m in ranks]
    for interpreter in interpreters:
        interpreter.args_iter = iter(inputs)
    for nodes in zip(*(m.graph.nodes for m in ranks), strict=True):
        if nodes[0].op == "output":
            return interpreters[0].env[nodes[0].args[0]]
        values = [i.run_node(n) for i, n in zip(interpreters, nodes, strict=True)]
        target = str(nodes[0].target)
        if target in reduced:
            values = [sum(values)] * len(values)
        if nodes[0].name in gathered:
            values = [torch.cat(values, dim=-1)] * len(values)
        for interpreter, node, value in zip(interpreters, nodes, values, strict=True):
            interpreter.env[node] = value
    raise AssertionError("no output node")


@pytest.mark.parametrize(("model", "tp"), [(SAMPLES / "gpt.py", 2), (SAMPLES / "gpt.py", 4),
                                           (MODELS / "gqa_lm.py", 2)], ids=str)
def test_the_ranks_together_compute_the_whole_model(model: Path, tp: int) -> None:
    gm, shardable, inputs = traced(model)
    regions = shardable.regions_at(tp)
    assert regions == shardable.regions
    expected = gm(*inputs)
    ranks = rank_modules(gm, regions, tp)
    column = regions[1].columns[0]  # the first MLP's
    assert ranks[0].get_submodule(column).weight.shape[0] * tp == \
        gm.get_submodule(column).weight.shape[0]
    got = run_in_lockstep(ranks, regions, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_rank_alone_computes_a_different_model() -> None:
    """The check above can fail: without the all-reduces the output is wrong."""
    gm, shardable, inputs = traced(SAMPLES / "gpt.py")
    ranks = rank_modules(gm, shardable.regions, 2)
    no_reduce = tuple(replace(r, rows=()) for r in shardable.regions)
    assert not torch.allclose(run_in_lockstep(ranks, no_reduce, inputs), gm(*inputs))

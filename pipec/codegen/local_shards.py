"""The local shard of tensor-parallel regions: each rank's graph and weights.

A rank's graph is the model's with every shape constant a region splits divided by tp (a view's
head count, a split's sizes, repeat_kv's expand: pipec.frontend.shardable.ShapeRewrite); its
weights are the rank's rows of each column-parallel linear (for a fused projection, its part of
each piece) and columns of each row-parallel one. A row-parallel linear's output is then a
partial sum that one all-reduce completes (Shoeybi et al., 2019, §3); its bias belongs to one
rank, so that the sum counts it once.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from pipec.frontend.shardable import Region, ShapeRewrite

__all__ = ["local_graph", "local_weights"]


def local_graph(gm: fx.GraphModule, regions: Sequence[Region], tp: int) -> fx.GraphModule:
    """A copy of ``gm`` (its submodules shared) with the shape constants of every rank's
    shard; the same for every rank."""
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    for region in regions:
        for rewrite in region.rewrites:
            _rewrite(graph, nodes[rewrite.node], rewrite, tp)
    return fx.GraphModule(gm, graph, type(gm).__name__)


def _rewrite(graph: fx.Graph, node: fx.Node, rewrite: ShapeRewrite, tp: int) -> None:
    if rewrite.position == "split":
        size = node.args[1]
        local = [s // tp for s in size] if isinstance(size, list | tuple) else int(size) // tp
        node.args = (node.args[0], local, *node.args[2:])  # type: ignore[arg-type]
        return
    listed = len(node.args) == 2 and isinstance(node.args[1], list | tuple)
    sizes = list(node.args[1] if listed else node.args[1:])  # type: ignore[arg-type]
    position = int(rewrite.position)
    sizes[position] = _divided(graph, node, sizes[position], tp)
    node.args = (node.args[0], sizes) if listed else (node.args[0], *sizes)


def _divided(graph: fx.Graph, before: fx.Node, size: Any, tp: int) -> Any:
    """``size // tp``: a constant computed now, a traced size as a node; -1 stays -1."""
    if isinstance(size, fx.Node):
        with graph.inserting_before(before):
            return graph.call_function(operator.floordiv, (size, tp))
    return size if size == -1 else int(size) // tp


def local_weights(state: Mapping[str, torch.Tensor], regions: Sequence[Region], tp: int,
                  rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of ``state`` (the whole model's state dict): the linears of
    ``regions`` sharded, everything else as it is."""
    local = dict(state)
    for region in regions:
        fused = dict(region.fused)
        for path in region.columns:
            pieces = fused.get(path, (state[path + ".weight"].shape[0],))
            for name in (path + ".weight", path + ".bias"):
                if name in state:
                    local[name] = _rows(state[name], pieces, tp, rank)
        for path in region.rows:
            weight = state[path + ".weight"]
            local[path + ".weight"] = weight.chunk(tp, dim=1)[rank].contiguous()
            if path + ".bias" in state and rank != 0:
                local[path + ".bias"] = torch.zeros_like(state[path + ".bias"])
    return local


def _rows(tensor: torch.Tensor, pieces: Sequence[int], tp: int, rank: int) -> torch.Tensor:
    """The rank's part of each piece along dim 0, concatenated."""
    return torch.cat([piece.chunk(tp, dim=0)[rank]
                      for piece in tensor.split(list(pieces), dim=0)]).contiguous()

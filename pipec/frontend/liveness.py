"""Liveness: which values cross each cut of the graph, and where a stage boundary may sit."""

from __future__ import annotations

import torch
from torch import fx

from pipec.frontend.costgraph import COMPUTE_OPS, NodeCost
from pipec.frontend.inplace import cuts_splitting_aliases


def lifetimes(gm: fx.GraphModule, compute: list[fx.Node]) -> dict[str, tuple[int, int]]:
    """For every value that can cross a cut: (position it is made at, last position it is used).

    Inputs are made at position -1; the output node sits at position n. get_attr values are
    excluded: each stage reads attributes itself.
    """
    position = {n.name: i for i, n in enumerate(compute)}
    last = len(compute)
    lifetimes: dict[str, tuple[int, int]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n.op in COMPUTE_OPS:
            made = position.get(n.name, -1)
            uses = [position.get(u.name, last) for u in n.users]
            lifetimes[n.name] = (made, max(uses, default=made))
    return lifetimes

def live_values(gm: fx.GraphModule) -> list[list[str]]:
    """Names of the values live across each cut, in graph order (the split pass's inputs)."""
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    return live_sets(lifetimes(gm, compute), len(compute))

def live_sets(lifetimes: dict[str, tuple[int, int]], n: int) -> list[list[str]]:
    """The values live across each cut i: made before position i, used at or after it."""
    live: list[list[str]] = [[] for _ in range(n + 1)]
    for name, (made, last_use) in lifetimes.items():
        for cut in range(made + 1, last_use + 1):
            live[cut].append(name)
    return live

def rederivable_sizes(compute: list[fx.Node]) -> dict[str, str]:
    """Sizes that torch.export reads once and uses far downstream (``aten.sym_size.int`` of an
    input: the dynamic batch), by name, with the symbol each one is. A stage reads such a size
    again from a tensor it receives with that symbol in its shape, so it never crosses a cut
    (otherwise every cut between the model's first node and its last view would be illegal)."""
    sizes = {}
    for n in compute:
        value = n.meta.get("val")
        if n.target is torch.ops.aten.sym_size.int and isinstance(value, torch.SymInt) \
                and value.node.expr.is_Symbol:
            sizes[n.name] = str(value.node.expr)
    return sizes


def shape_symbols(node: fx.Node) -> set[str]:
    """The symbols among the dimensions of the tensor ``node`` makes (export's meta values)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return set()
    return {str(d.node.expr) for d in value.shape
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol}


def legal_cuts(compute: list[fx.Node], lifetimes: dict[str, tuple[int, int]],
                nodes: tuple[NodeCost, ...]) -> tuple[bool, ...]:
    """A cut is legal when only tensors cross it (a size the next stage can read again from a
    tensor it receives does not count), and no two that share a storage a later node
    overwrites in place (sent, they arrive as two tensors and the write would reach one). (A
    parameter used on both sides is copied into both stages, whose gradients the training
    script sums.)"""
    n = len(compute)
    legal = [True] * (n + 1)
    if not compute:
        return tuple(legal)
    gm = compute[0].graph.owning_module
    is_tensor = {c.name: c.is_tensor for c in nodes}
    sizes = rederivable_sizes(compute)
    live = live_sets(lifetimes, n)
    by_name = {node.name: node for node in gm.graph.nodes}
    symbols = {name: shape_symbols(by_name[name]) for name in lifetimes}

    def received(name: str, cut: int) -> bool:
        return name in sizes and any(sizes[name] in symbols[v] for v in live[cut])

    for name, (made, last_use) in lifetimes.items():
        if made >= 0 and not is_tensor[name]:
            for cut in range(made + 1, last_use + 1):
                legal[cut] = legal[cut] and received(name, cut)
    for cut in cuts_splitting_aliases(gm, compute, live):
        legal[cut] = False
    legal[0] = legal[n] = True
    return tuple(legal)

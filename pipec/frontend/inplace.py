"""In-place operations in the traced graph, found statically: which node overwrites which value,
and which values may share one storage.

Two consequences for pipelining. torch.distributed.pipelining hands a stage each received
activation as a leaf tensor that requires grad, and autograd refuses to overwrite such a leaf or
a view of it: an ``nn.ReLU(inplace=True)`` right after a cut fails. So ``split`` clones the
received inputs a stage overwrites (``overwritten_inputs``), and only those. And values sent
across a cut arrive as separate tensors, so when two live values share a storage (a view and its
base) a write after the cut would reach one of them only: ``annotate`` makes such cuts illegal
(``cuts_splitting_aliases``).

The analysis errs on the side of "may alias": a missed alias could change results or fail in
autograd, an extra one costs a copy or a cut.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence
from functools import cache

import torch
from torch import fx, nn

from pipec.frontend.costgraph import COMPUTE_OPS

# Methods whose names end in "_" but that write no tensor data.
_METADATA_METHODS = frozenset({"requires_grad_", "share_memory_"})
# Indexing, attributes (x.T, x.mT, x.real), and conversions that return their very input when
# it already has the dtype or device (x.float()): their outputs may share their input's storage.
_MAY_RETURN_INPUT = frozenset({"getitem", "__getitem__", "getattr", "float", "double", "half",
                               "bfloat16", "type", "type_as", "cpu", "cuda"})
_ALIASING_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)


def overwritten_inputs(gm: fx.GraphModule, nodes: Sequence[fx.Node],
                       inputs: Sequence[str]) -> set[str]:
    """The names among ``inputs`` whose storage ``nodes`` overwrite in place, directly or
    through a view."""
    roots = storage_roots(gm, nodes)
    targets = {roots.get(w, w) for n in nodes if (w := written(gm, n)) is not None}
    return {t.name for t in targets} & set(inputs)


def cuts_splitting_aliases(gm: fx.GraphModule, compute: Sequence[fx.Node],
                           live: Sequence[Sequence[str]]) -> set[int]:
    """The cuts across which two live values share a storage that a node after the cut
    overwrites in place. ``live[i]``: the names of the values live across cut i."""
    roots = storage_roots(gm, compute)
    last_write: dict[fx.Node, int] = {}
    for position, n in enumerate(compute):
        if (w := written(gm, n)) is not None:
            last_write[roots.get(w, w)] = position
    by_name = {n.name: n for n in gm.graph.nodes}
    cuts = set()
    for cut, names in enumerate(live):
        shared = Counter(roots.get(by_name[v], by_name[v]) for v in names)
        if any(count > 1 and last_write.get(root, -1) >= cut for root, count in shared.items()):
            cuts.add(cut)
    return cuts


def storage_roots(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> dict[fx.Node, fx.Node]:
    """For each of ``nodes``, the value whose storage its output may share: for a view, a
    conversion or an in-place op, that of its first argument (a value made outside ``nodes``
    is its own root); for any other node, itself."""
    roots: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        first = _first_argument(n)
        roots[n] = roots.get(first, first) if first is not None and _aliases(gm, n) else n
    return roots


def written(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """The value ``n`` overwrites in place, if any: the input of an ``inplace=True`` module or
    function (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``), the tensor of a method or
    function whose name ends in "_" (``x.add_(y)``, ``torch.relu_(x)``, torch.export's
    ``aten.relu_``), or the target of item assignment."""
    first = _first_argument(n)
    if first is None:
        return None
    if n.op == "call_module":
        inplace = getattr(gm.get_submodule(str(n.target)), "inplace", False) is True
    else:
        name = _op_name(n)
        inplace = (_inplace_argument(n) or name in ("setitem", "__setitem__")
                   or (name.endswith("_") and not name.endswith("__")
                       and name not in _METADATA_METHODS))
    return first if inplace else None


def _aliases(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n``'s output may share its first argument's storage."""
    if written(gm, n) is not None:
        return True
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), _ALIASING_MODULES)
    name = _op_name(n)
    return name in _MAY_RETURN_INPUT or _aten_view(name)


@cache
def _aten_view(name: str) -> bool:
    """Whether an ATen operator of that name returns an alias of its first argument (view,
    reshape, transpose, split, contiguous ...), as its schema's alias annotations say."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if packet is None:
        return False
    schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    return any(s.arguments and s.arguments[0].alias_info is not None
               and any(r.alias_info is not None for r in s.returns) for s in schemas)


def _first_argument(n: fx.Node) -> fx.Node | None:
    if n.op not in COMPUTE_OPS:
        return None
    first = n.args[0] if n.args else n.kwargs.get("input")
    return first if isinstance(first, fx.Node) else None


def _op_name(n: fx.Node) -> str:
    """A method's name, or a function's: "relu_" for torch.relu_ and aten.relu_.default."""
    if n.op == "call_method":
        return str(n.target)
    return str(getattr(n.target, "__name__", "")).split(".")[0]


def _inplace_argument(n: fx.Node) -> bool:
    """Whether a function call passes ``inplace=True``, by keyword or by position."""
    if n.kwargs.get("inplace") is True or n.op != "call_function":
        return n.kwargs.get("inplace") is True
    try:
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature, or another signature
        return False
    return bound.arguments.get("inplace") is True

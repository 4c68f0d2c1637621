"""The matrix products and convolutions a node runs, by shape and kind, and what selective
recomputation keeps of them.

On a CPU, oneDNN compiles a kernel for each distinct product or convolution it runs and keeps it
for the life of the process (Device.bf16_matmul_kernel_bytes, conv_kernel_bytes): a stage holds
one per distinct call among its nodes, however many layers repeat it.

Selective recomputation (--recompute selective) keeps the outputs of the weights' products and
convolutions and of fused attention, and runs everything else again in the backward
(``SELECTIVE_SAVED``; the emitted train.py's policy lists the same operations): the expensive
operations are not repeated, the cheap ones (activations, norms, casts, the products inside
attention written by hand) do not hold memory for every micro-batch in flight."""

from __future__ import annotations

from typing import Any

import torch

from pipec.frontend.costgraph import KernelCall
from pipec.torchcompat import TorchDispatchMode

aten = torch.ops.aten
_KINDS = {aten.mm.default: "matmul", aten.addmm.default: "matmul", aten.bmm.default: "matmul",
          aten.baddbmm.default: "matmul", aten.convolution.default: "conv"}
# Whose outputs selective recomputation keeps (fused attention: the node's,
# pipec.frontend.node_costs).
SELECTIVE_SAVED = frozenset({aten.mm.default, aten.addmm.default, aten.convolution.default})


class KernelLog(TorchDispatchMode):
    """Records the products and convolutions run under it (on meta tensors, attention runs its
    two products, as the CPU's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[KernelCall] = []
        self.selective_bytes = 0  # the outputs of SELECTIVE_SAVED operations

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kind = _KINDS.get(func)
        if kind is not None:
            self.calls.append((kind, tuple(_describe(a) for a in args)))
        output = func(*args, **(kwargs or {}))
        if func in SELECTIVE_SAVED:
            self.selective_bytes += output.untyped_storage().nbytes()
        return output


def _describe(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape)
    if isinstance(arg, list | tuple):
        return tuple(_describe(a) for a in arg)
    return repr(arg)

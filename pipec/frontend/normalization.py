"""Normalization planning: choose, for each BatchNorm, the layer that suits the plan's parallelism.

Under pipelining each micro-batch runs through a BatchNorm on its own, so its statistics (and the
model's accuracy) depend on the micro-batch size; GroupNorm normalizes each sample over groups of
channels and does not (Wu & He, 2018). Under data parallelism, SyncBatchNorm computes the
statistics over the whole data-parallel batch, as one device would (the study behind pipec).

``--norm auto``: pp > 1 → GroupNorm; pp = 1 and dp > 1 → SyncBatchNorm; one device → unchanged.

This pass only decides: ``plan_norms`` returns a ``NormPlan`` and changes no model. The emitted
``stages.py`` applies the plan (``rewrite_norms``) when each rank builds its model, carrying the
affine weight and bias over (GroupNorm has no running statistics; SyncBatchNorm keeps them).
``to_group_norm`` below is the one BatchNorm → GroupNorm conversion: ``stages.py`` carries its
source, and ``pipec profile`` calls it, so both build the same layer.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.nn import functional as F

from pipec.errors import ConfigError
from pipec.frontend.costgraph import CostGraph
from pipec.frontend.trace import Traced

log = logging.getLogger(__name__)

NORM_CHOICES = ("auto", "keep", "group", "sync")
MAX_GROUPS = 32  # Wu & He's default group count
# Values each group normalizes over (channels per group × spatial size), at least: a group of one
# value normalizes to zero, and tiny groups give noisy statistics. Wu & He's 32 groups assume
# convolutional features; a BatchNorm1d on (N, C) features gets fewer, down to 1 (all channels).
MIN_GROUP_VALUES = 16


class Parallelism(Protocol):
    """What the rewrite needs of a plan: its stages, replicas and micro-batch size."""

    @property
    def pp(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...


@dataclass(frozen=True)
class NormRewrite:
    module: str
    from_: str
    to: str
    groups: int | None  # GroupNorm's group count; None for SyncBatchNorm
    channels: int
    # The graph node of a batch norm the model computes inside its own forward (timm's
    # BatchNormAct2d calls F.batch_norm, then its activation): rewritten in the graph, not by
    # swapping the module. "" for a BatchNorm module.
    node: str = ""


@dataclass(frozen=True)
class NormPlan:
    """What the emitted stages will do to each BatchNorm; nothing is rewritten here."""

    choice: str  # what was applied: "keep", "group" or "sync"
    rewrites: tuple[NormRewrite, ...]

    @property
    def grouped(self) -> bool:
        """Some BatchNorm becomes a GroupNorm."""
        return any(r.to == "GroupNorm" for r in self.rewrites)

    @property
    def synchronized(self) -> bool:
        """Some BatchNorm becomes a SyncBatchNorm: the emitted stages then need the CPU's
        all-reduce BatchNorm."""
        return any(r.to == "SyncBatchNorm" for r in self.rewrites)


def plan_norms(traced: Traced, graph: CostGraph, *, plan: Parallelism, choice: str = "auto",
               groups: int | None = None) -> NormPlan:
    """Plan the rewrites for ``--norm choice`` under ``plan``'s parallelism (pp stages × dp
    replicas); ``groups`` (``--norm-groups``) fixes every GroupNorm's group count."""
    if choice not in NORM_CHOICES:
        raise ConfigError(f"--norm {choice!r} is not supported; use one of "
                          f"{', '.join(NORM_CHOICES)}")
    batch_norms = _batch_norms(traced)
    applied = resolve_norm(choice, plan.pp, plan.dp)
    if applied == "sync" and _functional_batch_norms(traced):
        log.warning("%d batch norm(s) computed inside a module's forward (%s) stay BatchNorm: "
                    "each of the %d replicas normalizes over its own micro-batch",
                    len(_functional_batch_norms(traced)),
                    ", ".join(module for module, _ in _functional_batch_norms(traced)[:3]),
                    plan.dp)
    if applied in ("keep", "sync") and plan.pp > 1 and batch_norms:
        log.warning("--norm %s with %d stages: each BatchNorm normalizes over one micro-batch "
                    "of %d samples at a time%s", choice, plan.pp, plan.micro_batch,
                    f" (× {plan.dp} replicas)" if applied == "sync" else "")
    if applied == "keep":
        return NormPlan("keep", ())
    if applied == "sync":
        return NormPlan("sync", tuple(NormRewrite(name, type(m).__name__, "SyncBatchNorm", None,
                                                  int(m.num_features)) for name, m in batch_norms))
    return NormPlan("group", group_norm_rewrites(traced, graph, groups))


def group_norm_rewrites(traced: Traced, graph: CostGraph,
                        groups: int | None = None) -> tuple[NormRewrite, ...]:
    """Every BatchNorm's GroupNorm, whatever the parallelism: the rewrites of ``--norm group``
    (and of ``auto`` on a pipeline), with the group counts chosen from the annotated shapes."""
    spatial = _spatial_sizes(graph)
    modules = tuple(_group_norm_rewrite(name, m, groups, spatial.get(name, 1))
                    for name, m in _batch_norms(traced))
    shapes = {n.name: n.shape for n in graph.nodes}
    functional = tuple(
        replace(_group_norm_rewrite(module, nn.BatchNorm1d(int(node.meta["channels"])), groups,
                                    math.prod(shapes.get(node.name, ())[2:])),
                from_="F.batch_norm" if node.target is F.batch_norm else "aten.batch_norm",
                node=node.name)
        for module, node in _functional_batch_norms(traced))
    return modules + functional


def with_functional_group_norms(graph_module: fx.GraphModule,
                                rewrites: tuple[NormRewrite, ...]) -> fx.GraphModule:
    """A copy of ``graph_module`` whose batch norms computed inside a module's forward are the
    GroupNorms ``rewrites`` chose (the same affine weight and bias, no running statistics)."""
    chosen = {r.node: r for r in rewrites if r.node and r.to == "GroupNorm"}
    if not chosen:
        return graph_module
    copied = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph))
    for node in copied.graph.nodes:
        if node.name in chosen:
            arguments = _batch_norm_arguments(node)
            assert arguments is not None  # chosen from the nodes it recognizes
            groups, eps = chosen[node.name].groups, arguments.get("eps", 1e-5)
            weight, bias = arguments.get("weight"), arguments.get("bias")
            if node.target is F.batch_norm:
                node.target, node.args = F.group_norm, (arguments["input"], groups)
                node.kwargs = {"weight": weight, "bias": bias, "eps": eps}
            else:  # an exported graph's ATen operation
                node.target = torch.ops.aten.group_norm.default
                node.args, node.kwargs = (arguments["input"], groups, weight, bias, eps, False), {}
    for node in list(copied.graph.nodes):  # the running statistics, now unread
        if node.op == "get_attr" and not node.users:
            copied.graph.erase_node(node)
    copied.recompile()
    return copied


def to_group_norm(batch_norm: nn.Module, groups: int) -> nn.GroupNorm:
    """A GroupNorm of ``groups`` groups in place of ``batch_norm``, with its affine weight and
    bias (GroupNorm keeps no running statistics)."""
    group_norm = nn.GroupNorm(groups, batch_norm.num_features, eps=batch_norm.eps,
                              affine=batch_norm.affine)
    if batch_norm.affine:
        with torch.no_grad():
            group_norm.weight.copy_(batch_norm.weight)
            group_norm.bias.copy_(batch_norm.bias)
    return group_norm


def to_group_norm_source() -> str:
    """The source of ``to_group_norm``, as the emitted ``stages.py`` carries it."""
    return inspect.getsource(to_group_norm)


def group_count(channels: int, spatial: int) -> int:
    """The largest divisor of the channels, at most MAX_GROUPS, that leaves each group at least
    MIN_GROUP_VALUES values; 1 when none does."""
    fitting = [g for g in range(1, min(channels, MAX_GROUPS) + 1)
               if channels % g == 0 and channels // g * spatial >= MIN_GROUP_VALUES]
    return max(fitting, default=1)


def _batch_norms(traced: Traced) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in traced.graph_module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _functional_batch_norms(traced: Traced) -> list[tuple[str, fx.Node]]:
    """Training-mode ``F.batch_norm`` calls in an fx graph (a BatchNorm subclass with its own
    forward, which fx traces through), each with the module that owns its running mean; each
    node's ``meta["channels"]`` is that buffer's length."""
    found = []
    for node in traced.graph_module.graph.nodes:
        arguments = _batch_norm_arguments(node)
        if arguments is None:
            continue
        mean = arguments.get("running_mean")
        if not arguments.get("training", False) or not isinstance(mean, fx.Node) \
                or mean.op != "get_attr":
            continue
        node.meta["channels"] = traced.graph_module.get_buffer(str(mean.target)).shape[0]
        found.append((str(mean.target).rpartition(".")[0], node))
    return found


# The ATen batch norm of an exported graph, by its parameters' names (as F.batch_norm's).
_ATEN_BATCH_NORM = ("input", "weight", "bias", "running_mean", "running_var", "training",
                    "momentum", "eps", "cudnn_enabled")


def _batch_norm_arguments(node: fx.Node) -> dict[str, Any] | None:
    """A batch norm call's arguments by name: F.batch_norm (fx) or aten.batch_norm (export)."""
    if node.op != "call_function":
        return None
    if node.target is F.batch_norm:
        return dict(inspect.signature(F.batch_norm).bind(*node.args, **node.kwargs).arguments)
    if node.target is torch.ops.aten.batch_norm.default:
        return {**dict(zip(_ATEN_BATCH_NORM, node.args, strict=False)), **node.kwargs}
    return None


def _spatial_sizes(graph: CostGraph) -> dict[str, int]:
    """Values per channel (the product of the dimensions after the channels) of each module's
    output, from the annotated shapes."""
    return {n.target: math.prod(n.shape[2:]) for n in graph.nodes
            if n.op == "call_module" and n.shape}


def resolve_norm(choice: str, pp: int, dp: int) -> str:
    """What ``--norm choice`` does to BatchNorm under pp stages × dp replicas."""
    if choice != "auto":
        return choice
    if pp > 1:
        return "group"
    return "sync" if dp > 1 else "keep"


def _group_norm_rewrite(name: str, batch_norm: nn.Module, groups: int | None,
                        spatial: int) -> NormRewrite:
    channels = int(batch_norm.num_features)
    if groups is None:
        groups = group_count(channels, spatial)
    elif channels % groups:
        raise ConfigError(f"--norm-groups {groups} does not divide the {channels} channels of "
                          f"{name}; choose a divisor of {channels}")
    return NormRewrite(name, type(batch_norm).__name__, "GroupNorm", groups, channels)

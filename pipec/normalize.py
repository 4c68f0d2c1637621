"""Rewrite pass: choose a normalization for each BatchNorm to suit the plan's parallelism.

Under pipelining each micro-batch runs through a BatchNorm on its own, so its statistics (and the
model's accuracy) depend on the micro-batch size; GroupNorm normalizes each sample over groups of
channels and does not (Wu & He, 2018). Under data parallelism, SyncBatchNorm computes the
statistics over the whole data-parallel batch, as one device would (the study behind pipec).

``--norm auto``: pp > 1 → GroupNorm; pp = 1 and dp > 1 → SyncBatchNorm; one device → unchanged.
The rewrite itself is applied by the emitted ``stages.py`` (``rewrite_norms``), which carries the
affine weight and bias over (GroupNorm has no running statistics; SyncBatchNorm keeps them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn

from pipec.annotate import CostGraph
from pipec.errors import ConfigError
from pipec.trace import Traced

log = logging.getLogger(__name__)

NORM_CHOICES = ("auto", "keep", "group", "sync")
MAX_GROUPS = 32  # Wu & He's default group count
# Values each group normalizes over (channels per group × spatial size), at least: a group of one
# value normalizes to zero, and tiny groups give noisy statistics. Wu & He's 32 groups assume
# convolutional features; a BatchNorm1d on (N, C) features gets fewer, down to 1 (all channels).
MIN_GROUP_VALUES = 16


@dataclass(frozen=True)
class NormRewrite:
    module: str
    from_: str
    to: str
    groups: int | None  # GroupNorm's group count; None for SyncBatchNorm
    channels: int


@dataclass(frozen=True)
class NormPlan:
    choice: str  # what was applied: "keep", "group" or "sync"
    rewrites: tuple[NormRewrite, ...]


def plan_norms(traced: Traced, graph: CostGraph, pp: int, dp: int, micro_batch: int,
               choice: str, groups: int | None = None) -> NormPlan:
    """The rewrites for ``--norm choice`` on a plan of ``pp`` stages × ``dp`` replicas."""
    if choice not in NORM_CHOICES:
        raise ConfigError(f"--norm {choice!r} is not supported; use one of "
                          f"{', '.join(NORM_CHOICES)}")
    batch_norms = [(name, m) for name, m in traced.graph_module.named_modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    applied = _resolve(choice, pp, dp)
    if applied in ("keep", "sync") and pp > 1 and batch_norms:
        log.warning("--norm %s with %d stages: each BatchNorm normalizes over one micro-batch "
                    "of %d samples at a time%s", choice, pp, micro_batch,
                    f" (× {dp} replicas)" if applied == "sync" else "")
    if applied == "keep":
        return NormPlan("keep", ())
    if applied == "sync":
        return NormPlan("sync", tuple(NormRewrite(name, type(m).__name__, "SyncBatchNorm", None,
                                                  int(m.num_features)) for name, m in batch_norms))
    spatial = _spatial_sizes(graph)
    return NormPlan("group", tuple(_to_group_norm(name, m, groups, spatial.get(name, 1))
                                   for name, m in batch_norms))


def _spatial_sizes(graph: CostGraph) -> dict[str, int]:
    """Values per channel (the product of the dimensions after the channels) of each module's
    output, from the annotated shapes."""
    return {n.target: math.prod(n.shape[2:]) for n in graph.nodes
            if n.op == "call_module" and n.shape}


def _resolve(choice: str, pp: int, dp: int) -> str:
    if choice != "auto":
        return choice
    if pp > 1:
        return "group"
    return "sync" if dp > 1 else "keep"


def _to_group_norm(name: str, batch_norm: nn.Module, groups: int | None,
                   spatial: int) -> NormRewrite:
    channels = int(batch_norm.num_features)
    if groups is None:
        groups = group_count(channels, spatial)
    elif channels % groups:
        raise ConfigError(f"--norm-groups {groups} does not divide the {channels} channels of "
                          f"{name}; choose a divisor of {channels}")
    return NormRewrite(name, type(batch_norm).__name__, "GroupNorm", groups, channels)


def group_count(channels: int, spatial: int) -> int:
    """The largest divisor of the channels, at most MAX_GROUPS, that leaves each group at least
    MIN_GROUP_VALUES values; 1 when none does."""
    fitting = [g for g in range(1, min(channels, MAX_GROUPS) + 1)
               if channels % g == 0 and channels // g * spatial >= MIN_GROUP_VALUES]
    return max(fitting, default=1)


def largest_divisor(value: int, limit: int) -> int:
    """The largest divisor of ``value`` that is at most ``limit``."""
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)

"""Rewrite pass: choose a normalization for each BatchNorm to suit the plan's parallelism.

Under pipelining each micro-batch runs through a BatchNorm on its own, so its statistics (and the
model's accuracy) depend on the micro-batch size; GroupNorm normalizes each sample over groups of
channels and does not (Wu & He, 2018; the study behind pipec). The rewrite itself is applied by
the emitted ``stages.py`` (``rewrite_norms``), which carries the affine weight and bias over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from pipec.errors import ConfigError
from pipec.trace import Traced

log = logging.getLogger(__name__)

NORM_CHOICES = ("auto", "keep", "group")
MAX_GROUPS = 32  # Wu & He's default group count


@dataclass(frozen=True)
class NormRewrite:
    module: str
    from_: str
    to: str
    groups: int
    channels: int


@dataclass(frozen=True)
class NormPlan:
    choice: str  # what was applied: "keep" or "group"
    rewrites: tuple[NormRewrite, ...]


def plan_norms(traced: Traced, pp: int, micro_batch: int, choice: str,
               groups: int | None = None) -> NormPlan:
    """The rewrites for ``--norm choice`` on a plan with ``pp`` stages."""
    if choice not in NORM_CHOICES:
        raise ConfigError(f"--norm {choice!r} is not supported; use one of "
                          f"{', '.join(NORM_CHOICES)}")
    batch_norms = [(name, m) for name, m in traced.graph_module.named_modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    applied = "group" if choice == "group" or (choice == "auto" and pp > 1) else "keep"
    if applied == "keep" and pp > 1 and batch_norms:
        log.warning("--norm keep with %d stages: each BatchNorm normalizes over one micro-batch "
                    "of %d samples at a time", pp, micro_batch)
    if applied == "keep":
        return NormPlan("keep", ())
    return NormPlan("group", tuple(_to_group_norm(name, m, groups) for name, m in batch_norms))


def _to_group_norm(name: str, batch_norm: nn.Module, groups: int | None) -> NormRewrite:
    channels = int(batch_norm.num_features)
    if groups is None:
        groups = largest_divisor(channels, MAX_GROUPS)
    elif channels % groups:
        raise ConfigError(f"--norm-groups {groups} does not divide the {channels} channels of "
                          f"{name}; choose a divisor of {channels}")
    return NormRewrite(name, type(batch_norm).__name__, "GroupNorm", groups, channels)


def largest_divisor(value: int, limit: int) -> int:
    """The largest divisor of ``value`` that is at most ``limit``."""
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)

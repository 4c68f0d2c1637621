"""The tensors inside a value: a node's or a model's output can nest them in containers."""

from __future__ import annotations

from typing import Any

import torch


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, depth first: ``value`` itself if it is one, else those in its
    tuples, lists and dict values; anything else holds none."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for v in value for t in flat_tensors(v)]
    return []

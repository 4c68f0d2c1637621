"""A calibration as a JSON file (`pipec profile --out`, `pipec compile --calibration`, and the
measurement cache of pipec.calibration.by_default): every field of pipec.cost.model.Calibration,
the optional ones defaulting where an older file lacks them."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipec.cost.model import Calibration, Fit, NodeTiming
from pipec.errors import ConfigError


def save_calibration(calibration: Calibration, path: Path) -> None:
    path.write_text(json.dumps(asdict(calibration), indent=2, sort_keys=True) + "\n")


def load_calibration(path: Path) -> Calibration:
    try:
        data = json.loads(path.read_text())
        nodes = tuple(_node_timing(t) for t in data.get("nodes", ()))
        overhead = tuple(map(float, data.get("stage_overhead_s", (0.0, 0.0))))
        data_s = tuple(map(float, data.get("data_s", (0.0, 0.0))))
        loss = _node_timing(data["loss"]) if data.get("loss") else None
        split = _node_timing(data["split_backward"]) if data.get("split_backward") else None
        return Calibration(str(data["device"]), Fit(**data["forward"]), Fit(**data["backward"]),
                           nodes, (overhead[0], overhead[1]),
                           str(data.get("source", "pipec profile")),
                           float(data.get("contention", 1.0)), (data_s[0], data_s[1]), loss,
                           tuple(_node_timing(t) for t in data.get("kept_norm", ())), split,
                           tuple((str(name), float(fixed), float(per_tensor), float(per_byte))
                                 for name, fixed, per_tensor, per_byte
                                 in data.get("optimizer_s", ())))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"calibration file {path}: {exc}; make one with pipec profile") from None


def _node_timing(data: dict[str, Any]) -> NodeTiming:
    timing = NodeTiming(str(data["node"]), str(data["target"]), tuple(map(int, data["sizes"])),
                        tuple(map(float, data["fwd_s"])), tuple(map(float, data["bwd_s"])))
    sizes = timing.sizes
    if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)) or not (
            len(sizes) == len(timing.fwd_s) == len(timing.bwd_s)):
        raise ValueError(f"node {timing.node!r}: sizes must be ascending positive micro-batch "
                         "sizes, one forward and one backward time for each")
    return timing

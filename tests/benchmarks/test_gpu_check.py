"""The device check's dry run on a CPU (benchmarks/gpu_check.sh --dry-run): every phase's
commands, small shapes, gloo; the summary a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_every_phase_of_the_device_check_passes_a_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "PIPEC_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
                            env=env, capture_output=True, text=True, timeout=1200, check=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert result.returncode == 0, json.dumps(summary, indent=1)[-3000:]
    phases = summary["phases"]
    assert list(phases) == ["versions", "two_ranks", "runtime_probe", "communicators",
                            "measured", "losses", "memory", "step_time"]
    assert all(p["status"] == "passed" and (tmp_path / "out" / p["log"]).is_file()
               for p in phases.values())
    assert phases["two_ranks"]["figures"]["ranks_ok"] == 2
    probed = phases["runtime_probe"]["figures"]["measured"]
    assert probed["processes"] == 2 and probed["bandwidth"] > 0 and probed["schedule_step_s"]
    assert phases["losses"]["figures"]["within_1e-4"], phases["losses"]["figures"]
    assert len(phases["losses"]["figures"]["largest_relative_difference"]) == 6
    assert phases["measured"]["figures"]["node_times_measured"]
    assert all(m["allocated_mib"] > 0 for m in phases["memory"]["figures"]["memory"].values())
    assert set(phases["step_time"]["figures"]["step_time"]) == {"gpt", "resnet"}

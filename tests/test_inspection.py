"""`pipec inspect`: per-node and per-module costs, table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import SAMPLES
from pipec.cost.model import Training
from pipec.errors import ConfigError
from pipec.inspection import inspect_model


def test_json_lists_nodes_and_totals() -> None:
    result = subprocess.run([sys.executable, "-m", "pipec.cli", "inspect", str(SAMPLES / "mlp.py"),
                             "--batch-size", "4", "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["total"]) >= {"params", "fwd_flops", "bwd_flops", "activation_bytes"}
    assert len(data["nodes"]) == 11  # 6 Linear + 5 ReLU
    assert data["nodes"][0]["shape"] == [4, 256]
    assert data["total"]["params"] == sum(n["params"] for n in data["nodes"])
    assert data["total"]["fwd_flops"] == 4 * 2 * (64 * 256 + 4 * 256 * 256 + 256 * 10)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_grouping_by_module_keeps_the_totals(depth: int) -> None:
    nodes, total = inspect_model(SAMPLES / "resnet.py", 4, None, "cpu", Training())
    modules, grouped = inspect_model(SAMPLES / "resnet.py", 4, depth, "cpu", Training())
    assert len(modules) < len(nodes)
    assert replace(grouped, time_s=0.0) == replace(total, time_s=0.0)
    assert grouped.time_s == pytest.approx(total.time_s)
    if depth == 1:
        assert [m.name for m in modules] == ["stem", "layers", "(model)", "head"]


def test_table_has_a_totals_line() -> None:
    result = subprocess.run([sys.executable, "-m", "pipec.cli", "inspect", str(SAMPLES / "gpt.py"),
                             "--depth", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| node / module") and lines[-1].startswith("| total")


@pytest.mark.parametrize(("batch", "depth", "message"), [
    (0, None, "--batch-size 0"), (2, -1, "--depth -1")])
def test_bad_options(batch: int, depth: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        inspect_model(SAMPLES / "mlp.py", batch, depth, "cpu", Training())

"""The search over tensor parallelism: each degree plans pp × dp on one rank's costs over
gpus / tp devices; the fastest degree wins; tp divides a node's devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SAMPLES
from pipec.driver import Analyzed, CompileOptions, analyze
from pipec.frontend.shardable import Shardable, find_shardable
from pipec.planning.tp_search import plan_at, plan_with_tp, tp_degrees


def analyzed(tmp_path: Path, gpus: int = 4, nodes: int = 1) -> tuple[Analyzed, Shardable]:
    found = analyze(CompileOptions(model=SAMPLES / "gpt.py", out=tmp_path / "o", gpus=gpus,
                                   nodes=nodes, batch_size=64, hardware="a100-80g",
                                   measure="off"))
    shapes = {v.name: v.shape_high for v in found.graph.values}
    return found, find_shardable(found.traced.graph_module, shapes)


def test_tp_divides_a_nodes_devices_and_the_heads(tmp_path: Path) -> None:
    found, shardable = analyzed(tmp_path, gpus=8, nodes=1)
    assert tp_degrees(shardable, found.request) == (1, 2, 4, 8)  # at 8 the MLPs still shard
    found, shardable = analyzed(tmp_path, gpus=8, nodes=4)
    assert tp_degrees(shardable, found.request) == (1, 2)


def test_each_degree_plans_the_remaining_devices_on_a_ranks_costs(tmp_path: Path) -> None:
    found, shardable = analyzed(tmp_path)
    alone = plan_at(found.graph, shardable, found.request, 1)
    split = plan_at(found.graph, shardable, found.request, 2)
    assert alone.pp * alone.dp == 4 and split.pp * split.dp == 2
    assert sum(s.params for s in split.stages) < sum(s.params for s in alone.stages)


def test_the_fastest_degree_wins(tmp_path: Path) -> None:
    found, shardable = analyzed(tmp_path)
    best = plan_with_tp(found.graph, shardable, found.request, (1, 2, 4))
    assert [tp for tp, _ in best.tried] == [1, 2, 4]
    assert best.samples_per_s == pytest.approx(max(s for _, s in best.tried if s is not None))
    assert dict(best.tried)[best.tp] == best.samples_per_s

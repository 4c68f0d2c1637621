"""`pipec inspect`: what every node (or module) of a model costs, as a table or JSON; with
``--tp K``, which linears shard over K tensor-parallel ranks and why the others do not."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from pipec.cost.hardware import load_hardware
from pipec.cost.model import Calibration, Training, node_arrays, tp_collectives_s
from pipec.cost.sharded_costs import shard_costs
from pipec.errors import ConfigError
from pipec.frontend.annotate import CostGraph, NodeCost, annotate
from pipec.frontend.costgraph import Linear as CostLinear
from pipec.frontend.loader import load_model_file
from pipec.frontend.shardable import Region, Shardable, find_shardable
from pipec.frontend.trace import trace_model
from pipec.units import mib


@dataclass(frozen=True)
class Row:
    """One node, or the nodes of one module, at the batch size inspected."""

    name: str
    shape: tuple[int, ...]  # the output shape (of the module's last node)
    params: int
    fwd_flops: float
    bwd_flops: float
    activation_bytes: float  # saved for backward
    time_s: float  # forward + backward on the chosen hardware


def inspect_model(model: Path, batch_size: int, depth: int | None, hardware: str,
                  training: Training, calibration: Calibration | None = None
                  ) -> tuple[list[Row], Row]:
    """Rows per node (``depth`` None) or per module at ``depth``, and the totals."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: must be a positive integer")
    if depth is not None and depth < 0:
        raise ConfigError(f"--depth {depth}: must be 0 or more")
    spec = load_model_file(model)
    traced = trace_model(spec)
    graph = annotate(traced, spec, bf16_memory=False)
    times = _node_times(graph, hardware, batch_size, training, calibration)
    shapes = {v.name: v.shape_at(batch_size) for v in graph.values}
    rows = [_row(n.name, [n], [t], batch_size, shapes)
            for n, t in zip(graph.nodes, times, strict=True)]
    if depth is not None:
        rows = _by_module(graph, times, depth, batch_size, shapes)
    return rows, _total(rows)


def _node_times(graph: CostGraph, hardware: str, batch_size: int, training: Training,
                calibration: Calibration | None) -> list[float]:
    arrays = node_arrays(graph, load_hardware(hardware), batch_size, training, calibration)
    return [float(t) for t in arrays.fwd_s + arrays.bwd_s]


def _row(name: str, nodes: list[NodeCost], times: list[float], batch_size: int,
         shapes: dict[str, tuple[int, ...]]) -> Row:
    shaped = [n for n in nodes if n.name in shapes]
    return Row(name=name, shape=shapes[shaped[-1].name] if shaped else (),
               params=sum(n.params for n in nodes),
               fwd_flops=sum(n.fwd_flops.at(batch_size) for n in nodes),
               bwd_flops=sum(n.bwd_flops.at(batch_size) for n in nodes),
               activation_bytes=sum(n.saved_bytes.at(batch_size) for n in nodes),
               time_s=sum(times))


def _by_module(graph: CostGraph, times: list[float], depth: int, batch_size: int,
               shapes: dict[str, tuple[int, ...]]) -> list[Row]:
    """Consecutive nodes grouped by their module's first ``depth`` levels (0: the whole model)."""
    groups: list[tuple[str, list[NodeCost], list[float]]] = []
    for node, time in zip(graph.nodes, times, strict=True):
        name = ".".join(node.module.split(".")[:depth]) or "(model)"
        if not groups or groups[-1][0] != name:
            groups.append((name, [], []))
        groups[-1][1].append(node)
        groups[-1][2].append(time)
    return [_row(name, nodes, node_times, batch_size, shapes)
            for name, nodes, node_times in groups]


def _total(rows: list[Row]) -> Row:
    return Row("total", (), sum(r.params for r in rows), sum(r.fwd_flops for r in rows),
               sum(r.bwd_flops for r in rows), sum(r.activation_bytes for r in rows),
               sum(r.time_s for r in rows))


def render_table(rows: list[Row], total: Row) -> str:
    def cells(r: Row) -> tuple[Any, ...]:
        return (r.name, "×".join(map(str, r.shape)), f"{r.params:,}", f"{r.fwd_flops / 1e9:.4f}",
                f"{r.bwd_flops / 1e9:.4f}", mib(r.activation_bytes, 3),
                f"{r.time_s * 1e3:.3f}")

    headers = ("node / module", "output shape", "params", "fwd GFLOP", "bwd GFLOP",
               "saved MiB", "est. ms")
    return tabulate([*map(cells, rows), cells(total)], headers, tablefmt="github")


def render_json(rows: list[Row], total: Row) -> dict[str, Any]:
    return {"nodes": [{**asdict(r), "shape": list(r.shape)} for r in rows],
            "total": {"params": total.params, "fwd_flops": total.fwd_flops,
                      "bwd_flops": total.bwd_flops, "activation_bytes": total.activation_bytes,
                      "time_s": total.time_s}}


@dataclass(frozen=True)
class TpInspection:
    shardable: Shardable
    graph: CostGraph  # the whole model's costs


def shardable_model(model: Path) -> TpInspection:
    """The tensor-parallel regions of ``model``'s traced graph (pipec.frontend.shardable) and
    its cost graph."""
    spec = load_model_file(model)
    traced = trace_model(spec)
    graph = annotate(traced, spec, bf16_memory=False)
    shapes = {v.name: v.shape_high for v in graph.values}
    return TpInspection(find_shardable(traced.graph_module, shapes), graph)


def render_tp_costs(found: TpInspection, tp: int, hardware: str, batch_size: int,
                    training: Training) -> str:
    """One rank's share of the work and what its collectives cost, at ``batch_size``."""
    costs = shard_costs(found.graph, found.shardable.regions_at(tp), tp,
                        found.shardable.embeddings_at(tp))
    device = load_hardware(hardware)
    bf16 = training.precision == "bf16"
    whole = node_arrays(found.graph, device, batch_size, training)
    rank = node_arrays(costs.graph, device, batch_size, training)
    forward, backward = tp_collectives_s(costs.graph, device, batch_size, bf16)
    collectives = float(np.sum(forward + backward))
    compute = float(np.sum(whole.fwd_s + whole.bwd_s))
    rank_compute = float(np.sum(rank.fwd_s + rank.bwd_s)) - collectives
    moved = [b * batch_size * (0.5 if bf16 else 1.0) for b in costs.per_sample_bytes()]
    return (f"One of {tp} rank(s) at batch {batch_size} on {hardware}: "
            f"{_share(costs.graph, found.graph, 'fwd_flops', batch_size)} of the FLOPs, "
            f"{_share(costs.graph, found.graph, 'params', batch_size)} of the parameters; "
            f"compute {compute * 1e3:.3f} -> {rank_compute * 1e3:.3f} ms, collectives "
            f"{collectives * 1e3:.3f} ms "
            f"({mib(moved[0], 2)} MiB forward, {mib(moved[1], 2)} MiB backward)\n")


def _share(rank: CostGraph, whole: CostGraph, field: str, batch_size: int) -> str:
    def total(graph: CostGraph) -> float:
        values = (getattr(n, field) for n in graph.nodes)
        return sum(v.at(batch_size) if isinstance(v, CostLinear) else v for v in values)

    return f"{total(rank) / max(total(whole), 1e-30):.1%}"


def render_shardable(shardable: Shardable, tp: int) -> str:
    """The regions, the embeddings and the linears that stay whole, at ``tp`` ranks."""
    if tp < 1:
        raise ConfigError(f"--tp {tp}: must be a positive integer")
    regions = tabulate([_region_cells(r, tp) for r in shardable.regions],
                       ("region", "column-parallel", "row-parallel", "head reshapes",
                        "all-reduces fwd / bwd", f"shards over {tp}?"), tablefmt="github")
    embeddings = tabulate([(e.path, f"{e.rows:,}", _divides(e.rows, tp))
                           for e in shardable.vocabulary],
                          ("embedding", "rows", "vocabulary-parallel?"), tablefmt="github")
    whole = (tabulate([(w.path, w.reason) for w in shardable.whole], ("stays whole", "why"),
                      tablefmt="github") if shardable.whole else "Every linear is in a region.")
    sharded = len(shardable.regions_at(tp))
    return (f"{sharded} of {len(shardable.regions)} region(s) shard over {tp} rank(s); "
            f"every region shards at tp {', '.join(map(str, shardable.degrees(64)))}\n\n"
            f"{regions}\n\n{embeddings}\n\n{whole}\n")


def _region_cells(region: Region, tp: int) -> tuple[str, ...]:
    fused = dict(region.fused)
    columns = [c + (f" (fused {'+'.join(map(str, fused[c]))})" if c in fused else "")
               for c in region.columns]
    gathered = f" + all-gather ×{len(region.gathered)}" if region.gathered else ""
    blocker = region.blocker(tp)
    return (region.kind, ", ".join(columns), ", ".join(region.rows) or "-",
            str(len(region.rewrites)), f"{len(region.rows)} / {len(region.inputs)}{gathered}",
            "yes" if blocker is None else f"no: {blocker} is not a multiple of {tp}")


def _divides(size: int, tp: int) -> str:
    return "yes" if size % tp == 0 else f"no: {size} is not a multiple of {tp}"


def shardable_json(shardable: Shardable, tp: int) -> dict[str, Any]:
    return {"tp": tp, "regions": [{**asdict(r), "shards": r.allows(tp)}
                                  for r in shardable.regions],
            "vocabulary": [{"embedding": e.path, "rows": e.rows, "shards": e.rows % tp == 0}
                           for e in shardable.vocabulary],
            "whole": [asdict(w) for w in shardable.whole]}

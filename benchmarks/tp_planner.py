"""Predicted plans with tensor parallelism (pipec.planning.tp_search) for LLaMA shapes on GPU
presets, AdamW and bf16, sequence parallelism between the regions: for each tp degree, the
pp × dp plan of one tp rank, its samples/s, tokens/s per GPU and MFU over the devices' bf16
peak, counted two ways (6 · parameters · tokens, as benchmarks/planner.py; and the traced
graph's own forward and backward FLOPs, attention's included), and the time of the plan pass.
Predicted only: none of these GPU plans has run.

    python benchmarks/tp_planner.py [--quick]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from pipec.cost.hardware import load_hardware
from pipec.driver import CompileOptions, analyze
from pipec.errors import InfeasibleError
from pipec.frontend.shardable import find_shardable
from pipec.planning.tp_search import plan_at

ZOO = Path(__file__).resolve().parent / "zoo"

# (model file, devices, nodes, preset, global batch, tp degrees). Llama-3-8B at torchtitan's
# setting (8 H100s, one 8,192-token sequence per GPU); the 405B shape at Llama 3's (batch 2,048
# on 512 H100s); tp 1 of the 405B shape is left out: its plan pass alone takes 9.5 min here.
ENTRIES = (
    (ZOO / "llama3_8b.py", 8, 1, "h100-80g", 8, (1, 2, 4, 8)),
    (ZOO / "llama2_70b.py", 32, 4, "a100-80g", 64, (1, 2, 4, 8)),
    (ZOO / "llama3_405b.py", 512, 64, "h100-80g", 2048, (8,)),
)


def rows_for(model: Path, gpus: int, nodes: int, hardware: str, batch: int,
             degrees: tuple[int, ...], out: Path) -> list[tuple[str, ...]]:
    found = analyze(CompileOptions(model=model, out=out, gpus=gpus, nodes=nodes,
                                   batch_size=batch, hardware=hardware, measure="off",
                                   optimizer="adamw", precision="bf16"))
    shapes = {v.name: v.shape_high for v in found.graph.values}
    shardable = find_shardable(found.traced.graph_module, shapes)
    parameters = sum(n.params for n in found.graph.nodes)
    sample_flops = sum(n.fwd_flops.at(1) + n.bwd_flops.at(1) for n in found.graph.nodes)
    tokens = shapes[found.graph.values[0].name][1]  # the input's sequence length
    peak = load_hardware(hardware).bf16_flops
    rows = []
    for tp in degrees:
        started = time.perf_counter()
        setting = (model.name, f"{gpus} × {hardware}, {nodes} node(s)", f"{batch:,}", str(tp))
        try:
            plan = plan_at(found.graph, shardable, found.request, tp)
        except InfeasibleError as exc:
            needs = re.search(r"needs .* usable", str(exc))
            rows.append((*setting, f"does not fit: {needs.group(0) if needs else exc}", "", "",
                         "", "", f"{time.perf_counter() - started:.1f}"))
            continue
        seconds = time.perf_counter() - started
        per_gpu = plan.samples_per_s * tokens / gpus
        rows.append((*setting, f"{plan.pp}×{plan.dp} m {plan.micro_batch} {plan.schedule}"
                     f"{'' if plan.fsdp == 'off' else ' ' + plan.fsdp}",
                     f"{plan.samples_per_s:.2f}", f"{per_gpu:,.0f}",
                     f"{6 * parameters * per_gpu / peak:.1%}",
                     f"{sample_flops * plan.samples_per_s / (gpus * peak):.1%}",
                     f"{seconds:.1f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first two models")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in ENTRIES[:2] if args.quick else ENTRIES:
            rows += rows_for(*entry, out=Path(tmp) / "o")
    print(tabulate(rows, ("model", "devices", "batch", "tp", "plan (pp×dp)", "samples/s",
                          "tokens/s/GPU", "MFU (6PT)", "MFU (graph)", "plan s"),
                   tablefmt="github"))


if __name__ == "__main__":
    main()

"""Host bytes per autograd operation: what a micro-batch in flight holds beyond its saved tensors.

A micro-batch whose backward has not run keeps its autograd graph: one C++ node per recorded
operation, the saved-tensor records and tensor objects of what it saves. On a GPU that is host
memory; on a CPU it is the device's own, so the `cpu` preset's `graph_node_bytes` adds it to
each node's activations (docs/cost-model.md). This script measures it per model: it holds
`--graphs` forward passes of the model (the operations train.py's stages run), measures the
growth of the process's anonymous resident memory, with glibc serving blocks of 4 KiB or more
with their own mappings as train.py --metrics does, and takes off the saved bytes pipec predicts.

    python benchmarks/studies/graph_bytes.py [--micro-batch 2] [--graphs 32] [MODEL ...]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs, trace_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from commands import ROOT

SAMPLES = ("samples/gpt.py", "samples/mlp.py", "samples/resnet.py")
KIB = 1024


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * KIB
    raise SystemExit("no RssAnon in /proc/self/status (Linux only)")


def measure(path: Path, micro_batch: int, graphs: int) -> tuple[str, ...]:
    spec = load_model_file(path)
    traced = trace_model(spec)
    graph = annotate(traced, spec, autocast_device="cpu")
    saved = sum(n.saved_bytes.at(micro_batch) for n in graph.nodes)
    nodes = sum(n.autograd_nodes for n in graph.nodes)
    torch.manual_seed(0)
    model = spec.build_model().train()
    inputs, _ = batch_inputs(spec, micro_batch)
    model(*inputs)  # first-call allocations (kernels' workspaces, caches) before measuring
    libc = ctypes.CDLL("libc.so.6")
    gc.collect()
    libc.malloc_trim(0)
    before = resident_bytes()
    held = [model(*inputs) for _ in range(graphs)]
    per_graph = (resident_bytes() - before) / graphs
    del held
    per_node = (per_graph - saved) / nodes
    return (path.stem, str(nodes), f"{saved / KIB:.1f}", f"{per_graph / KIB:.1f}",
            f"{per_node:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(SAMPLES))
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--graphs", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 4 * KIB)  # M_MMAP_THRESHOLD, as train.py --metrics
    rows = [measure(ROOT / model, args.micro_batch, args.graphs) for model in args.models]
    print(tabulate(rows, headers=("model", "autograd nodes", "saved KiB (pipec)",
                                  "held KiB per graph", "bytes per node"), tablefmt="github"))


if __name__ == "__main__":
    main()

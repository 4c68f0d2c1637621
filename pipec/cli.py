"""Command line: argparse, exit codes and user-error formatting; nothing else.

Exit status: 0 success, 2 a user error (one line on stderr, no traceback), 1 a pipec bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from pipec import __version__
from pipec.calibration.by_default import MEASURE_CHOICES
from pipec.calibration.profile import PROFILE_NORMS, profile_model
from pipec.compare import compare
from pipec.compare import render as render_comparison
from pipec.cost.calibration_file import load_calibration, save_calibration
from pipec.cost.hardware import DEFAULT, PRESETS
from pipec.cost.model import OPTIMIZERS, PRECISIONS, Fit, Training
from pipec.driver import CompileOptions, compile_model
from pipec.errors import ConfigError, PipecError
from pipec.frontend.normalization import NORM_CHOICES
from pipec.frontend.trace import FRONTENDS
from pipec.inspection import (
    inspect_model,
    render_json,
    render_shardable,
    render_table,
    render_tp_costs,
    shardable_json,
    shardable_model,
)
from pipec.planning.planner import FSDP_MODES, RECOMPUTE, STRATEGIES, Plan
from pipec.planning.schedules import SCHEDULES
from pipec.torchcompat import check_torch


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="pipec: %(message)s")
    # A measurement takes seconds: say what runs.
    logging.getLogger("pipec.calibration.by_default").setLevel(logging.INFO)
    try:
        check_torch()
        return int(args.run(args))
    except PipecError as exc:
        print(f"pipec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # A reader that stopped early (`pipec inspect ... | head`): nothing more to say, and
        # Python must not report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipec", description="Partition a PyTorch model into pipeline stages and emit a "
        "standalone torchrun training script.")
    parser.add_argument("--version", action="version", version=f"pipec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(commands)
    _add_inspect(commands)
    _add_profile(commands)
    _add_compare(commands)
    return parser


def _auto_or_int(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None
    return value


def _percent(text: str) -> float:
    try:
        return float(text.removesuffix("%")) / 100
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, e.g. 5, got {text!r}") from None


def _node_indices(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected node indices separated by commas, e.g. "
                                         f"20 or 12,30,41, got {text!r}") from None


def _add_compile(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("compile", help="plan a model and write train.py, stages.py, "
                            "plan.json, report.md", description="Trace MODEL, plan its stages "
                            "and micro-batch size, and write a standalone training script.")
    p.add_argument("model", type=Path, help="model file defining build_model() and sample_batch()")
    p.add_argument("-o", "--out", type=Path, default=Path("out"), help="output directory (out)")
    p.add_argument("--gpus", type=int, default=1, help="total devices (1)")
    p.add_argument("--nodes", type=int, default=1, help="machines the devices are spread over (1)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (32)")
    p.add_argument("--hardware", default=DEFAULT, help=f"device preset ({', '.join(PRESETS)}), "
                   "a JSON file, or an ordered list for mixed devices, e.g. "
                   f"a100-80g:2,v100-32g:2 ({DEFAULT})")
    p.add_argument("--pp", type=_auto_or_int, default=None,
                   help="pipeline stages: auto (every K dividing --gpus is searched) or K; "
                   "data parallel = gpus / K")
    p.add_argument("--micro-batch", type=_auto_or_int, default=None,
                   help="micro-batch size: auto (searched) or K")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES), default="auto",
                   help="pipeline schedule (auto: the fastest that fits)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per device under --schedule interleaved (default: 2, 3 and 4 "
                   "are searched)")
    p.add_argument("--boundaries", type=_node_indices, default=None, metavar="N[,N...]",
                   help="pin the stage boundaries (the search still chooses the micro-batch, "
                   "schedule and replicas; nothing recomputes): each stage's first node after "
                   "the first stage's, "
                   "as plan.json's stages[].nodes gives it; one fewer than the stages")
    p.add_argument("--norm", choices=NORM_CHOICES, default="auto",
                   help="BatchNorm handling (auto: GroupNorm when pipelined, SyncBatchNorm when "
                   "only data-parallel, unchanged on one device)")
    p.add_argument("--norm-groups", type=int, default=None,
                   help="GroupNorm groups (default: the largest divisor of the channels ≤ 32 "
                   "leaving each group at least 16 values)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="auto",
                   help="activation recomputation per stage: auto (where a stage does not fit "
                   "otherwise, in full or selectively, whichever is faster), none, full or "
                   "selective (every stage that may; selective keeps the products' outputs)")
    p.add_argument("--fsdp", choices=FSDP_MODES, default="auto",
                   help="sharded data parallelism over each stage's replicas (FSDP2): off "
                   "(DDP), zero2, zero3 (the stage one unit), block (a unit per block, "
                   "gradients reduce-scattered every micro-batch), or auto (zero2 or block "
                   "where it is faster or the only fit)")
    p.add_argument("--mesh", choices=("auto", "dp,pp", "pp,dp"), default="auto",
                   help="the device mesh, outer dimension first: dp,pp puts each replica's "
                   "pipeline on neighbouring ranks, pp,dp each pipeline device's replicas "
                   "(auto: searched where it matters, across nodes)")
    p.add_argument("--tp", default="1", metavar="K",
                   help="tensor-parallel ranks per stage replica (Megatron-LM's attention and "
                   "MLP sharding, found in the traced graph; tp innermost in the mesh, within "
                   "a node), or auto: the fastest degree that fits (default: 1)")
    p.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto",
                   help="under tp, run the norms, residual adds and dropout between the "
                   "sharded regions on each rank's part of the sequence (Megatron-LM's "
                   "sequence parallelism: 1/tp of their activations, the same bytes in twice "
                   "the collectives); auto: planned with and without, the faster kept "
                   "(default: auto)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="(sgd)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="(fp32)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="compute times measured by pipec profile (JSON) instead of the preset's")
    p.add_argument("--measure", choices=MEASURE_CHOICES,
                   default=os.environ.get("PIPEC_MEASURE", "auto"),
                   help="auto: when --hardware is this machine's kind (cpu here), time the "
                   "model here once and cache it (in $PIPEC_CACHE_DIR or ~/.cache/pipec); "
                   "off: the preset's roofline (default: $PIPEC_MEASURE, else auto)")
    p.add_argument("--margin", type=_percent, default=None, metavar="PERCENT",
                   help="a more complex plan (interleaving, more stages, a smaller micro-batch) "
                   "must be predicted this much faster than a simpler one to win (default: the "
                   "time model's measured error, 5.2 %% with measured times, 13 %% from a preset)")
    p.add_argument("--strategy", choices=STRATEGIES, default="pipec",
                   help="emit pipec's plan (default) or a baseline's, to compare them")
    p.add_argument("--frontend", choices=FRONTENDS, default="auto",
                   help="graph capture: torch.fx, torch.export (for models fx cannot trace), "
                   "or auto: fx, then export if fx fails")
    p.add_argument("--onnx", action="store_true",
                   help="also write stage_K.onnx per stage, checked (needs the onnx extra)")
    p.add_argument("--force", action="store_true",
                   help="replace an output directory that is not a previous pipec output")
    p.add_argument("-v", "--verbose", action="store_true", help="log each pass")
    p.set_defaults(run=_run_compile)


def _add_inspect(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("inspect", help="per-node or per-module costs of a model",
                            description="Trace MODEL on the meta device and print what each node "
                            "(or each module at --depth) costs at --batch-size.")
    p.add_argument("model", type=Path, help="model file defining build_model() and sample_batch()")
    p.add_argument("--batch-size", type=int, default=1, help="samples (1)")
    p.add_argument("--depth", type=int, default=None,
                   help="group by module at this depth (default: one row per graph node)")
    p.add_argument("--hardware", default=DEFAULT, help=f"device for the time estimate ({DEFAULT})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="(sgd)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="(fp32)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="compute times measured by pipec profile (JSON)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--tp", type=int, default=None, metavar="K",
                   help="instead of the costs: the tensor-parallel regions, which shard over K "
                   "ranks, and why the other linears stay whole")
    p.set_defaults(run=_run_inspect)


def _add_compare(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("compare", help="predicted against measured, stage by stage",
                            description="Compare a compiled plan (OUT/plan.json) with the metrics "
                            "its train.py wrote (--metrics FILE) and say which assumption is off.")
    p.add_argument("out", type=Path, help="the pipec compile output directory")
    p.add_argument("metrics", type=Path, help="the JSON file train.py --metrics wrote")
    p.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    print(render_comparison(compare(args.out, args.metrics)), end="")
    return 0


def _add_profile(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("profile", help="time a model on this machine and fit the cost model",
                            description="Run MODEL's training passes on this machine's "
                            "device at several micro-batch sizes, time every node forward and "
                            "backward in context, and fit the time model's constants. "
                            "pipec compile --calibration uses the node times for this model and "
                            "the constants for any other. Profile with the OMP_NUM_THREADS the "
                            "training will use.")
    p.add_argument("model", type=Path, help="model file defining build_model() and sample_batch()")
    p.add_argument("--batch-size", type=int, default=16,
                   help="largest micro-batch to time; powers of two up to it (16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed passes per micro-batch size; the median is kept (10)")
    p.add_argument("--norm", choices=PROFILE_NORMS, default="group",
                   help="time each BatchNorm as the GroupNorm pipelined plans run (group), or "
                   "as it is (keep)")
    p.add_argument("--frontend", choices=FRONTENDS, default="auto",
                   help="the graph to time, as pipec compile --frontend captures it (auto)")
    p.add_argument("-o", "--out", type=Path, default=Path("calibration.json"),
                   help="calibration file to write (calibration.json)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.repeats < 1:
        raise ConfigError(f"--batch-size {args.batch_size} and --repeats {args.repeats} must be "
                          "positive")
    calibration, _ = profile_model(args.model, args.batch_size, args.device, args.repeats,
                                   args.norm, frontend=args.frontend)
    save_calibration(calibration, args.out)
    forward, backward = calibration.forward, calibration.backward
    sizes = ", ".join(map(str, calibration.nodes[0].sizes)) if calibration.nodes else "none"
    print(f"pipec: wrote {args.out}: {len(calibration.nodes)} nodes timed on "
          f"{calibration.device} at micro-batch sizes {sizes}; fitted "
          f"forward {forward.overhead_s * 1e6:.1f} µs/node + {_rate(forward)}, backward "
          f"{backward.overhead_s * 1e6:.1f} µs/node + {_rate(backward)}")
    return 0


def _rate(fit: Fit) -> str:
    return (f"{1 / fit.seconds_per_flop / 1e9:.1f} GFLOP/s" if fit.seconds_per_flop > 0
            else "no FLOP term")


def _run_inspect(args: argparse.Namespace) -> int:
    if args.tp is not None:
        return _run_inspect_tp(args)
    calibration = load_calibration(args.calibration) if args.calibration else None
    rows, total = inspect_model(args.model, args.batch_size, args.depth, args.hardware,
                                Training(args.optimizer, args.precision), calibration)
    if args.json:
        print(json.dumps(render_json(rows, total), indent=2))
    else:
        print(render_table(rows, total))
    return 0


def _run_inspect_tp(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: must be a positive integer")
    found = shardable_model(args.model)
    if args.json:
        print(json.dumps(shardable_json(found.shardable, args.tp), indent=2))
        return 0
    print(render_shardable(found.shardable, args.tp))
    print(render_tp_costs(found, args.tp, args.hardware, args.batch_size,
                          Training(args.optimizer, args.precision)), end="")
    return 0


def _run_compile(args: argparse.Namespace) -> int:
    options = CompileOptions(**{f.name: getattr(args, f.name) for f in fields(CompileOptions)})
    plan, emitted = compile_model(options)
    print(f"pipec: wrote {emitted.out}/ ({', '.join(emitted.files)}): {len(plan.stages)} "
          f"stage(s) on {plan.pp} pipeline device(s) × {plan.dp} replica(s), micro-batch "
          f"{plan.micro_batch}, {plan.schedule}, predicted "
          f"{plan.samples_per_s:,.1f} samples/s ({_time_basis(plan)})")
    return 0


def _time_basis(plan: Plan) -> str:
    calibration = plan.request.calibration
    if calibration is None:
        return f"from the {plan.request.hardware} roofline"
    if calibration.source == "pipec profile":
        return f"from times measured by pipec profile on {calibration.device}"
    return "from times " + calibration.source


if __name__ == "__main__":
    sys.exit(main())

"""Command line: argparse, exit codes and user-error formatting; nothing else.

Exit status: 0 success, 2 a user error (one line on stderr, no traceback), 1 a pipec bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pipec import __version__
from pipec.costmodel import Training
from pipec.driver import CompileOptions, compile_model
from pipec.errors import PipecError
from pipec.hardware import DEFAULT, PRESETS
from pipec.inspection import inspect_model, render_json, render_table
from pipec.normalize import NORM_CHOICES
from pipec.schedule import SCHEDULES


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="pipec: %(message)s")
    try:
        return int(args.run(args))
    except PipecError as exc:
        print(f"pipec: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipec", description="Partition a PyTorch model into pipeline stages and emit a "
        "standalone torchrun training script.")
    parser.add_argument("--version", action="version", version=f"pipec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(commands)
    _add_inspect(commands)
    return parser


def _auto_or_int(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None
    return value


def _add_compile(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("compile", help="plan a model and write train.py, stages.py, "
                            "plan.json, report.md", description="Trace MODEL, plan its stages "
                            "and micro-batch size, and write a standalone training script.")
    p.add_argument("model", type=Path, help="model file defining build_model() and sample_batch()")
    p.add_argument("-o", "--out", type=Path, default=Path("out"), help="output directory (out)")
    p.add_argument("--gpus", type=int, default=1, help="total devices (1)")
    p.add_argument("--nodes", type=int, default=1, help="machines the devices are spread over (1)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (32)")
    p.add_argument("--hardware", default=DEFAULT, help=f"device preset ({', '.join(PRESETS)}) "
                   f"or a JSON file ({DEFAULT})")
    p.add_argument("--pp", type=_auto_or_int, default=None,
                   help="pipeline stages: auto (= --gpus) or K; data parallel = gpus / K")
    p.add_argument("--micro-batch", type=_auto_or_int, default=None,
                   help="micro-batch size: auto (searched) or K")
    p.add_argument("--schedule", choices=("auto", *SCHEDULES), default="auto",
                   help="pipeline schedule (auto: the fastest that fits)")
    p.add_argument("--norm", choices=NORM_CHOICES, default="auto",
                   help="BatchNorm handling (auto: GroupNorm when pipelined, SyncBatchNorm when "
                   "only data-parallel, unchanged on one device)")
    p.add_argument("--norm-groups", type=int, default=None,
                   help="GroupNorm groups (default: largest divisor of the channels ≤ 32)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="(sgd)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="(fp32)")
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
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="(sgd)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="(fp32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    rows, total = inspect_model(args.model, args.batch_size, args.depth, args.hardware,
                                Training(args.optimizer, args.precision))
    if args.json:
        print(json.dumps(render_json(rows, total), indent=2))
    else:
        print(render_table(rows, total))
    return 0


def _run_compile(args: argparse.Namespace) -> int:
    options = CompileOptions(
        model=args.model, out=args.out, gpus=args.gpus, nodes=args.nodes,
        batch_size=args.batch_size, hardware=args.hardware, pp=args.pp,
        micro_batch=args.micro_batch, schedule=args.schedule, norm=args.norm,
        norm_groups=args.norm_groups, optimizer=args.optimizer, precision=args.precision,
        force=args.force)
    plan, emitted = compile_model(options)
    print(f"pipec: wrote {emitted.out}/ ({', '.join(emitted.files)}): {plan.pp} stage(s) × "
          f"{plan.dp} replica(s), micro-batch {plan.micro_batch}, {plan.schedule}, predicted "
          f"{plan.samples_per_s:,.1f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training speed and resident memory under CPU host allocators: tcmalloc, and settings of
glibc's heap.

The emitted train.py trains under tcmalloc where the system has it (allocator.py); under glibc
(PIPEC_ALLOCATOR=glibc, or no tcmalloc), metrics.py sets glibc's heap for training
(set_training_heap): blocks of MAPPED_BLOCK or more get mappings of their own unless the heap's
top has room for them, and HEAP_GROWTH pads that top. This benchmark compiles a few plans once
(`--measure off`, so the profile's allocator does not matter), copies each emitted directory
once per setting, and runs the copies in turn, round after round, so that every setting sees
the same machine state. It prints each launch's mean samples/s after the first step and its
resident peaks.

    OMP_NUM_THREADS=1 python benchmarks/heap_speed.py [--rounds 2] \
        [--settings tcmalloc MAPPED_BLOCK:HEAP_GROWTH ...]
        (glibc's in bytes; default tcmalloc 262144:67108864 262144:131072)
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from commands import PIPEC, ROOT, TORCHRUN, mean_samples_per_s, resident_peaks_mib, run
from tabulate import tabulate

from pipec.host_allocator import tcmalloc_library

KIB, MIB = 2**10, 2**20
LARGEST_MAPPED_BLOCK = 32 * MIB  # glibc's largest M_MMAP_THRESHOLD on 64-bit


@dataclass(frozen=True)
class Plan:
    name: str
    model: str  # relative to the repository
    processes: int
    options: tuple[str, ...]
    steps: int


PLANS = (
    Plan("gpt pp2 1f1b", "samples/gpt.py", 2,
         ("--pp", "2", "--schedule", "1f1b"), 40),
    Plan("long-lm pp2 1f1b m1", "benchmarks/models/long_lm.py", 2,
         ("--pp", "2", "--schedule", "1f1b", "--batch-size", "8", "--micro-batch", "1"), 5),
    Plan("deep-mlp 1 process m64", "benchmarks/models/deep_mlp.py", 1,
         ("--batch-size", "64", "--micro-batch", "64"), 60),
)


def compile_plan(plan: Plan, work: Path) -> Path:
    out = work / plan.name.replace(" ", "-")
    run([*PIPEC, "compile", str(ROOT / plan.model), "--gpus", str(plan.processes),
         "--hardware", "cpu", "--measure", "off", *plan.options, "-o", str(out)])
    return out


@dataclass(frozen=True)
class Setting:
    mapped_block: int  # bytes: blocks this large or larger are mapped apart
    heap_growth: int  # bytes: the heap's top pad
    tcmalloc: bool = False  # tcmalloc instead (glibc's settings unused)

    @classmethod
    def parse(cls, text: str) -> Setting:
        if text == "tcmalloc":
            if tcmalloc_library() is None:
                raise argparse.ArgumentTypeError("tcmalloc: not found on this machine")
            return cls(0, 0, tcmalloc=True)
        try:
            mapped_block, heap_growth = (int(value) for value in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give tcmalloc or MAPPED_BLOCK:HEAP_GROWTH in bytes, e.g. "
                "262144:131072") from None
        if not 0 < mapped_block <= LARGEST_MAPPED_BLOCK or heap_growth < 0:
            # glibc refuses these, and metrics.py ignores mallopt's answer: the run would
            # measure glibc's own settings under this setting's name.
            raise argparse.ArgumentTypeError(
                f"{text!r}: MAPPED_BLOCK must be 1 to {LARGEST_MAPPED_BLOCK} bytes and "
                "HEAP_GROWTH 0 or more")
        return cls(mapped_block, heap_growth)

    def __str__(self) -> str:
        if self.tcmalloc:
            return "tcmalloc"
        return (f"glibc, mapped from {self.mapped_block // KIB:,} KiB, "
                f"top pad {self.heap_growth // KIB:,} KiB")


def with_setting(emitted: Path, setting: Setting) -> Path:
    """A copy of the emitted directory whose training heap has `setting`."""
    suffix = "tcmalloc" if setting.tcmalloc else f"{setting.mapped_block}-{setting.heap_growth}"
    copy = emitted.with_name(f"{emitted.name}-{suffix}")
    shutil.copytree(emitted, copy)
    if setting.tcmalloc:
        return copy
    metrics = copy / "metrics.py"
    text = metrics.read_text()
    for name, value in (("MAPPED_BLOCK", setting.mapped_block),
                        ("HEAP_GROWTH", setting.heap_growth)):
        text, count = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, flags=re.MULTILINE)
        if count != 1:
            raise SystemExit(f"{metrics}: no {name} line to set")
    metrics.write_text(text)
    return copy


def launch(emitted: Path, plan: Plan, setting: Setting) -> tuple[float, list[float]]:
    """(mean samples/s after the first step, resident peak MiB per rank) of one launch."""
    output = run([str(TORCHRUN), "--standalone", f"--nproc-per-node={plan.processes}",
                  "train.py", "--steps", str(plan.steps)], cwd=emitted, attempts=2,
                 environment={"PIPEC_ALLOCATOR": "tcmalloc" if setting.tcmalloc else "glibc"})
    return mean_samples_per_s(output), resident_peaks_mib(output)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: run at least 1 round")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=_at_least_one, default=2)
    parser.add_argument("--settings", type=Setting.parse, nargs="+",
                        default=[*([Setting(0, 0, tcmalloc=True)] if tcmalloc_library() else []),
                                 Setting(256 * KIB, 64 * MIB), Setting(256 * KIB, 128 * KIB)],
                        help="tcmalloc, or glibc's MAPPED_BLOCK:HEAP_GROWTH in bytes")
    args = parser.parse_args()
    settings = list(dict.fromkeys(args.settings))  # each once: one copy of the script each
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipec-heap-speed-") as tmp:
        for plan in PLANS:
            emitted = compile_plan(plan, Path(tmp))
            copies = {setting: with_setting(emitted, setting) for setting in settings}
            speeds: dict[Setting, list[float]] = {setting: [] for setting in settings}
            peaks: dict[Setting, list[float]] = {setting: [] for setting in settings}
            for round_ in range(args.rounds):
                # Every other round in reverse: neither setting always runs first.
                order = list(copies.items())[::-1 if round_ % 2 else 1]
                for setting, copy in order:
                    speed, rank_peaks = launch(copy, plan, setting)
                    speeds[setting].append(speed)
                    peaks[setting].append(max(rank_peaks))
                    print(f"{plan.name}, {setting}: {speed:.1f} samples/s, "
                          f"peak {max(rank_peaks):.1f} MiB", flush=True)
            rows += [(plan.name, str(setting),
                      ", ".join(f"{value:,.1f}" for value in speeds[setting]),
                      f"{statistics.median(speeds[setting]):,.1f}",
                      ", ".join(f"{value:.1f}" for value in peaks[setting]))
                     for setting in settings]
    print(tabulate(rows, headers=("plan", "heap", "samples/s per launch", "median",
                                  "largest rank's resident peak MiB"), tablefmt="github"))


if __name__ == "__main__":
    main()

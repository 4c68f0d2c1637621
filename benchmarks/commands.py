"""What the benchmarks run: pipec and torchrun of this environment, one thread per process; and
what they read from the lines train.py prints at its end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPEC = [sys.executable, "-m", "pipec"]  # under tcmalloc where found, as train.py
TORCHRUN = Path(sys.executable).with_name("torchrun")
DONE = re.compile(r"^done: \d+ steps, ([\d.]+) samples/s", re.MULTILINE)
# ", tcmalloc" or ", glibc" before the colon: the host allocator the run had.
PEAKS = re.compile(r"^peak memory per rank \(MiB resident above the start(?:, \w+)?\): (.*)$",
                   re.MULTILINE)


def run(command: list[str], cwd: Path | None = None, attempts: int = 1,
        environment: dict[str, str] | None = None) -> str:
    """Run ``command``; its standard output, or exit with everything it printed. With
    ``attempts`` > 1, a failure is reported and the command run again, up to that many times
    in all: one launch out of hundreds failing must not end an hour's benchmark (a long-lm
    plan's torchrun once finished its steps and then aborted at exit: "terminate called
    without an active exception"). ``environment`` adds to this process's variables."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: run at least once")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(environment or {})}
    for attempt in range(1, attempts + 1):
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                                check=False)
        if not result.returncode:
            return result.stdout
        failure = f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
        if attempt == attempts:
            raise SystemExit(failure)
        print(f"{failure}\n(attempt {attempt} of {attempts}: running it again)",
              file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last attempt returns or exits")


def mean_samples_per_s(output: str) -> float:
    """The mean samples/s after the first step, from train.py's last line."""
    found = DONE.search(output)
    if found is None:
        raise SystemExit(f"no summary line in:\n{output}")
    return float(found.group(1))


def resident_peaks_mib(output: str) -> list[float]:
    """Each rank's peak resident MiB above its start, from train.py's summary of a run."""
    found = PEAKS.search(output)
    if found is None:
        raise SystemExit(f"no peak memory line in:\n{output}")
    return [float(mib) for mib in found.group(1).split()]

"""What the benchmarks run: pipec and torchrun of this environment, one thread per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPEC = [sys.executable, "-m", "pipec.cli"]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(command: list[str], cwd: Path | None = None, attempts: int = 1) -> str:
    """Run ``command``; its standard output, or exit with everything it printed. With
    ``attempts`` > 1, a failure is reported and the command run again, up to that many times
    in all: one launch out of hundreds failing must not end an hour's benchmark (a long-lm
    plan's torchrun once finished its steps and then aborted at exit: "terminate called
    without an active exception")."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: run at least once")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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

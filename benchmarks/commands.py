"""What the benchmarks run: pipec and torchrun of this environment, one thread per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPEC = [sys.executable, "-m", "pipec.cli"]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(command: list[str], cwd: Path | None = None) -> str:
    """Run ``command``; its standard output, or exit with everything it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout

"""benchmarks/commands.py: what the benchmarks read from the lines a real train.py ends with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from commands import mean_samples_per_s, resident_peaks_mib


def test_the_speed_and_each_ranks_peak_come_from_train_pys_last_lines(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=1, batch_size=8)
    printed = subprocess.run([sys.executable, "train.py", "--steps", "3"], cwd=tmp_path / "out",
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                             capture_output=True, text=True).stdout
    assert mean_samples_per_s(printed) > 0
    peaks = resident_peaks_mib(printed)
    assert len(peaks) == 1 and 0 < peaks[0] < 1024


def test_a_run_without_its_summary_lines_stops_the_benchmark() -> None:
    with pytest.raises(SystemExit, match="no summary line"):
        mean_samples_per_s("step 1 loss 2.3\n")
    with pytest.raises(SystemExit, match="no peak memory line"):
        resident_peaks_mib("done: 3 steps, 10.0 samples/s\n")

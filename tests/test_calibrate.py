"""`pipec profile` and `--calibration`: measured compute times replace the preset's roofline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SAMPLES, compile_to
from pipec.calibrate import _fit, load_calibration, profile_model, save_calibration
from pipec.errors import ConfigError


def test_fit_recovers_known_constants() -> None:
    rng = np.random.default_rng(0)
    features = [(float(f), float(b)) for f, b in rng.uniform(1e3, 1e9, size=(50, 2))]
    seconds = [2e-5 + f * 3e-11 + b * 4e-10 for f, b in features]
    fit = _fit(features, seconds)
    assert fit.overhead_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.seconds_per_flop == pytest.approx(3e-11, rel=1e-6)
    assert fit.seconds_per_byte == pytest.approx(4e-10, rel=1e-6)


def test_fit_never_goes_negative() -> None:
    # Time falls with bytes here: an unconstrained fit would give a negative coefficient.
    features = [(1e6 * i, 1e6 * (10 - i)) for i in range(10)]
    seconds = [1e-3 + 1e-9 * i for i in range(10)]
    fit = _fit(features, seconds)
    assert min(fit.overhead_s, fit.seconds_per_flop, fit.seconds_per_byte) >= 0


def test_profile_measures_every_node_and_round_trips(tmp_path: Path) -> None:
    calibration, samples = profile_model(SAMPLES / "mlp.py", 4, repeats=2)
    assert {s.micro_batch for s in samples} == {1, 2, 4}
    assert len(samples) == 3 * 11 and all(s.fwd_s > 0 for s in samples)
    assert calibration.device == "cpu"
    # The least-squares fit explains the measurements it came from (which coefficient carries
    # the time varies with the machine's noise: FLOPs and bytes grow together in an MLP).
    predicted = sum(calibration.forward.seconds(s.fwd_flops, s.moved_bytes) for s in samples)
    assert 0.5 < predicted / sum(s.fwd_s for s in samples) < 2
    save_calibration(calibration, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == calibration


def test_cli_profile_then_compile_with_calibration(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "pipec.cli"]
    result = subprocess.run([*cli, "profile", str(SAMPLES / "mlp.py"), "--batch-size", "2",
                             "--repeats", "2", "-o", str(tmp_path / "c.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "node timings on cpu" in result.stdout
    default = compile_to(SAMPLES / "mlp.py", tmp_path / "a", gpus=2, batch_size=16)
    calibrated = compile_to(SAMPLES / "mlp.py", tmp_path / "b", gpus=2, batch_size=16,
                            calibration=tmp_path / "c.json")
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["calibration"] == "cpu"
    assert calibrated.stages[0].compute_s != default.stages[0].compute_s


@pytest.mark.parametrize("text", ["not json", '{"device": "cpu"}'])
def test_bad_calibration_file(text: str, tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ConfigError, match="make one with pipec profile"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", calibration=tmp_path / "c.json")


def test_unknown_device() -> None:
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        profile_model(SAMPLES / "mlp.py", 2, device="tpu")

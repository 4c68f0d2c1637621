"""The command line: help, exit codes, one-line user errors without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLES
from pipec.cli import main

PIPEC = [sys.executable, "-m", "pipec.cli"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PIPEC, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_console_script() -> None:
    script = Path(sys.executable).with_name("pipec")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("pipec ")


def test_help() -> None:
    result = run("--help")
    assert result.returncode == 0 and "compile" in result.stdout
    result = run("compile", "--help")
    assert result.returncode == 0
    for flag in ("--gpus", "--nodes", "--batch-size", "--hardware", "--pp", "--micro-batch",
                 "--schedule", "--norm", "--optimizer", "--precision", "--out", "--force"):
        assert flag in result.stdout


def test_compile_succeeds(tmp_path: Path) -> None:
    result = run("compile", str(SAMPLES / "mlp.py"), "--gpus", "2", "-o", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and (tmp_path / "o" / "train.py").is_file()


@pytest.mark.parametrize(("args", "message"), [
    (["missing.py"], "model file missing.py not found"),
    ([str(SAMPLES / "mlp.py"), "--gpus", "3", "--nodes", "2"], "not divisible by --nodes 2"),
    ([str(SAMPLES / "mlp.py"), "--hardware", "abacus"], "unknown hardware 'abacus'"),
    ([str(SAMPLES / "mlp.py"), "--batch-size", "-4"], "must be a positive integer"),
])
def test_user_errors_exit_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = run("compile", *args, "-o", str(tmp_path / "o"), cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "m.py", "--micro-batch", "lots"])
    assert exit_info.value.code == 2
    assert "expected 'auto' or an integer" in capsys.readouterr().err

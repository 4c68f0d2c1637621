"""The command line: help, exit codes, one-line user errors without a traceback."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from conftest import SAMPLES
from pipec.cli import _parser, main
from pipec.driver import CompileOptions, _request
from pipec.errors import ConfigError

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


def compile_parser() -> argparse.ArgumentParser:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["compile"]


def test_every_compile_option_is_one_flag_with_the_same_default() -> None:
    flags = {action.dest: action for action in compile_parser()._actions}
    for option in fields(CompileOptions):
        assert option.name in flags, f"CompileOptions.{option.name} has no flag"
        if option.name not in ("model", "measure"):  # measure: $PIPEC_MEASURE sets its default
            assert flags[option.name].default == option.default, option.name
    assert set(flags) - {f.name for f in fields(CompileOptions)} == {"help", "verbose"}


def test_options_reach_the_plan_request_by_name(tmp_path: Path) -> None:
    args = compile_parser().parse_args([
        str(SAMPLES / "mlp.py"), "--gpus", "4", "--nodes", "2", "--pp", "2", "--batch-size", "8",
        "--schedule", "1f1b", "--recompute", "none", "--fsdp", "off", "--mesh", "pp,dp",
        "--strategy", "torchgpipe", "--margin", "7", "--norm", "group", "--optimizer", "adamw"])
    options = CompileOptions(**{f.name: getattr(args, f.name) for f in fields(CompileOptions)})
    request = _request(options)
    assert (request.gpus, request.nodes, request.pp, request.global_batch) == (4, 2, 2, 8)
    assert (request.schedule, request.recompute, request.fsdp, request.mesh) == (
        "1f1b", "none", "off", "pp,dp")
    assert (request.strategy, request.margin, request.norm) == ("torchgpipe", 0.07, "group")
    assert request.training.optimizer == "adamw" and len(request.devices) == 4


@pytest.mark.parametrize(("change", "message"), [
    ({"gpus": 0}, "--gpus 0: need at least 1 device"),
    ({"nodes": 0}, "not divisible by --nodes 0"),
    ({"pp": 0}, "--pp 0: need at least 1 stage"),
    ({"optimizer": "lion"}, "--optimizer 'lion'"),
    ({"precision": "fp8"}, "--precision 'fp8'"),
    ({"virtual_stages": 1}, "--virtual-stages 1"),
    ({"margin": 1.5}, "--margin 150%"),
    ({"measure": "sometimes"}, "--measure 'sometimes'"),
    ({"hardware": "cpu:3", "gpus": 2}, "lists 3 devices but --gpus is 2"),
])
def test_request_errors(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _request(replace(CompileOptions(model=SAMPLES / "mlp.py"), **change))


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    # `pipec inspect MODEL --tp 2 | head -1`: head closes the pipe after one line.
    result = subprocess.run(f"{sys.executable} -m pipec.cli inspect {SAMPLES / 'gpt.py'} "
                            "--tp 2 | head -1", shell=True, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.startswith("9 of 9 region(s) shard over 2 rank(s)")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr

"""pipec.host_allocator: a process starts again under tcmalloc where the system has it, once,
unless PIPEC_ALLOCATOR says glibc; and tcmalloc's free pages go back to the OS on request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipec import host_allocator

HAS_TCMALLOC = host_allocator.tcmalloc_library() is not None
needs_tcmalloc = pytest.mark.skipif(
    not HAS_TCMALLOC, reason="no tcmalloc on this machine (.ci/run installs libtcmalloc-minimal4)")

# Starts again under tcmalloc where wanted, then prints the allocator it runs with and how many
# times this code ran: once before the new start, once after.
REPORTS_ITS_ALLOCATOR = """
import os
from pipec import host_allocator
os.environ["RUNS"] = str(int(os.environ.get("RUNS", "0")) + 1)
host_allocator.run_under_tcmalloc()
print(host_allocator.running_allocator(), os.environ["RUNS"])
"""

# Holds 256 MiB in 1 MiB blocks, frees them, and prints its anonymous resident MiB then and
# after release_free_memory.
RELEASES_FREE_PAGES = """
from pathlib import Path
from pipec import host_allocator
host_allocator.run_under_tcmalloc()
def resident_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) // 1024
blocks = [bytearray(b"x" * 2**20) for _ in range(256)]
del blocks
freed = resident_mib()
host_allocator.release_free_memory()
print(host_allocator.running_allocator(), freed, resident_mib())
"""


def _run(code: str, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "PIPEC_ALLOCATOR") and not k.startswith("TCMALLOC_")}
    return subprocess.run([sys.executable, "-c", code], env={**env, **environment},
                          capture_output=True, text=True, timeout=60, check=False)


@needs_tcmalloc
def test_a_process_starts_again_under_tcmalloc_once() -> None:
    result = _run(REPORTS_ITS_ALLOCATOR)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tcmalloc", "2"]


@needs_tcmalloc
def test_what_the_user_set_stays() -> None:
    # A library already preloaded stays first; a report threshold already set is kept.
    code = REPORTS_ITS_ALLOCATOR + (
        "print(os.environ['LD_PRELOAD'], os.environ['TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD'])")
    result = _run(code, LD_PRELOAD="libm.so.6", TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD="4096")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "tcmalloc", "2", "libm.so.6", str(host_allocator.tcmalloc_library()), "4096"]


def test_another_allocator_preloaded_is_left_alone() -> None:
    # jemalloc (a name only here: the linker reports it missing) serves malloc when preloaded
    # first; tcmalloc after it would only take its name.
    result = _run(REPORTS_ITS_ALLOCATOR, LD_PRELOAD="libjemalloc-pipec-missing.so.2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["glibc", "1"]


def test_the_command_starts_again_before_anything_else() -> None:
    # `python -m pipec` checks PIPEC_ALLOCATOR (and starts again) before it parses a command.
    env = {**os.environ, "PIPEC_ALLOCATOR": "bogus"}
    result = subprocess.run([sys.executable, "-m", "pipec", "--version"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "PIPEC_ALLOCATOR='bogus'" in result.stderr


def test_glibc_when_asked() -> None:
    result = _run(REPORTS_ITS_ALLOCATOR, PIPEC_ALLOCATOR="glibc")
    assert result.stdout.split() == ["glibc", "1"]


def test_a_library_the_linker_cannot_preload_is_not_tried_again() -> None:
    # The linker reports it and goes on under glibc: one new start, not one per start.
    code = REPORTS_ITS_ALLOCATOR.replace(
        "host_allocator.run_under_tcmalloc()",
        "host_allocator.tcmalloc_library = lambda: 'libpipec-missing.so'\n"
        "host_allocator.run_under_tcmalloc()")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["glibc", "2"]
    assert "libpipec-missing.so" in result.stderr


@pytest.mark.parametrize(("rank", "says"), [("0", True), ("1", False)])
def test_the_first_rank_says_when_there_is_no_tcmalloc(rank: str, says: bool) -> None:
    code = REPORTS_ITS_ALLOCATOR.replace(
        "host_allocator.run_under_tcmalloc()",
        "host_allocator.tcmalloc_library = lambda: None\n"
        "host_allocator.run_under_tcmalloc(say_if_missing=True)")
    result = _run(code, RANK=rank)
    assert result.stdout.split() == ["glibc", "1"]
    assert ("note: no tcmalloc found, so training in glibc's heap" in result.stderr) is says
    assert ("apt install libtcmalloc-minimal4" in result.stderr) is says


def test_an_unknown_choice_is_an_error(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PIPEC_ALLOCATOR", "jemalloc")
    with pytest.raises(SystemExit) as stopped:
        host_allocator.run_under_tcmalloc()
    assert stopped.value.code == 2
    assert "PIPEC_ALLOCATOR='jemalloc': use tcmalloc (the default) or glibc" in (
        capsys.readouterr().err)


@needs_tcmalloc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_tcmalloc_gives_its_free_pages_back_on_request() -> None:
    result = _run(RELEASES_FREE_PAGES)
    assert result.returncode == 0, result.stderr
    allocator, freed, released = result.stdout.split()
    assert allocator == "tcmalloc"
    # tcmalloc keeps the freed 256 MiB for reuse until asked.
    assert int(freed) - int(released) > 200


@pytest.mark.parametrize(("argv", "orig_argv", "again"), [
    (["train.py", "--steps", "3"], ["python", "-u", "train.py", "--steps", "3"], True),
    (["/venv/bin/pipec", "compile"], ["/venv/bin/python", "/venv/bin/pipec", "compile"], True),
    (["/src/pipec/__main__.py", "compile"], ["python", "-m", "pipec", "compile"], True),
    (["/src/pipec/cli.py"], ["python", "-m", "pipec.cli"], True),
    (["-c"], ["python", "-c", "print(1)"], True),
    # A test runner's forked worker running train.py, with and without arguments.
    (["/out/train.py", "--steps", "4"], ["python", "-m", "pytest", "-q"], False),
    (["/out/train.py"], ["python", "-m", "pytest"], False),
    # IPython's %run train.py in a kernel.
    (["train.py"], ["python", "-m", "ipykernel_launcher", "-f", "kernel.json"], False),
    # A program read from stdin (read already), an interactive one, an embedded interpreter.
    (["-"], ["python", "-"], False),
    ([""], ["python"], False),
    (["train.py"], [], False),
])
def test_it_starts_again_only_what_its_command_line_runs(
        argv: list[str], orig_argv: list[str], again: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert host_allocator.started_as_this_program() is again

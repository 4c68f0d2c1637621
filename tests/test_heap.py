"""pipec.heap: pipec measures in the host heap train.py trains in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to
from pipec import heap

HEAP_AFTER_A_PASS = """
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pipec":
    from pipec.heap import keep_freed_memory
    assert keep_freed_memory()
elif sys.argv[1] == "emitted":
    import metrics
    metrics.keep_freed_memory()
before = libc.mallinfo2()
block = torch.empty(4 * 2**20).fill_(1.0)  # 16 MiB, every page written
held = libc.mallinfo2()
del block
freed = libc.mallinfo2()
print(held.hblks - before.hblks, held.arena - freed.arena)
"""


def _heap_after_a_pass(mode: str, cwd: Path | None = None) -> list[int]:
    run = subprocess.run([sys.executable, "-c", HEAP_AFTER_A_PASS, mode], check=True,
                         capture_output=True, text=True, cwd=cwd)
    return [int(word) for word in run.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_pass_keeps_the_memory_it_frees_as_train_py_does(tmp_path: Path) -> None:
    # pipec's measurements and the emitted script (metrics.keep_freed_memory) alike: a 16 MiB
    # block comes from glibc's heap and, freed, stays there for the next pass or step to reuse;
    # glibc's own settings map it apart and give it back to the OS when freed (the next step
    # faults it in again).
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=2, batch_size=8)
    assert _heap_after_a_pass("pipec") == [0, 0]
    assert _heap_after_a_pass("emitted", cwd=tmp_path / "out") == [0, 0]
    assert _heap_after_a_pass("glibc")[0] == 1


def test_the_emitted_script_sets_the_same_heap(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=2, batch_size=8)
    emitted: dict[str, object] = {}
    for line in (tmp_path / "out" / "metrics.py").read_text().splitlines():
        if line.startswith(("M_TRIM_THRESHOLD", "LARGEST_HEAP_BLOCK", "HEAP_GROWTH")):
            exec(line.split("#")[0], {}, emitted)
    assert emitted == {name: getattr(heap, name) for name in (
        "M_TRIM_THRESHOLD", "M_TOP_PAD", "M_MMAP_THRESHOLD", "LARGEST_HEAP_BLOCK",
        "HEAP_GROWTH")}

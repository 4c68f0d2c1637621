"""pipec.calibration.heap: pipec measures in the host heap train.py trains in, and that heap
gives large blocks back to the OS when they are freed while small ones keep their pages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to
from pipec.calibration import heap

# Prints, for a 16 MiB block, another, and then 256 blocks of 64 KiB: the blocks glibc mapped
# apart while they were held, and the heap bytes given back once they were freed.
HEAP_AFTER_A_PASS = """
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pipec":
    from pipec.calibration.heap import set_training_heap
    assert set_training_heap()
elif sys.argv[1] == "emitted":
    import metrics
    metrics.set_training_heap()
for sizes in ([4 * 2**20], [4 * 2**20], [2**14] * 256):  # float32: 16 MiB, 256 x 64 KiB
    before = libc.mallinfo2()
    blocks = [torch.empty(n).fill_(1.0) for n in sizes]  # every page written
    held = libc.mallinfo2()
    del blocks
    freed = libc.mallinfo2()
    print(held.hblks - before.hblks, held.arena - freed.arena)
"""


def _heap_after_a_pass(mode: str, cwd: Path | None = None) -> list[int]:
    run = subprocess.run([sys.executable, "-c", HEAP_AFTER_A_PASS, mode], check=True,
                         capture_output=True, text=True, cwd=cwd)
    return [int(word) for word in run.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_are_mapped_apart_and_small_ones_keep_the_heap(tmp_path: Path) -> None:
    # pipec's measurements and the emitted script alike: each 16 MiB block is mapped apart
    # (unmapped when freed: no heap left holding it), the 64 KiB blocks come from the heap,
    # which keeps their pages once they are freed. Under glibc's own settings the first large
    # block freed raises the threshold to its size: the second comes from the heap, where
    # blocks of that size fragment it.
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=2, batch_size=8)
    assert _heap_after_a_pass("pipec") == [1, 0, 1, 0, 0, 0]
    assert _heap_after_a_pass("emitted", cwd=tmp_path / "out") == [1, 0, 1, 0, 0, 0]
    assert _heap_after_a_pass("glibc")[:4] == [1, 0, 0, 0]


def test_the_emitted_script_sets_the_same_heap(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=2, batch_size=8)
    emitted: dict[str, object] = {}
    for line in (tmp_path / "out" / "metrics.py").read_text().splitlines():
        if line.startswith(("M_TRIM_THRESHOLD", "MAPPED_BLOCK", "HEAP_GROWTH")):
            exec(line.split("#")[0], {}, emitted)
    assert emitted == {name: getattr(heap, name) for name in (
        "M_TRIM_THRESHOLD", "M_TOP_PAD", "M_MMAP_THRESHOLD", "MAPPED_BLOCK", "HEAP_GROWTH")}

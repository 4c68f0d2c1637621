"""The host heap as the emitted train.py runs it on a CPU (its metrics.keep_freed_memory): glibc
serves blocks under 32 MiB from its heap, never trims it and grows it 256 MiB at a time, so a
training step reuses the pages the last one freed instead of faulting them in again. pipec's
measurements (the profile's passes, the runtime probe's forked processes) run the same way,
so that a pass is timed in the heap the training's steps run in."""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
LARGEST_HEAP_BLOCK = 32 * 2**20  # glibc's largest M_MMAP_THRESHOLD
HEAP_GROWTH = 256 * 2**20  # address space: only the pages a pass touches become resident


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's heap as train.py does, once per process; False where the C library is not
    glibc (nothing set)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in (
            (M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK), (M_TRIM_THRESHOLD, 2**31 - 1),
            (M_TOP_PAD, HEAP_GROWTH)))
    except (OSError, AttributeError):
        return False

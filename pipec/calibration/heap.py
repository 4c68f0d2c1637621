"""glibc's heap as the emitted train.py sets it on a CPU where tcmalloc is not found
(pipec.host_allocator; train.py's metrics.set_training_heap), so that pipec's measurements (the
profile's passes, the runtime probe's forked processes) time a pass in the heap the training's
steps run in.

Blocks of 256 KiB or more (MAPPED_BLOCK) get mappings of their own, given back to the OS when
freed, unless the heap's top has room for them; HEAP_GROWTH pads that top, and glibc serves a
block of any size from there. Smaller blocks come from the heap, which is never trimmed, so
each step reuses the pages the last one freed. The pad keeps the steps fast (large blocks reuse
the heap's pages instead of being faulted in afresh) at the price of a heap that fragments: the
resident size can exceed the plan (docs/runtime.md, benchmarks/results/heap_policies.md).
"""

from __future__ import annotations

import ctypes
import functools

from pipec.host_allocator import running_allocator

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MAPPED_BLOCK = 2**18  # blocks of this size or more are mapped apart, unmapped when freed
HEAP_GROWTH = 64 * 2**20  # address space: only the pages a pass touches become resident


@functools.cache
def set_training_heap() -> bool:
    """Set glibc's heap as train.py does, once per process; False under tcmalloc or where the
    C library is not glibc (nothing set)."""
    if running_allocator() == "tcmalloc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in (
            (M_MMAP_THRESHOLD, MAPPED_BLOCK), (M_TRIM_THRESHOLD, 2**31 - 1),
            (M_TOP_PAD, HEAP_GROWTH)))
    except (OSError, AttributeError):
        return False


def heap_settings() -> dict[str, int | str]:
    """What pipec's cached measurements depend on: a pass timed in another heap is stale."""
    return {"allocator": running_allocator(), "mapped_block": MAPPED_BLOCK,
            "heap_growth": HEAP_GROWTH}

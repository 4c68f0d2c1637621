"""The host heap as the emitted train.py runs it on a CPU (its metrics.set_training_heap), so
that pipec's measurements (the profile's passes, the runtime probe's forked processes) time a
pass in the heap the training's steps run in.

glibc serves blocks of 256 KiB or more (MAPPED_BLOCK) with mappings of their own, given back
to the OS when freed, unless the heap's top has room for them: it is padded by HEAP_GROWTH, and
glibc serves a block of any size from there. Smaller ones come from its heap, which it never
trims. The large blocks are
where training's memory goes (activations, logits, gradients); mapped, they hold no memory once
freed, so the resident size follows what is allocated, as the plan counts it. In the heap they
fragment it, and the resident size grows with the steps past the plan. The price is a page
fault per page of every such block (a long-sequence LM's steps ran 28 % slower on a 2-core AMD
EPYC VM), and pipec's profile, run in this same heap, times it (docs/runtime.md). The small
blocks keep their pages from step to step: a trimmed heap would fault them in every step.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MAPPED_BLOCK = 2**18  # blocks of this size or more are mapped apart, unmapped when freed
HEAP_GROWTH = 64 * 2**20  # address space: only the pages a pass touches become resident


@functools.cache
def set_training_heap() -> bool:
    """Set glibc's heap as train.py does, once per process; False where the C library is not
    glibc (nothing set)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in (
            (M_MMAP_THRESHOLD, MAPPED_BLOCK), (M_TRIM_THRESHOLD, 2**31 - 1),
            (M_TOP_PAD, HEAP_GROWTH)))
    except (OSError, AttributeError):
        return False


def heap_settings() -> dict[str, int]:
    """What pipec's cached measurements depend on: a pass timed in another heap is stale."""
    return {"mapped_block": MAPPED_BLOCK, "heap_growth": HEAP_GROWTH}

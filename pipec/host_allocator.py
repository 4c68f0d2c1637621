"""The host allocator of CPU training: gperftools' tcmalloc where the system has it.

glibc's heap cannot both follow the plan and keep the steps fast on a CPU: padded, it serves
large blocks from its top and fragments (resident up to 2.7x the planned peak); unpadded, it maps
each large block apart and faults it in afresh every time (the small models' steps 16-26 %
slower). tcmalloc keeps freed pages for reuse in size-segregated spans, so the resident size
stays near the plan at the padded heap's speed or better (benchmarks/results/heap_policies.md).

A process runs under tcmalloc only if the library is loaded before anything allocates, so
`run_under_tcmalloc` starts the process again with it in LD_PRELOAD. pipec's command line does
this before it measures the model, and the emitted train.py before it imports torch, so the
times pipec measures and the memory train.py holds come from the same allocator. This module
imports nothing outside the standard library: pipec copies it next to train.py as allocator.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

CHOICE = "PIPEC_ALLOCATOR"  # "glibc" keeps glibc's heap; unset or "tcmalloc", tcmalloc if found
# gperftools' allocator without its profilers (Debian and Ubuntu: libtcmalloc-minimal4).
LIBRARY_NAMES = ("tcmalloc_minimal", "tcmalloc")
OTHER_ALLOCATORS = ("jemalloc", "mimalloc", "tcmalloc")  # in LD_PRELOAD already: left alone
# tcmalloc prints a line for each allocation of 1 GiB or more; a large model's weights do that.
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**62)}
INSTALL_HINT = ("install gperftools' tcmalloc (Debian, Ubuntu: apt install libtcmalloc-minimal4) "
                "for a resident size that follows the plan")


def running_allocator() -> str:
    """"tcmalloc" where this Linux process allocates with tcmalloc, else "glibc" on Linux and
    "system" elsewhere (LD_PRELOAD is Linux's)."""
    if not sys.platform.startswith("linux"):
        return "system"
    tcmalloc = hasattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory")
    return "tcmalloc" if tcmalloc else "glibc"


def tcmalloc_library() -> str | None:
    """The name the dynamic linker finds tcmalloc by, or None where the system has none."""
    for name in LIBRARY_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def wanted() -> bool:
    choice = os.environ.get(CHOICE, "tcmalloc")
    if choice not in ("tcmalloc", "glibc"):
        print(f"error: {CHOICE}={choice!r}: use tcmalloc (the default) or glibc",
              file=sys.stderr)
        raise SystemExit(2)
    return choice == "tcmalloc"


def started_as_this_program() -> bool:
    """Whether starting this process again with its own command line runs this program again:
    not so where another program runs it (a test runner's forked worker, IPython's %run)."""
    program, arguments, command = sys.argv[0], sys.argv[1:], sys.orig_argv
    if program in ("", "-") or (arguments and command[-len(arguments):] != arguments):
        return False  # an interactive or piped program (stdin is read already)
    before = command[:len(command) - len(arguments)]
    if not before:
        return False
    if program == "-c":
        return "-c" in before
    if before[-1] == program:  # python [options] SCRIPT, or a console script
        return True
    # python -m MODULE: sys.argv[0] is the module's file, or its package's __main__.py.
    if len(before) < 3 or before[-2] != "-m":
        return False
    module, stem = before[-1].replace(".", os.sep), os.path.splitext(program)[0]
    return stem.endswith((os.sep + module, os.path.join(os.sep + module, "__main__")))


def run_under_tcmalloc(say_if_missing: bool = False) -> None:
    """Start this process again (same pid, same arguments) with tcmalloc preloaded, where it is
    wanted, found, and not yet tried: a library the linker could not preload is not retried.
    With `say_if_missing`, the job's first process says so where the system has none."""
    if not wanted() or running_allocator() != "glibc" or not started_as_this_program():
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name in OTHER_ALLOCATORS):
        return  # the user's choice: the first library preloaded serves malloc
    library = tcmalloc_library()
    if library is None and say_if_missing and os.environ.get("RANK", "0") == "0":
        print(f"note: no tcmalloc found, so training in glibc's heap; {INSTALL_HINT}",
              file=sys.stderr, flush=True)
    if library is None or library in preloaded.split():
        return
    environment = {**QUIET, **os.environ, "LD_PRELOAD": f"{preloaded} {library}".strip()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)


def release_free_memory() -> None:
    """Give the allocator's free pages back to the OS: what is resident afterwards is in use."""
    allocator = running_allocator()
    if allocator == "system":
        return
    process = ctypes.CDLL(None)
    if allocator == "tcmalloc":
        process.MallocExtension_ReleaseFreeMemory()
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(0)

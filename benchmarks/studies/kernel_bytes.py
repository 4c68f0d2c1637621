"""Host bytes the CPU math library keeps per distinct kernel: the `cpu` preset's kernel terms.

oneDNN compiles a kernel for each shape of matrix product or convolution it runs (JIT code and
a cached primitive) and keeps it for the life of the process. On a CPU with AVX512-BF16 or AMX,
every bf16 matrix product goes through it; fp32 matrix products go to a BLAS that keeps
nothing, and convolutions go to oneDNN in either precision. This script runs forwards with
their backward at shapes the process has not seen, with glibc serving blocks of 4 KiB or more
with their own mappings (as train.py --metrics does, so freed tensors leave), and prints the
growth of anonymous resident memory per forward call: matrix products (`F.linear`,
`torch.matmul`), attention (`F.scaled_dot_product_attention`, two products) and convolutions.

    python benchmarks/studies/kernel_bytes.py [--shapes 8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from pipec.cost.hardware import cpu_has_bf16_kernels

MIB = 2**20


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon in /proc/self/status (Linux only)")


def linear(width: int, dtype: torch.dtype) -> None:
    weight = torch.randn(width, 64, dtype=dtype, requires_grad=True)
    x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
    F.linear(x, weight).sum().backward()


def matmul(width: int, dtype: torch.dtype) -> None:
    a = torch.randn(4, 8, width, dtype=dtype, requires_grad=True)
    b = torch.randn(4, width, 8, dtype=dtype, requires_grad=True)
    torch.matmul(a, b).sum().backward()


def attention(length: int, dtype: torch.dtype) -> None:
    q = torch.randn(2, 4, length, 16, dtype=dtype, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def convolution(channels: int, dtype: torch.dtype) -> None:
    weight = torch.randn(channels, 8, 3, 3, dtype=dtype, requires_grad=True)
    x = torch.randn(2, 8, 16, 16, dtype=dtype, requires_grad=True)
    F.conv2d(x, weight, padding=1).sum().backward()


def per_new_shape(run: Callable[[int, torch.dtype], None], dtype: torch.dtype,
                  shapes: int) -> float:
    """Median growth per call at a shape not run before (the first, which loads the library's
    own state, is left out)."""
    run(12, dtype)
    growth = []
    for size in range(16, 16 + 8 * shapes, 8):
        before = resident_bytes()
        run(size, dtype)
        growth.append(resident_bytes() - before)
    return statistics.median(growth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=8, help="new shapes per measurement")
    args = parser.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 4096)  # M_MMAP_THRESHOLD, as train.py --metrics
    torch.manual_seed(0)
    rows = [(name, str(dtype).removeprefix("torch."),
             f"{per_new_shape(run, dtype, args.shapes) / MIB:.2f}")
            for dtype in (torch.float32, torch.bfloat16)
            for name, run in (("linear", linear), ("matmul", matmul),
                              ("attention", attention), ("convolution", convolution))]
    print(f"CPU bf16 kernels (AVX512-BF16 or AMX): {cpu_has_bf16_kernels()}")
    print(tabulate(rows, headers=("forward call", "dtype", "MiB per new shape"),
                   tablefmt="github"))


if __name__ == "__main__":
    main()

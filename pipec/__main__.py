"""`pipec` and `python -m pipec`: on a CPU, pipec measures the model under the allocator train.py
trains with, so the command starts again under tcmalloc (pipec.host_allocator) before torch
loads."""

from __future__ import annotations

from pipec.host_allocator import run_under_tcmalloc


def main() -> int:
    run_under_tcmalloc()
    from pipec.cli import main as run_command  # torch loads here, in the final process

    return run_command()


if __name__ == "__main__":
    raise SystemExit(main())

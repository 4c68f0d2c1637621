"""Byte and time units, and how pipec writes them for people (one way everywhere)."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30


def mib(value: float, digits: int = 1) -> str:
    """``value`` bytes in MiB with thousands separators, without the unit (table cells)."""
    return f"{value / MIB:,.{digits}f}"


def gib(value: float) -> str:
    """``value`` bytes in GiB, with the unit (sentences)."""
    return f"{value / GIB:.2f} GiB"


def duration(seconds: float) -> str:
    """Milliseconds under a second, seconds above, with the unit."""
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def module_list(names: tuple[str, ...], limit: int = 6) -> str:
    """Module names for a table cell or a header line: all of them, or the first few and the
    last with a count of the rest."""
    if len(names) <= limit:
        return ", ".join(names) or "(functions only)"
    return ", ".join(names[:3]) + f", … ({len(names) - 4} more), " + names[-1]

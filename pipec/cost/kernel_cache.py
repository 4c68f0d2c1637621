"""The kernels a CPU's math library compiles and keeps, as the partition DP counts them per
stage (numbers only: pipec.frontend.kernels logs the calls, pipec.cost.model sizes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KernelRuns:
    """The kernels a CPU's math library compiles and keeps (pipec.frontend.kernels), one entry
    per call in graph order: the node that runs it, the node of the same call's run before (−1:
    none) and its bytes. A stage holds each distinct call's once: the runs in its span whose run
    before lies outside it."""

    position: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    previous: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    call: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))  # equal: one kernel

    @classmethod
    def of(cls, position: list[int], call: list[object], nbytes: list[float]) -> KernelRuns:
        """From each run's node (ascending), its call (equal calls share a kernel), bytes."""
        last: dict[object, int] = {}
        previous = []
        for node, c in zip(position, call, strict=True):
            previous.append(last.get(c, -1))
            last[c] = node
        ids = {c: i for i, c in enumerate(dict.fromkeys(call))}
        return cls(np.array(position, dtype=int), np.array(previous, dtype=int),
                   np.array(nbytes, dtype=float), np.array([ids[c] for c in call], dtype=int))

    @property
    def held(self) -> bool:
        return bool(self.bytes.any())

    def row(self, start: int) -> np.ndarray:
        """Per run count c, the bytes of a span from ``start`` over the first c runs: summed
        in graph order, as every caller rounds."""
        first = (self.position >= start) & (self.previous < start)
        return np.concatenate(([0.0], np.cumsum(np.where(first, self.bytes, 0.0))))

    def span_bytes(self, start: int, end: int) -> float:
        if not self.held:
            return 0.0
        return float(self.row(start)[np.searchsorted(self.position, end)])

    def calls(self, start: int, end: int) -> set[int]:
        """The distinct calls run in nodes [start, end)."""
        return set(self.call[(self.position >= start) & (self.position < end)].tolist())

    def bytes_of(self, calls: set[int]) -> float:
        """The bytes the kernels of ``calls`` keep, each once."""
        first = np.unique(self.call, return_index=True)[1]
        return float(sum(self.bytes[i] for i in first if int(self.call[i]) in calls))

    def between(self, cuts: np.ndarray) -> np.ndarray:
        """span_bytes(cuts[a], cuts[b]) for every pair of cuts, as a matrix [a, b]."""
        if not self.held:
            return np.zeros((len(cuts), len(cuts)))
        runs = np.searchsorted(self.position, cuts)
        return np.stack([self.row(int(c))[runs] for c in cuts])

"""Is a plan measured faster than pipec's pick, or is that the machine's noise? A sign test on
the pairs of launches that benchmarks/fidelity.py ran next to each other.

Each pair gives a ratio: the plan's step ÷ the pick's, launched one after the other. If the
plan's true ratio were at the threshold or above, each pair would land below it with chance at
most one half, whatever the machine's noise looks like (the sign test: no assumption on its
distribution, only that pairs are independent). The p-value is the chance of at least as many
pairs below the threshold as were measured. With 6 pairs all below, p = 1/64 = 1.6 %; with 2
pairs (the rounds alone) it is at least 25 %: two pairs can never show a miss is real.

A verdict is "met" where the point estimate (the median pair) meets the target, "missed" where
it does not and p ≤ SIGNIFICANT, and "within noise" otherwise. Over the many plans of a run,
some verdicts at 5 % are wrong by chance: the figures, not the labels, are the evidence.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

SIGNIFICANT = 0.05  # one-sided


@dataclass(frozen=True)
class Verdict:
    """One target in one case: met, missed or within noise, and the evidence for it."""

    outcome: str  # "met", "missed" or "within noise"
    ratio: float  # the plan's step ÷ the pick's (median pair); 1.0 where no plan is compared
    below: int  # pairs below the threshold
    pairs: int
    p: float  # sign test; 1.0 where the target is met

    def describe(self) -> str:
        if self.outcome == "met":
            return "met"
        return (f"{self.outcome}: {self.ratio:.3f}, {self.below} of {self.pairs} pairs below, "
                f"p = {self.p:.3f}")


def sign_p(paired: list[float], threshold: float) -> float:
    """The chance that at least as many of ``paired`` fall below ``threshold`` as did, were
    each pair a fair coin (one-sided sign test)."""
    n, below = len(paired), sum(r < threshold for r in paired)
    return sum(math.comb(n, k) for k in range(below, n + 1)) / 2 ** n


def judged(paired: list[float], threshold: float) -> Verdict:
    """Whether a plan's median pair below ``threshold`` (faster than the target allows) is
    more than noise."""
    ratio = statistics.median(paired)
    below = sum(r < threshold for r in paired)
    if ratio >= threshold:
        return Verdict("met", ratio, below, len(paired), 1.0)
    p = sign_p(paired, threshold)
    return Verdict("missed" if p <= SIGNIFICANT else "within noise", ratio, below,
                   len(paired), p)


def regret_verdict(plans: list[dict[str, Any]], target_regret: float) -> Verdict:
    """Regret ≤ the target: no plan measured faster than the pick by more than it. The plan
    with the strongest evidence against the target decides (the smallest p)."""
    threshold = 1 / (1 + target_regret)
    verdicts = [judged(p["paired"], threshold) for p in plans if "pipec" not in p["roles"]]
    return min(verdicts, key=_strength, default=Verdict("met", 1.0, 0, 0, 1.0))


def baseline_verdicts(plans: list[dict[str, Any]], baselines: tuple[str, ...]
                      ) -> dict[str, Verdict]:
    """The pick measured at least as fast as each baseline (the threshold is 1)."""
    return {role: judged(p["paired"], 1.0) for p in plans if "pipec" not in p["roles"]
            for role in p["roles"] if role in baselines}


def worst(verdicts: list[Verdict]) -> Verdict:
    return min(verdicts, key=_strength, default=Verdict("met", 1.0, 0, 0, 1.0))


def _strength(v: Verdict) -> tuple[int, float, float]:
    """Missed before within noise before met; then the smaller p, then the faster plan."""
    return ({"missed": 0, "within noise": 1, "met": 2}[v.outcome], v.p, v.ratio)

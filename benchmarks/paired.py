"""Is a plan measured faster than pipec's pick, or is that the machine's noise? A sign test on
the pairs of launches that benchmarks/fidelity.py ran next to each other.

Each pair gives a ratio: the plan's step ÷ the pick's, launched one after the other. If the
plan's true ratio were at the threshold or above, each pair would land below it with chance at
most one half, whatever the machine's noise looks like (the sign test: no assumption on its
distribution, only that pairs are independent). The p-value is the chance of at least as many
pairs below the threshold as were measured: 6 of 6 below, 1/64 = 1.6 %; 4 of 4, 6.25 %.

The test counts only the duel's pairs: the rounds' pairs chose which plans to duel (those whose
median pair lay below the threshold), so counting them too would make every dueled plan look
surer than it is. A plan not dueled has only the rounds' pairs, 2 by default, which never show
a miss (25 % at best). A verdict is "met" where the median of all the plan's pairs (the figure
fidelity.py reports) meets the target, "missed" where it does not and p ≤ SIGNIFICANT, and
"within noise" otherwise. A case's regret takes the strongest evidence over its plans, with no
correction for testing several: over a run's dozens of comparisons a few verdicts at 5 % are
wrong by chance, and the figures, not the labels, are the evidence.

A duel may come in stages: fidelity.py's `--extend` pairs follow `--duels` only where the first
stage left a verdict within noise. Pooling both stages as one fixed sample gives the plan two
chances to look significant; staged_sign_p counts the two looks as such (the stagewise ordering
of a group-sequential test), so a verdict "missed" still errs at most 5 % of the time when the
plan is truly at the threshold, whatever the stages' sizes. At fidelity.py's 6 then 10 both ways
need 12 of 16 below (the discreteness leaves room); at 8 then 8 pooling would need 12 and err
6.0 % of the time, the staged test 13 (4.0 %). A look that rejects decides: later pairs, run for
the plan's other verdict, do not undo it.
"""

from __future__ import annotations

import itertools
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
    each pair a fair coin (one-sided sign test). A pair exactly at the threshold counts as not
    below and stays in n, which can only make p larger."""
    n, below = len(paired), sum(r < threshold for r in paired)
    return sum(math.comb(n, k) for k in range(below, n + 1)) / 2 ** n


def staged_sign_p(tested: list[float], threshold: float, stages: list[int]
                  ) -> tuple[float, int]:
    """The one-sided sign test over pairs taken in ``stages``, each stage run only where the
    looks before did not reject: the chance, were each pair a fair coin, of rejecting at an
    earlier look or of reaching this one with at least as many below as measured (stagewise
    ordering: Jennison & Turnbull, Group Sequential Methods with Applications to Clinical
    Trials, 2000, §8.4); and the pairs seen at the look that decided (the first that rejects,
    else the last). One stage is sign_p."""
    running = [1.0]  # chance of each count below so far, on the paths not yet rejected
    spent = 0.0
    for look, seen in enumerate(itertools.accumulate(stages)):
        running = _plus_fair_coins(running, stages[look])
        p = spent + sum(running[sum(r < threshold for r in tested[:seen]):])
        if look == len(stages) - 1 or p <= SIGNIFICANT:
            return p, seen
        critical = next(k for k in range(len(running) + 1)
                        if spent + sum(running[k:]) <= SIGNIFICANT)
        spent += sum(running[critical:])
        running = running[:critical]
    return 1.0, 0  # no stages: nothing tested


def _plus_fair_coins(counts: list[float], n: int) -> list[float]:
    """The distribution of a count after ``n`` more fair coins (a convolution)."""
    coins = [math.comb(n, k) / 2 ** n for k in range(n + 1)]
    return [sum(counts[i] * coins[k - i] for i in range(len(counts)) if 0 <= k - i <= n)
            for k in range(len(counts) + n)]


def judged(paired: list[float], threshold: float, rounds: int,
           stages: list[int] | None = None) -> Verdict:
    """Whether a plan's median pair below ``threshold`` (faster than the target allows) is
    more than noise, tested on the pairs after the first ``rounds`` (those that chose to duel
    it), in the duel's ``stages`` (one stage where not recorded: runs before the twenty-first
    session's), or on all of them where it was not dueled."""
    tested = paired[rounds:] or paired
    if not stages:
        stages = [len(tested)]
    if sum(stages) != len(tested):
        raise ValueError(f"duel stages {stages} do not add up to the {len(tested)} pairs "
                         "after the rounds")
    p, seen = staged_sign_p(tested, threshold, stages)
    if seen < len(tested):  # an earlier look rejected: its pairs are the verdict's
        return Verdict("missed", statistics.median(paired[:len(paired) - len(tested) + seen]),
                       sum(r < threshold for r in tested[:seen]), seen, p)
    ratio = statistics.median(paired)
    below = sum(r < threshold for r in tested)
    if ratio >= threshold:
        return Verdict("met", ratio, below, len(tested), 1.0)
    return Verdict("missed" if p <= SIGNIFICANT else "within noise", ratio, below,
                   len(tested), p)


def regret_threshold(target_regret: float) -> float:
    """The step ratio to the pick below which a plan's samples/s beat the pick's by more than
    ``target_regret``."""
    return 1 / (1 + target_regret)


def regret_verdict(plans: list[dict[str, Any]], target_regret: float) -> Verdict:
    """Regret ≤ the target: no plan measured faster than the pick by more than it. The plan
    with the strongest evidence against the target decides (the smallest p)."""
    rounds = _rounds(plans)
    verdicts = [judged(p["paired"], regret_threshold(target_regret), rounds,
                       p.get("duel_stages")) for p in plans if "pipec" not in p["roles"]]
    return worst(verdicts)


def baseline_verdicts(plans: list[dict[str, Any]], baselines: tuple[str, ...]
                      ) -> dict[str, Verdict]:
    """The pick measured at least as fast as each baseline (the threshold is 1)."""
    rounds = _rounds(plans)
    return {role: judged(p["paired"], 1.0, rounds, p.get("duel_stages")) for p in plans
            if "pipec" not in p["roles"] for role in p["roles"] if role in baselines}


def _rounds(plans: list[dict[str, Any]]) -> int:
    """The rounds every plan ran: the pick's own pairs (a duel adds pairs to its rival only)."""
    return len(next(p["paired"] for p in plans if "pipec" in p["roles"]))


def worst(verdicts: list[Verdict]) -> Verdict:
    return min(verdicts, key=_strength, default=Verdict("met", 1.0, 0, 0, 1.0))


def _strength(v: Verdict) -> tuple[int, float, float]:
    """Missed before within noise before met; then the smaller p, then the faster plan."""
    return ({"missed": 0, "within noise": 1, "met": 2}[v.outcome], v.p, v.ratio)

"""Which of two compiled plans trains faster here? Their train.py launched in turns, one pair at
a time, who goes first alternating; each launch times about `--timed-s` seconds of steps.

A fidelity run's verdict "within noise" is a rival within a few per cent of the pick whose six
pairs fell on both sides; this tests one such pair of plans alone over `--pairs` pairs (the
twentieth session's 4-process GPT: the split at node 64, 5 of 6 pairs below the pick at 65,
then at 66, in two runs; against 66 alone, 1.002 over 10 pairs). Both directories come from
`pipec compile` (pin a plan with `--pp`, `--micro-batch`, `--schedule`, `--boundaries`, ...)
and must train on the same number of processes. It prints each pair and then the median ratio
(A's step ÷ B's) and a two-sided sign test (benchmarks/paired.py): the chance of pairs at
least this lopsided if neither plan were faster.

    python benchmarks/studies/duel.py OUT_A OUT_B [--pairs 10] [--timed-s 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from fidelity import launch
from paired import sign_p

MIN_STEPS = 10  # as fidelity.py's --steps: a slow plan still times several steps


def processes(out: Path) -> int:
    """The processes a compiled plan trains on (pp × dp), or exit with what is wrong."""
    try:
        plan = json.loads((out / "plan.json").read_text())
        return int(plan["pp"]) * int(plan["dp"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{out}: no readable plan.json ({exc!r}); give a `pipec compile` "
                         "output directory") from None


def verdict(ratios: list[float]) -> str:
    """The median ratio, how many pairs fell below 1, and the two-sided sign test's p."""
    below = sum(r < 1 for r in ratios)
    above = sum(r > 1 for r in ratios)
    lopsided = ratios if below >= above else [1 / r for r in ratios]
    p = min(1.0, 2 * sign_p(lopsided, 1.0))
    return (f"A ÷ B: median {statistics.median(ratios):.3f} over {len(ratios)} pairs "
            f"({min(ratios):.3f}–{max(ratios):.3f}), {below} below 1, {above} above; "
            f"two-sided sign test p = {p:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="a pipec compile output directory")
    parser.add_argument("b", type=Path, help="another, for the same number of processes")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--timed-s", type=float, default=5.0)
    args = parser.parse_args()
    if args.pairs < 1 or args.timed_s <= 0:
        raise SystemExit(f"--pairs {args.pairs} --timed-s {args.timed_s}: give at least 1 pair "
                         "and a positive time")
    count, other = processes(args.a), processes(args.b)
    if other != count:
        raise SystemExit(f"{args.a} trains on {count} processes, {args.b} on {other}: compile "
                         "both for the same --gpus")
    ratios = []
    for pair in range(args.pairs):
        a_first = pair % 2 == 0
        order = (args.a, args.b) if a_first else (args.b, args.a)
        # A list, not a dict by directory: a plan dueled against itself measures the noise.
        first, second = (float(launch(out, count, MIN_STEPS, args.timed_s)["step_s"])
                         for out in order)
        a_s, b_s = (first, second) if a_first else (second, first)
        ratios.append(a_s / b_s)
        print(f"pair {pair + 1}: A {a_s * 1e3:.2f} ms, B {b_s * 1e3:.2f} ms, "
              f"A ÷ B {ratios[-1]:.3f}", flush=True)
    print(verdict(ratios))


if __name__ == "__main__":
    main()

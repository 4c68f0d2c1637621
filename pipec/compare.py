"""`pipec compare OUT METRICS`: the plan's predictions against a run's measured metrics, stage by
stage, and which assumption of the cost model is off."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pipec.codegen.plan_file import plan_id
from pipec.critical import Breakdown, mean_breakdown
from pipec.errors import MetricsError
from pipec.units import mib

# A prediction within this factor of the measurement is taken as holding.
TOLERANCE = 1.25
# Stages whose measured-to-predicted ratios differ by more than this factor are misbalanced.
SPREAD = 1.3
# Measured idle time above the predicted bubble by more than this fraction of the step.
EXTRA_IDLE = 0.10
# A device's measured peak memory within this fraction of the prediction holds: what is
# allocated; or, measured under tcmalloc, what it holds, its free memory included.
MEMORY_TOLERANCE = 0.15
RESIDENT_TOLERANCE = 0.20
# The critical path's waits (for inputs and between its own actions) above this share of the
# step are reported.
WAITS = 0.10


@dataclass(frozen=True)
class StageComparison:
    index: int
    device: int
    predicted_fwd_s: float
    measured_fwd_s: float
    predicted_bwd_s: float
    measured_bwd_s: float

    @property
    def ratio(self) -> float:
        """Measured ÷ predicted compute (forward + backward) per micro-batch."""
        return (self.measured_fwd_s + self.measured_bwd_s) / max(
            self.predicted_fwd_s + self.predicted_bwd_s, 1e-12)


@dataclass(frozen=True)
class Comparison:
    stages: tuple[StageComparison, ...]
    predicted_step_s: float
    measured_step_s: float
    predicted_bubble: float  # fraction of the step
    measured_idle: float  # fraction of the step, mean over ranks
    predicted_memory: tuple[float, ...]  # per pipeline device
    measured_memory: tuple[float | None, ...]  # per pipeline device, the largest over replicas
    device_type: str
    findings: tuple[str, ...]
    calibrated: bool = False  # the plan's compute times came from `pipec profile`
    # Per pipeline device, the predicted peak by term (plan.json predicted.memory_terms).
    memory_terms: tuple[dict[str, float], ...] = ()
    # The steps were timed while memory was measured (a short CPU run): slower than training.
    timed_under_memory: bool = False
    # The measured steps' critical path (pipec.critical), where metrics.json has timelines.
    path: Breakdown | None = None
    predicted_outside_s: float = 0.0  # plan.json's step terms: the step beyond its schedule
    host_allocator: str = ""  # on a CPU, the allocator the run had (metrics.json)


def compare(out: Path, metrics_path: Path) -> Comparison:
    plan, metrics = _read(out / "plan.json"), _read(metrics_path)
    if metrics.get("plan") != plan_id(plan):
        raise MetricsError(f"{metrics_path} was measured on another plan than {out}/plan.json; "
                           f"run {out}/train.py --metrics FILE and compare that file")
    try:
        return _compare(plan, metrics)
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
        raise MetricsError(f"{metrics_path} is not a complete metrics file ({exc!r}); "
                           "write it again with train.py --metrics") from None


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise MetricsError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise MetricsError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MetricsError(f"{path} is not a JSON object")
    return data


def _compare(plan: dict[str, Any], metrics: dict[str, Any]) -> Comparison:
    stages = tuple(StageComparison(p["index"], p["device"], p["fwd_s"], m["forward_s"],
                                   p["bwd_s"], m["backward_s"])
                   for p, m in zip(plan["stages"], metrics["stages"], strict=True))
    step = metrics["step_s"]
    idle = sum(r["idle_s"] for r in metrics["ranks"]) / len(metrics["ranks"]) / step
    memory = tuple(_largest([r["peak_memory_bytes"] for r in metrics["ranks"]
                             if r["device"] == d]) for d in range(plan["pp"]))
    comparison = Comparison(stages, plan["predicted"]["iteration_s"], step,
                            plan["predicted"]["bubble"], idle,
                            tuple(plan["predicted"]["peak_memory_bytes"]), memory,
                            metrics["device_type"], (), plan.get("calibration") is not None,
                            tuple(plan["predicted"].get("memory_terms", ())),
                            any(r.get("time_measure", "").startswith("steps slowed")
                                for r in metrics["ranks"]),
                            mean_breakdown(metrics.get("timelines", []), len(plan["stages"])),
                            sum(plan["predicted"].get("step_terms", {}).values()),
                            str(metrics["ranks"][0].get("host_allocator", "")))
    return Comparison(**{**comparison.__dict__, "findings": findings(comparison)})


def _largest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def findings(c: Comparison) -> tuple[str, ...]:
    """Which assumption is off, most basic first."""
    found = []
    if c.timed_under_memory:
        found.append("timing: these steps were timed while memory was measured, which slows "
                     "a CPU run (glibc maps every large block afresh); run train.py --metrics "
                     "for more than 4 steps to time the steps after the memory measurement")
    predicted = sum(s.predicted_fwd_s + s.predicted_bwd_s for s in c.stages)
    measured = sum(s.measured_fwd_s + s.measured_bwd_s for s in c.stages)
    overall = measured / max(predicted, 1e-12)
    if not 1 / TOLERANCE <= overall <= TOLERANCE:
        found.append(f"compute: the stages take {overall:.2f}× the predicted time overall; "
                     + _speed_advice(c))
    ratios = [s.ratio for s in c.stages]
    if len(ratios) > 1 and max(ratios) / min(ratios) > SPREAD:
        slow = max(c.stages, key=lambda s: s.ratio)
        fast = min(c.stages, key=lambda s: s.ratio)
        found.append(f"balance: stage {slow.index} runs {slow.ratio:.2f}× its prediction, stage "
                     f"{fast.index} {fast.ratio:.2f}×; the time model misjudges some kinds of "
                     "node, so the boundaries are off: calibrate with `pipec profile`")
    if c.measured_idle - c.predicted_bubble > EXTRA_IDLE:
        found.append(f"communication: devices idle {c.measured_idle:.0%} of the step against a "
                     f"predicted bubble of {c.predicted_bubble:.0%}; the links are slower (or "
                     "their latency higher) than the hardware preset says, or the optimizer step "
                     "and gradient all-reduce cost more")
    if c.path is not None and c.path.input_waits_s + c.path.between_s > WAITS * c.path.step_s:
        found.append(_waits_finding(c.path))
    tolerance = RESIDENT_TOLERANCE if c.host_allocator == "tcmalloc" else MEMORY_TOLERANCE
    for device, (p, m) in enumerate(zip(c.predicted_memory, c.measured_memory, strict=True)):
        if m is not None and abs(m / max(p, 1.0) - 1) > tolerance:
            terms = c.memory_terms[device] if device < len(c.memory_terms) else {}
            found.append(_memory_finding(device, p, m, terms, c.device_type)
                         + (UNDER_TCMALLOC if c.host_allocator == "tcmalloc" else ""))
    return tuple(found) or (f"the predictions hold: time within {TOLERANCE:.2f}×, memory "
                            f"within ±{tolerance:.0%}",)


UNDER_TCMALLOC = (" (measured under tcmalloc, whose free memory counts too: run train.py "
                  "--metrics with PIPEC_ALLOCATOR=glibc to measure what is allocated)")
# What the model is known not to count, by device type (docs/cost-model.md).
UNCOUNTED = {"cpu": "many small tensors' allocations rounded up to whole pages, or an "
                    "operator's scratch memory",
             "cuda": "cuDNN's convolution workspaces, or memory the allocator reserves"}


def _memory_finding(device: int, predicted: float, measured: float,
                    terms: dict[str, float], device_type: str) -> str:
    """Name the predicted term whose size is nearest the gap: the likeliest to be missing (when
    measured is above) or counted twice (below)."""
    gap = measured - predicted
    line = (f"memory: device {device} peaked at {mib(measured)} MiB against "
            f"{mib(predicted)} MiB predicted ({gap / max(predicted, 1.0):+.0%})")
    sized = {t: v for t, v in terms.items() if v > 0}
    if not sized:
        return line
    listed = "; terms: " + ", ".join(f"{t} {mib(v)}" for t, v in sorted(
        sized.items(), key=lambda tv: -tv[1]))
    if gap > max(sized.values()):
        known = UNCOUNTED.get(device_type, "")
        return (f"{line}; the gap, {mib(gap)} MiB, is larger than any predicted term: memory "
                f"the model does not count ({known + '; ' if known else ''}see "
                "docs/cost-model.md)" + listed)
    term = min(sized, key=lambda t: abs(sized[t] - abs(gap)))
    direction = "missing or undercounted" if gap > 0 else "overcounted"
    return (f"{line}; the gap, {mib(abs(gap))} MiB, is nearest the '{term}' term "
            f"({mib(sized[term])} MiB): likely {direction}" + listed)


def _waits_finding(path: Breakdown) -> str:
    hop = path.input_waits_s / path.hops if path.hops else 0.0
    return (f"waits: the critical path of a step waited {_ms(path.input_waits_s)} ms for other "
            f"devices' outputs ({path.hops} hops, {_ms(hop)} ms each) and {_ms(path.between_s)} "
            f"ms between its own actions, {(path.input_waits_s + path.between_s) / path.step_s:.0%}"
            " of the step: the transfers and the runtime between actions cost more than the "
            "links, the time per action and the late receives the model charges "
            "(docs/runtime.md)")


def _speed_advice(c: Comparison) -> str:
    if c.calibrated:
        return ("the plan is already calibrated, so the device ran at another speed than when "
                "it was profiled: profile again under the training's load and OMP_NUM_THREADS")
    return (f"the device's speed is off: run `pipec profile MODEL --device {c.device_type}` and "
            "compile with --calibration")


def render(c: Comparison) -> str:
    rows = [(s.index, s.device, _ms(s.predicted_fwd_s), _ms(s.measured_fwd_s),
             _ms(s.predicted_bwd_s), _ms(s.measured_bwd_s), f"{s.ratio:.2f}") for s in c.stages]
    table = tabulate(rows, ("stage", "device", "predicted fwd ms", "measured fwd ms",
                            "predicted bwd ms", "measured bwd ms", "measured ÷ predicted"),
                     tablefmt="github")
    totals = tabulate([
        ("step time ms", _ms(c.predicted_step_s), _ms(c.measured_step_s),
         f"{c.measured_step_s / c.predicted_step_s:.2f}"),
        ("idle (bubble) %", f"{c.predicted_bubble:.1%}", f"{c.measured_idle:.1%}", ""),
        *[(f"peak memory MiB, device {d}", mib(p),
           "n/a" if m is None else mib(m),
           "" if m is None else f"{m / max(p, 1.0):.2f}")
          for d, (p, m) in enumerate(zip(c.predicted_memory, c.measured_memory, strict=True))],
    ], ("", "predicted", "measured", "measured ÷ predicted"), tablefmt="github")
    notes = "\n".join(f"- {line}" for line in c.findings)
    return f"{table}\n\n{totals}\n\n{_path_table(c)}Findings:\n{notes}\n"


def _path_table(c: Comparison) -> str:
    """The measured critical path, part by part, against the predicted step's split between
    its schedule and what comes after it; empty without timelines."""
    if c.path is None:
        return ""
    path = c.path
    predicted = {"after the last action": c.predicted_outside_s}
    rows = [(part, _ms(seconds), f"{seconds / path.step_s:.1%}",
             _ms(predicted[part]) if part in predicted else "")
            for part, seconds in path.parts().items()]
    rows.append(("step", _ms(path.step_s), "100.0%", _ms(c.predicted_step_s)))
    table = tabulate(rows, ("critical path, mean of a step", "measured ms", "of the step",
                            "predicted ms"), tablefmt="github")
    return (f"{table}\n\nThe path: {path.actions} actions, {path.hops} waits for another "
            "device's output; predicted, the schedule takes "
            f"{_ms(c.predicted_step_s - c.predicted_outside_s)} ms and the step's all-reduce, "
            "optimizer, data and runtime terms the rest.\n\n")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if math.isfinite(seconds) else "n/a"

"""The partition report's tables (tabulate) and the schedule timeline (SVG)."""

from __future__ import annotations

import math
from html import escape

from tabulate import tabulate

from pipec.frontend.fakedevice import short_read
from pipec.frontend.normalization import NormPlan
from pipec.planning.planner import Plan
from pipec.planning.simulate import Simulation
from pipec.units import duration, mib, module_list

TOP_CANDIDATES = 10


def stage_table(plan: Plan) -> str:
    rows = [(s.index, s.device, module_list(s.modules), f"{s.params:,}", f"{s.fwd_flops / 1e9:.3f}",
             mib(s.activation_bytes, 2), mib(s.memory_bytes, 1),
             f"{s.time_s * 1e3:.3f}", mib(s.boundary_bytes, 3),
             "no" if s.recompute == "none" else s.recompute) for s in plan.stages]
    headers = ("stage", "device", "modules", "params", "fwd GFLOP / micro-batch", "activations MiB",
               "peak memory MiB", "time ms / micro-batch", "boundary MiB", "recomputes")
    return tabulate(rows, headers, tablefmt="github")


def search_table(plan: Plan) -> str:
    """The fastest candidates that fit, then the fastest that do not (if any)."""
    fits = sorted((c for c in plan.candidates if c.feasible), key=lambda c: -c.samples_per_s)
    too_big = sorted((c for c in plan.candidates if not c.feasible),
                     key=lambda c: -c.samples_per_s)
    ranked = fits[:TOP_CANDIDATES] + too_big[:3]
    rows = [(c.micro_batch, c.num_micro_batches, _schedule_label(c.schedule, c.virtual_stages),
             f"{c.pp}×{c.dp}" + ("" if c.fsdp == "off" else f" {c.fsdp}"),
             f"{c.samples_per_s:,.1f}", mib(c.peak_memory_bytes, 1),
             "yes" if c.feasible else "no") for c in ranked]
    headers = ("micro-batch", "micro-batches", "schedule", "pp×dp", "samples/s",
               "peak memory MiB", "fits")
    return tabulate(rows, headers, tablefmt="github")


def device_text(device: str, reads: tuple[str, ...]) -> str:
    """The report's note on code that read a tensor's device while the model was traced: the
    graph holds the branches a run on the traced device takes (pipec.frontend.fakedevice)."""
    if not reads:
        return ""
    places = ", ".join(f"`{short_read(r)}`" for r in reads[:3]) + (
        f" and {len(reads) - 3} more" if len(reads) > 3 else "")
    where = f"{len(reads)} place(s) ({places})"
    if device == "meta":
        return (f"The model reads a tensor's device at {where}. No GPU is visible here, so the "
                "model was traced on meta tensors: code that branches on the device took its "
                "non-CPU path, as on CUDA unless it tests for another device type; compile on "
                "a machine with a GPU to trace on CUDA.")
    return (f"The model reads a tensor's device at {where}: it was traced on {device}, the "
            f"device this plan trains on, so the graph holds the branches a {device} run "
            "takes; compile again for another device type.")


def decision_text(plan: Plan) -> str:
    """Why this plan and not the runner-up: their predicted margin against the model's error."""
    pinned = plan.request.boundaries
    return (f"Stage boundaries pinned at nodes {', '.join(map(str, pinned))} by --boundaries; "
            "the baselines are not candidates. " if pinned else "") + _choice_text(plan)


def _choice_text(plan: Plan) -> str:
    decision = plan.decision
    if decision is None:
        return f"Emitted as `--strategy {plan.request.strategy}` asked."
    margin = f"the time model's measured error, ±{decision.margin:.1%} (docs/fidelity.md)"
    runner = decision.runner_up
    if runner is None:
        return (f"No other plan fits what was asked. A more complex plan would have to win by "
                f"more than {margin}.")
    label = (f"{runner.pp}×{runner.dp}, micro-batch {runner.micro_batch}, "
             f"{_schedule_label(runner.schedule, runner.virtual_stages)}"
             f"{'' if runner.fsdp == 'off' else ', FSDP ' + runner.fsdp}")
    if decision.kept_simpler:
        return (f"Runner-up: {label}, predicted {-decision.runner_up_relative:.1%} faster but more "
                f"complex than a plan within {margin} of it; of the simplest plans within that "
                "margin, this one is predicted fastest.")
    return (f"Runner-up: {label}, predicted {decision.runner_up_relative:.1%} slower. A more "
            f"complex plan wins only by more than {margin}.")


def _schedule_label(schedule: str, virtual_stages: int) -> str:
    return f"{schedule} (v={virtual_stages})" if virtual_stages > 1 else schedule


def baseline_table(plan: Plan) -> str:
    rows = [("pipec", plan.micro_batch, _schedule_label(plan.schedule, plan.virtual_stages),
             f"{plan.samples_per_s:,.1f}", "yes", "1.00")]
    rows += [(b.strategy, b.micro_batch, b.schedule, f"{b.samples_per_s:,.1f}",
              "yes" if b.feasible else "no", f"{plan.samples_per_s / b.samples_per_s:.2f}")
             for b in plan.baselines]
    headers = ("method", "micro-batch", "schedule", "samples/s", "fits", "pipec ÷ method")
    return tabulate(rows, headers, tablefmt="github")


def max_batch_table(plan: Plan) -> str:
    """The largest global batch each method trains within memory; `≥ limit` when memory does
    not bound it (1F1B holds at most pp micro-batches whatever the batch)."""
    conventional = plan.max_batch[-1].batch
    rows = [(m.strategy, f"≥ {m.batch:,}" if m.capped else f"{m.batch:,}",
             f"{m.batch / conventional:.2f}{'+' if m.capped else ''}" if conventional else "—")
            for m in plan.max_batch]
    return tabulate(rows, ("method", "max global batch", "÷ conventional"), tablefmt="github")


def norm_table(norms: NormPlan, plan: Plan) -> str:
    if not norms.rewrites:
        return "No normalization layer rewritten."
    rows = [(r.module, r.from_, f"GroupNorm({r.groups}, {r.channels})" if r.groups else
             f"{r.to}({r.channels}) over the data-parallel group") for r in norms.rewrites]
    return tabulate(rows, ("module", "from", "to"), tablefmt="github") + _synchronized(plan)


def _synchronized(plan: Plan) -> str:
    """What the synchronized BatchNorms' all-reduces cost a step, and how it was modelled."""
    if plan.synchronized_norm_s <= 0:
        return ""
    devices = plan.request.devices  # the figures plan.json gives, the slowest device's
    latency = max(d.blocking_collective_s for d in devices)
    drift = max(d.blocking_drift for d in devices)
    how = "each the all-reduce's latency and the wait of one after compute"
    if latency or drift:
        per_root_ms = drift / math.sqrt(1000)  # seconds per √millisecond
        how = (f"each {duration(latency)} + {duration(per_root_ms)} × "
               "√(milliseconds of compute since the one before), as measured on this machine")
    return (f"\n\nTheir all-reduces (statistics forward, gradient sums backward, per "
            f"micro-batch) wait {duration(plan.synchronized_norm_s)} a step: {how}.")


# Timeline geometry, in SVG user units.
ROW_HEIGHT, ROW_GAP, LEFT, WIDTH, TOP = 28, 8, 70, 900, 24
# Forward blue, backward green (a zero-bubble schedule's input gradient green, its weights'
# gradient orange); under the interleaved schedules a device's later stages lighter.
COLORS = {"F": ("#4c78a8", "#86b4d9"), "B": ("#59a14f", "#8cc97f"),
          "I": ("#59a14f", "#8cc97f"), "W": ("#f28e2b", "#ffbe7d")}


def timeline_svg(simulation: Simulation, num_devices: int, title: str) -> str:
    """One row per pipeline device; a block per forward and backward; gaps are idle time."""
    scale = WIDTH / simulation.iteration_s if simulation.iteration_s > 0 else 0.0
    height = TOP + num_devices * (ROW_HEIGHT + ROW_GAP) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 10}" '
             f'height="{height}" font-family="sans-serif" font-size="11">',
             f'<text x="{LEFT}" y="14">{escape(title)}</text>']
    for d in range(num_devices):
        y = TOP + d * (ROW_HEIGHT + ROW_GAP)
        parts.append(f'<text x="4" y="{y + 18}">device {d}</text>')
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW_HEIGHT}" '
                     'fill="#eeeeee"/>')
    for a in simulation.actions:
        x, w = LEFT + a.start_s * scale, max((a.end_s - a.start_s) * scale, 0.5)
        y = TOP + a.device * (ROW_HEIGHT + ROW_GAP)
        shade = COLORS[a.kind][(a.stage // num_devices) % 2]
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_HEIGHT}" '
                     f'fill="{shade}" stroke="white" stroke-width="0.5">'
                     f'<title>stage {a.stage} {a.kind}{a.micro_batch}</title></rect>')
        if w > 14:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + 18}" fill="white" '
                         f'text-anchor="middle">{a.kind}{a.micro_batch}</text>')
    footer = (f"iteration {simulation.iteration_s * 1e3:.3f} ms, bubble "
              f"{simulation.bubble:.1%}; grey: idle")
    parts.append(f'<text x="{LEFT}" y="{height - 6}">{escape(footer)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"

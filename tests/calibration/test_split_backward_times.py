"""pipec.calibration.split_backward_times: what a zero-bubble schedule's split backward costs a
model, measured, and how the plan charges it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import fx

from conftest import MODELS, SAMPLES, compile_to
from pipec.calibration.split_backward_times import split_backward_timing
from pipec.cost.calibration_file import save_calibration
from pipec.cost.model import Calibration, Fit, NodeTiming
from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs, trace_model


@pytest.mark.parametrize("model", [SAMPLES / "gpt.py", SAMPLES / "resnet.py",
                                   MODELS / "manual_attention.py", MODELS / "shared_module.py"])
def test_the_split_is_measured_at_the_smallest_and_the_largest_size(model: Path) -> None:
    # The GPT sample's input is token ids: the graph is cut at its first floating-point value.
    # The written-out attention's output is a view (its logits reshaped), which torch's split
    # backward cannot detach in place. A module called twice has two groups of weights whose
    # paths meet: torch's weight pass, freeing the graph after the first, fails in the second.
    spec = load_model_file(model)
    torch.manual_seed(0)
    gm = fx.symbolic_trace(spec.build_model()).train()
    inputs = {size: batch_inputs(spec, size)[0] for size in (1, 2, 4)}
    timing = split_backward_timing(gm, inputs, torch.device("cpu"))
    assert timing.sizes == (1, 4) and timing.fwd_s == (0.0, 0.0)
    assert all(0 <= extra < 1.0 for extra in timing.bwd_s)
    assert all(p.grad is None for p in gm.parameters())  # measuring leaves no gradients


def _calibration(split: NodeTiming | None) -> Calibration:
    """The MLP sample's nodes: node i takes i ms per sample forward, 2i backward."""
    spec = load_model_file(SAMPLES / "mlp.py")
    graph = annotate(trace_model(spec), spec)
    nodes = tuple(NodeTiming(n.name, n.target, (1, 4), (i * 1e-3, i * 4e-3), (i * 2e-3, i * 8e-3))
                  for i, n in enumerate(graph.nodes))
    return Calibration("cpu", Fit(1.0, 0.0, 0.0), Fit(1.0, 0.0, 0.0), nodes,
                       contention=1.5, split_backward=split)


def test_a_split_backward_costs_each_stage_but_the_first_its_share(tmp_path: Path) -> None:
    # Measured: 4 ms at micro-batch 1, 10 ms at 4, so 6 ms at 2, × 1.5 (the contention); each
    # stage but the first pays its nodes' share of it by backward time (node i: 4i ms at 2).
    plans = {}
    for name, split in (("measured", NodeTiming("split_backward", "", (1, 4), (0.0, 0.0),
                                                (4e-3, 10e-3))), ("none", None)):
        save_calibration(_calibration(split), tmp_path / f"{name}.json")
        plans[name] = compile_to(SAMPLES / "mlp.py", tmp_path / name, gpus=2, batch_size=8,
                                 micro_batch=2, schedule="zbv",
                                 calibration=tmp_path / f"{name}.json")
    total = sum(4 * i for i in range(plans["none"].stages[-1].end))
    for measured, plain in zip(plans["measured"].stages, plans["none"].stages, strict=True):
        share = sum(4 * i for i in range(measured.start, measured.end)) / total
        extra = 0.0 if measured.index == 0 else 6e-3 * 1.5 * share
        assert measured.bwd_s - plain.bwd_s == pytest.approx(extra, abs=1e-12)
    assert plans["measured"].iteration_s > plans["none"].iteration_s


def test_a_calibration_keeps_its_split_only_for_its_own_model(tmp_path: Path) -> None:
    split = NodeTiming("split_backward", "", (1, 4), (0.0, 0.0), (4e-3, 10e-3))
    calibration = _calibration(split)
    save_calibration(calibration, tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["split_backward"]["bwd_s"] == \
        [4e-3, 10e-3]
    other = load_model_file(SAMPLES / "gpt.py")
    assert calibration.bind(annotate(trace_model(other), other)).split_backward is None
    assert replace(calibration, split_backward=None).bind(
        annotate(trace_model(other), other)) == replace(calibration, nodes=(), split_backward=None)

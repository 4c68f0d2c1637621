"""BatchNorm's own time where the profile timed GroupNorm: measured per node, charged to the
plans that keep BatchNorm only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import MODELS, SAMPLES, compile_to
from pipec.calibration.profile import profile_model
from pipec.cost.calibration_file import save_calibration
from pipec.cost.model import Calibration, Fit, NodeTiming
from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model


def test_each_batch_norm_is_timed_against_its_group_norm() -> None:
    calibration, _ = profile_model(MODELS / "norms_1d_3d.py", 4, repeats=1)
    spec = load_model_file(MODELS / "norms_1d_3d.py")
    graph = annotate(trace_model(spec), spec)
    norms = [n.name for n in graph.nodes if n.batch_norm_channels]
    assert [t.node for t in calibration.kept_norm] == norms and len(norms) == 3
    for timing in calibration.kept_norm:
        assert timing.sizes == (1, 2, 4)
        assert all(math.isfinite(s) for s in timing.fwd_s + timing.bwd_s)
    flat = calibration.kept_norm[0]  # (N, 12): one value per channel at micro-batch 1
    assert (flat.fwd_s[0], flat.bwd_s[0]) == (0.0, 0.0)
    # Profiled as BatchNorm, nothing is left to add.
    kept, _ = profile_model(SAMPLES / "resnet.py", 1, repeats=1, norm="keep")
    assert kept.kept_norm == ()


def _calibration(model: Path, extra_s: float) -> Calibration:
    """Made-up node times for ``model``, each BatchNorm ``extra_s`` slower than its GroupNorm
    forward and twice that backward."""
    spec = load_model_file(model)
    graph = annotate(trace_model(spec), spec)
    fit = Fit(1.0, 0.0, 0.0)
    return Calibration("cpu", fit, fit, tuple(
        NodeTiming(n.name, n.target, (1, 4), (1e-4, 4e-4), (2e-4, 8e-4)) for n in graph.nodes),
        kept_norm=tuple(NodeTiming(n.name, n.target, (1, 4), (extra_s,) * 2, (2 * extra_s,) * 2)
                        for n in graph.nodes if n.batch_norm_channels))


@pytest.mark.parametrize(("pp", "norm", "charged"), [(1, "auto", True), (1, "group", False),
                                                     (2, "auto", False), (2, "keep", True)])
def test_a_plan_that_keeps_batch_norm_pays_its_difference(pp: int, norm: str, charged: bool,
                                                          tmp_path: Path) -> None:
    times = {}
    for extra in (0.0, 1e-3):
        path = tmp_path / f"{extra}.json"
        save_calibration(_calibration(SAMPLES / "resnet.py", extra), path)
        plan = compile_to(SAMPLES / "resnet.py", tmp_path / str(extra), gpus=2, pp=pp,
                          batch_size=8, micro_batch=4, norm=norm, calibration=path)
        times[extra] = (sum(s.fwd_s for s in plan.stages), sum(s.bwd_s for s in plan.stages))
    spec = load_model_file(SAMPLES / "resnet.py")
    norms = sum(1 for n in annotate(trace_model(spec), spec).nodes if n.batch_norm_channels)
    expected = (norms * 1e-3, norms * 2e-3) if charged else (0.0, 0.0)
    assert times[1e-3][0] - times[0.0][0] == pytest.approx(expected[0], abs=1e-9)
    assert times[1e-3][1] - times[0.0][1] == pytest.approx(expected[1], abs=1e-9)

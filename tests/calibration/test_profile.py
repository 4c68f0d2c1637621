"""`pipec profile` and `--calibration`: measured compute times replace the preset's roofline."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import MODELS, SAMPLES, compile_to
from pipec.calibration.profile import Sample, fit_samples, profile_model
from pipec.cost.calibration_file import load_calibration, save_calibration
from pipec.cost.model import Calibration, Fit, NodeTiming
from pipec.errors import ConfigError
from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.tensors import flat_tensors
from pipec.frontend.trace import trace_model


def _samples(features: list[tuple[float, float]], seconds: list[float]) -> list[Sample]:
    """Samples whose forward and backward take ``seconds`` at (flops, bytes) ``features``."""
    return [Sample(f"n{i}", 1, flops, 2 * flops, moved, s, s)
            for i, ((flops, moved), s) in enumerate(zip(features, seconds, strict=True))]


def test_fit_recovers_known_constants() -> None:
    rng = np.random.default_rng(0)
    features = [(float(f), float(b)) for f, b in rng.uniform(1e3, 1e9, size=(50, 2))]
    seconds = [2e-5 + f * 3e-11 + b * 4e-10 for f, b in features]
    forward, backward = fit_samples(_samples(features, seconds))
    assert forward.overhead_s == pytest.approx(2e-5, rel=1e-6)
    assert forward.seconds_per_flop == pytest.approx(3e-11, rel=1e-6)
    assert forward.seconds_per_byte == pytest.approx(4e-10, rel=1e-6)
    # The backward of these samples does twice the FLOPs in the same time.
    assert backward.seconds_per_flop == pytest.approx(1.5e-11, rel=1e-6)


def test_fit_never_goes_negative() -> None:
    # Time falls with bytes here: an unconstrained fit would give a negative coefficient.
    features = [(1e6 * i, 1e6 * (10 - i)) for i in range(10)]
    seconds = [1e-3 + 1e-9 * i for i in range(10)]
    for fit in fit_samples(_samples(features, seconds)):
        assert min(fit.overhead_s, fit.seconds_per_flop, fit.seconds_per_byte) >= 0


def test_profile_measures_every_node_and_round_trips(tmp_path: Path) -> None:
    calibration, samples = profile_model(SAMPLES / "mlp.py", 4, repeats=2)
    assert {s.micro_batch for s in samples} == {1, 2, 4}
    assert len(samples) == 3 * 11 and all(s.fwd_s >= 0 and s.bwd_s >= 0 for s in samples)
    assert calibration.device == "cpu"
    assert [t.node for t in calibration.nodes] == [f"_{i}" for i in range(11)]
    assert all(t.sizes == (1, 2, 4) for t in calibration.nodes)
    assert 0 < calibration.stage_overhead_s[0] < 0.01 and 0 < calibration.stage_overhead_s[1] < 0.01
    # The least-squares fit explains the measurements it came from (which coefficient carries
    # the time varies with the machine's noise: FLOPs and bytes grow together in an MLP).
    predicted = sum(calibration.forward.seconds(s.fwd_flops, s.moved_bytes)  # type: ignore[arg-type]
                    for s in samples)
    assert 0.5 < predicted / sum(s.fwd_s for s in samples) < 2
    save_calibration(calibration, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == calibration


def test_profile_gives_each_node_its_own_time() -> None:
    # One node sleeps 20 ms forward and 40 ms backward; the others take microseconds.
    calibration, _ = profile_model(MODELS / "slow_node.py", 2, repeats=2)
    times = {t.node: t for t in calibration.nodes}
    assert list(times) == ["first", "slow", "relu", "last"]
    for size in range(2):
        assert 0.018 < times["slow"].fwd_s[size] < 0.03
        assert 0.038 < times["slow"].bwd_s[size] < 0.055
        for other in ("first", "relu", "last"):
            assert times[other].fwd_s[size] + times[other].bwd_s[size] < 0.01


SLOW_AFTER_CONSTANT = """
import time

import torch
from torch import fx, nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.04)
        return grad * 2


def slow(x):
    return _Sleep.apply(x)


fx.wrap("slow")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x):
        scaled = x * 2  # on the input alone: no gradient flows here
        return self.last(torch.relu(slow(self.first(scaled))))


def build_model():
    return Model()


def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
"""


def test_backward_time_goes_to_its_node_and_a_node_without_backward_keeps_none(
        tmp_path: Path) -> None:
    """Each interval between gradient-ready events goes to the node whose gradient opened it
    (the slow node's 40 ms, not its neighbours'); the even correction of the totals leaves a
    node without backward at exactly zero and takes no node below zero."""
    (tmp_path / "slow_after_constant.py").write_text(SLOW_AFTER_CONSTANT)
    calibration, samples = profile_model(tmp_path / "slow_after_constant.py", 2, repeats=2)
    times = {t.node: t for t in calibration.nodes}
    assert list(times) == ["mul", "first", "slow", "relu", "last"]
    assert times["mul"].bwd_s == (0.0, 0.0)
    for size in range(2):
        assert 0.038 < times["slow"].bwd_s[size] < 0.055
        for other in ("first", "relu", "last"):
            assert times[other].bwd_s[size] < 0.01
    assert all(s.fwd_s >= 0 and s.bwd_s >= 0 for s in samples)


def test_outputs_in_dicts_are_found() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    assert flat_tensors({"logits": a, "extra": (b, 3)}) == [a, b]
    assert flat_tensors([a, [b, None]]) == [a, b] and flat_tensors(3) == []


def test_node_times_interpolate_and_extrapolate() -> None:
    timing = NodeTiming("n", "t", (1, 2, 4), (1.0, 2.0, 3.0), (2.0, 4.0, 8.0))
    assert timing.at(2) == (2.0, 4.0)
    assert timing.at(3) == (2.5, 6.0)
    assert timing.at(8) == (5.0, 16.0)  # the last segment's slope continues
    assert NodeTiming("n", "t", (4,), (1.0,), (3.0,)).at(8) == (2.0, 6.0)


def _synthetic(graph_model: Path, fit: Fit) -> Calibration:
    """Made-up node times for ``graph_model``: node i takes i ms per sample forward, 2i back."""
    spec = load_model_file(graph_model)
    graph = annotate(trace_model(spec), spec)
    return Calibration("cpu", fit, fit, tuple(
        NodeTiming(n.name, n.target, (1, 4), (i * 1e-3, i * 4e-3), (i * 2e-3, i * 8e-3))
        for i, n in enumerate(graph.nodes)), stage_overhead_s=(1e-4, 3e-4))


def test_compile_uses_the_profiled_models_own_node_times(tmp_path: Path) -> None:
    save_calibration(_synthetic(SAMPLES / "mlp.py", Fit(1.0, 0.0, 0.0)), tmp_path / "c.json")
    plan = compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=2, batch_size=8,
                      micro_batch=2, calibration=tmp_path / "c.json")
    for stage in plan.stages:
        # node i at micro-batch 2: 2i ms forward + 4i ms backward; each stage 0.1 + 0.3 ms more
        forward = sum(2 * i * 1e-3 for i in range(stage.start, stage.end))
        assert stage.fwd_s == pytest.approx(forward + 1e-4)
        assert stage.bwd_s == pytest.approx(2 * forward + 3e-4)
        assert stage.compute_s == pytest.approx(stage.fwd_s + stage.bwd_s)
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["calibration_node_times"]
    assert "node times measured by `pipec profile`" in (tmp_path / "o" / "report.md").read_text()


def test_another_models_node_times_fall_back_to_the_fit(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    fit = Fit(1e-3, 0.0, 0.0)  # 1 ms per node
    save_calibration(_synthetic(SAMPLES / "mlp.py", fit), tmp_path / "c.json")
    plan = compile_to(MODELS / "dropout_mlp.py", tmp_path / "o", gpus=2, batch_size=8,
                      calibration=tmp_path / "c.json")
    assert "measured on another model" in caplog.text
    for stage in plan.stages:
        assert stage.compute_s == pytest.approx(2e-3 * (stage.end - stage.start) + 4e-4)
    assert not json.loads((tmp_path / "o" / "plan.json").read_text())["calibration_node_times"]


def test_profile_times_batch_norms_as_the_group_norms_pipelines_run(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=16)
    planned = json.loads((tmp_path / "o" / "plan.json").read_text())["norm_rewrites"]
    ran: list[nn.Module] = []
    hook = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: ran.append(module))
    try:
        profile_model(SAMPLES / "resnet.py", 1, repeats=1)
    finally:
        hook.remove()
    # The modules timed on real tensors, not those that the analysis runs on the meta device.
    ran = [m for m in ran if not any(t.is_meta for t in m.parameters())]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ran)
    group_norms = list({id(m): m for m in ran if isinstance(m, nn.GroupNorm)}.values())
    assert [m.num_groups for m in group_norms] == [r["groups"] for r in planned]


def test_unknown_profile_norm() -> None:
    with pytest.raises(ConfigError, match="--norm 'sync'"):
        profile_model(SAMPLES / "mlp.py", 2, norm="sync")


def test_cli_profile_then_compile_with_calibration(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "pipec.cli"]
    result = subprocess.run([*cli, "profile", str(SAMPLES / "mlp.py"), "--batch-size", "2",
                             "--repeats", "2", "-o", str(tmp_path / "c.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "11 nodes timed on cpu at micro-batch sizes 1, 2" in result.stdout
    default = compile_to(SAMPLES / "mlp.py", tmp_path / "a", gpus=2, batch_size=16)
    calibrated = compile_to(SAMPLES / "mlp.py", tmp_path / "b", gpus=2, batch_size=16,
                            calibration=tmp_path / "c.json")
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["calibration"] == "cpu"
    assert calibrated.stages[0].compute_s != default.stages[0].compute_s


_FIT = '{"overhead_s": 0, "seconds_per_flop": 0, "seconds_per_byte": 0}'
_FITS = f'"device": "cpu", "forward": {_FIT}, "backward": {_FIT}'


@pytest.mark.parametrize("text", [
    "not json", '{"device": "cpu"}', f'{{{_FITS}, "nodes": [{{"node": "_0"}}]}}',
    f'{{{_FITS}, "nodes": [{{"node": "_0", "target": "0", "sizes": [], "fwd_s": [], '
    '"bwd_s": []}]}',
    f'{{{_FITS}, "nodes": [{{"node": "_0", "target": "0", "sizes": [2, 1], "fwd_s": [1, 2], '
    '"bwd_s": [1, 2]}]}',
    f'{{{_FITS}, "nodes": [{{"node": "_0", "target": "0", "sizes": [1, 2], "fwd_s": [1], '
    '"bwd_s": [1, 2]}]}',
    f'{{{_FITS}, "stage_overhead_s": [1]}}',
])
def test_bad_calibration_file(text: str, tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ConfigError, match="make one with pipec profile"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", calibration=tmp_path / "c.json")


def test_unknown_device() -> None:
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        profile_model(SAMPLES / "mlp.py", 2, device="tpu")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_processes_sharing_cores_lend_them_in_the_bubbles(schedule: str, tmp_path: Path
                                                          ) -> None:
    """Two processes measured 2× slower side by side share one core's worth: the pipeline's
    step is its work done alone, one action at a time, bubbles or not (pipec.cost.cores). The
    stage times in the plan are the contended ones."""
    for contention in (1.0, 2.0):
        calibration = replace(_synthetic(SAMPLES / "mlp.py", Fit(1.0, 0.0, 0.0)),
                              contention=contention)
        save_calibration(calibration, tmp_path / f"{contention}.json")
    plans = {c: compile_to(SAMPLES / "mlp.py", tmp_path / str(c), gpus=2, batch_size=8,
                           micro_batch=2, schedule=schedule, calibration=tmp_path / f"{c}.json")
             for c in (1.0, 2.0)}
    shared = plans[2.0]
    work = shared.num_micro_batches * sum(s.fwd_s + s.bwd_s for s in shared.stages)
    assert shared.simulation.iteration_s == pytest.approx(work / 2, rel=1e-3)
    # Without contention, the two devices overlap and nothing is lent.
    plain = plans[1.0]
    assert plain.simulation.iteration_s < sum(s.fwd_s + s.bwd_s for s in plain.stages) \
        * plain.num_micro_batches

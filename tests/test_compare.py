"""`pipec compare`: a real run's metrics file against its plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to, run_forked
from pipec.cli import main
from pipec.compare import Comparison, StageComparison, compare, findings, render
from pipec.critical import Breakdown
from pipec.errors import MetricsError


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-stage GPT plan and the metrics of 6 steps of it on 2 forked processes."""
    root = tmp_path_factory.mktemp("compare")
    compile_to(SAMPLES / "gpt.py", root / "o", gpus=2, batch_size=16, micro_batch=4,
               schedule="1f1b")
    run_forked(root / "o", 2, "--steps", "6", "--metrics", str(root / "m.json"))
    return root / "o", root / "m.json"


def test_metrics_file_has_every_stage_and_rank(measured: tuple[Path, Path]) -> None:
    metrics = json.loads(measured[1].read_text())
    # On a CPU the first 3 steps measure memory, the 4th warms up again, the rest are timed.
    assert metrics["steps"] == 2
    assert [s["index"] for s in metrics["stages"]] == [0, 1]
    assert all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in metrics["stages"])
    assert sorted(r["rank"] for r in metrics["ranks"]) == [0, 1]
    for rank in metrics["ranks"]:
        assert rank["busy_s"] + rank["idle_s"] == pytest.approx(rank["step_s"], rel=1e-6)
        # Measured on CPU too: above the process's baseline (some 200 MiB), a few MiB here.
        assert rank["memory_measure"] == "peak RSS less file-backed pages"
        assert 2**20 < rank["peak_memory_bytes"] < 64 * 2**20 < rank["baseline_memory_bytes"]
        assert rank["time_measure"] == "training steps"
    assert metrics["samples_per_s"] == pytest.approx(16 / metrics["step_s"])


def test_metrics_keep_each_timed_steps_actions_in_their_order(
        measured: tuple[Path, Path]) -> None:
    metrics = json.loads(measured[1].read_text())
    assert len(metrics["timelines"]) == metrics["steps"] == 2
    for ranks in metrics["timelines"]:
        ends = {(a[0], a[1], a[2]): a[4] for r in ranks for a in r["actions"]}
        assert sorted(ends) == sorted((kind, k, m) for kind in ("forward", "backward")
                                      for k in (0, 1) for m in range(4))
        for r in ranks:
            assert all(r["start"] <= a[3] < a[4] <= r["end"] for a in r["actions"])
            for kind, k, m, start, _ in r["actions"]:  # each after the action it needs
                needed = ("forward", 0, m) if kind == "forward" else ("backward", 1, m)
                if (kind, k) in (("forward", 1), ("backward", 0)):
                    assert start >= ends[needed]
    path = compare(*measured).path
    assert path is not None and path.actions >= 4 and path.hops >= 2
    assert sum(path.parts().values()) == pytest.approx(path.step_s)


def test_a_short_cpu_run_says_its_steps_were_timed_under_the_memory_measurement(
        measured: tuple[Path, Path], tmp_path: Path) -> None:
    out, long_run = measured
    run_forked(out, 2, "--steps", "3", "--metrics", str(tmp_path / "short.json"))
    short = json.loads((tmp_path / "short.json").read_text())
    assert short["steps"] == 2 and all(
        r["time_measure"].startswith("steps slowed by the memory measurement")
        for r in short["ranks"])
    # The same allocations measured either way: the peak does not depend on the run's length.
    # Both runs forked now, from the same test process: what a forked rank's small tensors find
    # free in the heap it inherits moves this small model's peak by up to ~2 MiB between runs
    # forked at different points of the session.
    again = tmp_path / "long.json"
    run_forked(out, 2, "--steps", "6", "--metrics", str(again))
    for rank in short["ranks"]:
        other = next(r for r in json.loads(again.read_text())["ranks"]
                     if r["rank"] == rank["rank"])
        assert rank["peak_memory_bytes"] == pytest.approx(other["peak_memory_bytes"],
                                                          abs=1.5 * 2**20)
    assert any(f.startswith("timing: these steps were timed while memory was measured")
               for f in compare(out, tmp_path / "short.json").findings)
    assert not any(f.startswith("timing:") for f in compare(out, long_run).findings)


def test_compare_puts_prediction_and_measurement_side_by_side(
        measured: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    comparison = compare(*measured)
    plan = json.loads((measured[0] / "plan.json").read_text())
    assert [s.predicted_fwd_s for s in comparison.stages] == [s["fwd_s"] for s in plan["stages"]]
    assert comparison.predicted_memory == tuple(plan["predicted"]["peak_memory_bytes"])
    metrics = json.loads(measured[1].read_text())
    assert comparison.measured_memory == tuple(
        next(r["peak_memory_bytes"] for r in metrics["ranks"] if r["device"] == d)
        for d in (0, 1))
    assert set(comparison.memory_terms[1]) >= {"static", "activations", "receive_buffers",
                                               "loss", "runtime"}
    assert main(["compare", str(measured[0]), str(measured[1])]) == 0
    printed = capsys.readouterr().out
    assert "measured ÷ predicted" in printed and "peak memory MiB, device 1" in printed
    assert "critical path, mean of a step" in printed and "waits for inputs" in printed


def _comparison(ratios: tuple[float, float], idle: float = 0.2,
                memory: float | None = None) -> Comparison:
    stages = tuple(StageComparison(k, k, 1.0, r, 2.0, 2 * r) for k, r in enumerate(ratios))
    terms = ({"static": 60.0, "activations": 30.0, "receive_buffers": 10.0},) * 2
    return Comparison(stages, 10.0, 10.0, 0.2, idle, (100.0, 100.0), (memory, None), "cuda", (),
                      memory_terms=terms)


def test_findings_name_the_assumption_that_is_off() -> None:
    assert findings(_comparison((1.0, 1.1), memory=110.0)) == (
        "the predictions hold: time within 1.25×, memory within ±15%",)
    assert "compute: the stages take 2.00×" in findings(_comparison((2.0, 2.0)))[0]
    assert "run `pipec profile MODEL --device cuda`" in findings(_comparison((2.0, 2.0)))[0]
    calibrated = replace(_comparison((2.0, 2.0)), calibrated=True)
    assert "already calibrated" in findings(calibrated)[0]
    assert findings(_comparison((0.8, 1.3)))[0].startswith("balance: stage 1 runs 1.30×")
    assert "communication: devices idle 50%" in findings(_comparison((1.0, 1.0), idle=0.5))[0]
    # 28 bytes above the prediction: nearest the 30-byte activations term; 18 below: the
    # 10-byte receive buffers (the 30-byte activations are 12 away).
    above = findings(_comparison((1.0, 1.0), memory=128.0))[0]
    assert above.startswith("memory: device 0 peaked") and "nearest the 'activations' term" in above
    assert "missing or undercounted" in above
    below = findings(_comparison((1.0, 1.0), memory=82.0))[0]
    assert "nearest the 'receive_buffers' term" in below and "overcounted" in below
    beyond = findings(_comparison((1.0, 1.0), memory=170.0))[0]  # 70 above; the largest is 60
    assert "larger than any predicted term" in beyond and "nearest" not in beyond
    assert "cuDNN" in beyond  # the test comparison was measured on CUDA
    on_cpu = replace(_comparison((1.0, 1.0), memory=170.0), device_type="cpu")
    assert "rounded up to whole pages" in findings(on_cpu)[0]
    # Under tcmalloc a CPU run's peak is what the process holds: ±20 %, and said so.
    tcmalloc = replace(_comparison((1.0, 1.0), memory=118.0), device_type="cpu",
                       host_allocator="tcmalloc")
    assert findings(tcmalloc) == ("the predictions hold: time within 1.25×, memory within ±20%",)
    held = findings(replace(tcmalloc, measured_memory=(125.0, None)))[0]
    assert held.startswith("memory: device 0 peaked at") and "PIPEC_ALLOCATOR=glibc" in held
    assert "PIPEC_ALLOCATOR" not in findings(replace(on_cpu, host_allocator="glibc"))[0]
    assert "n/a" in render(_comparison((1.0, 1.0)))
    waited = replace(_comparison((1.0, 1.0)), path=Breakdown(10.0, 7.0, 2.0, 0.5, 0.2, 0.3, 6, 4))
    assert ("waits: the critical path of a step waited 2000.000 ms for other devices' outputs "
            "(4 hops, 500.000 ms each) and 500.000 ms between its own actions, 25% of the step"
            ) in findings(waited)[0]
    assert "critical path" not in render(_comparison((1.0, 1.0)))


def test_metrics_of_another_plan_are_refused(measured: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "other", gpus=2, batch_size=16)
    with pytest.raises(MetricsError, match="measured on another plan"):
        compare(tmp_path / "other", measured[1])


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"), ("{not json", "is not JSON"), ("[1, 2]", "is not a JSON object")])
def test_bad_metrics_files(measured: tuple[Path, Path], tmp_path: Path, content: str | None,
                           message: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(MetricsError, match=message):
        compare(measured[0], path)
    assert main(["compare", str(measured[0]), str(path)]) == 2
    assert message in capsys.readouterr().err


def test_an_incomplete_metrics_file_is_refused(measured: tuple[Path, Path],
                                               tmp_path: Path) -> None:
    metrics = json.loads(measured[1].read_text())
    del metrics["ranks"]
    (tmp_path / "m.json").write_text(json.dumps(metrics))
    with pytest.raises(MetricsError, match="not a complete metrics file"):
        compare(measured[0], tmp_path / "m.json")

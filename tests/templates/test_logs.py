"""--log-dir: each step's figures as JSON lines and TensorBoard scalars, from the rank that
prints the steps; and the time left on each printed step line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MODELS, SAMPLES, compile_to, losses_of, run_forked_text

FIGURES = {"loss", "lr", "samples_per_s", "mfu", "peak_memory_mib", "time_left_s"}


def test_log_dir_holds_every_steps_figures_as_json_lines_and_tensorboard_scalars(
        tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=2, batch_size=16)
    printed = run_forked_text(tmp_path / "o", 2, "--steps", "4", "--seed", "1", "--clip-norm",
                              "1.0", "--log-dir", str(tmp_path / "logs"))
    lines = [json.loads(line) for line in (tmp_path / "logs" / "steps.jsonl").read_text()
             .splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all(set(line) == FIGURES | {"step", "grad_norm"} for line in lines)
    assert [round(line["loss"], 6) for line in lines] == losses_of(printed)
    assert lines[-1]["time_left_s"] == 0 and all(line["time_left_s"] >= 0 for line in lines)
    assert all(0 < line["mfu"] < 1 and line["peak_memory_mib"] > 0 for line in lines)
    events = event_accumulator.EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {f"train/{name}" for name in FIGURES | {"grad_norm"}}
    assert [event.value for event in events.Scalars("train/loss")] == pytest.approx(
        [line["loss"] for line in lines])


def test_each_step_line_says_the_time_left(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=1, batch_size=16)
    printed = run_forked_text(tmp_path / "o", 1, "--steps", "3")
    step_lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and step_lines[-1].endswith(" left 0:00")
    assert all(" left " in line for line in step_lines)


def test_held_out_figures_go_to_eval_jsonl_and_eval_scalars(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    compile_to(MODELS / "digits_eval.py", tmp_path / "o", gpus=1, batch_size=64)
    printed = run_forked_text(tmp_path / "o", 1, "--steps", "4", "--eval-every", "2",
                              "--log-dir", str(tmp_path / "logs"))
    lines = [json.loads(line) for line in (tmp_path / "logs" / "eval.jsonl").read_text()
             .splitlines()]
    assert [line["step"] for line in lines] == [2, 4]
    assert all(set(line) == {"step", "loss", "accuracy"} for line in lines)
    accuracy = lines[1]["accuracy"]
    assert f"held-out after step 4 (4 global batches): accuracy {accuracy:.6f}" in printed
    events = event_accumulator.EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    assert {"eval/loss", "eval/accuracy", "train/loss"} <= set(events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("eval/loss")] == [2, 4]


def test_tokens_per_second_where_the_model_file_says_what_a_sample_holds(
        tmp_path: Path) -> None:
    compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=1, batch_size=8)
    printed = run_forked_text(tmp_path / "o", 1, "--steps", "2", "--log-dir",
                              str(tmp_path / "logs"))
    lines = [json.loads(line) for line in (tmp_path / "logs" / "steps.jsonl").read_text()
             .splitlines()]
    assert all(line["tokens_per_s"] == pytest.approx(32 * line["samples_per_s"])
               for line in lines)  # samples/gpt.py: TOKENS_PER_SAMPLE = CONTEXT = 32
    assert all(" tokens/s " in line for line in printed.splitlines() if line.startswith("step "))

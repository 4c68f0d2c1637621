"""The emitted data pipeline (data.py) and held-out evaluation (evaluation.py): loader workers,
map-style and iterable datasets, the same global batches on every plan, the data position in
checkpoints, and held-out figures that every plan computes alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import MODELS, compile_to, emitted_train, losses_of, run_forked_text

HELD_OUT_LINE = "held-out after step"


def held_out_figures(printed: str) -> list[dict[str, float]]:
    """Each held-out line's figures: 'held-out after step S (N global batches): a 1.0 b 2.0'."""
    figures = []
    for line in printed.splitlines():
        if line.startswith(HELD_OUT_LINE):
            words = line.split(": ", 1)[1].split()
            figures.append({name: float(value) for name, value in zip(words[::2], words[1::2],
                                                                      strict=True)})
    return figures


def assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= 1e-4 * abs(e), (actual, expected)


def test_training_and_held_out_figures_equal_on_2_stages_2_replicas_and_1_process(
        tmp_path: Path) -> None:
    """digits with a held-out split and accuracy: 2 stages reading with a loader worker, 4
    stages interleaved over 2 devices, 2 replicas, and 2 sharded replicas give one process's
    training losses and held-out loss and accuracy."""
    model = MODELS / "digits_eval.py"
    plans = {"one": {"gpus": 1}, "pp2": {"gpus": 2, "pp": 2},
             "interleaved": {"gpus": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2},
             "dp2": {"gpus": 2, "pp": 1, "fsdp": "off"}, "zero3": {"gpus": 2, "pp": 1,
                                                                  "fsdp": "zero3"}}
    runs = {}
    for name, plan in plans.items():
        compile_to(model, tmp_path / name, **plan, batch_size=64, optimizer="adamw")
        runs[name] = run_forked_text(tmp_path / name, plan["gpus"], "--steps", "12", "--lr",
                                     "0.01", "--eval-every", "6", "--data-workers",
                                     "0" if name == "one" else "1")
    reference = held_out_figures(runs["one"])
    assert len(reference) == 2 and set(reference[0]) == {"loss", "accuracy"}
    assert reference[1]["accuracy"] > reference[0]["accuracy"] > 0.2  # it learns
    for name in plans.keys() - {"one"}:
        assert_close(losses_of(runs[name]), losses_of(runs["one"]))
        for figures, expected in zip(held_out_figures(runs[name]), reference, strict=True):
            assert_close([figures["loss"], figures["accuracy"]],
                         [expected["loss"], expected["accuracy"]])


def test_resume_mid_epoch_with_loader_workers_on_another_plan_reads_the_same_batches(
        tmp_path: Path) -> None:
    """Interrupted at step 10 of a 23-step epoch on 2 stages, resumed on 1 process with a
    loader worker: steps 11 to 30 (across the epoch's end) lose what an uninterrupted run
    loses, and the checkpoint says where the data stands."""
    model = MODELS / "digits_eval.py"
    compile_to(model, tmp_path / "one", gpus=1, batch_size=64, optimizer="adamw")
    compile_to(model, tmp_path / "pp2", gpus=2, batch_size=64, optimizer="adamw")
    common = ("--lr", "0.01", "--eval-every", "0")
    uninterrupted = losses_of(run_forked_text(tmp_path / "one", 1, "--steps", "30", *common))
    checkpoints = tmp_path / "checkpoints"
    first = losses_of(run_forked_text(tmp_path / "pp2", 2, "--steps", "10", *common,
                                      "--data-workers", "1", "--checkpoint-dir",
                                      str(checkpoints)))
    marker = json.loads((checkpoints / "step_00000010" / "COMPLETE").read_text())
    assert marker["data"] == {"epoch": 0, "batch": 10}
    resumed = run_forked_text(tmp_path / "one", 1, "--steps", "30", *common, "--data-workers",
                              "1", "--checkpoint-dir", str(checkpoints), "--resume",
                              logs=tmp_path / "resumed-logs")
    later = [float(v) for k, v in
             (line.split()[1:4:2] for line in resumed.splitlines() if line.startswith("step "))
             if int(k) > 10]
    assert_close(first, uninterrupted[:10])
    assert_close(later, uninterrupted[10:])


@pytest.fixture
def stream_batches(tmp_path: Path) -> type:
    compile_to(MODELS / "stream_items.py", tmp_path / "o", gpus=1, batch_size=8)
    batches: type = emitted_train(tmp_path / "o").Batches
    return batches


def items_of(batches: object, steps: range) -> list[list[int]]:
    return [[int(x) for x in batches(step, torch.device("cpu"))[0][0].flatten()]  # type: ignore[operator]
            for step in steps]


def test_an_iterable_dataset_over_2_replicas_and_2_workers_reads_each_item_once_an_epoch(
        stream_batches: type) -> None:
    """103 items, global batch 8: 12 steps an epoch (7 items dropped), replica r taking rows
    [4r, 4r + 4) of each, its 2 workers alternate steps; the next epoch reads the reversed
    order (set_epoch)."""
    replicas = [stream_batches(0, r, 8, 2, workers=2) for r in range(2)]
    shares = [items_of(b, range(1, 14)) for b in replicas]
    epoch = [item for step in range(12) for r in range(2) for item in shares[r][step]]
    assert epoch == list(range(96))  # each step's global batch: 8 consecutive items
    assert shares[0][12] + shares[1][12] == list(range(102, 94, -1))  # epoch 1 starts
    assert replicas[0].state() == {"epoch": 1, "batch": 1}


def test_an_iterable_dataset_resumes_at_the_checkpointed_position(
        stream_batches: type) -> None:
    uninterrupted = items_of(stream_batches(0, 1, 8, 2, workers=2), range(1, 16))
    resumed = stream_batches(0, 1, 8, 2, workers=1)
    resumed.resume_at({"epoch": 0, "batch": 10})
    assert items_of(resumed, range(11, 16)) == uninterrupted[10:]


def test_a_map_style_dataset_s_global_batch_is_the_same_for_any_replica_count(
        tmp_path: Path) -> None:
    compile_to(MODELS / "digits_eval.py", tmp_path / "o", gpus=1, batch_size=64)
    batches = emitted_train(tmp_path / "o").Batches
    whole = batches(0, 0, 64, 1, workers=0)(7, torch.device("cpu"))[1]
    shares = [batches(0, r, 64, 4, workers=1)(7, torch.device("cpu"))[1] for r in range(4)]
    assert torch.equal(torch.cat(shares), whole)


def test_an_iterable_dataset_trains_alike_on_2_replicas_with_workers_and_1_process(
        tmp_path: Path) -> None:
    """15 steps of 12-step epochs: the replicas' loader workers cross the epoch's end together."""
    compile_to(MODELS / "stream_items.py", tmp_path / "one", gpus=1, batch_size=8)
    compile_to(MODELS / "stream_items.py", tmp_path / "dp2", gpus=2, pp=1, batch_size=8)
    reference = losses_of(run_forked_text(tmp_path / "one", 1, "--steps", "15",
                                          "--data-workers", "0"))
    assert_close(losses_of(run_forked_text(tmp_path / "dp2", 2, "--steps", "15",
                                           "--data-workers", "2")), reference)

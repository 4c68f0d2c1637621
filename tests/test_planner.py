"""The planner's search, its constraints and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to
from pipec.errors import ConfigError, InfeasibleError


def test_micro_batch_divides_the_replica_batch(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=24)
    assert plan.micro_batch * plan.num_micro_batches == 24
    assert {c.micro_batch for c in plan.candidates} <= {1, 2, 3, 4, 6, 8, 12, 24}


def test_pp_overrides_and_the_rest_is_data_parallel(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=4, pp=2, batch_size=32)
    assert (plan.pp, plan.dp) == (2, 2)
    assert plan.micro_batch * plan.num_micro_batches == 16


def test_one_device_is_a_one_stage_plan(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=1, batch_size=8)
    assert len(plan.stages) == 1 and plan.stages[0].start == 0


def test_chosen_plan_is_the_fastest_candidate_and_beats_conventional(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=4, batch_size=64)
    assert plan.samples_per_s == max(c.samples_per_s for c in plan.candidates)
    assert all(plan.samples_per_s >= b.samples_per_s * (1 - 1e-9)
               for b in plan.baselines if b.feasible)


def test_1f1b_is_only_chosen_with_a_micro_batch_per_stage(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=4, batch_size=32)
    assert all(c.num_micro_batches >= 4 for c in plan.candidates if c.schedule == "1f1b")
    with pytest.raises(ConfigError, match="at least 4 micro-batches"):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=4, batch_size=32, micro_batch=16,
                   schedule="1f1b")


def test_memory_that_does_not_fit_is_an_error_with_numbers(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.json"
    tiny.write_text('{"name": "tiny", "fp32_flops": 1e12, "bf16_flops": 1e12, '
                    '"memory_bandwidth": 1e11, "memory_bytes": 100000, '
                    '"intra_node_bandwidth": 1e10, "inter_node_bandwidth": 1e9, '
                    '"intra_node_latency_s": 1e-6, "inter_node_latency_s": 1e-5, '
                    '"kernel_overhead_s": 1e-5, "efficiency": 0.5}')
    with pytest.raises(InfeasibleError, match=r"needs \d+\.\d+ GiB .* have 0\.00 GiB"):
        compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=2, batch_size=8,
                   hardware=str(tiny))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("options", "message"), [
    ({"gpus": 0}, "at least 1 device"),
    ({"gpus": 4, "nodes": 3}, "not divisible by --nodes 3"),
    ({"batch_size": 0}, "positive integer"),
    ({"gpus": 4, "pp": 3}, "--pp 3 does not divide --gpus 4"),
    ({"gpus": 4, "pp": 2, "batch_size": 7}, "not divisible by the 2 data-parallel"),
    ({"batch_size": 12, "micro_batch": 5}, "does not divide the per-replica batch 12"),
    ({"gpus": 64}, "legal stage boundaries"),
    ({"hardware": "tpu-v9"}, "unknown hardware 'tpu-v9'; presets: a100-40g"),
])
def test_bad_options(tmp_path: Path, options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", **options)
    assert not (tmp_path / "o").exists()


def test_boundaries_between_nodes_cost_the_inter_node_link(tmp_path: Path) -> None:
    one = compile_to(SAMPLES / "gpt.py", tmp_path / "a", gpus=4, batch_size=16, micro_batch=4,
                     schedule="1f1b", hardware="a100-80g")
    two = compile_to(SAMPLES / "gpt.py", tmp_path / "b", gpus=4, nodes=2, batch_size=16,
                     micro_batch=4, schedule="1f1b", hardware="a100-80g")
    # Stage 1 → 2 crosses from node 0 to node 1; InfiniBand is slower than NVLink.
    assert two.iteration_s > one.iteration_s


def test_crosses_nodes() -> None:
    from pipec.costmodel import crosses_nodes

    # 4 stages × 2 replicas on 2 nodes of 4: only stage 3 → 0 (not a boundary) crosses.
    assert [crosses_nodes(s, 4, 2, 4) for s in range(3)] == [False, False, False]
    # 8 stages on 2 nodes of 4: stage 3 → 4 crosses.
    assert [crosses_nodes(s, 8, 1, 4) for s in range(7)] == [s == 3 for s in range(7)]


def test_candidates_that_do_not_fit_are_reported_not_chosen(tmp_path: Path) -> None:
    small = tmp_path / "small.json"
    # 32 MiB (28.8 usable): GPipe, with the whole batch in flight, needs about 47 MiB on its
    # fuller stage and does not fit; 1F1B with micro-batches up to 16 does.
    small.write_text('{"name": "small", "fp32_flops": 1e12, "bf16_flops": 1e12, '
                     '"memory_bandwidth": 1e11, "memory_bytes": 33554432, '
                     '"intra_node_bandwidth": 1e10, "inter_node_bandwidth": 1e9, '
                     '"intra_node_latency_s": 1e-6, "inter_node_latency_s": 1e-5, '
                     '"kernel_overhead_s": 1e-5, "efficiency": 0.5}')
    plan = compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=64,
                      hardware=str(small))
    too_big = [c for c in plan.candidates if not c.feasible]
    assert too_big and all(c.peak_memory_bytes > 32 * 2**20 * 0.9 for c in too_big)
    assert {c.schedule for c in too_big} >= {"gpipe"}
    assert max(s.memory_bytes for s in plan.stages) <= 32 * 2**20 * 0.9
    assert "| no " in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.parametrize(("optimizer", "precision", "ratio"), [
    ("sgd", "fp32", 3.0), ("adamw", "fp32", 4.0), ("sgd", "bf16", 3.5), ("adamw", "bf16", 4.5)])
def test_static_memory_per_parameter(optimizer: str, precision: str, ratio: float) -> None:
    from pipec.costmodel import Training, static_ratio

    # weight + gradient + optimizer state (+ the autocast bf16 weight copy), per fp32 byte
    assert static_ratio(Training(optimizer, precision)) == ratio

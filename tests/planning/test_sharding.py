"""Sharded data parallelism (--fsdp): what a sharded stage holds and what its collectives cost,
by hand; when the search shards; its user errors; and the emitted script, which trains like one
process under zero2 and zero3, and whose sharded checkpoints any plan resumes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    MODELS,
    SAMPLES,
    STEP_LINE,
    compile_to,
    device_file,
    run_forked,
    run_forked_text,
)
from pipec.cost.hardware import PRESETS
from pipec.cost.model import Training, allreduce_s, optimizer_s, usable_memory
from pipec.driver import CompileOptions, analyze
from pipec.errors import ConfigError, InfeasibleError
from pipec.planning import planner
from pipec.planning.points import Costs
from pipec.planning.sharding import HOST_BYTES, sharded_static_ratio
from pipec.torchcompat import counting_fsdp_reductions

ADAMW = {"optimizer": "adamw", "batch_size": 16}
ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo"


def test_a_sharded_stage_keeps_its_weights_and_gradients_whole_and_the_rest_sharded() -> None:
    # AdamW, fp32: weight 1 and gradient 1 whole; the sharded weight and two moments ÷ 4.
    assert sharded_static_ratio(Training("adamw", "fp32"), 4) == 1 + 1 + 3 / 4
    # bf16 autocast keeps a bf16 copy of each gathered weight (half its bytes).
    assert sharded_static_ratio(Training("sgd", "bf16"), 2) == 1 + 1 + 2 / 2 + 0.5


def test_sharded_memory_collectives_and_optimizer_by_hand(tmp_path: Path) -> None:
    options = {"gpus": 4, "pp": 2, "micro_batch": 2, "schedule": "1f1b", **ADAMW}
    ddp = compile_to(SAMPLES / "mlp.py", tmp_path / "off", fsdp="off", **options)
    sharded = compile_to(SAMPLES / "mlp.py", tmp_path / "z2", fsdp="zero2", **options)
    assert (ddp.fsdp, sharded.fsdp) == ("off", "zero2")
    device = PRESETS["cpu"]
    weights = [4.0 * s.params for s in sharded.stages]  # fp32; the MLP has no buffers
    for stage, stage_weights in zip(sharded.stages, weights, strict=True):
        assert stage.memory is not None
        assert stage.memory.static == pytest.approx(stage_weights * (1 + 1 + 3 / 2))
    # Each position's runtime holds FSDP's own host memory besides DDP's (a CPU's).
    for d in range(2):
        runtime = [plan.device_memory_bytes[d] - sum(s.memory_bytes for s in plan.stages
                                                     if s.device == d)
                   for plan in (ddp, sharded)]
        assert runtime[1] - runtime[0] == pytest.approx(HOST_BYTES)
    # One all-gather and one reduce-scatter (each half a ring all-reduce) and three waits (the
    # loss's too), on the slowest position; the optimizer steps over half the weights.
    expected = max(allreduce_s(w, 2, device) + 3 * device.step_collective_s for w in weights)
    assert sharded.step_terms["all_reduce"] == pytest.approx(expected)
    assert sharded.step_terms["optimizer"] == pytest.approx(
        max(optimizer_s(w / 2, "adamw", device) for w in weights))
    plan_json = json.loads((tmp_path / "z2" / "plan.json").read_text())
    report = (tmp_path / "z2" / "report.md").read_text()
    assert plan_json["fsdp"] == "zero2" and "FSDP2 (zero2)" in report
    assert "FSDP all-gathers and reduce-scatter" in report and "all-reduce " not in report


def test_zero3_gathers_the_weights_again_for_each_micro_batch(tmp_path: Path) -> None:
    options = {"gpus": 4, "pp": 2, "micro_batch": 2, "schedule": "1f1b", **ADAMW}
    zero2 = compile_to(SAMPLES / "mlp.py", tmp_path / "z2", fsdp="zero2", **options)
    zero3 = compile_to(SAMPLES / "mlp.py", tmp_path / "z3", fsdp="zero3", **options)
    assert zero3.device_memory_bytes == zero2.device_memory_bytes
    assert zero3.step_terms["all_reduce"] > zero2.step_terms["all_reduce"]


def test_auto_shards_where_only_sharding_fits_and_not_otherwise(tmp_path: Path) -> None:
    options = {"gpus": 2, "pp": 1, "micro_batch": 8, **ADAMW}
    roomy = compile_to(SAMPLES / "gpt.py", tmp_path / "auto", hardware=device_file(tmp_path),
                       **options)
    assert roomy.fsdp == "off"  # no faster by more than the margin: DDP is simpler
    ddp, sharded = (max(compile_to(SAMPLES / "gpt.py", tmp_path / mode, fsdp=mode,
                                   hardware=device_file(tmp_path), **options).device_memory_bytes)
                    for mode in ("off", "zero2"))
    assert sharded < ddp
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "tight",
                      hardware=device_file(tmp_path, (sharded + ddp) / 2), **options)
    assert plan.fsdp == "zero2"


def test_auto_shards_by_block_only_where_nothing_lighter_fits(tmp_path: Path) -> None:
    options = {"gpus": 2, "pp": 1, "micro_batch": 8, **ADAMW}
    zero2, block = (max(compile_to(SAMPLES / "gpt.py", tmp_path / mode, fsdp=mode,
                                   hardware=device_file(tmp_path), **options).device_memory_bytes)
                    for mode in ("zero2", "block"))
    assert block < zero2
    roomy = compile_to(SAMPLES / "gpt.py", tmp_path / "roomy",
                       hardware=device_file(tmp_path, zero2 * 1.01), **options)
    assert roomy.fsdp in ("off", "zero2")
    tight = compile_to(SAMPLES / "gpt.py", tmp_path / "tight",
                       hardware=device_file(tmp_path, (block + zero2) / 2), **options)
    assert tight.fsdp == "block"


def test_block_sharding_needs_blocks(tmp_path: Path) -> None:
    flat = tmp_path / "flat.py"
    flat.write_text("import torch\nfrom torch import nn\n\n\ndef build_model():\n"
                    "    return nn.Linear(8, 4)\n\n\ndef sample_batch(batch_size):\n"
                    "    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))\n")
    with pytest.raises(ConfigError, match=r"--fsdp block: the model has no blocks .* use "
                                          r"--fsdp zero2 or zero3"):
        compile_to(flat, tmp_path / "o", gpus=2, pp=1, fsdp="block", batch_size=16)


def test_nothing_fitting_quotes_the_leanest_sharding(tmp_path: Path) -> None:
    """2 replicas of one stage, AdamW, on devices too small for any: the error quotes the
    sharding that holds least, a unit per block, and what it needs."""
    with pytest.raises(InfeasibleError, match=r"the nearest, 1 pipeline device\(s\) × 2 "
                       r"replica\(s\) sharded a unit per block at micro-batch 1 .* needs"):
        compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=2, pp=1,
                   hardware=device_file(tmp_path, 2**20), **ADAMW)


def test_sharding_fits_a_larger_micro_batch(tmp_path: Path) -> None:
    """On 4 devices of 2.6 MiB with AdamW, as 2 stages × 2 replicas: sharding frees the
    optimizer state, so micro-batch 2 fits where DDP fits only 1 (the baselines, never
    sharded, keep their maximum batch)."""
    small = device_file(tmp_path, 2.6 * 2**20)
    options: dict[str, Any] = {"gpus": 4, "pp": 2, "batch_size": 16, "hardware": small,
                               "optimizer": "adamw"}
    with pytest.raises(InfeasibleError):
        compile_to(SAMPLES / "gpt.py", tmp_path / "ddp2", fsdp="off", micro_batch=2, **options)
    sharded = compile_to(SAMPLES / "gpt.py", tmp_path / "auto2", fsdp="auto", micro_batch=2,
                         **options)
    assert (sharded.fsdp, sharded.pp, sharded.dp) == ("zero2", 2, 2)
    unsharded = compile_to(SAMPLES / "gpt.py", tmp_path / "off", fsdp="off", **options)
    assert unsharded.micro_batch == 1
    assert sharded.max_batch[1:] == unsharded.max_batch[1:]


@pytest.mark.parametrize(("options", "message"), [
    ({"fsdp": "zero1"}, r"--fsdp 'zero1': use one of auto, off, zero2, zero3, block"),
    ({"fsdp": "block", "gpus": 4, "pp": 2, "schedule": "interleaved"},
     r"--fsdp block with --schedule interleaved"),
    ({"fsdp": "zero2", "gpus": 2, "pp": 2}, r"--fsdp zero2 shards .* 1 replica"),
    ({"fsdp": "zero3", "gpus": 4, "pp": 2, "schedule": "zbv"}, r"--fsdp zero3 with --schedule"),
    ({"fsdp": "zero2", "gpus": 4, "pp": 2, "schedule": "interleaved"},
     r"--fsdp zero2 with --schedule interleaved"),
], ids=["unknown", "block-interleaved", "no-replicas", "zero-bubble", "interleaved"])
def test_sharding_that_cannot_run_is_a_user_error(options: dict[str, object], message: str,
                                                  tmp_path: Path) -> None:
    options = {"gpus": 2, "batch_size": 16, **options}
    with pytest.raises(ConfigError, match=message):
        compile_to(SAMPLES / "mlp.py", tmp_path / "o", **options)


def _losses(out: Path, processes: int, *args: str) -> list[float]:
    return run_forked(out, processes, "--steps", "4", "--seed", "3", "--clip-norm", "0.05",
                      *args)


@pytest.mark.parametrize(("mode", "gpus", "pp", "recompute"), [
    ("zero2", 4, 2, "auto"),  # the tied embedding and head on two devices, both sharded
    ("zero3", 4, 2, "auto"),
    ("zero3", 2, 1, "auto"),
    ("zero2", 4, 2, "full"),  # FSDP's hooks around a checkpointed forward
    ("zero3", 4, 2, "selective"),
    ("block", 4, 2, "auto"),  # a unit per block, gradients reduce-scattered every backward
    ("block", 2, 1, "full"),
])
def test_sharded_plans_train_like_one_process(mode: str, gpus: int, pp: int, recompute: str,
                                              tmp_path: Path) -> None:
    model = "tied_gpt"
    compile_to(MODELS / f"{model}.py", tmp_path / "one", gpus=1, **ADAMW)
    plan = compile_to(MODELS / f"{model}.py", tmp_path / mode, gpus=gpus, pp=pp, fsdp=mode,
                      recompute=recompute, **ADAMW)
    assert all(s.recompute == recompute for s in plan.stages) or recompute == "auto"
    assert (plan.fsdp, plan.dp) == (mode, 2)
    expected = _losses(tmp_path / "one", 1, "--save-model", str(tmp_path / "one.safetensors"))
    assert len(set(expected)) > 1
    assert _losses(tmp_path / mode, gpus, "--save-model", str(tmp_path / "sharded.safetensors")
                   ) == pytest.approx(expected, rel=1e-5)
    # --save-model gathers each sharded tensor whole: the same model as one process's.
    one, sharded = (load_file(tmp_path / f"{name}.safetensors") for name in ("one", "sharded"))
    assert one.keys() == sharded.keys()
    for key, tensor in one.items():
        torch.testing.assert_close(sharded[key], tensor, rtol=1e-4, atol=1e-6)


def test_a_sharded_plan_trains_like_ddp_under_bf16(tmp_path: Path) -> None:
    """Autocast over FSDP's gathered fp32 weights casts them as it casts DDP's: the same
    losses as the same layout with DDP (measured: equal to 7 digits), and within bf16's
    rounding of one process's."""
    options = {**ADAMW, "precision": "bf16"}
    compile_to(MODELS / "tied_gpt.py", tmp_path / "one", gpus=1, **options)
    for mode in ("off", "zero2"):
        compile_to(MODELS / "tied_gpt.py", tmp_path / mode, gpus=4, pp=2, fsdp=mode, **options)
    sharded = _losses(tmp_path / "zero2", 4)
    assert sharded == pytest.approx(_losses(tmp_path / "off", 4), rel=1e-6)
    assert sharded == pytest.approx(_losses(tmp_path / "one", 1), rel=1e-3)


def test_block_sharding_reduce_scatters_every_block_in_every_backward(tmp_path: Path) -> None:
    """Under --fsdp block each micro-batch's backward reduces each unit's gradients (its
    blocks' and the stage's own) at once; zero2, under torch's pipeline runtime, once a step.
    FSDP's reduction is counted in the forked ranks, which inherit the wrapper."""

    def record() -> None:
        with (tmp_path / f"reduced-{os.getpid()}").open("a") as log:
            log.write("1\n")

    options = {"gpus": 4, "pp": 2, "micro_batch": 2, "schedule": "1f1b", **ADAMW}
    for mode in ("block", "zero2"):
        compile_to(MODELS / "tied_gpt.py", tmp_path / mode, fsdp=mode, **options)
        with counting_fsdp_reductions(record):
            run_forked(tmp_path / mode, 4, "--steps", "2")
        counts = sorted(len(f.read_text().split()) for f in tmp_path.glob("reduced-*"))
        for f in tmp_path.glob("reduced-*"):
            f.unlink()
        if mode == "block":
            units = [len(stages_module(tmp_path / mode).STAGES[k].FSDP_UNITS) + 1
                     for k in (0, 1)]
            assert min(units) > 1
            micro_batches = 16 // 2 // 2
            per_step = sorted(2 * [micro_batches * u for u in units])
        else:
            per_step = 4 * [1]
        assert counts == [2 * n for n in per_step], (mode, counts)


def stages_module(out: Path) -> Any:
    """The emitted stages.py of ``out``, imported under its own name."""
    spec = importlib.util.spec_from_file_location(f"stages_{out.name}", out / "stages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(out))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(out))
    return module


def test_a_block_sharded_plan_trains_like_one_process_under_bf16(tmp_path: Path) -> None:
    """bf16 gathers (MixedPrecisionPolicy) round the weights, and each block's inputs, to bf16
    where one process's autocast keeps the residual stream fp32: the losses stay within bf16's
    rounding of one process's (measured: 4.2e-4 relative at most)."""
    options = {**ADAMW, "precision": "bf16"}
    compile_to(MODELS / "tied_gpt.py", tmp_path / "one", gpus=1, **options)
    compile_to(MODELS / "tied_gpt.py", tmp_path / "block", gpus=4, pp=2, fsdp="block",
               **options)
    assert 'PRECISION = "bf16"' in (tmp_path / "block" / "pipeline.py").read_text()
    assert _losses(tmp_path / "block", 4) == pytest.approx(_losses(tmp_path / "one", 1),
                                                           rel=3e-3)


def test_block_sharding_holds_blocks_sharded_and_pays_per_micro_batch(tmp_path: Path) -> None:
    """By hand, on the sample GPT (4 blocks, AdamW, fp32, 2 replicas of one stage): a node of
    a block keeps (1 + 1 + 2) / 2 of its weight bytes, the rest also its gathered weights and
    their gradient; the position adds the largest block's working copies (2 gathered, its
    gradient); every block and the stage all-gather twice and reduce-scatter once per
    micro-batch."""
    options = {"gpus": 2, "pp": 1, "micro_batch": 2, **ADAMW}
    block = compile_to(SAMPLES / "gpt.py", tmp_path / "block", fsdp="block", **options)
    zero2 = compile_to(SAMPLES / "gpt.py", tmp_path / "z2", fsdp="zero2", **options)
    analyzed = analyze(CompileOptions(model=SAMPLES / "gpt.py", out=tmp_path / "o", gpus=2,
                                      pp=1, micro_batch=2, fsdp="block", measure="off",
                                      **ADAMW))
    costs = Costs(analyzed.graph, analyzed.request)
    blocks = float(costs.weight_bytes[costs.in_block].sum())
    rest = float(costs.weight_bytes[~costs.in_block].sum())
    assert set(costs.block_unit) == {"", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}
    assert costs.largest_block_bytes == pytest.approx(blocks / 4)
    assert block.stages[0].memory is not None
    assert block.stages[0].memory.static == pytest.approx(blocks * 4 / 2 + rest * (4 / 2 + 2))
    working = costs.largest_block_bytes * (2 + 1)
    assert (block.device_memory_bytes[0] - block.stages[0].memory_bytes
            - (zero2.device_memory_bytes[0] - zero2.stages[0].memory_bytes)
            ) == pytest.approx(working)
    assert max(block.device_memory_bytes) < max(zero2.device_memory_bytes)
    assert block.step_terms["all_reduce"] > zero2.step_terms["all_reduce"]
    assert json.loads((tmp_path / "block" / "plan.json").read_text())["fsdp"] == "block"
    # Recomputing runs each block's forward again in its backward: a third all-gather.
    again = compile_to(SAMPLES / "gpt.py", tmp_path / "again", fsdp="block", recompute="full",
                       **options)
    assert again.step_terms["all_reduce"] > block.step_terms["all_reduce"]


@pytest.mark.parametrize(("saver", "resumer"), [("z2", "one"), ("one", "z2")])
def test_a_sharded_checkpoint_resumes_on_another_plan(saver: str, resumer: str,
                                                      tmp_path: Path) -> None:
    """The zero2 plan saves its shards at step 2 and one process resumes them, or the other
    way round: steps 3 and 4 are those of an uninterrupted run."""
    compile_to(MODELS / "tied_gpt.py", tmp_path / "one", gpus=1, **ADAMW)
    compile_to(MODELS / "tied_gpt.py", tmp_path / "z2", gpus=4, pp=2, fsdp="zero2", **ADAMW)
    processes = {"one": 1, "z2": 4}
    expected = _losses(tmp_path / "one", 1)
    checkpoints = str(tmp_path / "checkpoints")
    run_forked(tmp_path / saver, processes[saver], "--steps", "2", "--seed", "3",
               "--clip-norm", "0.05", "--checkpoint-dir", checkpoints, "--checkpoint-every", "2")
    text = run_forked_text(tmp_path / resumer, processes[resumer], "--steps", "4", "--seed",
                           "3", "--clip-norm", "0.05", "--checkpoint-dir", checkpoints,
                           "--resume")
    resumed = [(int(k), float(v)) for k, v in STEP_LINE.findall(text)]
    assert [k for k, _ in resumed] == [3, 4], text
    assert [v for _, v in resumed] == pytest.approx(expected[2:], rel=1e-5)


def test_llama_7b_shards_on_8_a100s(tmp_path: Path) -> None:
    """LLaMA-2-7B's shape, AdamW, bf16 (benchmarks/planner.py --levers-only): sharding AdamW's
    state and the master weights over 4 replicas lets 2 pipeline devices hold it."""
    analyzed = analyze(CompileOptions(model=ZOO / "llama2_7b.py", out=tmp_path / "o", gpus=8,
                                      batch_size=64, hardware="a100-80g", optimizer="adamw",
                                      precision="bf16", measure="off"))
    plan = planner.plan(analyzed.graph, analyzed.request)
    assert (plan.pp, plan.dp, plan.fsdp) == (2, 4, "zero2")
    assert max(plan.device_memory_bytes) <= usable_memory(PRESETS["a100-80g"])

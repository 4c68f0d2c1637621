"""Tensor parallelism in the emitted script (pipec compile --tp): every tp plan trains to one
process's losses, on forked gloo ranks; checkpoints and --save-model hold whole tensors, so a
run resumes across tp degrees; the user's mistakes are clear errors."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    MODELS,
    SAMPLES,
    compile_to,
    losses_of,
    run_forked,
    run_forked_text,
    steps_of,
)
from pipec.driver import CompileOptions, compile_model
from pipec.errors import ConfigError
from pipec.frontend.loader import load_model_file

STEPS = "4"
# Clipped below the sample GPT's gradient norm (about 0.3): the norm over tp ranks matters.
TRAINING = ("--steps", STEPS, "--seed", "3", "--clip-norm", "0.1")
# A tp plan's trained weights against one process's: within 1 % of one AdamW update (lr 0.01).
# AdamW divides each gradient by its own running size, so gradients summed in another order
# move a weight by a fraction of lr: up to 1.006e-5 on an Intel Xeon VM, torch 2.13.0+cpu.
SAVED_WEIGHTS_ATOL = 1e-4


def assert_same_losses(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected) == int(STEPS)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= 1e-5 * abs(e), (actual, expected)


def train(model: Path, out: Path, processes: int, *args: str, **options: Any) -> list[float]:
    return losses_of(train_text(model, out, processes, *args, **options))


def train_text(model: Path, out: Path, processes: int, *args: str, **options: Any) -> str:
    """What ``model``'s training printed, compiled to ``out`` with ``options`` (sequence
    parallel unless they say otherwise: on this CPU's gloo, planned without it where pipec
    chooses)."""
    options.setdefault("gpus", processes)
    options.setdefault("sequence_parallel", "on")
    compile_to(model, out, batch_size=16, optimizer="adamw", **options)
    return run_forked_text(out, processes, *TRAINING, *args)


def gradient_norms(text: str) -> list[float]:
    return [float(norm) for norm in re.findall(r"grad_norm (\S+)", text)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train_text(SAMPLES / "gpt.py", tmp_path_factory.mktemp("tp") / "one", 1)


@pytest.mark.parametrize(("gpus", "pp", "fsdp", "schedule"), [
    (2, 1, "off", "auto"), (4, 2, "off", "1f1b"), (4, 1, "off", "auto"), (4, 1, "zero2", "auto"),
    (4, 1, "block", "auto"), (4, 2, "off", "zbv")],
    ids=["tp2", "tp2xpp2", "tp2xdp2", "tp2xfsdp2", "tp2xfsdp2-block", "tp2xpp2-zbv"])
def test_the_sample_gpt_trains_like_one_process(gpus: int, pp: int, fsdp: str, schedule: str,
                                                one_process: str, tmp_path: Path) -> None:
    # ZB-V splits each backward into the input's gradient (where the tp all-reduces run) and
    # the weights'.
    assert len(set(losses_of(one_process))) > 1  # really training
    text = train_text(SAMPLES / "gpt.py", tmp_path / "tp", gpus, tp="2", pp=pp, fsdp=fsdp,
                      schedule=schedule, micro_batch=4 if schedule == "zbv" else None)
    assert_same_losses(losses_of(text), losses_of(one_process))
    # The norm clipped is the whole model's: each tp rank's parts summed over the group.
    assert len(gradient_norms(text)) == int(STEPS)
    assert gradient_norms(text) == pytest.approx(gradient_norms(one_process), rel=1e-3)
    plan = json.loads((tmp_path / "tp" / "plan.json").read_text())
    assert (plan["tp"], plan["gpus"], plan["pp"], plan["dp"]) == (2, gpus, pp, gpus // 2 // pp)
    assert plan["mesh"][-1] == "tp"
    assert '"tok_emb.weight": (0, (256,))' in (tmp_path / "tp" / "tensor_parallel.py").read_text()
    # Between the regions each rank ran its part of the sequence.
    assert plan["sequence_parallel"]
    stages = (tmp_path / "tp" / "stages.py").read_text()
    assert "tensor_parallel.sequence_reduce(" in stages
    if fsdp == "block":  # the row-parallel linears run as F.linear: in the stage's own unit
        units = re.search(r"FSDP_UNITS = \((.*?)\n    \)", stages, re.S)
        assert units is not None
        assert '"blocks.0.attn.qkv"' in units.group(1)
        assert '"blocks.0.attn.proj"' not in units.group(1)
    if pp == 2:  # the residual stream crosses as each rank's half of the 32 tokens
        sent = re.search(r"OUTPUTS = \(\(\(\d+, (\d+), 64\)", stages)
        assert sent is not None and sent.group(1) == "16"


@pytest.mark.parametrize(("gpus", "pp"), [(2, 1), (4, 2)], ids=["tp2", "tp2xpp2"])
def test_sequence_parallelism_off_trains_like_one_process_and_holds_more(
        gpus: int, pp: int, one_process: str, tmp_path: Path) -> None:
    whole = train(SAMPLES / "gpt.py", tmp_path / "off", gpus, tp="2", pp=pp,
                  sequence_parallel="off")
    assert_same_losses(whole, losses_of(one_process))
    compile_to(SAMPLES / "gpt.py", tmp_path / "on", gpus=gpus, tp="2", pp=pp, batch_size=16,
               optimizer="adamw", sequence_parallel="on")
    off, on = (json.loads((tmp_path / name / "plan.json").read_text()) for name in ("off", "on"))
    assert (off["sequence_parallel"], on["sequence_parallel"]) == (False, True)
    assert "sequence_" not in (tmp_path / "off" / "stages.py").read_text()
    # Norms and residual adds on half the sequence: less activation memory predicted.
    assert on["predicted"]["peak_memory_bytes"][0] < off["predicted"]["peak_memory_bytes"][0]


def test_sequence_parallelism_auto_keeps_the_faster_plan(tmp_path: Path) -> None:
    """Planned with and without: on 2 CPU processes its twice as many blocking collectives
    cost more than the norms' time it saves (benchmarks/results/tp_step_time.md)."""
    plans = {choice: compile_to(SAMPLES / "gpt.py", tmp_path / choice, gpus=2, tp="2", pp=1,
                                batch_size=64, sequence_parallel=choice)
             for choice in ("auto", "on", "off")}
    assert plans["on"].sequence_parallel and not plans["off"].sequence_parallel
    assert plans["on"].samples_per_s < plans["off"].samples_per_s
    assert plans["auto"].samples_per_s == plans["off"].samples_per_s
    assert not plans["auto"].sequence_parallel


def test_sequence_parallelism_on_where_the_sequence_does_not_split_is_a_clear_error(
        tmp_path: Path) -> None:
    # 7 tokens over 2 ranks; auto plans the same tp without sequence parallelism.
    with pytest.raises(ConfigError, match=r"--sequence-parallel on at tp 2.*does not split"):
        compile_to(MODELS / "odd_sequence.py", tmp_path, gpus=2, tp="2", pp=1,
                   batch_size=8, sequence_parallel="on")
    plan = compile_to(MODELS / "odd_sequence.py", tmp_path / "auto", gpus=2, tp="2", pp=1,
                      batch_size=8)
    assert plan.tp == 2 and not plan.sequence_parallel


def test_a_head_that_reads_across_the_sequence_gathers_it_first(tmp_path: Path) -> None:
    """The token mixer's residual stream is split after its MLP and gathered before its
    flatten: the same losses as one process."""
    mixer = MODELS / "token_mixer.py"
    reference = train(mixer, tmp_path / "one", 1)
    losses = train(mixer, tmp_path / "tp", 2, tp="2", pp=1)
    assert_same_losses(losses, reference)
    stages = (tmp_path / "tp" / "stages.py").read_text()
    assert "tensor_parallel.sequence_gather(" in stages


@pytest.mark.parametrize(("model", "gpus", "pp", "fsdp"), [
    ("gqa_lm", 2, 1, "auto"), ("gqa_lm", 4, 2, "auto"), ("gqa_lm", 4, 1, "zero2"),
    ("tiny_llama", 2, 1, "auto"), ("tiny_llama", 4, 2, "auto"), ("tiny_llama", 4, 1, "zero2"),
    ("tied_gpt", 4, 2, "auto")],
    ids=["llama-shaped-tp2", "llama-shaped-tp2xpp2", "llama-shaped-tp2xfsdp2",
         "hugging-face-llama-tp2", "hugging-face-llama-tp2xpp2", "hugging-face-llama-tp2xfsdp2",
         "tied-head-tp2xpp2"])
def test_llama_shaped_models_train_like_one_process(model: str, gpus: int, pp: int, fsdp: str,
                                                    tmp_path: Path) -> None:
    # Grouped-query attention, rotary embeddings and SwiGLU; Hugging Face's Llama through
    # torch.export; a head tied to the embedding, which stays whole on each rank.
    reference = train(MODELS / f"{model}.py", tmp_path / "one", 1)
    losses = train(MODELS / f"{model}.py", tmp_path / "tp", gpus, tp="2", pp=pp, fsdp=fsdp)
    assert_same_losses(losses, reference)
    shards = (tmp_path / "tp" / "tensor_parallel.py").read_text()
    # Both kinds of linear hold a part, under the model's own keys.
    sharded = dict(re.findall(r'^    "([^"]+)": \((\d),', shards, re.MULTILINE))
    assert set(sharded.values()) == {"0", "1"}
    assert sharded.keys() <= load_model_file(MODELS / f"{model}.py").build_model() \
        .state_dict().keys()
    # An embedding no other module shares is vocabulary-parallel (gqa_lm's has a padding
    # index, in the last rank's rows); a tied one stays whole.
    assert ('"embed.weight": (0,' in shards) == (model == "gqa_lm")


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_under_tp_trains_like_one_process(recompute: str, one_process: str,
                                                        tmp_path: Path) -> None:
    # Selective recomputation keeps each product's output: the row-parallel all-reduce must
    # leave it as it was, for the recomputed forward.
    losses = train(SAMPLES / "gpt.py", tmp_path / "tp", 2, tp="2", pp=1, recompute=recompute)
    assert_same_losses(losses, losses_of(one_process))


def emitted_tensor_parallel(out: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("emitted_tensor_parallel",
                                                  out / "tensor_parallel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_regions_dropout_draws_per_rank_and_the_rest_alike(tmp_path: Path) -> None:
    """The region's hidden features are the rank's part: its dropout mask must be its own
    (the same on both ranks would tie feature i to feature i + 32). What is drawn after it,
    outside the regions, is the same on every rank; drawn again from the same state (as
    recomputation does), the mask is the same."""
    compile_to(MODELS / "dropout_mlp.py", tmp_path, gpus=2, pp=1, tp="2", batch_size=16)
    tensor_parallel = emitted_tensor_parallel(tmp_path)

    def draw(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        tensor_parallel.RANK = rank
        torch.manual_seed(5)
        masked = torch.nn.functional.dropout(tensor_parallel.own_random(torch.ones(512)), 0.5)
        return tensor_parallel.shared_random(masked), torch.rand(8)

    (mask0, after0), (mask1, after1), (again, _) = draw(0), draw(1), draw(0)
    assert not torch.equal(mask0, mask1) and torch.equal(mask0, again)
    assert torch.equal(after0, after1)
    stages = (tmp_path / "stages.py").read_text()
    assert stages.count("tensor_parallel.own_random(") == 1  # the region's dropout, not the other


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_dropout_under_tp_recomputes_the_masks_it_drew(recompute: str, tmp_path: Path) -> None:
    """Recomputing replays each dropout, in the region (the rank's stream) and outside it:
    the losses of a tp plan with dropout are the same recomputed or not."""
    dropout = MODELS / "dropout_mlp.py"
    # Its values have no sequence (batch, features): nothing to split along one.
    kept = train(dropout, tmp_path / "kept", 2, tp="2", pp=1, recompute="none",
                 sequence_parallel="auto")
    recomputed = train(dropout, tmp_path / "recomputed", 2, tp="2", pp=1, recompute=recompute,
                       sequence_parallel="auto")
    assert len(set(kept)) > 1 and recomputed == kept


def test_bf16_autocast_under_tp_trains_close_to_one_process(tmp_path: Path) -> None:
    # The row-parallel partial sums are all-reduced in bf16 (as Megatron-LM does), where one
    # process accumulates the whole product in fp32: close, not equal.
    gpt = SAMPLES / "gpt.py"
    reference = train(gpt, tmp_path / "one", 1, precision="bf16")
    losses = train(gpt, tmp_path / "tp", 2, tp="2", pp=1, precision="bf16")
    assert losses == pytest.approx(reference, rel=2e-4)


def test_evaluation_through_a_tp_pipeline_equals_the_pipeline_alone(tmp_path: Path) -> None:
    digits = MODELS / "digits_eval.py"
    held = []
    for name, gpus, tp in (("pp", 2, "1"), ("tp", 4, "2")):
        compile_to(digits, tmp_path / name, gpus=gpus, pp=2, tp=tp, batch_size=32)
        text = run_forked_text(tmp_path / name, gpus, "--steps", "2", "--eval-every", "1")
        held.append([float(v) for v in re.findall(r"held-out after step \d+ .* loss (\S+)",
                                                  text)])
    assert len(held[0]) == 2
    assert held[1] == pytest.approx(held[0], rel=1e-5)


def test_a_run_resumes_across_tp_degrees_and_saves_whole_tensors(tmp_path: Path) -> None:
    """Steps 1–3 on tp 2 × FSDP 2, steps 4–6 on one process, steps 7–8 on tp 2 × pp 2: the
    losses of one uninterrupted process, AdamW state included; the model saved by tp 2 × FSDP
    2 equals the one process's."""
    gpt = SAMPLES / "gpt.py"
    whole = train(gpt, tmp_path / "one", 1, "--steps", "8")
    for name, gpus, pp, fsdp in (("fsdp", 4, 1, "zero2"), ("pp", 4, 2, "off")):
        compile_to(gpt, tmp_path / name, gpus=gpus, pp=pp, tp="2", fsdp=fsdp, batch_size=16,
                   optimizer="adamw")
    parts: dict[int, float] = {}
    for name, processes, steps, extra in (
            ("fsdp", 4, "3", ("--save-model", str(tmp_path / "fsdp.safetensors"))),
            ("one", 1, "6", ("--resume",)), ("pp", 4, "8", ("--resume",))):
        text = run_forked_text(tmp_path / name, processes, *TRAINING, "--steps", steps,
                               "--checkpoint-dir", str(tmp_path / "ck"), *extra,
                               logs=tmp_path / f"log-{name}")
        parts.update(steps_of(text))
    assert sorted(parts) == list(range(1, 9))
    for step, loss in parts.items():
        assert loss == pytest.approx(whole[step - 1], rel=1e-5), (parts, whole)
    # The model tp 2 × FSDP 2 saved after step 3 is one process's after step 3.
    run_forked(tmp_path / "one", 1, *TRAINING, "--steps", "3", "--save-model",
               str(tmp_path / "one-3.safetensors"))
    saved = load_file(tmp_path / "fsdp.safetensors")
    expected = load_file(tmp_path / "one-3.safetensors")
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max() <= SAVED_WEIGHTS_ATOL, key


def test_the_saved_model_of_a_tp_plan_equals_one_process_and_initializes_one(
        tmp_path: Path) -> None:
    gpt = SAMPLES / "gpt.py"
    train(gpt, tmp_path / "one", 1, "--save-model", str(tmp_path / "one.safetensors"))
    train(gpt, tmp_path / "tp", 4, "--save-model", str(tmp_path / "tp.safetensors"), tp="2",
          pp=2, schedule="1f1b")
    saved = load_file(tmp_path / "tp.safetensors")
    expected = load_file(tmp_path / "one.safetensors")
    assert saved.keys() == expected.keys()
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max() <= SAVED_WEIGHTS_ATOL, key
    # Each tp rank reads its part of each sharded tensor of the file (a lazy safetensors
    # slice): trained on, the same losses as the one process that reads it whole.
    init = ("--init-from", str(tmp_path / "one.safetensors"))
    assert_same_losses(run_forked(tmp_path / "tp", 4, *TRAINING, *init),
                       run_forked(tmp_path / "one", 1, *TRAINING, *init))


def test_compiling_a_tp_plan_twice_gives_identical_files(tmp_path: Path) -> None:
    for name in ("a", "b"):
        compile_to(SAMPLES / "gpt.py", tmp_path / name, gpus=4, pp=2, tp="2")
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


@pytest.mark.parametrize(("model", "options", "message"), [
    ("gpt", {"gpus": 4, "tp": "3"}, "does not divide the 4 device"),
    ("gpt", {"gpus": 2, "tp": "two"}, "use a positive integer"),
    ("gpt", {"gpus": 2, "tp": "0"}, "use a positive integer"),
    ("gpt", {"gpus": 2, "tp": "²"}, "use a positive integer"),
    ("gpt", {"gpus": 2, "tp": "2", "onnx": True}, "--onnx with --tp 2"),
    ("gpt", {"gpus": 7, "tp": "7"}, "no region divides by 7"),
    ("gpt", {"gpus": 4, "tp": "2", "batch_size": 5}, "not divisible by the 2 data-parallel"),
], ids=["not-a-divisor", "not-a-number", "zero", "superscript", "onnx", "divides-no-region",
        "batch"])
def test_a_tp_the_model_or_the_devices_do_not_allow_is_a_clear_error(
        model: str, options: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_model(CompileOptions(model=SAMPLES / f"{model}.py", out=tmp_path / "out",
                                     hardware="cpu", measure="off", pp=1, **options))


def test_the_batch_divides_by_the_replicas_of_tp_groups_not_by_the_devices(
        tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "out", gpus=4, pp=1, tp="2", batch_size=6)
    assert (plan.tp, plan.dp, plan.processes) == (2, 2, 4)


def test_tp_auto_tries_each_degree_of_a_node_and_keeps_the_fastest(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "out", gpus=4, pp=None, tp="auto")
    degrees = [tp for tp, _ in plan.tp_tried]
    assert degrees == [1, 2, 4]
    rates = dict(plan.tp_tried)
    assert rates[plan.tp] == max(rate for rate in rates.values() if rate is not None)
    listed = json.loads((tmp_path / "out" / "plan.json").read_text())["tp_tried"]
    assert [entry["tp"] for entry in listed] == degrees
    assert "`--tp auto` tried tp 1:" in (tmp_path / "out" / "report.md").read_text()


def test_pipec_compile_with_a_bad_tp_exits_2_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pipec.cli", "compile",
                             str(SAMPLES / "gpt.py"), "--gpus", "4", "--tp", "3",
                             "--measure", "off", "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "--tp 3 does not divide the 4 device(s) of a node" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_without_linear_regions_cannot_take_tp(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no Linear → Linear region"):
        compile_model(CompileOptions(model=MODELS / "inplace_cnn.py", out=tmp_path / "out",
                                     gpus=2, pp=1, tp="2", hardware="cpu", measure="off"))

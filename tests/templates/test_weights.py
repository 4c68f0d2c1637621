"""The emitted weights.py: each rank materializes only its stages, pretrained weights
(--init-from), the whole model as one file (--save-model), checkpoints that another plan of the
same model resumes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import safetensors.torch
import torch

from conftest import (
    MODELS,
    SAMPLES,
    compile_to,
    emitted_modules,
    glibc_environment,
    losses_of,
    run_forked,
    run_forked_text,
    steps_of,
)


def run_alone(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A one-process plan's train.py, as `python train.py` runs it."""
    return subprocess.run([sys.executable, "train.py", *args], cwd=out, capture_output=True,
                          text=True, check=False, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def weights_module(out: Path) -> ModuleType:
    """The emitted weights.py, with the model and stages beside it."""
    with emitted_modules(out):
        return importlib.import_module("weights")


def test_each_rank_holds_only_its_own_stages(tmp_path: Path) -> None:
    """Eight 4 MiB layers on 4 devices: every rank's measured peak stays within its device's
    planned share (a whole build would add the other stages' 24 MiB)."""
    compile_to(MODELS / "wide_mlp.py", tmp_path / "o", gpus=4, batch_size=16)
    # Fresh processes, as a user runs it: a worker forked from the test session inherits its
    # heap, and measured up to 5 MiB more.
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "4", "train.py",
                    "--steps", "3", "--metrics", str(tmp_path / "m.json")], cwd=tmp_path / "o",
                   check=True, capture_output=True, env=glibc_environment())
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    predicted = plan["predicted"]["peak_memory_bytes"]
    measured = json.loads((tmp_path / "m.json").read_text())["ranks"]
    assert len(measured) == 4
    for rank in measured:
        share = predicted[rank["device"]]
        assert 0.85 * share <= rank["peak_memory_bytes"] <= 1.15 * share, (rank, predicted)


def test_the_seeded_build_gives_every_plan_the_same_model(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Custom initialization, a random buffer outside the state dict, a persistent buffer and a
    weight tied across stages: 4 stages train like one process, and the build is cleaned up."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    compile_to(MODELS / "init_buffers.py", tmp_path / "one", gpus=1, batch_size=16)
    compile_to(MODELS / "init_buffers.py", tmp_path / "four", gpus=4, batch_size=16)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "4")
    assert run_forked(tmp_path / "four", 4, "--steps", "3", "--seed", "4") == reference
    assert list((tmp_path / "tmp").iterdir()) == []
    # Resumed, the 4 ranks build nothing: the checkpoint holds every value, the random buffer
    # outside the state dict included.
    checkpoint = ("--seed", "4", "--checkpoint-dir", str(tmp_path / "ck"))
    run_forked(tmp_path / "four", 4, "--steps", "2", *checkpoint, logs=tmp_path / "first")
    rest = run_forked_text(tmp_path / "four", 4, "--steps", "3", *checkpoint, "--resume",
                           logs=tmp_path / "rest")
    assert steps_of(rest) == {3: reference[2]}


def test_resume_under_another_plan_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Steps 1–3 on a 2-stage pipeline (tied embedding on both), steps 4–6 on 2 data-parallel
    replicas, steps 7–8 on one process: the losses of one uninterrupted process, AdamW state
    included."""
    model = MODELS / "tied_gpt.py"
    compile_to(model, tmp_path / "one", gpus=1, batch_size=16, optimizer="adamw")
    compile_to(model, tmp_path / "pp", gpus=2, batch_size=16, optimizer="adamw")
    compile_to(model, tmp_path / "dp", gpus=2, pp=1, batch_size=16, optimizer="adamw")
    common = ("--seed", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    whole = losses_of(run_forked_text(tmp_path / "one", 1, "--steps", "8", "--seed", "2",
                                      logs=tmp_path / "whole"))
    parts = {}
    for out, steps, resume in (("pp", "3", ()), ("dp", "6", ("--resume",)),
                               ("one", "8", ("--resume",))):
        text = run_forked_text(tmp_path / out, 2 if out != "one" else 1, "--steps", steps,
                               *common, *resume, logs=tmp_path / f"log-{out}")
        parts.update(steps_of(text))
        if resume:
            assert "written by another plan of this model" in text
    assert sorted(parts) == list(range(1, 9))
    for step, loss in parts.items():
        assert loss == pytest.approx(whole[step - 1], rel=1e-4), (parts, whole)


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


def test_a_checkpoint_holds_one_copy_per_data_parallel_group(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "one", gpus=1, batch_size=16)
    compile_to(SAMPLES / "mlp.py", tmp_path / "dp", gpus=2, pp=1, batch_size=16)
    run_forked(tmp_path / "one", 1, "--steps", "1", "--checkpoint-dir", str(tmp_path / "c1"))
    run_forked(tmp_path / "dp", 2, "--steps", "1", "--checkpoint-dir", str(tmp_path / "c2"))
    one = checkpoint_bytes(tmp_path / "c1" / "step_00000001")
    two = checkpoint_bytes(tmp_path / "c2" / "step_00000001")
    assert one > 10_000 and abs(two - one) < 0.05 * one  # not twice: replicas write one copy


def test_resume_refuses_another_models_checkpoint(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "mlp", gpus=1, batch_size=16)
    compile_to(MODELS / "tied_gpt.py", tmp_path / "gpt", gpus=1, batch_size=16)
    run_forked(tmp_path / "mlp", 1, "--steps", "1", "--checkpoint-dir", str(tmp_path / "ck"))
    result = run_alone(tmp_path / "gpt", "--steps", "2", "--checkpoint-dir",
                       str(tmp_path / "ck"), "--resume")
    assert result.returncode == 1 and "holds another model" in result.stderr
    assert "tensor(s) differ in name, shape or dtype" in result.stderr


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_init_from_then_save_model_round_trips_every_tensor(suffix: str, tmp_path: Path
                                                            ) -> None:
    """Pretrained weights in, 2 stages (the tied weight on both), --lr 0, the whole model out:
    every tensor unchanged, loadable strictly into build_model()."""
    compile_to(MODELS / "init_buffers.py", tmp_path / "o", gpus=2, batch_size=16)
    with emitted_modules(tmp_path / "o") as (user_model, _):
        torch.manual_seed(9)
        pretrained = user_model.build_model()
        state = {k: v.clone() for k, v in pretrained.state_dict().items() if k != "out.weight"}
    path = tmp_path / f"pretrained{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        safetensors.torch.save_file(state, path)
    run_forked(tmp_path / "o", 2, "--steps", "1", "--lr", "0", "--init-from", str(path),
               "--save-model", str(tmp_path / "saved.safetensors"))
    saved = safetensors.torch.load_file(tmp_path / "saved.safetensors")
    assert saved.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(saved[key], value), key
    with emitted_modules(tmp_path / "o") as (user_model, _):
        fresh = user_model.build_model()
        assert safetensors.torch.load_model(fresh, tmp_path / "saved.safetensors") == (
            set(), [])
        assert torch.equal(fresh.out.weight, state["embed.weight"])


def test_init_from_names_missing_and_unexpected_keys(tmp_path: Path) -> None:
    compile_to(MODELS / "init_buffers.py", tmp_path / "o", gpus=1, batch_size=16)
    with emitted_modules(tmp_path / "o") as (user_model, _):
        state = user_model.build_model().state_dict()
    state = {k: v for k, v in state.items() if k not in ("mix.bias", "out.weight")}
    safetensors.torch.save_file({**state, "extra.weight": torch.zeros(2)},
                                tmp_path / "w.safetensors")
    result = run_alone(tmp_path / "o", "--steps", "1", "--init-from",
                       str(tmp_path / "w.safetensors"))
    assert result.returncode == 1, result.stderr
    assert "1 missing key(s) (mix.bias), 1 unexpected key(s) (extra.weight)" in result.stderr
    result = run_alone(tmp_path / "o", "--steps", "1", "--init-from", str(tmp_path))
    assert "no model.safetensors, pytorch_model.bin or their *.index.json" in result.stderr


@pytest.mark.parametrize("shard_size", [None, "40KB"])
def test_a_tiny_hugging_face_llama_loads_with_its_first_loss(shard_size: str | None,
                                                             tmp_path: Path) -> None:
    """save_pretrained's directory (one file, or shards and their index) into a model file that
    holds the Llama as self.lm (--init-prefix lm.), on 2 stages: the first loss is Hugging
    Face's own forward's."""
    transformers = pytest.importorskip("transformers")
    compile_to(MODELS / "tiny_llama.py", tmp_path / "o", gpus=2, batch_size=8)
    with emitted_modules(tmp_path / "o") as (user_model, _):
        torch.manual_seed(7)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**user_model.CONFIG))
        hf.save_pretrained(tmp_path / "hf", max_shard_size=shard_size or "5GB")
        index = (tmp_path / "hf" / "model.safetensors.index.json").is_file()
        assert index == (shard_size is not None)
        torch.manual_seed(0 * 1_000_003 + 1)  # train.py's data of step 1, seed 0
        inputs, targets = user_model.sample_batch(8)
        with torch.no_grad():
            expected = user_model.loss_fn(hf(input_ids=inputs, use_cache=False).logits,
                                          targets).item()
    text = run_forked_text(tmp_path / "o", 2, "--steps", "1", "--init-from",
                           str(tmp_path / "hf"), "--init-prefix", "lm.")
    assert losses_of(text)[0] == pytest.approx(expected, abs=1e-5)
    if shard_size is None:
        hint = run_alone_error(tmp_path, "--init-from", str(tmp_path / "hf"))
        assert "here: --init-prefix 'lm.'" in hint


def run_alone_error(tmp_path: Path, *args: str) -> str:
    """A one-process plan of the tiny Llama, run with `args`: its error output."""
    compile_to(MODELS / "tiny_llama.py", tmp_path / "alone", gpus=1, batch_size=8)
    result = run_alone(tmp_path / "alone", "--steps", "1", *args)
    assert result.returncode == 1
    return result.stderr


def test_safetensors_written_in_parts_load_with_the_library(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=1, batch_size=16)
    weights = weights_module(tmp_path / "o")
    tensors = {"b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": torch.tensor(3.5),
               "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4),
               "ids": torch.arange(5, dtype=torch.int64)[::2]}
    real_pwrite = os.pwrite
    # As Linux writes at most 2 GiB at a time: here at most 5 bytes, so every tensor takes
    # several writes.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights.os, "pwrite",
                      lambda fd, data, offset: real_pwrite(fd, data[:5], offset))
        weights.write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    loaded = safetensors.torch.load_file(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_save_model_says_how_to_load_a_group_norm_model(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=8)
    text = run_forked_text(tmp_path / "o", 2, "--steps", "1", "--save-model",
                           str(tmp_path / "r.safetensors"))
    assert "were trained as GroupNorm and are saved so; load into `model = build_model(); " \
        "stages.rewrite_norms(model)`" in text
    with emitted_modules(tmp_path / "o") as (user_model, stages):
        model = user_model.build_model()
        stages.rewrite_norms(model)
        assert safetensors.torch.load_model(model, tmp_path / "r.safetensors") == (set(), [])


DERIVED = '''
import torch
from torch import nn


class Derived(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("snapshot", self.fc.weight.detach().clone(), persistent=False)

    def forward(self, x):
        return self.fc(x) @ self.snapshot


def build_model():
    return Derived()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))
'''


def test_a_buffer_made_from_a_parameter_is_a_clear_error(tmp_path: Path) -> None:
    """Pretrained weights cannot give a buffer outside the state dict that __init__ copied
    from a parameter: the script names it instead of training on an empty tensor."""
    (tmp_path / "derived.py").write_text(DERIVED)
    compile_to(tmp_path / "derived.py", tmp_path / "o", gpus=1, batch_size=8)
    with emitted_modules(tmp_path / "o") as (user_model, _):
        safetensors.torch.save_file(user_model.build_model().state_dict(),
                                    tmp_path / "w.safetensors")
    result = run_alone(tmp_path / "o", "--steps", "1", "--init-from",
                       str(tmp_path / "w.safetensors"))
    assert result.returncode == 1 and "weights: snapshot has no value" in result.stderr


def test_a_parameter_registered_twice_stays_one_on_meta(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=1, batch_size=16)
    weights = weights_module(tmp_path / "o")
    with weights.parameters_on_meta():
        shared = torch.nn.Parameter(torch.ones(3))
        first, second = torch.nn.Module(), torch.nn.Module()
        first.w, second.w = shared, shared
    assert first.w.is_meta and first.w is second.w


def test_resume_on_a_pipeline_restores_a_buffer_made_from_a_parameter(tmp_path: Path) -> None:
    """Resumed, a pipeline's ranks build nothing: the buffer outside the state dict that
    __init__ copied from a parameter comes from the checkpoint, as the weights do."""
    (tmp_path / "derived.py").write_text(DERIVED)
    compile_to(tmp_path / "derived.py", tmp_path / "o", gpus=2, batch_size=8)
    whole = run_forked(tmp_path / "o", 2, "--steps", "3", logs=tmp_path / "whole")
    checkpoint = ("--checkpoint-dir", str(tmp_path / "ck"))
    run_forked(tmp_path / "o", 2, "--steps", "2", *checkpoint, logs=tmp_path / "first")
    rest = run_forked_text(tmp_path / "o", 2, "--steps", "3", *checkpoint, "--resume",
                           logs=tmp_path / "rest")
    assert steps_of(rest) == {3: whole[2]}

"""The output directory: complete, deterministic, atomic, and the templates ship in the wheel."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES, compile_to
from pipec import host_allocator
from pipec.errors import OutputError, TraceError

PLAN_KEYS = {"gpus", "nodes", "pp", "dp", "global_batch", "micro_batch", "num_micro_batches",
             "schedule", "hardware", "stages", "predicted", "baselines", "norm_rewrites"}
STAGE_KEYS = {"index", "modules", "params", "fwd_flops", "bwd_flops", "activation_bytes",
              "memory_bytes", "time_s", "boundary_bytes"}
FILES = ["allocator.py", "checkpoints.py", "data.py", "evaluation.py", "gradients.py", "launch.sh",
         "launch.slurm", "logs.py", "metrics.py", "model.py", "pipeline.py", "plan.json",
         "report.md", "stages.py", "timeline.svg", "torch_compat.py", "train.py", "weights.py"]


def tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_output_files_and_plan_keys(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "out", gpus=4, batch_size=32)
    assert sorted(tree(tmp_path / "out")) == FILES
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert set(plan) >= PLAN_KEYS
    assert all(set(stage) >= STAGE_KEYS for stage in plan["stages"])
    assert {"iteration_s", "samples_per_s", "bubble", "peak_memory_bytes"} <= set(
        plan["predicted"])
    assert [b["name"] for b in plan["baselines"]] == ["uniform", "parameters", "torchgpipe",
                                                      "conventional"]
    assert plan["micro_batch"] * plan["num_micro_batches"] * plan["dp"] == 32


def test_compiling_twice_gives_identical_bytes(tmp_path: Path) -> None:
    compile_to(SAMPLES / "gpt.py", tmp_path / "a", gpus=2, batch_size=16)
    compile_to(SAMPLES / "gpt.py", tmp_path / "b", gpus=2, batch_size=16)
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    assert str(tmp_path) not in (tmp_path / "a" / "train.py").read_text()


def test_emitted_script_imports_no_pipec(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "out", gpus=2, batch_size=16)
    for name in ("train.py", "stages.py", "weights.py", "checkpoints.py", "metrics.py",
                 "data.py", "evaluation.py", "gradients.py", "pipeline.py", "torch_compat.py",
                 "logs.py", "allocator.py"):
        text = (tmp_path / "out" / name).read_text()
        assert "import pipec" not in text and "from pipec" not in text
        compile(text, name, "exec")


def test_report_shows_stages_choice_and_run_command(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "resnet.py", tmp_path / "out", gpus=4, batch_size=32)
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"micro-batch **{plan.micro_batch}**" in report
    rows = [line for line in report.splitlines() if re.match(r"\|\s+\d+ \| ", line)]
    assert [int(row.split("|")[1]) for row in rows[:plan.pp]] == list(range(plan.pp))
    assert "torchrun --standalone --nproc_per_node 4 train.py" in report
    svg = (tmp_path / "out" / "timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") > 4 * plan.num_micro_batches * 2


def test_existing_foreign_directory_is_refused_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"not a pipec output.*--force"):
        compile_to(SAMPLES / "mlp.py", out)
    assert (out / "notes.txt").read_text() == "mine"
    compile_to(SAMPLES / "mlp.py", out, force=True)
    assert sorted(tree(out)) == FILES


def test_previous_output_is_replaced_whole(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=2)
    (tmp_path / "out" / "stale.txt").write_text("old")
    compile_to(SAMPLES / "mlp.py", tmp_path / "out", gpus=1)
    assert sorted(tree(tmp_path / "out")) == FILES
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["pp"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left


def test_failure_leaves_no_partial_output(tmp_path: Path) -> None:
    model = tmp_path / "untraceable.py"
    model.write_text("import torch\n\nclass M(torch.nn.Module):\n"
                     "    def forward(self, x):\n"
                     "        if x.sum() > 0:\n            return x\n        return -x\n\n"
                     "def build_model():\n    return M()\n\n"
                     "def sample_batch(b):\n    return torch.randn(b, 3), torch.zeros(b)\n")
    with pytest.raises(TraceError, match=r"untraceable\.py:5: torch\.fx cannot trace"):
        compile_to(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wheel_contains_the_templates(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("pipec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for template in ("train.py.j2", "stages.py.j2", "weights.py.j2", "checkpoints.py.j2",
                     "metrics.py.j2", "data.py.j2", "gradients.py.j2", "pipeline.py.j2",
                     "torch_compat.py.j2", "report.md.j2", "launch.sh.j2", "launch.slurm.j2",
                     "logs.py.j2", "evaluation.py.j2"):
        assert f"pipec/templates/{template}" in names


def test_cpu_plans_train_under_pipecs_allocator_module(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "cpu", gpus=1, batch_size=8)
    compile_to(SAMPLES / "mlp.py", tmp_path / "gpu", gpus=1, batch_size=8, hardware="h100-80g")
    for plan in ("cpu", "gpu"):  # one source: pipec's module, copied
        copied = (tmp_path / plan / "allocator.py").read_text()
        assert copied.endswith(inspect.getsource(host_allocator))
    cpu_script = (tmp_path / "cpu" / "train.py").read_text()
    assert ('\nif __name__ == "__main__":\n    allocator.run_under_tcmalloc(say_if_missing=True)\n'
            in cpu_script)
    assert "allocator" not in (tmp_path / "gpu" / "train.py").read_text()
    # Imported by another program (as tests do), the script starts nothing again.
    imported = ("import importlib.util; spec = importlib.util.spec_from_file_location("
                "'emitted_train', 'train.py'); spec.loader.exec_module("
                "importlib.util.module_from_spec(spec)); import allocator; "
                "print(allocator.running_allocator())")
    result = subprocess.run([sys.executable, "-c", imported], cwd=tmp_path / "cpu",
                            capture_output=True, text=True, timeout=120, check=False,
                            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["glibc"]

"""The emitted files read like hand-written code: train.py passes the project's ruff rules,
stages.py passes pyflakes, and stages.py carries the all-reduce BatchNorm only where the plan
synchronizes BatchNorm."""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyflakes.api
import pyflakes.reporter
import pytest

from conftest import ROOT, SAMPLES, compile_to
from pipec.frontend.normalization import to_group_norm_source

PLANS: dict[str, tuple[Path, dict[str, Any]]] = {
    "gpt-1f1b": (SAMPLES / "gpt.py", {"gpus": 2, "batch_size": 16, "schedule": "1f1b"}),
    "resnet-group": (SAMPLES / "resnet.py", {"gpus": 2, "batch_size": 16, "norm": "group"}),
    # Pure data parallelism: --norm auto synchronizes BatchNorm over the replicas.
    "resnet-sync": (SAMPLES / "resnet.py", {"gpus": 2, "pp": 1, "batch_size": 16}),
    "gpt-interleaved": (SAMPLES / "gpt.py", {"gpus": 2, "batch_size": 16,
                                             "schedule": "interleaved"}),
    "gpt-tp2xpp2": (SAMPLES / "gpt.py", {"gpus": 4, "pp": 2, "tp": "2", "batch_size": 16}),
}
MAX_FUNCTION_LINES = 60


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each plan compiled once for the whole module."""
    root = tmp_path_factory.mktemp("emitted")
    for name, (model, options) in PLANS.items():
        compile_to(model, root / name, **options)
    return {name: root / name for name in PLANS}


@pytest.mark.parametrize("name", PLANS)
def test_train_py_passes_ruff(name: str, outputs: dict[str, Path]) -> None:
    # From the output directory, so that `model` and `stages` sort as the script's own modules.
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                             str(ROOT / "pyproject.toml"), "--output-format", "concise",
                             "train.py", "weights.py", "checkpoints.py", "metrics.py",
                             "data.py", "evaluation.py", "gradients.py", "pipeline.py",
                             "torch_compat.py", "logs.py", "allocator.py",
                             *(["tensor_parallel.py"] if "tp" in name else [])],
                            cwd=outputs[name], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", PLANS)
def test_stages_py_passes_pyflakes(name: str, outputs: dict[str, Path]) -> None:
    messages = io.StringIO()
    reporter = pyflakes.reporter.Reporter(messages, messages)
    problems = pyflakes.api.check((outputs[name] / "stages.py").read_text(), "stages.py",
                                  reporter)
    assert problems == 0, messages.getvalue()


@pytest.mark.parametrize("name", PLANS)
def test_train_py_has_small_functions_and_no_dangling_commas(name: str,
                                                            outputs: dict[str, Path]) -> None:
    text = (outputs[name] / "train.py").read_text()
    lengths = {node.name: (node.end_lineno or node.lineno) - node.lineno + 1
               for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef)}
    assert max(lengths.values()) <= MAX_FUNCTION_LINES, lengths
    stages = (outputs[name] / "stages.py").read_text()
    assert ", )" not in text and ", )" not in stages


def test_stage_tuple_renders_like_hand_written_code(outputs: dict[str, Path]) -> None:
    assert "\nSTAGES = (Stage0, Stage1)\n" in (outputs["gpt-1f1b"] / "stages.py").read_text()
    assert "\nSTAGES = (Stage0,)\n" in (outputs["resnet-sync"] / "stages.py").read_text()


@pytest.mark.parametrize("name", PLANS)
def test_all_reduce_batch_norm_is_emitted_only_when_the_plan_syncs(
        name: str, outputs: dict[str, Path]) -> None:
    rewrites = json.loads((outputs[name] / "plan.json").read_text())["norm_rewrites"]
    synchronized = any(r["to"] == "SyncBatchNorm" for r in rewrites)
    assert synchronized == (name == "resnet-sync")
    stages = (outputs[name] / "stages.py").read_text()
    for code in ("class AllReduceBatchNorm(", "class AllReduceBatchNormFunction(",
                 "def to_sync_batch_norm(", "import torch.distributed as dist"):
        assert (code in stages) == synchronized, code


@pytest.mark.parametrize("name", PLANS)
def test_group_norm_conversion_is_pipecs_own_when_the_plan_groups(
        name: str, outputs: dict[str, Path]) -> None:
    rewrites = json.loads((outputs[name] / "plan.json").read_text())["norm_rewrites"]
    grouped = any(r["to"] == "GroupNorm" for r in rewrites)
    assert grouped == (name == "resnet-group")
    assert (to_group_norm_source() in (outputs[name] / "stages.py").read_text()) == grouped


def test_mkl_keeps_no_buffer_pool_from_before_torch_loads(outputs: dict[str, Path]) -> None:
    # MKL reads MKL_DISABLE_FAST_MM when torch loads it: set after `import torch`, its pool of
    # packing buffers stays, and fp32 host memory exceeds the plan (docs/runtime.md).
    body = ast.parse((outputs["gpt-1f1b"] / "train.py").read_text()).body
    setting = next(i for i, node in enumerate(body)
                   if "MKL_DISABLE_FAST_MM" in ast.unparse(node))
    first_torch = next(i for i, node in enumerate(body)
                       if isinstance(node, ast.Import | ast.ImportFrom)
                       and "torch" in ast.unparse(node))
    assert setting < first_torch

"""The same plans, compiled by pipec on each supported torch release and trained there, give the
losses they give on this test run's torch (within 1e-5): a 2-stage and a 1-stage plan of the
sample GPT. The other releases' virtual environments are built by `make test-torch`, which
names them in PIPEC_TORCH_VENVS; this run's own torch is the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SAMPLES, losses_of

VENVS = [Path(v) for v in os.environ.get("PIPEC_TORCH_VENVS", "").split()]
PLANS = {"2 stages": ["--gpus", "2", "--pp", "2", "--schedule", "1f1b", "--micro-batch", "4"],
         "1 stage": ["--gpus", "1"]}
STEPS = 4
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(not VENVS, reason="no other torch release: run make test-torch")


def compile_and_train(bin_dir: Path, out: Path, flags: list[str]) -> tuple[str, list[float]]:
    """Compile samples/gpt.py with ``bin_dir``'s pipec, train it with its torchrun; the torch
    version and the losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEC_MEASURE": "off"}
    subprocess.run([str(bin_dir / "pipec"), "compile", str(SAMPLES / "gpt.py"), *flags,
                    "--batch-size", "16", "--hardware", "cpu", "-o", str(out)], check=True,
                   env=env, capture_output=True)
    processes = flags[flags.index("--gpus") + 1]
    run = subprocess.run([str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node",
                          processes, "train.py", "--steps", str(STEPS)], cwd=out, env=env,
                         capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    version = subprocess.run([str(bin_dir / "python"), "-c",
                              "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return version, losses_of(run.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Each plan's losses on this run's torch."""
    root = tmp_path_factory.mktemp("reference")
    here = Path(sys.executable).parent
    return {name: compile_and_train(here, root / name.replace(" ", "-"), flags)[1]
            for name, flags in PLANS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("venv", VENVS, ids=str)
@pytest.mark.parametrize("plan", PLANS)
def test_a_plan_trains_to_the_same_losses_on_another_torch(venv: Path, plan: str,
                                                           reference: dict[str, list[float]],
                                                           tmp_path: Path) -> None:
    version, losses = compile_and_train(venv / "bin", tmp_path / "out", PLANS[plan])
    assert version != torch.__version__, f"{venv} has this run's own torch"
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference[plan], abs=TOLERANCE), (version, torch.__version__)

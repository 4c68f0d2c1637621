"""The supported torch range: checked at `pipec compile` and at the emitted script's start, and
stated once (pipec.torchcompat) for pyproject.toml, the compiler and the emitted script."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SAMPLES, compile_to
from pipec.cli import main
from pipec.torchcompat import (
    SUPPORTED_PIP,
    SUPPORTED_TORCH,
    UnsupportedTorchError,
    check_torch,
    counting_fsdp_reductions,
    release,
)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1"])
def test_every_release_in_the_range_is_accepted(version: str) -> None:
    check_torch(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.15.0+cu130", "2.16.0.dev20270101", "3.0.0"])
def test_a_release_outside_the_range_is_refused_with_the_range_and_the_fix(version: str) -> None:
    with pytest.raises(UnsupportedTorchError, match=r"2\.11 to 2\.14.*pip install 'torch>="):
        check_torch(version)


def test_release_reads_major_and_minor() -> None:
    assert release("2.11.0+cu130") == (2, 11)
    assert release("2.15.0a0+git1234") == (2, 15)
    assert SUPPORTED_TORCH[0] <= release() <= SUPPORTED_TORCH[1]


def test_pyproject_states_the_supported_range() -> None:
    dependencies = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines()
                        if line.startswith("dependencies = "))
    assert f'"{SUPPORTED_PIP}"' in dependencies


def test_compile_on_an_unsupported_torch_is_a_user_error(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    code = main(["compile", str(SAMPLES / "mlp.py"), "--gpus", "2", "--hardware", "cpu",
                 "-o", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch 2.10.0 is not supported" in err
    assert not (tmp_path / "out").exists()


def test_the_emitted_script_stops_at_its_start_on_an_unsupported_torch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_to(SAMPLES / "mlp.py", out, gpus=1, batch_size=8)
    # The script run as torchrun runs it, on a torch that says it is 2.15.
    start = ("import runpy, sys, torch; torch.__version__ = '2.15.0+cu130'; "
             "sys.argv = ['train.py', '--steps', '1']; runpy.run_path('train.py', "
             "run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", start], cwd=out, capture_output=True,
                            text=True, check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert "torch 2.15.0+cu130 is not supported" in result.stderr
    assert "runs on torch 2.11 to 2.14" in result.stderr


def test_fsdp_reductions_are_counted_once_per_unit_and_backward(tmp_path: Path) -> None:
    """The wrapper around FSDP2's private reduction finds it on the installed release and
    sees each unit's reduction call: two units, two backwards, four calls. It runs in a forked
    child: a backward in the test process would start a CUDA build's autograd threads, after
    which the ranks later tests fork cannot run one."""
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.apply(_fsdp_reductions_in_two_backwards, (str(tmp_path / "store"),)) == 4


def _fsdp_reductions_in_two_backwards(store_path: str) -> int:
    """One process, a CPU mesh (FSDP's default mesh would be a GPU's where one is visible):
    the reductions counted over two backwards, and none after the block."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        calls: list[int] = []
        with counting_fsdp_reductions(lambda: calls.append(1)):
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
        model(torch.ones(2, 4)).sum().backward()  # after the block: not counted
    finally:
        dist.destroy_process_group()
    return len(calls)

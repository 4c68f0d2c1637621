"""Cluster launches of the emitted script: SLURM tasks started by `srun` without torchrun, one
visible GPU per task, nodes sharing a temporary directory, and the collectives' timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLES, compile_to, emitted_train, free_port, losses_of, run_forked


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cluster") / "o"
    compile_to(SAMPLES / "mlp.py", out, gpus=2, batch_size=16)
    return out


@pytest.mark.parametrize(("nodelist", "host"), [
    ("gpu[07-09,12],cpu3", "gpu07"), ("node1", "node1"), ("a-b[1-2]", "a-b1"),
    ("n[3]", "n3"), ("x1,x2", "x1")])
def test_the_first_host_of_a_slurm_node_list(two_stages: Path, nodelist: str, host: str
                                             ) -> None:
    assert emitted_train(two_stages).first_host(nodelist) == host


def test_slurm_variables_become_torch_distributeds(two_stages: Path) -> None:
    train = emitted_train(two_stages)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_JOB_NODELIST": "gpu[04-05]", "SLURM_JOB_ID": "123456"}
    assert train.slurm_environment(slurm) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu04",
        "MASTER_PORT": str(20000 + 123456 % 20000)}
    chosen = train.slurm_environment({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "29500"})
    assert (chosen["MASTER_ADDR"], chosen["MASTER_PORT"]) == ("head", "29500")
    assert train.slurm_environment({"HOME": "/root"}) is None


def test_a_task_that_sees_one_gpu_uses_it(two_stages: Path) -> None:
    train = emitted_train(two_stages)
    assert train.cuda_index(3, 1) == 0  # srun --gpus-per-task=1: each task sees its own
    assert train.cuda_index(1, 4) == 1
    with pytest.raises(SystemExit, match="local rank 4 but only 2 GPU"):
        train.cuda_index(4, 2)


def test_nodes_sharing_a_temporary_directory_build_apart(two_stages: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Without GROUP_RANK (srun without torchrun) the node's host name keeps the seeded builds
    of two nodes apart."""
    weights = emitted_train(two_stages).weights
    environ = {"TORCHELASTIC_RUN_ID": "job", "MASTER_PORT": "29500"}
    folders = set()
    for host in ("node1", "node2"):
        monkeypatch.setattr(weights.socket, "gethostname", lambda host=host: host)
        folders.add(weights.build_folder(environ))
    assert len(folders) == 2


def test_srun_tasks_without_torchrun_train_as_torchrun_ranks(two_stages: Path) -> None:
    """Two real processes with only SLURM's variables (as `srun --ntasks 2 python train.py`
    starts them) train to the forked ranks' losses."""
    reference = run_forked(two_stages, 2, "--steps", "3", "--seed", "2")
    port, environ = free_port(), {k: v for k, v in os.environ.items()
                                  if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    tasks = [subprocess.Popen(
        [sys.executable, "train.py", "--steps", "3", "--seed", "2", "--collective-timeout",
         "120"], cwd=two_stages, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
             "SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}) for rank in range(2)]
    printed = "".join(task.communicate(timeout=300)[0] for task in tasks)
    assert [task.returncode for task in tasks] == [0, 0], printed
    assert losses_of(printed) == reference

"""The launch scripts in the output directory: launch.sh on one node and on two (two torchrun
agents on loopback), and launch.slurm run by stand-ins for SLURM's srun and scontrol (SLURM
does not run here): each trains to the forked ranks' losses."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from conftest import SAMPLES, compile_to, free_port, losses_of, run_forked

BIN = str(Path(sys.executable).parent)  # torchrun, as a user's activated venv puts it on PATH


def _environment(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return {**base, "PATH": f"{BIN}:{base['PATH']}", "OMP_NUM_THREADS": "1", **extra}


def _run(commands: list[list[str]], cwd: Path, environments: list[dict[str, str]]) -> str:
    started = [subprocess.Popen(command, cwd=cwd, env=environment, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for command, environment in zip(commands, environments, strict=True)]
    printed = [process.communicate(timeout=300)[0] for process in started]
    assert [p.returncode for p in started] == [0] * len(started), "\n".join(printed)[-3000:]
    return "".join(printed)


def test_launch_sh_on_one_node(tmp_path: Path) -> None:
    out = tmp_path / "o"
    compile_to(SAMPLES / "mlp.py", out, gpus=2, batch_size=16)
    assert os.stat(out / "launch.sh").st_mode & stat.S_IXUSR
    printed = _run([["bash", str(out / "launch.sh"), "--steps", "3", "--seed", "2"]], tmp_path,
                   [_environment()])
    assert losses_of(printed) == run_forked(out, 2, "--steps", "3", "--seed", "2")


def test_launch_sh_on_two_nodes_meets_at_head(tmp_path: Path) -> None:
    out = tmp_path / "o"
    compile_to(SAMPLES / "mlp.py", out, gpus=4, nodes=2, pp=2, batch_size=16)
    node = _environment(HEAD="127.0.0.1", PORT=str(free_port()), RUN_ID="launch-test")
    printed = _run([["bash", "launch.sh", "--steps", "3", "--seed", "2"]] * 2, out, [node] * 2)
    assert losses_of(printed) == run_forked(out, 4, "--steps", "3", "--seed", "2")


def test_launch_sh_on_two_nodes_needs_head(tmp_path: Path) -> None:
    out = tmp_path / "o"
    compile_to(SAMPLES / "mlp.py", out, gpus=4, nodes=2, pp=2, batch_size=16)
    run = subprocess.run(["bash", "launch.sh"], cwd=out, env=_environment(), text=True,
                         capture_output=True, check=False)
    assert run.returncode != 0 and "set HEAD to the address of the first node" in run.stderr


SRUN = """#!/bin/bash
# Stands in for SLURM's srun: the command once per node (--nodes=K), all at once.
nodes=1; while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
for node in $(seq 0 $((nodes - 1))); do SLURM_NODEID=$node "$@" & done
status=0; for job in $(jobs -p); do wait "$job" || status=1; done; exit $status
"""


def test_launch_slurm_starts_torchrun_on_each_node(tmp_path: Path) -> None:
    out = tmp_path / "o"
    compile_to(SAMPLES / "mlp.py", out, gpus=4, nodes=2, pp=2, batch_size=16)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "srun").write_text(SRUN)
    (shims / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    script = (out / "launch.slurm").read_text()
    assert "#SBATCH --nodes=2" in script and "--gpus-per-node" not in script  # a CPU plan
    job = _environment(SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="42",
                       SLURM_SUBMIT_DIR=str(out), MASTER_PORT=str(free_port()))
    job["PATH"] = f"{shims}:{job['PATH']}"
    printed = _run([["bash", str(out / "launch.slurm"), "--steps", "3", "--seed", "2"]],
                   tmp_path, [job])
    assert losses_of(printed) == run_forked(out, 4, "--steps", "3", "--seed", "2")


def test_a_gpu_plan_asks_slurm_for_its_gpus(tmp_path: Path) -> None:
    compile_to(SAMPLES / "mlp.py", tmp_path / "o", gpus=16, nodes=2, pp=2, batch_size=64,
               hardware="a100-80g")
    assert "#SBATCH --gpus-per-node=8" in (tmp_path / "o" / "launch.slurm").read_text()

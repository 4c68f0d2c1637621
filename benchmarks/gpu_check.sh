#!/usr/bin/env bash
# The CUDA/NCCL path of the emitted script, and predicted against measured step time and memory.
#
#   bash benchmarks/gpu_check.sh            # on a machine with an NVIDIA GPU and torch (CUDA)
#   PYTHON=.venv/bin/python HARDWARE=h200 STEPS=30 bash benchmarks/gpu_check.sh
#
# Compiles samples/gpt.py and samples/resnet.py for one GPU (--gpus 1, the preset HARDWARE),
# runs each emitted train.py with --metrics, and prints `pipec compare`: per-stage forward and
# backward time, step time and peak CUDA memory, predicted and measured. GPT runs again with a
# calibration measured on the device itself (pipec profile --device cuda). With two or more GPUs it
# also runs a 2-stage pipeline over NCCL with torchrun. The long-sequence LM
# (benchmarks/models/long_lm.py) checks the memory model where it matters: logits, loss and
# receive buffers, in fp32 and bf16; then its largest micro-batch on a 4 GiB device of the same
# kind is run (benchmarks/memory_fidelity.py --largest-micro-batch), and the memory each process
# holds before its model (CUDA context, NCCL communicator) is measured. ALLOW_CPU=1
# HARDWARE=cpu runs the same steps without a GPU (gloo; memory as
# the CPU measures it), to check the script itself. PROFILE=0 leaves out the calibrated run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
case $PYTHON in  # absolute, since the runs below change directory
    /*) ;;
    */*) PYTHON="$PWD/$PYTHON" ;;
    *) PYTHON=$(command -v "$PYTHON" || echo "$PYTHON") ;;
esac
HARDWARE=${HARDWARE:-h200}
STEPS=${STEPS:-30}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! "$PYTHON" -c "import torch, pipec" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch and pipec; set PYTHON to an environment with both" >&2
    exit 2
fi
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -lt 1 ] && [ "${ALLOW_CPU:-0}" != 1 ]; then
    echo "gpu_check: no CUDA device visible to $PYTHON; nothing to check (ALLOW_CPU=1 runs" \
        "the same steps on the CPU, to check the script itself)" >&2
    exit 2
fi
if [ "$gpus" -ge 1 ]; then
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
fi

check() {  # name, model file, batch, extra compile options...
    local name=$1 model=$2 batch=$3
    shift 3
    "$PYTHON" -m pipec.cli compile "$model" --batch-size "$batch" --hardware "$HARDWARE" \
        -o "$work/$name" "$@"
    echo "=== $name: $(grep -m1 '^Plan:' "$work/$name/train.py")"
}

run_one() {  # name
    (cd "$work/$1" && "$PYTHON" train.py --steps "$STEPS" --metrics metrics.json | tail -2)
    "$PYTHON" -m pipec.cli compare "$work/$1" "$work/$1/metrics.json"
}

check gpt-1gpu samples/gpt.py 64 --gpus 1
run_one gpt-1gpu
check gpt-1gpu-bf16 samples/gpt.py 64 --gpus 1 --precision bf16
run_one gpt-1gpu-bf16
check resnet-1gpu samples/resnet.py 64 --gpus 1
run_one resnet-1gpu
check long-lm-1gpu benchmarks/models/long_lm.py 16 --gpus 1 --micro-batch 2
run_one long-lm-1gpu
check long-lm-1gpu-bf16 benchmarks/models/long_lm.py 16 --gpus 1 --micro-batch 2 --precision bf16
run_one long-lm-1gpu-bf16
"$PYTHON" benchmarks/memory_fidelity.py --only --largest-micro-batch --hardware "$HARDWARE" \
    --device-mib "${DEVICE_MIB:-4096}" --steps 3
if [ "$gpus" -ge 1 ]; then  # what a process holds beyond its tensors: the hardware's process_bytes
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 "$PYTHON" - <<'PROBE'
import torch
import torch.distributed as dist
def used():
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**20
torch.cuda.init(); torch.zeros(1, device="cuda")
print(f"process memory: CUDA context {used():.0f} MiB", end="")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(torch.ones(1, device="cuda")); torch.cuda.synchronize()
print(f", with an NCCL communicator {used():.0f} MiB (not counting PyTorch's allocator)")
dist.destroy_process_group()
PROBE
fi
# The same GPT plan with compute times measured on this device (pipec profile) instead of the
# preset's roofline (PROFILE=0 skips it).
if [ "${PROFILE:-1}" = 1 ]; then
    device=$([ "$gpus" -ge 1 ] && echo cuda || echo cpu)
    "$PYTHON" -m pipec.cli profile samples/gpt.py --batch-size 64 --device "$device" \
        -o "$work/gpt-calibration.json"
    check gpt-1gpu-calibrated samples/gpt.py 64 --gpus 1 --calibration "$work/gpt-calibration.json"
    run_one gpt-1gpu-calibrated
fi
if [ "$gpus" -ge 2 ]; then
    check gpt-2gpu samples/gpt.py 64 --gpus 2 --pp 2 --schedule 1f1b
    (cd "$work/gpt-2gpu" && "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 \
        train.py --steps "$STEPS" --metrics metrics.json | tail -2)
    "$PYTHON" -m pipec.cli compare "$work/gpt-2gpu" "$work/gpt-2gpu/metrics.json"
    check long-lm-2gpu benchmarks/models/long_lm.py 16 --gpus 2 --pp 2 --schedule 1f1b \
        --micro-batch 1
    (cd "$work/long-lm-2gpu" && "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node 2 train.py --steps "$STEPS" --metrics metrics.json | tail -2)
    "$PYTHON" -m pipec.cli compare "$work/long-lm-2gpu" "$work/long-lm-2gpu/metrics.json"
fi

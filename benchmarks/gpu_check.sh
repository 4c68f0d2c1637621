#!/usr/bin/env bash
# The device check from a plain checkout: install this checkout into $PYTHON's environment
# (offline: no index, no dependencies; torch must be there), then run benchmarks/gpu_check.py,
# which writes summary.json and one log per phase to $OUT.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh             # on a machine with a GPU
#   PYTHON=.venv/bin/python OUT=out/gpu-check bash benchmarks/gpu_check.sh --dry-run   # on a CPU
#   HARDWARE=h100-80g STEPS=30 bash benchmarks/gpu_check.sh --phase losses memory
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-out/gpu-check}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch; set PYTHON to an environment with it" >&2
    exit 2
fi
# The templates load as package data (pipec.templates): the checkout must be installed, not
# only on PYTHONPATH.
if ! "$PYTHON" -c "import pipec.templates, jinja2, tabulate, numpy, safetensors" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation -e . ||
        { echo "gpu_check: could not install this checkout offline (needs setuptools, jinja2," \
            "tabulate, numpy and safetensors in $PYTHON's environment)" >&2; exit 2; }
fi
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT" ${STEPS:+--steps "$STEPS"} "$@"

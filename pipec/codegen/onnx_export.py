"""Optional last pass (`compile --onnx`): each stage as `stage_{k}.onnx`, checked by onnx.

The stages are the emitted stages.py classes, built from the model with seed 0 (the emitted
train.py's default, so the weights are its initial ones) in eval mode, exported with
`torch.onnx.export(dynamo=True)` at the plan's micro-batch size and checked with
`onnx.checker.check_model(full_check=True)`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipec.codegen.output_dir import emitted_modules
from pipec.errors import ConfigError, ExportError

EXTRA_HINT = "install the onnx extra: pip install 'pipec[onnx]'"


def require_onnx() -> None:
    """Fail before any work when the exporter's dependencies are missing."""
    for name in ("onnx", "onnxscript"):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--onnx needs the {name} package; {EXTRA_HINT}")


def export_stages(directory: Path) -> tuple[str, ...]:
    """Write and check stage_{k}.onnx for every stage of the emitted files in ``directory``."""
    import onnx

    with emitted_modules(directory) as (user_model, stages):
        torch.manual_seed(0)
        model = user_model.build_model()
        stages.rewrite_norms(model)
        names = []
        for k, stage_class in enumerate(stages.STAGES):
            path = directory / f"stage_{k}.onnx"
            _export(stage_class(model).eval(), example_inputs(stage_class.INPUTS), path, k)
            _strip_metadata(path)
            onnx.checker.check_model(str(path), full_check=True)
            names += sorted(p.name for p in directory.glob(f"stage_{k}.onnx*"))
    return tuple(names)


def example_inputs(specs: tuple[tuple[Any, str, bool], ...]) -> tuple[torch.Tensor, ...]:
    """Inputs with the boundary's shapes and dtypes: normal floats, zero integers (always
    valid indices)."""
    tensors = []
    for shape, dtype_name, _ in specs:
        dtype = getattr(torch, dtype_name)
        tensors.append(torch.randn(shape, dtype=dtype) if dtype.is_floating_point
                       else torch.zeros(shape, dtype=dtype))
    return tuple(tensors)


# Protocol buffers stop at 2 GiB: larger stages keep their weights in stage_{k}.onnx.data.
EMBEDDED_LIMIT = 1 << 30


def _export(stage: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path,
            index: int) -> None:
    weights = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
    try:
        with _quiet():
            torch.onnx.export(stage, args, str(path), dynamo=True,
                              external_data=weights > EMBEDDED_LIMIT,
                              input_names=[f"input_{i}" for i in range(len(args))])
    except Exception as exc:  # the exporter raises many kinds; report which stage and why
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"stage {index} cannot be exported to ONNX: {first_line}; compile "
                          "without --onnx, or see docs/runtime.md for what exports") from None


def _strip_metadata(path: Path) -> None:
    """Drop the exporter's per-node source locations: they hold the staging directory's
    absolute path, and compiling twice must give identical files."""
    import onnx

    proto = onnx.load(str(path))
    for graph_nodes in [proto.graph.node, *(f.node for f in proto.functions)]:
        for node in graph_nodes:
            del node.metadata_props[:]
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    onnx.save(proto, str(path), save_as_external_data=external,
              location=f"{path.name}.data" if external else None)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter logs a warning per missing optional operator library; keep stderr clean."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):  # type: ignore[type-var]
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)

"""The output directory: written atomically (a failure never leaves a partial one), and read
back as train.py reads it (the emitted model.py and stages.py, imported)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from pipec.errors import OutputError

MARKER = "plan.json"  # a directory holding this (and train.py) is a previous pipec output


def write_atomically(out: Path, contents: dict[str, bytes],
                     finish: Callable[[Path], tuple[str, ...]] | None = None) -> tuple[str, ...]:
    """Write every file into a staging directory beside ``out``, run ``finish`` on it (more
    files, e.g. ONNX), and only then swap it into place: a failure leaves ``out`` as it was.
    Returns the names of the files written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in contents.items():
            _write(staging / name, data)
        extra = finish(staging) if finish else ()
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tuple(sorted((*contents, *extra)))


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} exists and is not a directory; choose another -o")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not force:
        raise OutputError(f"output directory {out} exists and is not a pipec output; "
                          "choose another -o or pass --force to replace it")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    if data.startswith(b"#!"):  # the launch scripts
        os.chmod(path, 0o755)


def _replace(staging: Path, out: Path) -> None:
    """Swap the finished staging directory into place of ``out``."""
    os.chmod(staging, 0o755)
    if not out.exists():
        staging.rename(out)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    retired.rmdir()
    out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)


_EMITTED = ("model", "stages", "weights", "checkpoints", "metrics", "data", "gradients",
            "pipeline", "logs", "torch_compat", "evaluation")


@contextlib.contextmanager
def emitted_modules(directory: Path) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Import the emitted model.py and stages.py as train.py does, then forget them (and the
    other modules train.py imports)."""
    saved: dict[str, ModuleType] = {name: sys.modules.pop(name) for name in _EMITTED
                                    if name in sys.modules}
    sys.path.insert(0, str(directory))
    try:
        yield _import(directory, "model"), _import(directory, "stages")
    finally:
        sys.path.remove(str(directory))
        for name in _EMITTED:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _import(directory: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

"""Load pass: import the user's model file and check the model-file contract (docs/models.md)."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pipec.errors import ModelFileError

REQUIRED = ("build_model", "sample_batch")
OPTIONAL_FUNCTIONS = ("loss_fn", "train_dataset", "eval_dataset", "eval_metrics")


@dataclass(frozen=True)
class ModelSpec:
    """The user's model file, imported, with the contract's callables."""

    path: Path
    source: bytes
    module: ModuleType
    has_loss_fn: bool
    has_train_dataset: bool

    def build_model(self) -> Any:
        return call_user(self.path, self.module.build_model)

    def sample_batch(self, batch_size: int) -> Any:
        return call_user(self.path, self.module.sample_batch, batch_size)


def load_model_file(path: str | Path) -> ModelSpec:
    """Import ``path`` as a fresh module and validate ``build_model`` / ``sample_batch``."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} not found; pass the path of a .py file")
    module = _import(path)
    for name in REQUIRED:
        if not callable(getattr(module, name, None)):
            raise ModelFileError(
                f"{path}: no function {name}() found; a model file defines "
                "build_model() -> nn.Module and sample_batch(batch_size) -> (inputs, targets)"
            )
    _check_optional(path, module)
    return ModelSpec(
        path=path,
        source=path.read_bytes(),
        module=module,
        has_loss_fn=callable(getattr(module, "loss_fn", None)),
        has_train_dataset=callable(getattr(module, "train_dataset", None)),
    )


def _check_optional(path: Path, module: ModuleType) -> None:
    """The optional names, where the file defines them: functions, and a positive token count."""
    for name in OPTIONAL_FUNCTIONS:
        if hasattr(module, name) and not callable(getattr(module, name)):
            raise ModelFileError(f"{path}: {name} is not a function; define {name}() "
                                 "(docs/models.md) or remove the name")
    tokens = getattr(module, "TOKENS_PER_SAMPLE", None)
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or tokens < 1):
        raise ModelFileError(f"{path}: TOKENS_PER_SAMPLE = {tokens!r}; give the tokens one "
                             "sample holds as a positive integer (for the logged tokens/s)")


def _import(path: Path) -> ModuleType:
    name = f"pipec_user_model_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: cannot be imported as a Python module; use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ModelFileError(f"{exc.filename}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        raise ModelFileError(f"{user_frame(path, exc)}: importing the model file failed: "
                             f"{type(exc).__name__}: {exc}") from None
    return module


def call_user(path: Path, function: Callable[..., Any], *args: Any) -> Any:
    """Call a function of the model file; its exceptions become a one-line ModelFileError."""
    try:
        return function(*args)
    except Exception as exc:
        raise ModelFileError(f"{user_frame(path, exc)}: {function.__name__}() raised "
                             f"{type(exc).__name__}: {exc}") from None


def user_frame(path: Path, exc: BaseException) -> str:
    """``file:line`` of the innermost traceback frame inside the user's file (else the file)."""
    resolved = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if str(Path(f.filename).resolve()) == resolved]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)

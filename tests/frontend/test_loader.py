"""The model-file contract: every mistake is a one-line ModelFileError naming file:line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import SAMPLES
from pipec.errors import ModelFileError
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs, trace_model


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(text)
    return path


def test_loads_a_sample() -> None:
    spec = load_model_file(SAMPLES / "gpt.py")
    assert spec.has_loss_fn and not spec.has_train_dataset
    assert spec.source == (SAMPLES / "gpt.py").read_bytes()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    with pytest.raises(ModelFileError, match=r"model\.py:3: syntax error"):
        load_model_file(path)


@pytest.mark.parametrize("missing", ["build_model", "sample_batch"])
def test_missing_contract_function(tmp_path: Path, missing: str) -> None:
    functions = {"build_model": "def build_model():\n    return None\n",
                 "sample_batch": "def sample_batch(b):\n    return None\n"}
    del functions[missing]
    with pytest.raises(ModelFileError, match=f"no function {missing}"):
        load_model_file(write(tmp_path, "".join(functions.values())))


def test_exception_while_importing_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "x = 1\nraise RuntimeError('broken config')\n")
    with pytest.raises(ModelFileError, match=r"model\.py:2: .*RuntimeError: broken config"):
        load_model_file(path)


def test_exception_inside_build_model_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "def build_model():\n    return 1 / 0\n\n"
                           "def sample_batch(b):\n    return None\n")
    spec = load_model_file(path)
    with pytest.raises(ModelFileError, match=r"model\.py:2: build_model\(\) raised "
                                             "ZeroDivisionError"):
        trace_model(spec)


def test_build_model_must_return_a_module(tmp_path: Path) -> None:
    spec = load_model_file(write(tmp_path, "def build_model():\n    return 3\n\n"
                                           "def sample_batch(b):\n    return None\n"))
    with pytest.raises(ModelFileError, match=r"expected a torch\.nn\.Module"):
        trace_model(spec)


@pytest.mark.parametrize("returned", ["None", "(1, 2)", "((), 1)"])
def test_sample_batch_must_return_inputs_and_targets(tmp_path: Path, returned: str) -> None:
    spec = load_model_file(write(tmp_path, "import torch\ndef build_model():\n"
                                 "    return torch.nn.Linear(2, 2)\n\n"
                                 f"def sample_batch(b):\n    return {returned}\n"))
    with pytest.raises(ModelFileError, match="sample_batch"):
        batch_inputs(spec, 2)


@pytest.mark.parametrize(("line", "message"), [
    ("eval_dataset = [1, 2]", "eval_dataset is not a function"),
    ("eval_metrics = 'accuracy'", "eval_metrics is not a function"),
    ("TOKENS_PER_SAMPLE = 0", "TOKENS_PER_SAMPLE = 0; give the tokens one sample holds"),
    ("TOKENS_PER_SAMPLE = 12.5", "TOKENS_PER_SAMPLE = 12.5"),
])
def test_optional_names_of_the_wrong_kind_are_user_errors(line: str, message: str,
                                                         tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text((SAMPLES / "mlp.py").read_text() + f"\n{line}\n")
    with pytest.raises(ModelFileError, match=re.escape(message)):
        load_model_file(model)

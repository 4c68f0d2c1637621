"""Random models (hypothesis): every plan is valid and its emitted stages compose to the model.

Each example is a model file generated as source: a random program over values of width W —
linear layers, activations, sums and concatenations of any earlier values (skips over several
layers), one or two inputs, a module called twice (shared weights), and in-place operations
(nn.ReLU(inplace=True), F.relu(x, inplace=True), x.add_(y), a write through a slice) on which
random cuts land. It is compiled for 1 to 4 stages, and the emitted stages.py, run in order as
torch.distributed.pipelining runs them (each later stage's inputs fresh leaf tensors), must give
exactly the original's output, and the original's gradients.
A bounded number of examples runs in CI; raise PIPEC_FUZZ_EXAMPLES for a longer search.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import compile_to, emitted_modules, run_as_pipeline
from pipec.errors import ConfigError

WIDTH = 6
EXAMPLES = int(os.environ.get("PIPEC_FUZZ_EXAMPLES", "25"))
IN_PLACE = ["relu_module", "relu_function", "add_", "slice_mul_"]
TWO_OPERANDS = ("add", "cat", "add_")


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, list[tuple[str, ...]], str]:
    """(number of inputs, operations, the first input's name); operation k makes value
    ``inputs + k``. The name is sometimes `input`, which fx renames (`input_1`).

    In-place operations keep to what the original model can run forward and backward: none
    writes a storage that an earlier operation saved for backward, and after ``y = relu_(x)``
    the program uses ``y`` only, as real models do (``x = self.relu(x)``). The statement forms
    ``x.add_(z)`` and ``x[:, 1:].mul_(0.5)`` keep using ``x``."""
    inputs = draw(st.integers(1, 2))
    operations: list[tuple[str, ...]] = []
    storage = list(range(inputs))  # each value's storage
    saved: set[int] = set()  # storages that an operation saved for backward
    dropped: set[int] = set()  # values replaced by an in-place result of another name
    for k in range(draw(st.integers(1, 10))):
        usable = [v for v in range(inputs + k) if v not in dropped]
        writable = [v for v in usable if storage[v] not in saved]
        kind = draw(st.sampled_from(["linear", "tanh", "add", "cat", "shared"]
                                    + (IN_PLACE if writable else [])))
        a = draw(st.sampled_from(writable if kind in IN_PLACE else usable))
        operands = (a, draw(st.sampled_from(usable))) if kind in TWO_OPERANDS else (a,)
        operations.append((kind, *map(str, operands)))
        storage.append(storage[a] if kind in IN_PLACE else len(storage))
        if kind in ("linear", "shared"):  # they save their input
            saved.add(storage[a])
        elif kind in ("tanh", "relu_module", "relu_function"):  # they save their output
            saved.add(storage[-1])
        if kind in ("relu_module", "relu_function"):
            dropped.update(v for v in range(inputs + k) if storage[v] == storage[a])
    return inputs, operations, draw(st.sampled_from(["v0", "input"]))


def model_source(inputs: int, operations: list[tuple[str, ...]], first: str = "v0") -> str:
    layers, body = [], []
    for k, (kind, *args) in enumerate(operations):
        out, a = f"v{inputs + k}", f"v{args[0]}"
        if kind == "linear":
            layers.append(f"        self.l{k} = nn.Linear({WIDTH}, {WIDTH})")
            body.append(f"        {out} = self.l{k}({a})")
        elif kind == "tanh":
            body.append(f"        {out} = torch.tanh({a})")
        elif kind == "add":
            body.append(f"        {out} = {a} + v{args[1]}")
        elif kind == "cat":
            layers.append(f"        self.l{k} = nn.Linear({2 * WIDTH}, {WIDTH})")
            body.append(f"        {out} = self.l{k}(torch.cat([{a}, v{args[1]}], dim=1))")
        elif kind == "relu_module":
            layers.append(f"        self.l{k} = nn.ReLU(inplace=True)")
            body.append(f"        {out} = self.l{k}({a})")
        elif kind == "relu_function":
            body.append(f"        {out} = F.relu({a}, inplace=True)")
        elif kind == "add_":
            body += [f"        {a}.add_(v{args[1]})", f"        {out} = {a}"]
        elif kind == "slice_mul_":
            body += [f"        {a}[:, 1:].mul_(0.5)", f"        {out} = {a}"]
        else:
            body.append(f"        {out} = self.shared({a})")
    names = ", ".join([first] + [f"v{i}" for i in range(1, inputs)])
    batch = ", ".join(f"torch.randn(batch_size, {WIDTH})" for _ in range(inputs))
    return "\n".join([
        "import torch", "from torch import nn", "from torch.nn import functional as F", "", "",
        "class Random(nn.Module):", "    def __init__(self):", "        super().__init__()",
        f"        self.shared = nn.Linear({WIDTH}, {WIDTH})", *layers, "",
        f"    def forward(self, {names}):", f"        v0 = {first}", *body,
        f"        return v{inputs + len(operations) - 1}", "", "",
        "def build_model():", "    return Random()", "", "",
        "def sample_batch(batch_size):",
        f"    return ({batch},), torch.randint(0, {WIDTH}, (batch_size,))", "",
    ])


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(1, 4))
def test_random_models_split_into_stages_that_compose_exactly(
        program: tuple[int, list[tuple[str, ...]], str], stages: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random_model.py"
        path.write_text(model_source(*program))
        try:
            plan = compile_to(path, Path(tmp) / "out", gpus=stages, batch_size=8)
        except ConfigError as error:  # fewer legal boundaries than stages: a clear refusal
            assert "legal stage boundaries" in str(error)
            return
        bounds = [(s.start, s.end) for s in plan.stages]
        assert bounds[0][0] == 0 and all(a < b for a, b in bounds)
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
        with emitted_modules(Path(tmp) / "out") as (user, emitted):
            torch.manual_seed(0)
            model = user.build_model()
            inputs, _ = user.sample_batch(8)
            # Fresh copies for each run: in-place operations may overwrite the inputs.
            expected = model(*(t.clone() for t in inputs))
            if expected.requires_grad:
                expected.square().sum().backward()
            gradients = {n: p.grad for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            output = run_as_pipeline(emitted, model, tuple(t.clone() for t in inputs))
            torch.testing.assert_close(output, expected, rtol=0, atol=0)
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter.grad, gradients[name], msg=name)

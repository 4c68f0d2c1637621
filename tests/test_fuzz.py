"""Random models (hypothesis): every plan is valid and its emitted stages compose to the model.

Each example is a model file generated as source: a random program over values of width W —
linear layers, activations, sums and concatenations of any earlier values (skips over several
layers), one or two inputs, and a module called twice (shared weights). It is compiled for 1 to
4 stages, and the emitted stages.py, run in order, must give exactly the original's output.
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

from conftest import compile_to, emitted_modules
from pipec.errors import ConfigError

WIDTH = 6
EXAMPLES = int(os.environ.get("PIPEC_FUZZ_EXAMPLES", "25"))


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, list[tuple[str, ...]], str]:
    """(number of inputs, operations, the first input's name); operation k makes value
    ``inputs + k``. The name is sometimes `input`, which fx renames (`input_1`)."""
    inputs = draw(st.integers(1, 2))
    operations: list[tuple[str, ...]] = []
    for k in range(draw(st.integers(1, 10))):
        available = inputs + k
        pick = st.integers(0, available - 1)
        kind = draw(st.sampled_from(["linear", "tanh", "add", "cat", "shared"]))
        if kind in ("add", "cat"):
            operations.append((kind, str(draw(pick)), str(draw(pick))))
        else:
            operations.append((kind, str(draw(pick))))
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
        else:
            body.append(f"        {out} = self.shared({a})")
    names = ", ".join([first] + [f"v{i}" for i in range(1, inputs)])
    batch = ", ".join(f"torch.randn(batch_size, {WIDTH})" for _ in range(inputs))
    return "\n".join([
        "import torch", "from torch import nn", "", "",
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
            expected = model(*inputs)
            values: object = tuple(inputs)
            for stage_class in emitted.STAGES:
                stage = stage_class(model)
                values = stage(*values) if isinstance(values, tuple) else stage(values)
            torch.testing.assert_close(values, expected, rtol=0, atol=0)

"""Front ends: torch.fx, torch.export for what fx cannot trace (a Hugging Face GPT-2), and the
messages when neither can."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MODELS, compile_apart, compile_to, composed_stages, emitted_modules, run_forked
from pipec.errors import ConfigError, ModelFileError, TraceError
from pipec.frontend.annotate import COMPUTE_OPS
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model

HF = MODELS / "hf_gpt2.py"


def test_auto_falls_back_to_export_for_a_hugging_face_model(tmp_path: Path) -> None:
    compile_to(HF, tmp_path / "o", gpus=2, batch_size=8)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["frontend"] == "export"
    assert "front end export" in (tmp_path / "o" / "report.md").read_text()
    # GPT-2's output head shares the token embedding: both stages hold it.
    with emitted_modules(tmp_path / "o") as (_, stages):
        assert [len(copies) for copies in stages.TIED] == [2]


@pytest.mark.parametrize("gpus", [1, 2])
def test_exported_stages_compose_to_the_hugging_face_model(gpus: int, tmp_path: Path) -> None:
    compile_to(HF, tmp_path / "o", gpus=gpus, batch_size=8, frontend="export")
    with emitted_modules(tmp_path / "o") as (user_model, stages):
        torch.manual_seed(0)
        model = user_model.build_model().eval()
        idx = user_model.sample_batch(4)[0]
        values: tuple[torch.Tensor, ...] = (idx,)
        with torch.no_grad():
            for stage_class in stages.STAGES:
                out = stage_class(model)(*values)
                values = out if isinstance(out, tuple) else (out,)
            expected = model(idx)
    torch.testing.assert_close(values[0], expected, rtol=1e-5, atol=1e-5)


def test_hugging_face_gpt2_trains_identically_on_1_and_2_stages(tmp_path: Path) -> None:
    compile_apart(HF, tmp_path / "one", gpus=1, batch_size=16)
    compile_apart(HF, tmp_path / "two", gpus=2, batch_size=16)
    reference = run_forked(tmp_path / "one", 1, "--steps", "4", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "4", "--seed", "3") == reference
    assert len(set(reference)) > 1


def test_value_dependent_control_flow_under_fx_names_the_line_and_export(tmp_path: Path) -> None:
    spec = load_model_file(MODELS / "control_flow.py")
    with pytest.raises(TraceError, match=r"control_flow\.py:15: torch\.fx cannot trace the model"
                                         r".*; try --frontend export"):
        trace_model(spec, "fx")


def test_when_neither_front_end_can_trace_both_reasons_are_given(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"torch\.fx cannot trace.*and with --frontend export: "
                                         r".*torch\.export cannot capture the model"):
        compile_to(MODELS / "control_flow.py", tmp_path / "o", gpus=1, batch_size=8)
    assert not (tmp_path / "o").exists()


def test_unknown_front_end(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--frontend 'jit': use one of auto, fx, export"):
        compile_to(MODELS / "control_flow.py", tmp_path / "o", gpus=1, batch_size=8,
                   frontend="jit")


def test_exported_nodes_keep_the_models_module_names(tmp_path: Path) -> None:
    plan = compile_to(HF, tmp_path / "o", gpus=2, batch_size=8)
    names = [name for stage in plan.stages for name in stage.modules]
    assert names and all(name.startswith("gpt") for name in names), names


def test_profile_times_the_exported_graph_node_by_node() -> None:
    """pipec profile (and --measure auto) times the graph the compile plans with, exported
    too: every compute node of the Hugging Face GPT-2 gets times, bound to its name."""
    from pipec.calibration.profile import profile_model

    calibration, samples = profile_model(HF, 2, repeats=2)
    traced = trace_model(load_model_file(HF))
    compute = [n.name for n in traced.graph_module.graph.nodes if n.op in COMPUTE_OPS]
    assert traced.frontend == "export"
    assert {t.node for t in calibration.nodes} == set(compute)
    assert sum(s.fwd_s + s.bwd_s for s in samples if s.micro_batch == 2) > 0


def test_each_exported_stage_reads_the_dynamic_batch_again(tmp_path: Path) -> None:
    """torch.export reads the batch size once, at the top, and uses it down to the last view:
    a stage reads it again from a tensor it receives, so cuts inside the model are legal (128
    of GPT-2's 134 inner cuts; 6, all near the end, before) and 4 stages, each of 10 nodes or
    more, train like one process."""
    compile_apart(HF, tmp_path / "one", gpus=1, batch_size=16)
    plan = compile_apart(HF, tmp_path / "four", gpus=4, batch_size=16)
    assert all(s.end - s.start >= 10 for s in plan.stages), [(s.start, s.end) for s in plan.stages]
    source = (tmp_path / "four" / "stages.py").read_text()
    assert source.count("torch.ops.aten.sym_size.int(") >= 3
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "four", 4, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-5)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_optional_argument_the_inputs_do_not_supply_stays_its_default(
        frontend: str, tmp_path: Path) -> None:
    """timm's blocks take ``attn_mask=None``: a forward parameter with a default that
    sample_batch does not supply is traced as its default (a constant), under either front
    end, and the model trains on 2 stages as on one process."""
    model = MODELS / "optional_args.py"
    traced = trace_model(load_model_file(model), frontend)
    assert traced.input_names == ("x",)
    compile_apart(model, tmp_path / "one", gpus=1, batch_size=16, frontend=frontend)
    compile_apart(model, tmp_path / "two", gpus=2, batch_size=16, frontend=frontend)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)
    assert len(set(reference)) > 1


def test_a_failing_export_prints_one_line_and_keeps_torchs_log_in_a_file(tmp_path: Path
                                                                         ) -> None:
    """torch.export prints the graphs it captured when it fails; pipec's message is the one
    line on stderr, and it names the file that holds torch's output."""
    command = [sys.executable, "-c", "from pipec.cli import main; raise SystemExit(main())",
               "compile", str(MODELS / "control_flow.py"), "--gpus", "1", "--hardware", "cpu",
               "--frontend", "export", "-o", str(tmp_path / "out")]
    run = subprocess.run(command, capture_output=True, text=True, check=False,
                         env={**os.environ, "PIPEC_MEASURE": "off"})
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1, run.stderr
    log = Path(run.stderr.split("(torch's log: ")[1].split(")")[0])
    assert "control_flow.py:15" in run.stderr and log.read_text().strip()
    log.unlink()


def _variant(source: Path, tmp_path: Path, old: str, new: str) -> Path:
    """A copy of a test model file with one change."""
    text = source.read_text()
    assert old in text
    path = tmp_path / source.name
    path.write_text(text.replace(old, new))
    return path


def test_an_export_failure_in_library_code_names_its_line_and_the_fix(tmp_path: Path) -> None:
    """Mixtral's eager experts loop over the experts a batch routes to (data-dependent): the
    message names transformers' line, the model file's line that led there, and the fix."""
    model = _variant(MODELS / "hf_mixtral.py", tmp_path, "max_position_embeddings=CONTEXT)",
                     "max_position_embeddings=CONTEXT, experts_implementation='eager')")
    with pytest.raises(TraceError, match=r"export: transformers/models/mixtral/modeling_mixtral"
                                         r"\.py:\d+ \(from .*hf_mixtral\.py:\d+\): torch\.export "
                                         r"cannot capture the model: .*data-dependent.*torch\.where"
                                         r" or torch\.cond.*default experts implementation"):
        trace_model(load_model_file(model))


def test_a_model_that_returns_its_cache_is_told_to_turn_it_off(tmp_path: Path) -> None:
    model = _variant(MODELS / "hf_unwrapped.py", tmp_path, ", use_cache=False)", ")")
    with pytest.raises(TraceError, match=r"DynamicCache'> in output, which is not a known type; "
                                         r"the model returns its key/value cache: set "
                                         r"use_cache=False in its config"):
        trace_model(load_model_file(model), "export")


def test_an_output_type_pytree_cannot_write_is_refused_with_the_fix(tmp_path: Path) -> None:
    model = tmp_path / "named_output.py"
    model.write_text(
        "import collections\nimport torch\nfrom torch import nn\n\n"
        "Output = collections.namedtuple('Output', 'logits')\n\n\n"
        "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.head = nn.Linear(4, 3)\n\n    def forward(self, x):\n"
        "        return Output(self.head(x))\n\n\n"
        "def build_model():\n    return Model()\n\n\n"
        "def sample_batch(n):\n    return torch.randn(n, 4), torch.randint(0, 3, (n,))\n")
    with pytest.raises(ModelFileError, match=r"named_output\.py: forward returns a namedtuple, "
                                             r"which pipec cannot rebuild for loss_fn .*; return a"
                                             r" tensor, a tuple or a dict of tensors"):
        trace_model(load_model_file(model), "export")


def test_a_constant_the_forward_makes_travels_in_stages_py(tmp_path: Path) -> None:
    """torch.export lifts torch.tensor(16.0) into a constant the model does not hold: stages.py
    carries its value, and 2 stages compose to the model and train as one process."""
    model = MODELS / "made_constant.py"
    compile_apart(model, tmp_path / "one", gpus=1, batch_size=16, frontend="export")
    compile_apart(model, tmp_path / "two", gpus=2, batch_size=16, frontend="export")
    source = (tmp_path / "two" / "stages.py").read_text()
    assert re.search(r'"lifted_tensor_0": torch\.tensor\(16(\.0)?, dtype=torch\.float32\)',
                     source), source[:3000]
    staged, eager = composed_stages(tmp_path / "two")
    torch.testing.assert_close(staged, eager)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)


def test_a_no_grad_region_and_a_complex_view_compose_and_train(tmp_path: Path) -> None:
    """torch.export writes the no_grad region as a submodule graph: pipec inlines it (its
    results detached), and the second block's .real is measured again rather than copied from
    the first's (a view in another dtype)."""
    model = MODELS / "no_grad_region.py"
    compile_apart(model, tmp_path / "one", gpus=1, batch_size=16, frontend="export")
    compile_apart(model, tmp_path / "two", gpus=2, batch_size=16, frontend="export")
    assert "wrap_with_set_grad_enabled" not in (tmp_path / "two" / "stages.py").read_text()
    staged, eager = composed_stages(tmp_path / "two")
    torch.testing.assert_close(staged, eager)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)


def test_a_model_returning_a_dict_goes_to_export_and_loss_fn_gets_the_dict(tmp_path: Path
                                                                           ) -> None:
    model = tmp_path / "dict_output.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.body = nn.Linear(4, 8)\n        self.head = nn.Linear(8, 3)\n\n"
        "    def forward(self, x):\n        return {'logits': self.head(self.body(x).relu())}\n\n\n"
        "def build_model():\n    return Model()\n\n\n"
        "def sample_batch(n):\n    g = torch.Generator().manual_seed(n)\n"
        "    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)\n\n\n"
        "def loss_fn(output, targets):\n"
        "    return nn.functional.cross_entropy(output['logits'], targets)\n")
    with pytest.raises(TraceError, match=r"records forward's output as a plain container \(an "
                                         r"object or dict\), which --frontend export keeps"):
        trace_model(load_model_file(model), "fx")
    compile_apart(model, tmp_path / "one", gpus=1, batch_size=16)
    compile_apart(model, tmp_path / "two", gpus=2, batch_size=16)
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["frontend"] == "export"
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)


def test_a_value_derived_from_a_buffer_is_computed_by_the_stages(tmp_path: Path) -> None:
    """fx records the buffer read: no constant, whose value the meta-built model lacks."""
    model = MODELS / "buffer_index.py"
    traced = trace_model(load_model_file(model), "fx")
    assert "_tensor_constant" not in traced.graph_module.code
    compile_to(model, tmp_path / "one", gpus=1, batch_size=16)
    compile_to(model, tmp_path / "two", gpus=2, batch_size=16)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)

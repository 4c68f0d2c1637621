"""Hugging Face transformers models as users bring them, built from tiny configs (no download):
each is traced (torch.export), split into 2 stages that compose to the model itself, and
trained on 2 processes to one process's losses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import MODELS, compile_apart, compile_to, composed_stages, run_forked

REAL_MODELS = {
    "hf_gpt2": "GPT-2, its output head tied to the token embedding",
    "hf_bert": "BERT with an attention mask as a second input",
    "hf_t5": "T5, encoder and decoder, two inputs",
    "tiny_llama": "Llama: rotary embeddings, grouped-query attention",
    "hf_mistral": "Mistral with a sliding attention window",
    "hf_mixtral": "Mixtral, its default experts (device-dependent histc)",
    "hf_unwrapped": "Qwen2 returned unwrapped: loss_fn reads output.logits",
}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_two_stages_compose_to_the_model_and_train_as_one_process(name: str, tmp_path: Path
                                                                   ) -> None:
    model = MODELS / f"{name}.py"
    compile_apart(model, tmp_path / "one", gpus=1, batch_size=8)
    compile_apart(model, tmp_path / "two", gpus=2, batch_size=8)
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert (plan["frontend"], plan["pp"], plan["traced_on"]) == ("export", 2, "cpu")
    staged, eager = composed_stages(tmp_path / "two")
    torch.testing.assert_close(staged, eager, rtol=1e-5, atol=1e-5)
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-6)
    assert len(set(reference)) > 1


def test_mixtral_is_traced_on_the_cpu_path_of_its_experts(tmp_path: Path) -> None:
    """On meta its experts take the non-CPU path (histc of integers), which a CPU cannot run."""
    compile_apart(MODELS / "hf_mixtral.py", tmp_path / "o", gpus=2, batch_size=8)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert any(read.startswith("transformers/integrations/moe.py:")
               for read in plan["device_reads"])
    histc_inputs = re.findall(r"(\w+) = torch\.ops\.aten\.histc\.default\((\w+)",
                              (tmp_path / "o" / "stages.py").read_text())
    source = (tmp_path / "o" / "stages.py").read_text()
    assert histc_inputs and all(
        re.search(rf"{value} = torch\.ops\.aten\.to\.dtype\(\w+, torch\.float32\)", source)
        for _, value in histc_inputs)


def test_an_unwrapped_model_hands_loss_fn_its_output_object(tmp_path: Path) -> None:
    compile_apart(MODELS / "hf_unwrapped.py", tmp_path / "o", gpus=2, batch_size=8)
    source = (tmp_path / "o" / "pipeline.py").read_text()
    assert "The model returns a CausalLMOutputWithPast" in source
    assert "loss_fn could not run" not in (tmp_path / "o" / "report.md").read_text()


def test_a_measured_by_default_compile_of_an_exported_model_says_it_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEC_CACHE_DIR", str(tmp_path / "cache"))
    compile_to(MODELS / "hf_gpt2.py", tmp_path / "o", gpus=2, batch_size=8, measure="auto")
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["calibration"] == "cpu" and plan["calibration_node_times"]
    assert "times measured on this machine" in (tmp_path / "o" / "report.md").read_text()

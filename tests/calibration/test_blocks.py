"""Measuring block by block (pipec.calibration.blocks): the runs of identical blocks found in a
graph, spans that compose to the model, and a model too big for this host measured by
default one block at a time."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch

from conftest import MODELS, ROOT, SAMPLES
from pipec.calibration.blocks import measuring_plan, profile_by_blocks, repeated_blocks, span_of
from pipec.calibration.by_default import measure_locally
from pipec.calibration.profile import _with_real_tensors
from pipec.cost.hardware import load_devices
from pipec.frontend import annotate, load_model_file, trace_model
from pipec.frontend.trace import batch_inputs


def traced_sample(name: str) -> tuple:
    spec = load_model_file(SAMPLES / name)
    traced = trace_model(spec, "fx", "cpu")
    return spec, traced, annotate(traced, spec, bf16_memory=False)


def test_a_transformer_s_layers_are_one_run_of_identical_blocks() -> None:
    _, _, graph = traced_sample("gpt.py")
    blocks = repeated_blocks(graph)
    assert blocks is not None and blocks.container == "blocks"
    assert len(blocks.starts) == 4 and blocks.starts[1] - blocks.starts[0] == blocks.length
    assert all(graph.nodes[start].module.startswith(f"blocks.{k}")
               for k, start in enumerate(blocks.starts))
    _, _, mlp = traced_sample("mlp.py")
    assert repeated_blocks(mlp) is None  # nn.Sequential's numbered layers differ from each other


def test_the_spans_compose_to_the_model() -> None:
    """Before the blocks, each block, after them: run in turn, each on what the others made,
    they compute what the whole graph computes."""
    spec, traced, graph = traced_sample("gpt.py")
    real = _with_real_tensors(traced, spec, torch.device("cpu"))
    plan = measuring_plan(graph)
    assert plan is not None
    names = [n.name for n in graph.nodes]
    cuts = [0, *plan.blocks.starts, plan.blocks.end, len(names)]
    spans = [span_of(real, names[a:b], last=b == len(names))
             for a, b in itertools.pairwise(cuts)]
    (inputs,), _ = batch_inputs(spec, 3)
    placeholder = next(n.name for n in real.graph.nodes if n.op == "placeholder")
    values = {placeholder: inputs}
    for span in spans[:-1]:
        values.update(zip(span.outputs, span.module(*(values[n] for n in span.inputs)),
                          strict=True))
    output = spans[-1].module(*(values[n] for n in spans[-1].inputs))
    torch.testing.assert_close(output, real(inputs), rtol=0, atol=0)


def test_block_by_block_times_every_node_and_gives_each_block_the_first_s_times() -> None:
    spec, traced, graph = traced_sample("gpt.py")
    plan = measuring_plan(graph)
    assert plan is not None
    calibration = profile_by_blocks(spec, traced, graph, plan, [1, 2], torch.device("cpu"),
                                    2, False, 0.0, 1)
    timings = calibration.nodes
    assert [t.node for t in timings] == [n.name for n in graph.nodes]
    first, length = plan.blocks.starts[0], plan.blocks.length
    for start in plan.blocks.starts[1:]:
        assert [t.fwd_s for t in timings[start:start + length]] == [
            t.fwd_s for t in timings[first:first + length]]
    assert sum(sum(t.fwd_s) for t in timings[:first]) > 0  # the embedding, timed on its own
    assert calibration.loss is not None and calibration.optimizer_s


@pytest.mark.slow
def test_a_model_larger_than_this_host_is_measured_block_by_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """A 6.3 B-parameter decoder (47 GiB to profile whole at micro-batch 2 with its gradients
    and activations) on this 24 GiB host: its 120 blocks are measured on the first."""
    monkeypatch.setenv("PIPEC_CACHE_DIR", str(tmp_path / "cache"))
    # This host's free memory, fixed: on a larger host the model would be measured whole.
    monkeypatch.setattr("pipec.calibration.by_default.free_bytes", lambda _: 16 * 2**30)
    caplog.set_level(logging.INFO)
    model = ROOT / "benchmarks" / "zoo" / "wide_decoder_6b.py"
    spec = load_model_file(model)
    graph = annotate(trace_model(spec, "fx", "cpu"), spec)
    local = measure_locally(model, load_devices("cpu", 1), 1, 2, "fp32", "auto", "fx", graph)
    assert local is not None
    assert "block by block" in local.calibration.source
    assert len(local.calibration.nodes) == len(graph.nodes)
    assert "block by block: its passes would hold the whole model" in caplog.text
    assert "Its 120 identical blocks (blocks.0 to blocks.119)" in caplog.text


def test_a_model_that_ends_on_its_last_block_times_its_loss_there() -> None:
    """Nothing follows the blocks: the last block is measured on its own as the span that
    returns the model's output, which the loss is timed on."""
    spec = load_model_file(MODELS / "only_blocks.py")
    traced = trace_model(spec, "fx", "cpu")
    graph = annotate(traced, spec, bf16_memory=False)
    plan = measuring_plan(graph)
    assert plan is not None and plan.blocks.end == len(graph.nodes)
    assert plan.spans[-1] == (plan.blocks.starts[-1], len(graph.nodes))
    calibration = profile_by_blocks(spec, traced, graph, plan, [1, 2], torch.device("cpu"),
                                    2, False, 0.0, 1)
    assert [t.node for t in calibration.nodes] == [n.name for n in graph.nodes]
    assert calibration.loss is not None

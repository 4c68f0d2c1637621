"""A tp rank's graph split along the sequence between its regions: which nodes run on the
rank's tokens, which collectives join them to the regions, and the model that cannot split.
tests/templates/test_tensor_parallel.py trains the emitted stages to one process's losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from conftest import MODELS, SAMPLES
from pipec.codegen.local_shards import EMITTED_COLLECTIVES, parallel_graph
from pipec.codegen.sequence_parallel import (
    EMITTED_SEQUENCE,
    SequenceParallelError,
    sequence_parallel_graph,
    sequence_split,
)
from pipec.frontend.loader import load_model_file
from pipec.frontend.shardable import Shardable, find_shardable


def traced(path: Path) -> tuple[fx.GraphModule, dict[str, tuple[int, ...]], Shardable]:
    spec = load_model_file(path)
    torch.manual_seed(0)
    gm = fx.symbolic_trace(spec.build_model())
    ShapeProp(gm).propagate(*spec.sample_batch(3)[:-1])
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    return gm, shapes, find_shardable(gm, shapes)


def calls(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) == name]


def test_the_gpt_samples_norms_and_residual_adds_run_on_the_ranks_tokens() -> None:
    gm, shapes, shardable = traced(SAMPLES / "gpt.py")
    regions = shardable.regions_at(2)
    split = sequence_split(gm, shapes, regions, (), 2)
    inside = {name for region in regions for name in region.nodes}
    assert {"blocks_0_ln2", "blocks_1_ln1", "blocks_3_ln2", "ln_f", "add_1", "add_8"} <= split
    assert not split & inside
    # The first block's norm reads the embeddings, whole: its output is cut after it.
    assert "blocks_0_ln1" not in split and "add" not in split


def test_each_region_gathers_the_sequence_and_reduce_scatters_it() -> None:
    gm, shapes, shardable = traced(SAMPLES / "gpt.py")
    local = parallel_graph(gm, shardable.regions_at(2), 2, EMITTED_COLLECTIVES)
    split = sequence_parallel_graph(local, shapes, 2, EMITTED_COLLECTIVES, EMITTED_SEQUENCE)
    gm = split.graph_module
    assert len(calls(gm, "sequence_enter")) == 9  # 4 attention, 4 MLP, the head
    assert len(calls(gm, "sequence_reduce")) == 8
    assert not calls(gm, "enter") and not calls(gm, "reduce")
    # The 8 norms after the first, each weight and bias summed over the group, and the 8
    # row-parallel biases.
    assert len(split.summed) == 8 * 2 + 8
    assert {"ln_f.weight", "ln_f.bias", "blocks.0.attn.proj.bias", "blocks.1.ln1.weight"} \
        <= set(split.summed)  # by the model's names
    # The head's input is gathered on entry and its logits all-gathered whole: nothing split
    # leaves the graph.
    assert not calls(gm, "sequence_gather")
    # Attention's views read the whole sequence's length from the split norm: no collective.
    assert len(calls(gm, "whole_shape")) == 3


def test_a_split_value_read_across_tokens_is_gathered_first() -> None:
    gm, shapes, shardable = traced(MODELS / "token_mixer.py")
    local = parallel_graph(gm, shardable.regions_at(2), 2, EMITTED_COLLECTIVES)
    split = sequence_parallel_graph(local, shapes, 2, EMITTED_COLLECTIVES, EMITTED_SEQUENCE)
    (gathered,) = calls(split.graph_module, "sequence_gather")
    assert [u.target for u in gathered.users] == ["flatten"]
    # The norm's output and the residual stream.
    assert len(calls(split.graph_module, "scatter")) == 2


def test_a_sequence_tp_does_not_divide_cannot_split() -> None:
    gm, shapes, shardable = traced(SAMPLES / "gpt.py")
    odd = {name: (s[0], 33, *s[2:]) if len(s) == 3 else s for name, s in shapes.items()}
    with pytest.raises(SequenceParallelError, match="does not split over 2 ranks"):
        sequence_split(gm, odd, shardable.regions_at(2), (), 2)


class _Scaled(torch.nn.Module):
    """After an MLP region: ``(1 + gain) * x`` (Gemma's norm weight), a buffer's shift and a
    norm module, ``shared``, that also runs on the whole input when ``mixed``."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.gain = torch.nn.Parameter(torch.zeros(8))
        self.register_buffer("shift", torch.ones(8))
        self.shared, self.mixed = torch.nn.LayerNorm(8), mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self.shared(x) if self.mixed else x
        y = start + self.down(torch.relu(self.up(x)))
        return self.shared((1 + self.gain) * y + self.shift).mean(dim=1)


def _rank_graph(mixed: bool) -> tuple[fx.GraphModule, dict[str, tuple[int, ...]], Shardable]:
    gm = fx.symbolic_trace(_Scaled(mixed))
    ShapeProp(gm).propagate(torch.ones(2, 4, 8))
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    return gm, shapes, find_shardable(gm, shapes)


def test_every_trainable_parameter_a_split_node_reads_is_summed_and_no_buffer() -> None:
    gm, shapes, shardable = _rank_graph(mixed=False)
    local = parallel_graph(gm, shardable.regions_at(2), 2, EMITTED_COLLECTIVES)
    split = sequence_parallel_graph(local, shapes, 2, EMITTED_COLLECTIVES, EMITTED_SEQUENCE)
    assert set(split.summed) == {"gain", "down.bias", "shared.weight", "shared.bias"}


def test_a_parameter_read_both_split_and_whole_cannot_split() -> None:
    gm, shapes, shardable = _rank_graph(mixed=True)
    with pytest.raises(SequenceParallelError, match="read both"):
        sequence_split(gm, shapes, shardable.regions_at(2), (), 2)

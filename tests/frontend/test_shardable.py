"""Tensor-parallel regions found in traced graphs: the sample GPT (fused q/k/v), a LLaMA-shaped
model (grouped-query attention, SwiGLU), Hugging Face Llama through torch.export, and the
operations that keep a linear whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn import functional as F

from conftest import MODELS, SAMPLES
from pipec.cli import main
from pipec.errors import ConfigError
from pipec.frontend.shardable import Shardable, find_shardable
from pipec.inspection import render_shardable, shardable_model


def shardable_of(module: nn.Module, *inputs: torch.Tensor) -> Shardable:
    """find_shardable on torch.fx's graph of ``module``, shapes from a real run."""
    gm = fx.symbolic_trace(module)
    ShapeProp(gm).propagate(*inputs)
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)}
    return find_shardable(gm, shapes)


def kinds(shardable: Shardable) -> list[str]:
    return [r.kind for r in shardable.regions]


@pytest.fixture(scope="module")
def gpt() -> Shardable:
    return shardable_model(SAMPLES / "gpt.py").shardable


def test_the_sample_gpt_shards_attention_mlp_and_head(gpt: Shardable) -> None:
    assert kinds(gpt) == ["attention", "MLP"] * 4 + ["head"]
    attention, mlp = gpt.regions[:2]
    assert (attention.columns, attention.rows) == (("blocks.0.attn.qkv",), ("blocks.0.attn.proj",))
    assert attention.fused == (("blocks.0.attn.qkv", (64, 64, 64)),)
    # the split of q, k, v, their three head views (4 heads) and the reshape back
    assert [r.position for r in attention.rewrites] == ["split", 2, 2, 2, 2]
    assert (mlp.columns, mlp.rows) == (("blocks.0.mlp.0",), ("blocks.0.mlp.2",))
    head = gpt.regions[-1]
    assert (head.columns, head.rows, head.gathered) == (("head",), (), ("head",))
    assert gpt.whole == ()
    assert [(e.path, e.rows) for e in gpt.vocabulary] == [("tok_emb", 256), ("pos_emb", 32)]


def test_a_degree_must_divide_the_heads_and_features(gpt: Shardable) -> None:
    assert gpt.degrees(8) == (1, 2, 4)  # 4 heads
    assert [r.kind for r in gpt.regions_at(8)] == ["MLP"] * 4 + ["head"]  # 256 features
    assert gpt.regions[0].blocker(8) == 4


def test_grouped_query_attention_shards_keys_and_values_by_their_own_heads() -> None:
    llama = shardable_model(MODELS / "gqa_lm.py").shardable
    assert kinds(llama) == ["attention", "gated MLP"] * 2 + ["head"]
    attention, mlp = llama.regions[:2]
    assert attention.columns == ("blocks.0.attn.q", "blocks.0.attn.kv")
    assert attention.fused == (("blocks.0.attn.kv", (16, 16)),)  # chunk(2) into k and v
    assert mlp.columns == ("blocks.0.gate", "blocks.0.up")
    assert llama.degrees(8) == (1, 2)  # 2 key/value heads
    assert [r.kind for r in llama.regions_at(4)] == ["gated MLP", "gated MLP", "head"]


def test_a_hugging_face_llama_through_export_shards_like_a_hand_written_one() -> None:
    llama = shardable_model(MODELS / "tiny_llama.py").shardable
    # Its LM head is tied to the token embedding: a rank's part would untie them.
    assert kinds(llama) == ["attention", "gated MLP"] * 2
    assert [w.path for w in llama.whole] == ["lm.lm_head"]
    assert "tied weight" in llama.whole[0].reason
    attention = llama.regions[0]
    prefix = "lm.model.layers.0.self_attn."
    assert attention.columns == tuple(prefix + p for p in ("q_proj", "k_proj", "v_proj"))
    assert attention.rows == (prefix + "o_proj",)
    # repeat_kv's expand and reshape of the 2 key/value heads are rewritten too
    assert len(attention.rewrites) == 9
    assert llama.degrees(8) == (1, 2)


def test_a_tied_head_stays_whole_and_an_untied_one_shards() -> None:
    tied = shardable_model(MODELS / "tied_gpt.py").shardable
    assert "head" not in kinds(tied)
    assert [w.path for w in tied.whole] == ["head"]
    assert "head" in kinds(shardable_model(MODELS / "gqa_lm.py").shardable)


class ResidualLinear(nn.Module):
    """A linear added straight to the residual stream: nothing makes its output whole."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.up(x)
        return x + self.mlp(x)


def test_a_linear_added_to_the_residual_stays_whole_and_says_why() -> None:
    found = shardable_of(ResidualLinear(), torch.randn(2, 8))
    assert kinds(found) == ["MLP"]
    assert [w.path for w in found.whole] == ["up"]
    assert "add" in found.whole[0].reason and "whole along the split" in found.whole[0].reason


class ScaledMLP(nn.Module):
    """An MLP whose hidden features are scaled by a trained vector of size 1 along them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)) * self.scale)


def test_a_trained_parameter_inside_a_region_keeps_it_whole() -> None:
    # Each rank would make the part of its gradient that its features give, and nothing
    # would sum the parts.
    found = shardable_of(ScaledMLP(), torch.randn(2, 8))
    assert [w.path for w in found.whole] == ["up"]
    assert "made from trained parameters" in found.whole[0].reason
    assert kinds(found) == ["head"]  # the last linear alone, its output gathered


class Router(nn.Module):
    """A mixture-of-experts router: softmax over the experts the linear scores."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.gate(x), dim=-1)


def test_a_softmax_over_the_split_features_keeps_the_router_whole() -> None:
    found = shardable_of(Router(), torch.randn(2, 8))
    assert found.regions == ()
    assert "normalizes over the split dimension" in found.whole[0].reason


class ShapeReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h.reshape(h.shape[0], -1))


def test_reading_the_shape_of_a_split_value_stays_whole() -> None:
    found = shardable_of(ShapeReader(), torch.randn(2, 8))
    assert [w.path for w in found.whole] == ["a"]


def test_pipec_inspect_tp_prints_regions_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MODELS / "gqa_lm.py"), "--tp", "4"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("3 of 5 region(s) shard over 4 rank(s)")
    assert "no: 2 is not a multiple of 4" in text
    assert main(["inspect", str(SAMPLES / "gpt.py"), "--tp", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [r["shards"] for r in found["regions"]] == [True] * 9


def test_a_tp_degree_below_one_is_a_user_error(gpt: Shardable, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tp 0"):
        render_shardable(gpt, 0)
    assert main(["inspect", str(SAMPLES / "gpt.py"), "--tp", "0"]) == 2


class ComputedWeight(nn.Module):
    """A linear whose weight forward computes (a transposed tie): no region, and no crash."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.ones(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return F.linear(h, self.scale.t() * 2)


def test_a_linear_with_a_computed_weight_keeps_its_region_whole() -> None:
    found = shardable_of(ComputedWeight(), torch.randn(2, 8))
    assert found.regions == ()
    assert [w.path for w in found.whole] == ["up"]
    assert "not a model attribute" in found.whole[0].reason


class ComputedShape(nn.Module):
    """Heads split by a shape forward computes as one value: the view cannot be rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.qkv(x)
        heads = h.view(x.shape[:-1] + (2, 4))  # noqa: RUF005 (one computed shape: the case)
        return self.out(heads.flatten(-2))


def test_a_view_to_a_computed_shape_keeps_its_region_whole() -> None:
    found = shardable_of(ComputedShape(), torch.randn(3, 8))
    assert [w.path for w in found.whole] == ["qkv"]
    assert "one computed value" in found.whole[0].reason
    assert kinds(found) == ["head"]  # the output linear, now reading a whole value


class Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.up(x).view(x.shape[0], 2, 4)
        return self.down(heads.flatten(1))


def test_flatten_merges_the_heads_back_without_a_rewrite() -> None:
    found = shardable_of(Flattened(), torch.randn(3, 8))
    assert [(r.kind, r.columns, r.rows) for r in found.regions] == [("MLP", ("up",), ("down",))]
    assert [r.node for r in found.regions[0].rewrites] == ["view"]


class SkipsAChunk(nn.Module):
    """Chunks along the tokens, one chunk unused: the split features pass through."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, _, last = self.up(x).chunk(3, dim=1)
        return self.down(first + last)


def test_a_split_along_another_dimension_keeps_every_piece_split() -> None:
    gm = fx.symbolic_trace(SkipsAChunk())
    gm.graph.eliminate_dead_code()  # as torch.export leaves it: no node for the unused chunk
    gm.recompile()
    ShapeProp(gm).propagate(torch.randn(2, 3, 8))
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)}
    found = find_shardable(gm, shapes)
    assert [(r.columns, r.rows) for r in found.regions] == [(("up",), ("down",))]

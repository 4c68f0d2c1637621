"""Each tp rank's graph (local head counts, Megatron-LM's collectives) and weights: a training
step on forked gloo ranks gives the whole model's loss and, on each rank, its shard of the whole
model's gradients: the sample GPT (fused q/k/v, biases) at tp 2 and 4, the LLaMA-shaped model
(grouped-query attention, fused k/v, SwiGLU) at tp 2."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from conftest import MODELS, SAMPLES, free_port
from pipec.codegen.local_shards import Collectives, local_weights, parallel_graph
from pipec.frontend.loader import load_model_file
from pipec.frontend.shardable import Shardable, find_shardable


def traced(path: Path, batch: int = 3
           ) -> tuple[fx.GraphModule, Shardable, tuple[torch.Tensor, ...]]:
    spec = load_model_file(path)
    torch.manual_seed(0)
    gm = fx.symbolic_trace(spec.build_model())
    inputs = spec.sample_batch(batch)[:-1]
    ShapeProp(gm).propagate(*inputs)
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("tensor_meta"), TensorMetadata)}
    return gm, find_shardable(gm, shapes), inputs


class Enter(torch.autograd.Function):
    """Megatron-LM's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    """Megatron-LM's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Gather(torch.autograd.Function):
    """All-gather along the last dimension forward; the rank's slice of the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


def enter(x: torch.Tensor) -> torch.Tensor:
    return Enter.apply(x)  # type: ignore[no-any-return]


def reduce(x: torch.Tensor) -> torch.Tensor:
    return Reduce.apply(x)  # type: ignore[no-any-return]


def gather(x: torch.Tensor) -> torch.Tensor:
    return Gather.apply(x)  # type: ignore[no-any-return]


COLLECTIVES = Collectives(enter, reduce, gather)


def train_step_worker(rank: int, tp: int, port: int, model: str, report: str) -> None:
    """One tp rank: the whole model's loss and gradients here, then the rank's parallel graph's
    (its regions: those that shard over ``tp``); the largest differences written to
    ``report``.rank."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    gm, shardable, inputs = traced(Path(model))
    spec = load_model_file(Path(model))
    torch.manual_seed(1)
    targets = spec.sample_batch(3)[-1]
    expected_loss = spec.module.loss_fn(gm(*inputs), targets)
    expected_loss.backward()
    whole = {name: p.grad for name, p in gm.named_parameters()}
    state = {name: t.detach() for name, t in gm.state_dict().items()}
    regions = shardable.regions_at(tp)
    local = copy.deepcopy(parallel_graph(gm, regions, tp, COLLECTIVES))
    for name, tensor in local_weights(state, regions, tp, rank).items():
        parent, _, leaf = name.rpartition(".")
        setattr(local.get_submodule(parent), leaf, nn.Parameter(tensor.clone()))
    loss = spec.module.loss_fn(local(*inputs), targets)
    loss.backward()
    wanted = local_weights(whole, regions, tp, rank)
    worst = max(float((p.grad - wanted[name]).abs().max()) for name, p in local.named_parameters())
    Path(f"{report}.{rank}").write_text(f"{abs(float(loss - expected_loss))} {worst}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("model", "tp"), [(SAMPLES / "gpt.py", 2), (SAMPLES / "gpt.py", 4),
                                           (MODELS / "gqa_lm.py", 2)], ids=str)
def test_a_training_step_over_gloo_gives_the_whole_models_gradients(model: Path, tp: int,
                                                                   tmp_path: Path) -> None:
    """Real all-reduces: the loss, and each rank's gradients equal its shard of the whole
    model's (column and row weights, whole biases, replicated norms and embeddings)."""
    context = mp.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=train_step_worker,
                             args=(r, tp, port, str(model), str(tmp_path / "report")))
             for r in range(tp)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    for rank in range(tp):
        loss_gap, gradient_gap = map(float, (tmp_path / f"report.{rank}").read_text().split())
        assert loss_gap < 1e-5 and gradient_gap < 1e-5, (rank, loss_gap, gradient_gap)


def test_a_regions_random_nodes_run_on_the_ranks_own_stream() -> None:
    """Each node of a region that may draw random numbers (attention's dropout_p, a dropout
    module) runs between own_random and shared_random; the dropout outside the region does
    not."""
    def own(value: Any) -> Any:
        return value

    def shared(value: Any) -> Any:
        return value

    collectives = Collectives(enter, reduce, gather, None, own, shared)
    for model, wrapped in ((SAMPLES / "gpt.py", "scaled_dot_product_attention"),
                           (MODELS / "dropout_mlp.py", "2")):
        gm, shardable, _ = traced(model)
        graph = parallel_graph(gm, shardable.regions_at(2), 2, collectives).graph
        around = [(n.args[0].args[0], n.args[0].target) for n in graph.nodes
                  if n.target is shared]  # (own_random's node, the random node)
        assert around and all(before.target is own for before, _ in around)
        assert {getattr(t, "__name__", t) for _, t in around} == {wrapped}
        assert len(around) == (4 if wrapped != "2" else 1)

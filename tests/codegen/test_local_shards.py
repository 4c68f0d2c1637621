"""Each rank's local graph and weights, run in lockstep with the all-reduces and all-gathers of
its regions done by hand, give the whole model's output: the sample GPT (fused q/k/v) at tp 2
and 4, the LLaMA-shaped model (grouped-query attention, fused k/v, SwiGLU) at tp 2. With the
collectives in the graph, a training step on two gloo ranks gives the whole model's loss and
each rank its shard of the whole model's gradients."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from conftest import MODELS, SAMPLES, free_port
from pipec.codegen.local_shards import Collectives, local_graph, local_weights, parallel_graph
from pipec.frontend.loader import load_model_file
from pipec.frontend.shardable import Region, Shardable, find_shardable


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


def rank_modules(gm: fx.GraphModule, regions: tuple[Region, ...], tp: int) -> list[fx.GraphModule]:
    shared = local_graph(gm, regions, tp)
    ranks = []
    for rank in range(tp):
        module = copy.deepcopy(shared)
        for name, tensor in local_weights(gm.state_dict(), regions, tp, rank).items():
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, nn.Parameter(tensor))
        ranks.append(module)
    return ranks


def run_in_lockstep(ranks: list[fx.GraphModule], regions: tuple[Region, ...],
                    inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every rank's graph node by node; a row-parallel linear's outputs summed (all-reduce), a
    gathered output concatenated along its last dimension (all-gather)."""
    reduced = {row for r in regions for row in r.rows}
    gathered = {name for r in regions for name in r.gathered}
    interpreters = [fx.Interpreter(m) for m in ranks]
    for interpreter in interpreters:
        interpreter.args_iter = iter(inputs)
    for nodes in zip(*(m.graph.nodes for m in ranks), strict=True):
        if nodes[0].op == "output":
            return interpreters[0].env[nodes[0].args[0]]
        values = [i.run_node(n) for i, n in zip(interpreters, nodes, strict=True)]
        target = str(nodes[0].target)
        if target in reduced:
            values = [sum(values)] * len(values)
        if nodes[0].name in gathered:
            values = [torch.cat(values, dim=-1)] * len(values)
        for interpreter, node, value in zip(interpreters, nodes, values, strict=True):
            interpreter.env[node] = value
    raise AssertionError("no output node")


@pytest.mark.parametrize(("model", "tp"), [(SAMPLES / "gpt.py", 2), (SAMPLES / "gpt.py", 4),
                                           (MODELS / "gqa_lm.py", 2)], ids=str)
def test_the_ranks_together_compute_the_whole_model(model: Path, tp: int) -> None:
    gm, shardable, inputs = traced(model)
    regions = shardable.regions_at(tp)
    assert regions == shardable.regions
    expected = gm(*inputs)
    ranks = rank_modules(gm, regions, tp)
    column = regions[1].columns[0]  # the first MLP's
    assert ranks[0].get_submodule(column).weight.shape[0] * tp == \
        gm.get_submodule(column).weight.shape[0]
    got = run_in_lockstep(ranks, regions, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_rank_alone_computes_a_different_model() -> None:
    """The check above can fail: without the all-reduces the output is wrong."""
    gm, shardable, inputs = traced(SAMPLES / "gpt.py")
    ranks = rank_modules(gm, shardable.regions, 2)
    no_reduce = tuple(replace(r, rows=()) for r in shardable.regions)
    assert not torch.allclose(run_in_lockstep(ranks, no_reduce, inputs), gm(*inputs))


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
    """One tp rank: the whole model's loss and gradients here, then the rank's parallel graph's;
    the largest differences written to ``report``.rank."""
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
    local = copy.deepcopy(parallel_graph(gm, shardable.regions, tp, COLLECTIVES))
    for name, tensor in local_weights(state, shardable.regions, tp, rank, True).items():
        parent, _, leaf = name.rpartition(".")
        setattr(local.get_submodule(parent), leaf, nn.Parameter(tensor.clone()))
    loss = spec.module.loss_fn(local(*inputs), targets)
    loss.backward()
    wanted = local_weights(whole, shardable.regions, tp, rank, True)
    worst = max(float((p.grad - wanted[name]).abs().max()) for name, p in local.named_parameters())
    Path(f"{report}.{rank}").write_text(f"{abs(float(loss - expected_loss))} {worst}")
    dist.destroy_process_group()


@pytest.mark.parametrize("model", [SAMPLES / "gpt.py", MODELS / "gqa_lm.py"], ids=str)
def test_a_training_step_over_gloo_gives_the_whole_models_gradients(model: Path,
                                                                   tmp_path: Path) -> None:
    """Two forked ranks, real all-reduces: the loss, and each rank's gradients equal its shard
    of the whole model's (column and row weights, whole biases, replicated norms and
    embeddings)."""
    context = mp.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=train_step_worker,
                             args=(r, 2, port, str(model), str(tmp_path / "report")))
             for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    for rank in range(2):
        loss_gap, gradient_gap = map(float, (tmp_path / f"report.{rank}").read_text().split())
        assert loss_gap < 1e-5 and gradient_gap < 1e-5, (rank, loss_gap, gradient_gap)

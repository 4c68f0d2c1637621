"""BatchNorm rewrites: chosen by parallelism, and equal to GroupNorm's definition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import MODELS, SAMPLES, compile_to, emitted_modules, run_forked
from pipec.errors import ConfigError
from pipec.frontend.annotate import annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.normalization import group_count, group_norm_rewrites, to_group_norm
from pipec.frontend.trace import trace_model


def test_group_count_keeps_enough_values_per_group() -> None:
    assert group_count(64, 32 * 32) == 32  # convolutional features: Wu & He's 32
    assert group_count(64, 1) == 4  # (N, 64): 4 groups of 16 channels
    assert group_count(12, 1) == 1  # (N, 12): fewer than 16 channels, one group
    assert group_count(12, 5) == 3  # (N, 12, 5): groups of 4 channels × 5 = 20 values


def test_pipelined_plan_rewrites_every_batch_norm(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=16)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    rewrites = plan["norm_rewrites"]
    assert len(rewrites) == 15 and plan["norm"] == "group"
    assert rewrites[0] == {"module": "stem.1", "from": "BatchNorm2d", "to": "GroupNorm",
                           "groups": 16}


def test_one_device_keeps_batch_norm(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=1, batch_size=16)
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["norm_rewrites"] == []


def test_keep_under_pipelining_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=16, norm="keep",
               micro_batch=4)
    assert "normalizes over one micro-batch of 4 samples" in caplog.text


def test_groups_must_divide_channels(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--norm-groups 5 does not divide the 16 channels"):
        compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, norm="group", norm_groups=5)


def group_norm_by_definition(x: torch.Tensor, groups: int, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Wu & He (2018), eq. 1-3: normalize each sample over groups of channels, then scale."""
    n, c = x.shape[:2]
    grouped = x.reshape(n, groups, -1)
    mean = grouped.mean(dim=2, keepdim=True)
    var = grouped.var(dim=2, unbiased=False, keepdim=True)
    normalized = ((grouped - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    return normalized * weight.reshape(shape) + bias.reshape(shape)


def test_rewritten_layer_equals_definition_and_carries_weights(tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=16)
    with emitted_modules(tmp_path / "o") as (user, stages):
        torch.manual_seed(0)
        model = user.build_model()
        with torch.no_grad():
            model.layers[2].bn1.weight.uniform_(0.5, 1.5)
            model.layers[2].bn1.bias.uniform_(-1, 1)
        weight = model.layers[2].bn1.weight.detach().clone()
        bias = model.layers[2].bn1.bias.detach().clone()
        stages.rewrite_norms(model)
        layer = model.layers[2].bn1
    assert isinstance(layer, torch.nn.GroupNorm) and layer.num_groups == 32
    torch.testing.assert_close(layer.weight.detach(), weight)
    torch.testing.assert_close(layer.bias.detach(), bias)
    x = torch.randn(4, 32, 5, 5, requires_grad=True)
    expected_x = x.detach().clone().requires_grad_()
    out = layer(x)
    expected = group_norm_by_definition(expected_x, 32, layer.weight, layer.bias, layer.eps)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, expected_x.grad)


@pytest.mark.parametrize(("gpus", "pp", "norm", "expected"), [
    (1, None, "auto", "keep"),
    (2, 2, "auto", "group"),
    (2, 1, "auto", "sync"),
    (4, 2, "auto", "group"),
    (4, 2, "sync", "sync"),
    (2, 1, "group", "group"),
    (2, None, "keep", "keep"),
])
def test_norm_choice_follows_the_parallelism(gpus: int, pp: int | None, norm: str,
                                             expected: str, tmp_path: Path) -> None:
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=gpus, pp=pp, norm=norm, batch_size=16)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["norm"] == expected
    to = {"keep": set(), "group": {"GroupNorm"}, "sync": {"SyncBatchNorm"}}[expected]
    assert {r["to"] for r in plan["norm_rewrites"]} == to


def _all_reduce_batch_norm_worker(rank: int, port: int, case: str, results: str) -> None:
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    stages = sys.modules["stages"]
    x, weight, bias, grad = torch.load(Path(results) / "inputs.pt")
    half = x.shape[0] // 2
    layer = stages.AllReduceBatchNorm(x.shape[1], momentum=0.3)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    mine = x[rank * half:(rank + 1) * half].clone().requires_grad_()
    out = layer(mine)
    out.backward(grad[rank * half:(rank + 1) * half])
    torch.save({"out": out.detach(), "dx": mine.grad, "dw": layer.weight.grad,
                "db": layer.bias.grad, "mean": layer.running_mean,
                "var": layer.running_var}, Path(results) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(8, 3), (8, 3, 5), (6, 4, 3, 3), (4, 2, 2, 3, 3)],
                         ids=["1d-flat", "1d", "2d", "3d"])
def test_all_reduce_batch_norm_on_2_processes_equals_batch_norm(shape: tuple[int, ...],
                                                                tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from conftest import free_port

    torch.manual_seed(1)
    x = torch.randn(shape) * 3 + 1
    weight, bias, grad = torch.rand(shape[1]) + 0.5, torch.randn(shape[1]), torch.randn(shape)
    torch.save((x, weight, bias, grad), tmp_path / "inputs.pt")
    # Pure data parallelism: the plan synchronizes BatchNorm, so stages.py carries the CPU's
    # all-reduce BatchNorm.
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, pp=1, batch_size=16)
    with emitted_modules(tmp_path / "o"):
        mp.start_processes(_all_reduce_batch_norm_worker,
                           args=(free_port(), "", str(tmp_path)), nprocs=2, join=True,
                           start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = torch.nn.modules.batchnorm._BatchNorm(shape[1], momentum=0.3)
    reference._check_input_dim = lambda input: None  # type: ignore[method-assign]
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    whole = x.clone().requires_grad_()
    out = reference(whole)
    out.backward(grad)
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), out.detach())
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), whole.grad)
    torch.testing.assert_close(ranks[0]["dw"] + ranks[1]["dw"], reference.weight.grad)
    torch.testing.assert_close(ranks[0]["db"] + ranks[1]["db"], reference.bias.grad)
    for r in ranks:
        torch.testing.assert_close(r["mean"], reference.running_mean)
        torch.testing.assert_close(r["var"], reference.running_var)


def test_batch_norm_1d_and_3d_become_group_norms_that_match_the_definition(
        tmp_path: Path) -> None:
    from conftest import MODELS

    compile_to(MODELS / "norms_1d_3d.py", tmp_path / "o", gpus=2, batch_size=8, norm="group")
    rewrites = json.loads((tmp_path / "o" / "plan.json").read_text())["norm_rewrites"]
    # (N, 12): one value per channel, so one group of all 12 (a group of one value would
    # normalize to zero); (N, 12, 5): 3 groups of 4 × 5 = 20 values; (N, 8, 5, 2, 2): 8 groups.
    assert [(r["module"], r["from"], r["groups"]) for r in rewrites] == [
        ("bn_flat", "BatchNorm1d", 1), ("bn_seq", "BatchNorm1d", 3),
        ("bn_vol", "BatchNorm3d", 8)]
    with emitted_modules(tmp_path / "o") as (user, stages):
        model = user.build_model()
        stages.rewrite_norms(model)
    for name, shape in (("bn_flat", (6, 12)), ("bn_seq", (6, 12, 5)), ("bn_vol", (6, 8, 5, 2, 2))):
        layer = getattr(model, name)
        assert isinstance(layer, torch.nn.GroupNorm)
        x = torch.randn(shape)
        expected = group_norm_by_definition(x, layer.num_groups, layer.weight, layer.bias,
                                            layer.eps)
        torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("affine", [True, False])
def test_to_group_norm_carries_the_affine_weight_and_bias(affine: bool) -> None:
    batch_norm = torch.nn.BatchNorm2d(8, eps=1e-3, affine=affine)
    if affine:
        with torch.no_grad():
            batch_norm.weight.uniform_(0.5, 1.5)
            batch_norm.bias.uniform_(-1, 1)
    group_norm = to_group_norm(batch_norm, 4)
    assert (group_norm.num_groups, group_norm.num_channels, group_norm.eps,
            group_norm.affine) == (4, 8, 1e-3, affine)
    if affine:
        torch.testing.assert_close(group_norm.weight, batch_norm.weight)
        torch.testing.assert_close(group_norm.bias, batch_norm.bias)
        assert group_norm.weight.data_ptr() != batch_norm.weight.data_ptr()  # a copy


def test_group_norm_rewrites_are_those_of_a_pipelined_plan(tmp_path: Path) -> None:
    """The entry point for `pipec profile`: no plan needed, the same group counts."""
    compile_to(SAMPLES / "resnet.py", tmp_path / "o", gpus=2, batch_size=16)
    planned = json.loads((tmp_path / "o" / "plan.json").read_text())["norm_rewrites"]
    spec = load_model_file(SAMPLES / "resnet.py")
    traced = trace_model(spec)
    rewrites = group_norm_rewrites(traced, annotate(traced, spec))
    assert [{"module": r.module, "from": r.from_, "to": r.to, "groups": r.groups}
            for r in rewrites] == planned


def test_a_batch_norm_inside_a_modules_forward_becomes_a_group_norm_in_the_graph(
        tmp_path: Path) -> None:
    """timm's BatchNormAct2d calls F.batch_norm in its own forward, which fx traces through:
    a pipelined plan rewrites the call in the graph (its activation stays), and 2 stages train
    as one process with the same GroupNorms."""
    model = MODELS / "bn_act.py"
    compile_to(model, tmp_path / "one", gpus=1, batch_size=16, norm="group")
    compile_to(model, tmp_path / "two", gpus=2, batch_size=16)
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["norm_rewrites"] == [
        {"module": "bn1", "from": "F.batch_norm", "to": "GroupNorm", "groups": 16},
        {"module": "bn2", "from": "F.batch_norm", "to": "GroupNorm", "groups": 32}]
    source = (tmp_path / "two" / "stages.py").read_text()
    assert source.count("functional.group_norm(") == 2 and "functional.batch_norm" not in source
    assert source.count("torch.nn.functional.relu(") == 2
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-5)


def test_a_batch_norm_inside_a_modules_forward_stays_under_data_parallelism(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    compile_to(MODELS / "bn_act.py", tmp_path / "o", gpus=2, pp=1, batch_size=16)
    assert "batch_norm(" in (tmp_path / "o" / "stages.py").read_text()
    assert "2 batch norm(s) computed inside a module's forward (bn1, bn2) stay BatchNorm" in \
        caplog.text


def test_an_exported_graphs_batch_norm_becomes_a_group_norm_too(tmp_path: Path) -> None:
    """Under torch.export a BatchNorm is an aten.batch_norm call (timm's MobileViT and
    TF-EfficientNet go there): rewritten in the graph like F.batch_norm."""
    model = MODELS / "bn_act.py"
    compile_to(model, tmp_path / "one", gpus=1, batch_size=16, norm="group", frontend="export")
    compile_to(model, tmp_path / "two", gpus=2, batch_size=16, frontend="export")
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert [r["from"] for r in plan["norm_rewrites"]] == ["aten.batch_norm"] * 2
    source = (tmp_path / "two" / "stages.py").read_text()
    assert source.count("aten.group_norm.default(") == 2 and "aten.batch_norm" not in source
    reference = run_forked(tmp_path / "one", 1, "--steps", "3", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "3", "--seed", "3") == pytest.approx(
        reference, rel=1e-5)

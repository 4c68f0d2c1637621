"""timm and torchvision models as users bring them, random weights, shrunk by their own
arguments: optional forward arguments (timm's attn_mask), in-place activations,
squeeze-excitation, timm's BatchNormAct2d (a batch norm inside the module's forward) and
stochastic depth. Each trains on 2 stages as on one process. They run where timm and
torchvision import: beside torch 2.14.1 (make test-torch); torchvision 0.28 does not load
beside the CPU torch 2.13 wheel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compile_to, composed_stages, run_forked

pytest.importorskip("timm")
pytest.importorskip("torchvision")
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo_models as vision_zoo

CASES = {
    "timm_vit": vision_zoo.timm_model("vit_tiny_patch16_224", 32, img_size=32, patch_size=8,
                                      depth=2),
    "timm_convnext": vision_zoo.timm_model("convnext_atto", 32, depths=(1, 1, 1, 1)),
    "timm_efficientnet": vision_zoo.timm_model("efficientnet_b0", 32),
    "timm_resnet_d": vision_zoo.timm_model("resnet18d", 32),
    "torchvision_resnet": vision_zoo.torchvision_model("resnet18", 32),
    "torchvision_mobilenet_v3": vision_zoo.torchvision_model("mobilenet_v3_small", 32,
                                                             width_mult=0.25),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_stages_train_as_one_process(name: str, tmp_path: Path) -> None:
    """--norm group on both plans, so that both train the same GroupNorms."""
    model = vision_zoo.write(CASES[name], tmp_path, name)
    compile_to(model, tmp_path / "one", gpus=1, batch_size=8, norm="group")
    compile_to(model, tmp_path / "two", gpus=2, batch_size=8, norm="group")
    reference = run_forked(tmp_path / "one", 1, "--steps", "2", "--seed", "3")
    assert run_forked(tmp_path / "two", 2, "--steps", "2", "--seed", "3") == pytest.approx(
        reference, rel=1e-4)


def test_timm_batch_norm_act_becomes_group_norm_under_pipelining(tmp_path: Path) -> None:
    model = vision_zoo.write(CASES["timm_efficientnet"], tmp_path, "efficientnet")
    compile_to(model, tmp_path / "o", gpus=2, batch_size=8)
    rewrites = json.loads((tmp_path / "o" / "plan.json").read_text())["norm_rewrites"]
    assert rewrites and {r["from"] for r in rewrites} == {"F.batch_norm"}
    assert "functional.batch_norm" not in (tmp_path / "o" / "stages.py").read_text()


def test_timm_vit_composes_to_the_model(tmp_path: Path) -> None:
    """Its blocks take attn_mask=None, which the inputs do not supply."""
    model = vision_zoo.write(CASES["timm_vit"], tmp_path, "vit")
    compile_to(model, tmp_path / "o", gpus=2, batch_size=8)
    staged, eager = composed_stages(tmp_path / "o")
    assert float((staged - eager).abs().max()) < 1e-5


def test_timm_stochastic_depth_trains_on_2_stages(tmp_path: Path) -> None:
    """Drop-path draws at random, so the losses differ from one process's; fx traces it in
    training mode (its module is not a torch.nn leaf)."""
    model = vision_zoo.write(vision_zoo.timm_model(
        "vit_tiny_patch16_224", 32, img_size=32, patch_size=8, depth=2, drop_path_rate=0.1),
        tmp_path, "vit")
    compile_to(model, tmp_path / "o", gpus=2, batch_size=8)
    losses = run_forked(tmp_path / "o", 2, "--steps", "3", "--seed", "3")
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)

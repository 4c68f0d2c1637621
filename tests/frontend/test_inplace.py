"""Static in-place analysis of the fx graph: which inputs a stage overwrites, and which cuts
would separate two names of one storage that is overwritten later."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn import functional as F

from conftest import MODELS
from pipec.frontend.annotate import annotate, live_values
from pipec.frontend.inplace import cuts_splitting_aliases, overwritten_inputs
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model


class Writes(nn.Module):
    """Each input is overwritten in its own way, or (``keep``) only read."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.flatten = nn.Flatten()

    def forward(self, module: torch.Tensor, keyword: torch.Tensor, positional: torch.Tensor,
                method: torch.Tensor, function: torch.Tensor, view: torch.Tensor,
                attribute: torch.Tensor, flattened: torch.Tensor, keep: torch.Tensor
                ) -> torch.Tensor:
        a = self.relu(module)
        b = F.relu(keyword, inplace=True)
        c = F.hardtanh(positional, -1.0, 1.0, True)
        method.mul_(2)
        torch.relu_(function)
        view.transpose(0, 1)[0].add_(1)  # through two views
        attribute.mT.mul_(3)
        self.flatten(flattened).clamp_(max=1)
        fresh = (keep + 1).relu_()  # a new tensor: keep is only read
        keep.clone().sub_(1)
        return (a + b + c + method + function + view + attribute + flattened.flatten(1)
                + fresh)


def test_every_kind_of_in_place_write_is_found_and_only_those() -> None:
    gm = fx.symbolic_trace(Writes())
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert overwritten_inputs(gm, nodes, inputs) == set(inputs) - {"keep"}


def test_torch_export_in_place_ops_are_found_by_name() -> None:
    class Export(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return torch.relu(y) + x

    gm = torch.export.export(Export(), (torch.randn(2, 3), torch.randn(2, 3))).module()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert any("add_" in str(n.target) for n in nodes)
    assert overwritten_inputs(gm, nodes, ["x", "y"]) == {"x"}


def test_a_cut_between_two_names_of_an_overwritten_storage_is_found() -> None:
    class Aliased(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            head = x[:, :2]  # a view of x
            y = torch.tanh(x)
            head.mul_(2)  # x changes too
            return y + x

    gm = fx.symbolic_trace(Aliased())
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert [n.target.__name__ if callable(n.target) else n.target for n in compute] == [
        "getitem", "tanh", "mul_", "add"]
    # Cuts 1 and 2 separate x and its view `head` before the write; cut 3 is after it.
    assert cuts_splitting_aliases(gm, compute, live_values(gm)) == {1, 2}


def test_annotate_makes_those_cuts_illegal() -> None:
    spec = load_model_file(MODELS / "aliased.py")
    assert annotate(trace_model(spec), spec).legal_cuts == (True, False, False, True, True)

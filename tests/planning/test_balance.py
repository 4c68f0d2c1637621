"""Stage boundaries pinned by the user (--boundaries): kept exactly, the rest still searched,
and each mistake refused with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MODELS, SAMPLES, compile_to, device_file
from pipec.cli import main
from pipec.errors import ConfigError, InfeasibleError


def _starts(out: Path) -> list[int]:
    return [stage["nodes"][0] for stage in json.loads((out / "plan.json").read_text())["stages"]]


def test_pinned_boundaries_are_the_plans_and_the_search_goes_on(tmp_path: Path) -> None:
    uniform = compile_to(SAMPLES / "gpt.py", tmp_path / "a", gpus=2, batch_size=16,
                         strategy="uniform")
    own = compile_to(SAMPLES / "gpt.py", tmp_path / "c", gpus=2, batch_size=16)
    moved = (uniform.stages[1].start,)
    assert moved != (own.stages[1].start,)  # pinned elsewhere than pipec would place it
    pinned = compile_to(SAMPLES / "gpt.py", tmp_path / "b", gpus=2, batch_size=16,
                        boundaries=moved)
    assert _starts(tmp_path / "b") == [0, *moved]
    # The micro-batch and schedule are still chosen: every one of them was evaluated.
    assert len({(c.micro_batch, c.schedule) for c in pinned.candidates}) > 1
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["strategy"] == "pipec"
    assert f"pinned at nodes {moved[0]} by --boundaries" in (tmp_path / "b" / "report.md"
                                                             ).read_text()


def test_pinning_pipecs_own_boundaries_predicts_its_own_plan(tmp_path: Path) -> None:
    own = compile_to(SAMPLES / "mlp.py", tmp_path / "a", gpus=2, batch_size=64, margin=0.0)
    assert own.pp == 2
    starts = tuple(s.start for s in own.stages[1:])
    pinned = compile_to(SAMPLES / "mlp.py", tmp_path / "b", gpus=2, batch_size=64,
                        margin=0.0, boundaries=starts)
    assert (pinned.micro_batch, pinned.schedule) == (own.micro_batch, own.schedule)
    assert pinned.samples_per_s == pytest.approx(own.samples_per_s)


def test_the_stage_count_follows_the_boundaries_when_pp_is_searched(tmp_path: Path) -> None:
    plan = compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=4, batch_size=16, pp=None,
                      boundaries=(8,))
    assert (plan.pp, plan.dp) == (2, 2)
    assert _starts(tmp_path / "o") == [0, 8]


@pytest.mark.parametrize(("options", "message"), [
    ({"boundaries": (5, 8)}, "gives 2 boundaries, so 3 stages, but the plans"),
    ({"boundaries": (5,), "pp": 1}, "so 2 stages, but the plans .* allow have 1 stage;"),
    ({"boundaries": (9, 5)}, "give increasing node indices from 1 to"),
    ({"boundaries": (0,)}, "give increasing node indices from 1 to"),
    ({"boundaries": (10_000,)}, "give increasing node indices from 1 to"),
    ({"boundaries": (5,), "strategy": "uniform"}, "a baseline places its own boundaries"),
    ({"boundaries": (5,), "recompute": "full"}, "planned without recomputation"),
])
def test_bad_boundaries(options: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_to(SAMPLES / "gpt.py", tmp_path / "o", gpus=2, batch_size=16, **options)


def test_a_boundary_at_an_illegal_cut_names_the_legal_ones(tmp_path: Path) -> None:
    # tests/models/aliased.py: cuts 1 and 2 split x from its view before a write.
    with pytest.raises(ConfigError, match=r"no stage may start at node 2 .* nearest are 3"):
        compile_to(MODELS / "aliased.py", tmp_path / "o", gpus=2, batch_size=8,
                   boundaries=(2,))


def test_boundaries_that_are_not_numbers_are_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "m.py", "--boundaries", "12,x"])
    assert exit_info.value.code == 2
    assert "expected node indices separated by commas" in capsys.readouterr().err


def test_a_pinned_split_that_does_not_fit_says_what_it_needs(tmp_path: Path) -> None:
    """On 2 devices of 2.6 MiB the GPT's own split fits (AdamW, 2 stages); the split with all
    but the last node on the first stage does not, and the error names its leanest plan's
    need and the fix."""
    small = device_file(tmp_path, 2.6 * 2**20)
    options = {"gpus": 2, "batch_size": 16, "hardware": small, "optimizer": "adamw"}
    own = compile_to(SAMPLES / "gpt.py", tmp_path / "own", **options)
    assert own.pp == 2
    with pytest.raises(InfeasibleError, match=r"the split --boundaries pins does not fit: .* "
                       r"needs [0-9.]+ GiB on its fullest device .* leave --boundaries out"):
        compile_to(SAMPLES / "gpt.py", tmp_path / "pinned", boundaries=(124,), **options)

"""Plan files are checked once, where they are read (`ParallelPlan.from_json` / `load`): a broken
field fails `meshplan explain` and `meshplan run` alike with exit code 2 and one line naming it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import runtime.launch
import runtime.profiler
from cost_models.errors import MeshplanError
from planner.plans.manual import manual_plan
from planner.vocab.plan_check import validate
from planner.vocab.plan_file import ParallelPlan
from runtime.cli import main

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128"


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A valid tp2 x pp2 plan of a tiny GPT on 4 devices, as its file holds it (4 layers, one
    per block, 2 per stage)."""
    plan = manual_plan(
        SPEC,
        "1x4xA100-80GB",
        dp=1,
        tp=2,
        pp=2,
        num_microbatches=2,
        global_batch=8,
        dtype="float32",
    )
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return json.loads(path.read_text())


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to start processes fail the test."""

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(runtime.launch, "launch", refuse)
    monkeypatch.setattr(runtime.profiler, "run_profile", refuse)


def _first_param(d: dict[str, Any]) -> str:
    return next(iter(d["stages"][0]["param_placements"]))


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set `key` (a dotted path; integers index lists) to `value`."""
    *parents, last = key.split(".")

    def corrupt(d: dict[str, Any]) -> None:
        for k in parents:
            d = d[int(k)] if k.isdigit() else d[k]
        d[int(last) if last.isdigit() else last] = value

    return corrupt


def _param(value: Any) -> Callable[[dict[str, Any]], None]:
    def corrupt(d: dict[str, Any]) -> None:
        d["stages"][0]["param_placements"][_first_param(d)] = value

    return corrupt


def _node(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set the first of `key` ("inputs" or "outputs") of stage 1's first node to `value`."""

    def corrupt(d: dict[str, Any]) -> None:
        next(iter(d["stages"][1]["node_strategies"].values()))[key][0] = value

    return corrupt


# (what is corrupted, how, text the one-line error must contain)
CASES = [
    ("version", _set("format_version", 2), "format_version: 2 is not supported"),
    (
        "mesh size",
        _set("stages.1.logical_mesh", [3, 7]),
        "stages[1].logical_mesh: [3, 7] has 21 devices, but the stage has 2 devices [2, 3]",
    ),
    ("submesh size", _set("stages.0.submesh", [1, 4]), "stages[0].submesh: [1, 4]"),
    ("mesh shape", _set("stages.0.logical_mesh", [2]), "stages[0].logical_mesh: [2]"),
    ("placement X", _param(["R", "X"]), '"X" is not a placement; expected R, S(d)'),
    ("placement S(-1)", _param(["S(-1)", "R"]), '"S(-1)" is not a placement'),
    ("placement length", _param(["R"]), "is not a list of 2 placements"),
    (
        "node input",
        _node("inputs", ["R", "S(x)"]),
        '.inputs[0][1]: "S(x)" is not a placement',
    ),
    (
        "node output",
        _node("outputs", ["R"]),
        '].outputs[0]: ["R"] is not a list of 2 placements',
    ),
    (
        "received placement",
        _set("stages.1.input_placements.add_4", ["R", "P"]),
        (
            'stages[1].input_placements["add_4"][1]: "P": a received value arrives '
            "reduced; expected R or S(d)"
        ),
    ),
    (
        "zero param",
        _set("stages.0.zero_params", ["nope"]),
        'stages[0].zero_params: "nope" is not a parameter of the stage',
    ),
    (
        "layer out of range",
        _set("stages.1.layers", [1, 99]),
        "stages[1].layers: [1, 99] is not [first, last] with 0 <= first <= last < 4",
    ),
    (
        "layers from 0",
        _set("stages.0.layers", [1, 1]),
        "stages[0].layers: [1, 1] starts at layer 1, expected 0",
    ),
    (
        "layer overlap",
        _set("stages.1.layers", [0, 1]),
        "stages[1].layers: [0, 1] starts at layer 0, expected 2",
    ),
    (
        "layer gap",
        lambda d: d["layer_nodes"].append(d["layer_nodes"][-1]),
        "stages[1].layers: [2, 3] ends at layer 3, but the last stage must end at the last layer, 4",
    ),
    ("no layers", _set("layer_nodes", []), "layer_nodes: [] is not a non-empty list"),
    ("layer node", _set("layer_nodes.0", ["a"]), "layer_nodes[0]"),
    ("no stages", _set("stages", []), "stages: [] is not a non-empty list"),
    (
        "device out of range",
        _set("stages.1.devices", [2, 4]),
        "stages[1].devices: 4 is not a device of the cluster, which has 4 devices (0..3)",
    ),
    ("negative device", _set("stages.1.devices", [-1, 2]), "stages[1].devices: -1"),
    (
        "duplicate device",
        _set("stages.1.devices", [2, 2]),
        "stages[1].devices: [2, 2] names device 2 twice",
    ),
    (
        "shared devices",
        _set("stages.1.devices", [1, 2]),
        "stages[1].devices: [1, 2] shares device 1 with stages[0]",
    ),
    ("interleaving", _set("virtual_stages", 2), "stages[1].devices"),
    ("virtual stages", _set("virtual_stages", 3), "stages: 2 stages do not split"),
    (
        "micro-batches",
        _set("num_microbatches", 3),
        "global_batch: 8 does not split into num_microbatches=3",
    ),
    (
        "no micro-batches",
        _set("num_microbatches", 0),
        "num_microbatches: 0 is not a positive int",
    ),
    (
        "schedule",
        _set("schedule", "zigzag"),
        'schedule: "zigzag" is not one of gpipe, 1f1b, interleaved',
    ),
    (
        "dtype",
        _set("dtype", "float64"),
        'dtype: "float64" is not one of float32, float16, bfloat16',
    ),
    (
        "kind",
        _set("kind", "magic"),
        'kind: "magic" is not one of auto, manual, intra-only, inter-only',
    ),
    (
        "missing field",
        lambda d: d["stages"][0].pop("devices"),
        "stages[0].devices: missing",
    ),
    (
        "unknown field",
        _set("stages.0.colour", "red"),
        "stages[0].colour: unknown field",
    ),
    (
        "time",
        _set("stages.0.time_s", "fast"),
        'stages[0].time_s: "fast" is not a number >= 0',
    ),
]


@pytest.mark.parametrize(
    "corrupt, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_broken_plan_fails_explain_and_run_with_one_line(
    plan_json: dict[str, Any],
    corrupt: Callable[[dict[str, Any]], None],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_launch: None,
) -> None:
    d = copy.deepcopy(plan_json)
    corrupt(d)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(d))
    for argv in (["explain", str(path)], ["run", SPEC, "--plan", str(path)]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"meshplan: error: {path}: "), lines[0]
        assert expected in lines[0], lines[0]
        assert captured.out == ""


def test_valid_plan_round_trips(plan_json: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json))
    plan = ParallelPlan.load(path)
    assert json.loads(plan.dumps()) == plan_json
    assert ParallelPlan.from_json(plan.to_json()).to_json() == plan.to_json()
    validate(plan)


def test_interleaved_plan_is_valid() -> None:
    plan = manual_plan(
        SPEC,
        "1x4xA100-80GB",
        dp=2,
        tp=1,
        pp=2,
        virtual_stages=2,
        num_microbatches=2,
        global_batch=8,
        dtype="float32",
    )
    back = ParallelPlan.from_json(json.loads(plan.dumps()))
    assert [s.devices for s in back.stages] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_not_an_object_and_schedule_alias(plan_json: dict[str, Any]) -> None:
    with pytest.raises(MeshplanError, match=r"^x: \[1\] is not a plan"):
        ParallelPlan.from_json([1], "x")
    d = copy.deepcopy(plan_json) | {"schedule": "Schedule1F1B"}
    assert ParallelPlan.from_json(d).schedule == "Schedule1F1B"

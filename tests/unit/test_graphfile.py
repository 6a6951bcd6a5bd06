"""Saved graphs (``*.graph.json``): the same graph back, and data, never code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import captured
from torchweave.cli import main
from torchweave.graphfile import GraphFileError, graph_from_json, graph_to_json
from torchweave.policies import resolve
from torchweave.sim import parse_cluster, simulate

pytestmark = pytest.mark.usefixtures("in_tmp_dir")  # default Gantt charts land there


def _same(a, b) -> None:
    assert [(n.name, n.target, n.args, n.kwargs, n.outputs, n.annotation, n.module)
            for n in a.nodes] == [(n.name, n.target, n.args, n.kwargs, n.outputs, n.annotation,
                                   n.module) for n in b.nodes]
    assert a.values == b.values and list(a.values) == list(b.values)
    assert (a.inputs, a.outputs, a.loss) == (b.inputs, b.outputs, b.loss)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "recycler-tiny", "t5-tiny"])
def test_a_saved_graph_is_the_captured_one_and_simulates_the_same(name: str) -> None:
    g = captured(name)
    back = graph_from_json(graph_to_json(g))
    _same(g, back)
    assert back.meta.get("recycle") == g.meta.get("recycle")
    cluster = parse_cluster("2xA100-80GB-SXM")
    a = simulate(g, resolve("tp", g, 2), cluster, timeline=False)
    b = simulate(back, resolve("tp", back, 2), cluster, timeline=False)
    assert (a.step_time, a.memory) == (b.step_time, b.memory)


def test_a_transformers_moe_graph_saves_with_its_memory_formats_and_experts_op() -> None:
    """transformers writes ``clone(memory_format=torch.contiguous_format)``; its experts are
    one ``torchweave.moe_experts`` op (torchweave/ops/moe.py). Both go through the file."""
    pytest.importorskip("transformers")
    g = captured("hf-mixtral-tiny")
    text = graph_to_json(g)
    assert '"memory_format"' in text and "torchweave.moe_experts" in text
    _same(g, graph_from_json(text))


def _tampered(change) -> str:
    data = json.loads(graph_to_json(captured("gpt-tiny")))
    change(data)
    return json.dumps(data)


def _first_node(data: dict) -> dict:
    return data["nodes"][0]


HOSTILE = {
    "op outside the registry": (lambda d: _first_node(d).update(target="builtins.eval.default"),
                                "an op torchweave has an annotation for"),
    "code as an op name": (lambda d: _first_node(d).update(target="__import__('os').system('x')"),
                           "allowed characters"),
    "code as a value name": (lambda d: d["values"].update({"x; import os": d["values"].popitem()[1]}),
                             "allowed characters"),
    "reference to no value": (lambda d: _first_node(d).update(args=[{"ref": "nowhere"}]),
                              "a value the graph holds"),
    "unknown tagged argument": (lambda d: _first_node(d).update(args=[{"pickle": "gASV"}]),
                                "a number, boolean"),
    "dtype that is not torch's": (lambda d: next(iter(d["values"].values())).update(dtype="object"),
                                  "one of float32"),
    "a key the format lacks": (lambda d: d.update(__reduce__="os.system"), "keys among"),
    "a node key the format lacks": (lambda d: _first_node(d).update(annotation="a -> a; x"),
                                    "keys among"),
    "a negative dimension": (lambda d: next(iter(d["values"].values())).update(shape=[-1]),
                             "a whole number >= 0"),
    "a string dimension": (lambda d: next(iter(d["values"].values())).update(shape=["1e9"]),
                           "a whole number >= 0"),
    "a module path with a newline": (lambda d: _first_node(d).update(module="a\nimport os"),
                                     "short printable string"),
    "a memory format that is not torch's": (
        lambda d: _first_node(d).update(args=[{"memory_format": "__class__"}]), "a number, boolean"),
    "arguments nested too deep": (lambda d: _first_node(d).update(args=[[[[[[[[[[1]]]]]]]]]]),
                                  "at most 8 deep"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_graph_file_is_refused_naming_what_is_wrong(case: str, tmp_path: Path) -> None:
    change, words = HOSTILE[case]
    with pytest.raises(GraphFileError) as info:
        graph_from_json(_tampered(change))
    assert words in str(info.value), str(info.value)


def test_bad_json_and_an_old_version_are_refused() -> None:
    with pytest.raises(GraphFileError, match="valid JSON"):
        graph_from_json("{")
    with pytest.raises(GraphFileError, match="graph files of version 1"):
        graph_from_json(_tampered(lambda d: d.update(version=0)))


def test_capture_once_then_plan_and_simulate_the_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gpt.graph.json"
    assert main(["inspect", "gpt-tiny", "--totals", "--save-graph", str(path)]) == 0
    assert "plan, simulate and explain take it as MODEL" in capsys.readouterr().out
    assert main(["simulate", "gpt-tiny", "--cluster", "2xA100-80GB-SXM", "--plan", "tp"]) == 0
    direct = capsys.readouterr().out
    assert main(["simulate", str(path), "--cluster", "2xA100-80GB-SXM", "--plan", "tp"]) == 0
    saved = capsys.readouterr().out

    def step(out: str) -> str:
        return next(x for x in out.splitlines() if "step time" in x)

    assert step(saved) == step(direct)
    assert main(["plan", str(path), "--plan", "tp", "--world-size", "2",
                 "--code", str(tmp_path / "code")]) == 0
    assert (tmp_path / "code" / "rank0.py").exists()
    # what runs the model needs its weights; a graph cannot be cut into micro-batches
    assert main(["verify", str(path)]) == 2
    assert "holds no weights" in capsys.readouterr().out
    assert main(["simulate", str(path), "--cluster", "2xA100-80GB-SXM", "--grad-accum", "2"]) == 2
    assert "cannot be cut into micro-batches" in capsys.readouterr().out
    assert main(["inspect", "gpt-tiny", "--save-graph", str(tmp_path / "g.json")]) == 2
    assert "ends in .graph.json" in capsys.readouterr().out

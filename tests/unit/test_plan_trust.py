"""Hostile plan files are refused, with the field named, before any code is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import built, captured
from torchweave.cli import main
from torchweave.parallel import compile_plan
from torchweave.plan.plan import Plan
from torchweave.plan.validate import PlanError
from torchweave.policies import resolve

def _payload(marker: Path) -> str:
    return f"__import__('os').system('touch {marker}')"


def _rename_first(d: dict, new: str) -> None:
    key = next(iter(d))
    d[new] = d.pop(key)


def _split_dim(data: dict, bad: str) -> None:
    entry = next(ts for ts in data["trans"].values() if any(d for d, _ in ts))
    next(t for t in entry if t[0])[0] = bad


def _recycle(data: dict, link: list[str]) -> None:
    data["pipeline"]["recycle"] = {"passes": 2, "links": [link]}


def _set(key: str) -> Callable[[dict, object], None]:
    return lambda d, bad: d.update({key: bad})


# case → (policy the JSON starts from, field the error names, the hostile value from the
# payload, how to plant it)
CASES: dict[str, tuple[str, str, Callable[[str], object], Callable[[dict, object], None]]] = {
    "name closes the docstring": ("tp", "plan name", lambda p: f'x"""\n{p}\n"""', _set("name")),
    "name is no string": ("tp", "plan name", lambda p: 7, _set("name")),
    "name too long": ("tp", "plan name", lambda p: "a" * 65, _set("name")),
    "newline in a mesh axis": ("tp", "plan mesh axis 1", lambda p: f"tp\n{p}",
                               lambda d, bad: d["mesh"][1].__setitem__(0, bad)),
    "zero_axis": ("zero1", "plan zero_axis", lambda p: f"dp\n{p}", _set("zero_axis")),
    "trans node": ("tp", "plan trans node", lambda p: f'a"""{p}',
                   lambda d, bad: _rename_first(d["trans"], bad)),
    "trans dim": ("tp", "plan trans dim of", lambda p: f"v\n{p}", _split_dim),
    "assign node": ("tp", "plan assign node", lambda p: f"a\n{p}",
                    lambda d, bad: _rename_first(d["assign"], bad)),
    "order node": ("tp", "plan order 0", lambda p: f"x\n{p}",
                   lambda d, bad: d.update(order=[[[bad, [0]], ["arange", [0]]]])),
    "recompute group node": ("tp", "plan recompute group 0", lambda p: f"x\n{p}",
                             lambda d, bad: d.update(recompute=[[bad]])),
    "notes key": ("tp", "plan notes key", lambda p: f"k\n{p}",
                  lambda d, bad: d["notes"].update({bad: "v"})),
    "notes value": ("tp", "plan notes 'policy'", lambda p: f"tp\n{p}",
                    lambda d, bad: d["notes"].update(policy=bad)),
    "pipeline kind": ("1f1b", "plan pipeline kind", lambda p: f'1f1b"""{p}',
                      lambda d, bad: d["pipeline"].update(kind=bad)),
    "pipeline stage_of node": ("1f1b", "plan pipeline stage_of node", lambda p: f"x\n{p}",
                               lambda d, bad: _rename_first(d["pipeline"]["stage_of"], bad)),
    "recycle link input": ("1f1b", "plan pipeline recycle link 0 input", lambda p: f"idx\n{p}",
                           lambda d, bad: _recycle(d, [bad, "ln_f"])),
    "recycle link output": ("1f1b", "plan pipeline recycle link 0 output",
                            lambda p: f"ln_f\n{p}", lambda d, bad: _recycle(d, ["idx", bad])),
}


def _hostile(case: str, marker: Path) -> tuple[str, str, object]:
    """(plan JSON, the field the error must name, the bad value)."""
    policy, field, make, plant = CASES[case]
    data = json.loads(resolve(policy, captured("gpt-tiny"), 2).to_json())
    bad = make(_payload(marker))
    plant(data, bad)
    return json.dumps(data), field, bad


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_json_refuses_a_hostile_string(case: str, tmp_path: Path) -> None:
    text, field, bad = _hostile(case, tmp_path / "marker")
    with pytest.raises(PlanError) as info:
        Plan.from_json(text)
    msg = str(info.value)
    assert field in msg and "outside their alphabets" in msg, msg
    assert repr(bad)[:20] in msg, msg
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("case", sorted(CASES) + ["node not in the graph"])
def test_compile_plan_and_the_cli_write_no_code_for_a_hostile_plan(
        case: str, tmp_path: Path, capsys) -> None:
    marker = tmp_path / "marker"
    if case == "node not in the graph":
        data = json.loads(resolve("tp", captured("gpt-tiny"), 2).to_json())
        _rename_first(data["assign"], "no_such_node")
        text, field, bad = json.dumps(data), "node 'no_such_node'", "no_such_node"
        Plan.from_json(text)  # a well-formed name: the graph check refuses it
    else:
        text, field, bad = _hostile(case, marker)
    path = tmp_path / "hostile.json"
    path.write_text(text)
    model, inputs = built("gpt-tiny")[:2]
    code = tmp_path / "code"
    with pytest.raises(PlanError) as info:
        compile_plan(model, inputs, str(path), world_size=2, code_dir=str(code))
    assert field in str(info.value) and repr(bad)[:20] in str(info.value), str(info.value)
    assert not code.exists()

    cli_code = tmp_path / "cli-code"
    assert main(["plan", "gpt-tiny", "--plan", str(path), "--code", str(cli_code)]) == 2
    out = capsys.readouterr().out
    assert "error:" in out and field in out, out
    assert not cli_code.exists()
    assert not marker.exists()

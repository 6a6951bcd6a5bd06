"""The strings a plan holds, each checked against an alphabet before anything reads it.

A plan is data that users edit, diff and load from JSON. Its strings reach
generated code (the header names the plan and its mesh), terminals and file
contents, so each field admits a short, safe alphabet and nothing else:

- node names, split dimensions, mesh axes, the ZeRO axis and recycled inputs
  are identifiers (:data:`IDENT`), as the graph's and the annotations' are;
- the plan's name, a pipeline's kind and note keys are :data:`NAME` (``dp``,
  ``1f1b``, ``zero_bubble``, ``random7``);
- a recycled output is a module path or value (:data:`PATH`);
- a note's value is printable text on one line (the search's reasons).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from torchweave.errors import Problem

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
NAME = re.compile(r"[A-Za-z0-9_.:=,+-]{1,64}")
PATH = re.compile(r"[A-Za-z0-9_.-]{1,200}")
NOTE_LEN = 1000

_RULES = {
    IDENT: "an identifier ([A-Za-z_][A-Za-z0-9_]*, at most 200 characters)",
    NAME: "letters, digits and _ . : = , + - only, 1 to 64 characters",
    PATH: "a module path or value name (letters, digits, _ . -), at most 200 characters",
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(field: str, value: Any, pattern: re.Pattern[str], out: list[Problem]) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        out.append(Problem(obj=f"plan {field}", value=_shown(value),
                           rule=f"a string of {_RULES[pattern]}",
                           fix="rename it in the plan (names come from `torchweave inspect`)"))


def _nodes(plan: Any) -> Iterable[tuple[str, Any]]:
    """Every (field, node name) the plan holds."""
    for node, ts in plan.trans.items():
        yield "trans node", node
        for t in ts:
            yield f"trans node of {node!r}", t.node
    for node in plan.assignment:
        yield "assign node", node
    for i, o in enumerate(plan.orders):
        yield f"order {i}", o.before.node
        yield f"order {i}", o.after.node
    for i, group in enumerate(plan.recompute):
        for node in group:
            yield f"recompute group {i}", node
    if plan.pipeline is not None:
        for node in plan.pipeline.stage_of:
            yield "pipeline stage_of node", node


def string_problems(plan: Any) -> list[Problem]:
    """Every string of ``plan`` outside its field's alphabet, or of another type."""
    out: list[Problem] = []
    _check("name", plan.name, NAME, out)
    for i, (axis, _) in enumerate(plan.mesh.axes if plan.mesh is not None else ()):
        _check(f"mesh axis {i}", axis, IDENT, out)
    if plan.zero_axis is not None:
        _check("zero_axis", plan.zero_axis, IDENT, out)
    for field, node in _nodes(plan):
        _check(field, node, IDENT, out)
    for node, ts in plan.trans.items():
        for t in ts:
            if t.dim is not None:
                _check(f"trans dim of {node!r}", t.dim, IDENT, out)
    for key, text in plan.notes.items():
        _check("notes key", key, NAME, out)
        if not isinstance(text, str) or not text.isprintable() or len(text) > NOTE_LEN:
            out.append(Problem(obj=f"plan notes {_shown(key)}", value=_shown(text),
                               rule=f"printable text on one line, at most {NOTE_LEN} characters"))
    pipe = plan.pipeline
    if pipe is not None:
        _check("pipeline kind", pipe.kind, NAME, out)
        for i, (name, output) in enumerate(pipe.recycle.links if pipe.recycle else ()):
            _check(f"pipeline recycle link {i} input", name, IDENT, out)
            _check(f"pipeline recycle link {i} output", output, PATH, out)
    return out


__all__ = ["IDENT", "NAME", "PATH", "string_problems"]

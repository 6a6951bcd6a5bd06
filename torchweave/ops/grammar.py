"""The annotation language: one line per op that names its dimensions.

``b s k+, n k+ -> b s n`` is a linear layer without bias. Grammar::

    annotation := side "->" side
    side       := tensor ("," tensor)*  |  (nothing: no tensors)
    tensor     := item+  |  "()"  (a 0-d tensor)  |  "?"  (a tensor the op
                  does not split: always passed whole)  |  "*"  (a tensor whose
                  values are not read, only its dtype and device: any piece will do)
    item       := dim  |  "(" dim dim+ ")"  |  "1"  |  "..."
    dim        := NAME ["+" | "^"]

- a plain NAME is *spatial*: splitting it splits every tensor that has it;
- ``+`` marks a *reduction*: a name that no output has; splitting it leaves the
  outputs as partial sums (or partial means, for ops registered so);
- ``^`` marks a dimension that may not be split;
- ``(h d)`` is one tensor axis made of several named dimensions (reshapes);
  only the first, outermost name of a group may be split;
- ``1`` is an axis of size one (broadcast);
- ``...`` stands for any number of leading spatial axes, aligned from the right.

A name keeps its marker wherever it appears; writing it once is enough.
Errors point at the offending character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from torchweave.errors import AnnotationError, Problem

DimKind = Literal["spatial", "reduce", "frozen"]
_MARK = {"+": "reduce", "^": "frozen"}
_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<mark>[+^]?)|(?P<sym>\.\.\.|->|[(),?*1]))")


@dataclass(frozen=True)
class Dim:
    """A named dimension."""

    name: str
    kind: DimKind = "spatial"

    def __str__(self) -> str:
        return self.name + {"spatial": "", "reduce": "+", "frozen": "^"}[self.kind]


@dataclass(frozen=True)
class Axis:
    """One tensor axis: one dim, several dims (a reshape group), or size one."""

    dims: tuple[Dim, ...]
    """Empty for a size-one axis."""
    ellipsis: bool = False

    def __str__(self) -> str:
        if self.ellipsis:
            return "..."
        if not self.dims:
            return "1"
        if len(self.dims) == 1:
            return str(self.dims[0])
        return "(" + " ".join(map(str, self.dims)) + ")"


@dataclass(frozen=True)
class TensorSpec:
    """The axes of one tensor; ``opaque`` for ``?`` and ``*``."""

    axes: tuple[Axis, ...]
    opaque: bool = False
    meta_only: bool = False
    """``*``: only dtype and device are read, so no piece needs moving."""

    def names(self) -> list[str]:
        return [d.name for a in self.axes for d in a.dims]

    def __str__(self) -> str:
        if self.meta_only:
            return "*"
        if self.opaque:
            return "?"
        return " ".join(map(str, self.axes)) if self.axes else "()"


@dataclass(frozen=True)
class Annotation:
    """A parsed annotation."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def dims(self) -> dict[str, Dim]:
        """Every named dim, in order of first appearance."""
        out: dict[str, Dim] = {}
        for t in self.inputs + self.outputs:
            for a in t.axes:
                for d in a.dims:
                    out.setdefault(d.name, d)
        return out

    def __str__(self) -> str:
        left = ", ".join(map(str, self.inputs))
        right = ", ".join(map(str, self.outputs))
        return f"{left} -> {right}".strip()


def _error(text: str, pos: int, rule: str, fix: str = "") -> AnnotationError:
    caret = " " * pos + "^"
    return AnnotationError(
        Problem(obj=f"annotation {text!r}", value=f"\n    {text}\n    {caret}", rule=rule, fix=fix)
    )


def parse(text: str) -> Annotation:
    """Parse an annotation; raise :class:`AnnotationError` pointing at the character."""
    tokens: list[tuple[str, str, int]] = []  # (kind, value, position)
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            bad = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise _error(text, bad, f"unexpected character {text[bad]!r}",
                         "use names, '+', '^', '(', ')', '1', '...', ',', '?', '*' and '->'")
        start = m.start("name") if m["name"] else m.start("sym")
        if m["name"]:
            tokens.append(("name", m["name"] + m["mark"], start))
        else:
            tokens.append((m["sym"], m["sym"], start))
        pos = m.end()
    arrows = [t for t in tokens if t[0] == "->"]
    if len(arrows) != 1:
        at = arrows[1][2] if arrows else len(text)
        raise _error(text, at, "an annotation has exactly one '->'", "write 'inputs -> outputs'")
    split = tokens.index(arrows[0])
    inputs = _parse_side(text, tokens[:split])
    outputs = _parse_side(text, tokens[split + 1 :])
    ann = Annotation(inputs, outputs)
    _check_kinds(text, tokens, ann)
    return ann


def _parse_side(text: str, tokens: list[tuple[str, str, int]]) -> tuple[TensorSpec, ...]:
    if not tokens:
        return ()
    specs: list[TensorSpec] = []
    current: list[Axis] = []
    i = 0
    opaque = empty = meta = False

    def finish(at: int) -> None:
        nonlocal current, opaque, empty, meta
        if opaque or empty:
            specs.append(TensorSpec((), opaque=opaque, meta_only=meta))
        elif not current:
            raise _error(text, at, "a tensor names at least one axis", "write '()' for a 0-d tensor")
        else:
            if sum(a.ellipsis for a in current) > 1:
                raise _error(text, at, "a tensor has at most one '...'")
            specs.append(TensorSpec(tuple(current)))
        current, opaque, empty, meta = [], False, False, False

    while i < len(tokens):
        kind, val, p = tokens[i]
        if (opaque or empty) and kind != ",":
            raise _error(text, p, "'?', '*' and '()' stand alone for a tensor")
        if kind == ",":
            finish(p)
        elif kind in ("?", "*"):
            if current:
                raise _error(text, p, f"'{kind}' stands alone for a tensor")
            opaque, meta = True, kind == "*"
        elif kind == "name":
            current.append(Axis((_dim(val),)))
        elif kind == "1":
            current.append(Axis(()))
        elif kind == "...":
            current.append(Axis((), ellipsis=True))
        elif kind == "(":
            j = i + 1
            group: list[Dim] = []
            while j < len(tokens) and tokens[j][0] == "name":
                group.append(_dim(tokens[j][1]))
                j += 1
            if j >= len(tokens) or tokens[j][0] != ")":
                raise _error(text, p, "a group '(' is closed by ')' and holds only names")
            if not group and not current:
                empty = True
            elif len(group) < 2:
                raise _error(text, p, "a group holds two or more names", "drop the parentheses")
            else:
                current.append(Axis(tuple(group)))
            i = j
        elif kind == ")":
            raise _error(text, p, "')' without '('")
        i += 1
    finish(tokens[-1][2] + 1)
    return tuple(specs)


def _dim(token: str) -> Dim:
    if token[-1] in _MARK:
        return Dim(token[:-1], _MARK[token[-1]])  # type: ignore[arg-type]
    return Dim(token)


def _check_kinds(text: str, tokens: list[tuple[str, str, int]], ann: Annotation) -> None:
    """A name has one marker; reductions appear in no output."""
    kinds: dict[str, DimKind] = {}
    for kind, val, p in tokens:
        if kind != "name":
            continue
        d = _dim(val)
        if d.kind == "spatial":
            continue
        if kinds.setdefault(d.name, d.kind) != d.kind:
            raise _error(text, p, f"dimension {d.name!r} has one marker ('+' or '^') everywhere")
    split = tokens.index(next(t for t in tokens if t[0] == "->"))
    for kind, val, p in tokens[split + 1 :]:
        if kind == "name" and kinds.get(val.rstrip("+^")) == "reduce":
            raise _error(text, p, f"reduction {val.rstrip('+^')!r} appears in no output",
                         "drop '+' if the output keeps this dimension")


def normalize_kinds(ann: Annotation) -> Annotation:
    """Give every occurrence of a name the marker written on any occurrence."""
    kinds = {d.name: d.kind for t in ann.inputs + ann.outputs for a in t.axes for d in a.dims
             if d.kind != "spatial"}

    def fix(t: TensorSpec) -> TensorSpec:
        axes = tuple(
            Axis(tuple(Dim(d.name, kinds.get(d.name, d.kind)) for d in a.dims), a.ellipsis)
            for a in t.axes
        )
        return TensorSpec(axes, t.opaque, t.meta_only)

    return Annotation(tuple(map(fix, ann.inputs)), tuple(map(fix, ann.outputs)))

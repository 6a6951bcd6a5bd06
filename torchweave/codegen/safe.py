"""What generated code may hold of the outside world, and how.

Generated code is imported and run, so nothing from a plan or a graph reaches
it raw except names checked here to be Python identifiers (locals, keyword
arguments, callables' dotted paths). Every other string goes through ``repr``
in an expression position, or through :func:`comment` / :func:`doc`, which
escape what could end a comment line or a docstring.
"""

from __future__ import annotations

import keyword
import re
from typing import Any, Iterator

from torchweave.errors import Problem, TorchweaveError
from torchweave.lower.program import Comm, Compute, Free, LocalRef, Program

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
RESERVED = frozenset({"torch", "aten", "C", "p2p", "STEPS", "rt", "p", "b"})
"""Names generated code gives its imports, its step table and its functions' own arguments
(``rt``, the parameter dict ``p``, a stage's hand-over dict ``b``): a local of the same name
would shadow them."""


class CodegenError(TorchweaveError):
    """A program holding a name that cannot appear in code as it is."""


def comment(text: str) -> str:
    """``text`` for the rest of a ``#`` line: every unprintable character (newlines,
    carriage returns, NUL, line separators) escaped, so the line cannot end early."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


def doc(text: str) -> str:
    """``text`` for inside a triple-quoted docstring: :func:`comment`, backslashes and quotes escaped."""
    return comment(text).replace("\\", "\\\\").replace('"', '\\"')


def _refs(x: Any) -> Iterator[str]:
    if isinstance(x, LocalRef):
        yield x.name
    elif isinstance(x, (list, tuple)):
        for i in x:
            yield from _refs(i)
    elif isinstance(x, dict):
        for i in x.values():
            yield from _refs(i)


def _names(prog: Program) -> Iterator[tuple[str, str]]:
    """Every (what, name) that generated code writes as a bare name."""
    for prm in prog.params:
        yield "parameter local", prm.local
    for i in prog.inputs:
        yield "input local", i.local
    if prog.loss:
        yield "loss", prog.loss
    for seg in prog.segments:
        for n in [*seg.inputs, *seg.outputs, *([seg.loss] if seg.loss else [])]:
            yield f"stage {seg.stage} name", n
        for b in [*seg.recvs, *seg.sends]:
            yield f"stage {seg.stage} boundary", b.key
            yield f"stage {seg.stage} boundary", b.local
    for ins in [*prog.instrs, *(i for seg in prog.segments for i in seg.instrs)]:
        if isinstance(ins, Compute):
            yield "node", ins.node
            for n in [*ins.outputs, *_refs(ins.args), *_refs(ins.kwargs)]:
                if n:
                    yield f"local of node {ins.node!r}", n
            for k in ins.kwargs:
                yield f"keyword of node {ins.node!r}", k
        elif isinstance(ins, Comm):
            for n in ins.reads():
                yield "communication source", n
            yield "communication result", ins.dst
        elif isinstance(ins, Free):
            for n in ins.names:
                yield "freed local", n


def check(prog: Program) -> None:
    """Raise :class:`CodegenError` listing every name of ``prog`` that is no identifier."""
    problems = []
    for what, name in _names(prog):
        if not isinstance(name, str) or not _IDENT.fullmatch(name) or keyword.iskeyword(name):
            problems.append(Problem(obj=f"rank {prog.rank} {what}", value=repr(name),
                                    rule="names in generated code are Python identifiers, "
                                         "not keywords",
                                    fix="rename it in the model or the plan"))
        elif name in RESERVED and not what.startswith("keyword"):
            problems.append(Problem(obj=f"rank {prog.rank} {what}", value=repr(name),
                                    rule=f"generated code keeps {', '.join(sorted(RESERVED))} "
                                         "for its own imports and arguments",
                                    fix="rename it in the model or the plan"))
    for ins in [*prog.instrs, *(i for seg in prog.segments for i in seg.instrs)]:
        if isinstance(ins, Compute) and not _DOTTED.fullmatch(ins.fn):
            problems.append(Problem(obj=f"rank {prog.rank} node {ins.node!r}",
                                    value=f"callable {ins.fn!r}",
                                    rule="a callable is a dotted path of identifiers",
                                    fix="register the op under a plain name"))
    if problems:
        raise CodegenError(problems, header=f"cannot write code for rank {prog.rank}")


__all__ = ["CodegenError", "check", "comment", "doc"]

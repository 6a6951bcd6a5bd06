"""Program → one readable Python module per rank, in the style of nanoGPT.

One operation per line, each with a shape and annotation comment, a header that
names the plan, the rank and its groups. The runtime imports and runs exactly
this code. Names in it are checked to be identifiers, and every other string
from the plan or the graph is escaped (:mod:`torchweave.codegen.safe`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Any

import torch

from torchweave.codegen.fuse import fuse_bias, fuse_cross_entropy
from torchweave.codegen.recompute import RecomputeRun, recompute_runs
from torchweave.codegen.safe import CodegenError, check, comment, doc
from torchweave.errors import Problem
from torchweave.ops import REGISTRY
from torchweave.ops.custom import defining_module
from torchweave.lower.program import Comm, Compute, Free, LocalRef, Program, Segment
from torchweave.lower import units
from torchweave.lower.stages import reads
from torchweave.lower.steps import P2P, Group, Narrow


def literal(x: Any) -> str:
    """Python source for a constant argument."""
    if isinstance(x, LocalRef):
        return x.name
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, torch.device):
        return "rt.device"
    if isinstance(x, (torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, float):
        if math.isinf(x):
            return "float('inf')" if x > 0 else "float('-inf')"
        if math.isnan(x):
            return "float('nan')"
        return repr(x)
    if isinstance(x, (list, tuple)):
        inner = ", ".join(literal(i) for i in x)
        if isinstance(x, tuple):
            return f"({inner},)" if len(x) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {literal(v)}" for k, v in x.items()) + "}"
    if x is None or isinstance(x, (bool, int, str)):
        return repr(x)
    raise TypeError(f"cannot render constant {x!r} of type {type(x).__name__}")


RESHAPING_VIEWS = {"aten.view.default": "aten.reshape.default",
                   "aten._unsafe_view.default": "aten.reshape.default"}
"""A traced ``view`` was valid for the strides the capture saw; a rank's operand may come
from a collective or another kernel's choice of layout (T5's attention output after a
split mask), where only a copy reshapes it. ``reshape`` views whenever it can."""


def _torch_op(fn: str) -> bool:
    """Whether ``fn`` names a torch op (``ns.op.overload``) rather than a Python function by
    its import path: in the ``torchweave`` namespace only the ops torchweave registers
    (``torchweave.moe_experts.default``), beside its kernels (``torchweave.ops.kernels.…``)."""
    return fn.count(".") >= 2 and (fn.split(".")[0] != "torchweave" or fn in REGISTRY.specs)


def _callable(fn: str) -> str:
    if fn.startswith("aten."):
        return RESHAPING_VIEWS.get(fn, fn)
    if _torch_op(fn):
        return f"torch.ops.{fn}"
    module, _, name = fn.rpartition(".")
    return f"{module.replace('.', '_')}.{name}"


_DOTTED_OR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
"""A module name that may be written into an import (anything else is left out)."""


def _imports(prog: Program) -> list[str]:
    mods, registers = set(), set()
    for ins in [*prog.computes(), *(i for seg in prog.segments for i in seg.instrs
                                    if isinstance(i, Compute))]:
        fn = ins.fn
        if fn.startswith("torchweave.") and not _torch_op(fn):
            mods.add(fn.rpartition(".")[0])
        else:
            module = defining_module(fn)
            if module is not None and _DOTTED_OR_NAME.fullmatch(module):
                if importlib.util.find_spec(module) is None:
                    raise CodegenError(Problem(
                        obj=f"rank {prog.rank} node {ins.node!r}", value=f"custom op {fn}",
                        rule=f"each rank imports {module!r}, which registers the op; it is not "
                             "importable here",
                        fix=f"put {module!r} on the ranks' PYTHONPATH"))
                registers.add(module)
    return ([f"import {m} as {m.replace('.', '_')}" for m in sorted(mods)]
            + [f"import {m}  # registers its custom ops" for m in sorted(registers)])


def _group(prog: Program, groups: tuple[Group, ...]) -> str:
    mine = next(g for g in groups if prog.rank in g)
    return literal(mine)


def _comm_line(prog: Program, c: Comm) -> str:
    """``dst = C.<fn>(rt.group_cache, src, group, *args, **kwargs)``, as the step's own table says."""
    s, x, y = c.step, c.src, c.dst
    if isinstance(s, Narrow):
        box = dict(s.boxes)[prog.rank]
        call = f"{x}[{', '.join(f'{a}:{b}' for a, b in box)}].contiguous()"
    elif isinstance(s, P2P):
        call = f"p2p.p2p(rt, {x}, STEPS[{c.dst!r}])"
    else:
        fn, args, kwargs = s.runtime_call()
        rest = [literal(a) for a in args] + [f"{k}={literal(v)}" for k, v in kwargs.items()]
        rest += [f"{k}={name}" for k, name in zip(getattr(s, "EXTRA", ()), c.extra)]
        call = f"C.{fn}(rt.group_cache, {', '.join([x, _group(prog, s.groups), *rest])})"
    return f"{y} = {call}"


def render(prog: Program) -> str:
    """The Python source of ``prog``; raises :class:`~torchweave.codegen.safe.CodegenError`
    if a name in it is no identifier."""
    check(prog)
    groups = ", ".join(f"g{i}={literal(g)}" for i, g in enumerate(prog.groups) if prog.rank in g)
    lines = [
        f'"""torchweave generated code: plan {doc(repr(prog.plan_name))}, rank {prog.rank} of '
        f'{prog.world_size}{", mesh " + doc(prog.mesh) if prog.mesh else ""}.',
        "",
        f"Groups with this rank: {groups or 'none'}.",
        f"Parameters held: {len(prog.params)} pieces. Do not edit: regenerate from the plan.",
        '"""',
        "import torch",
        "import torch.utils.checkpoint",
        "",
        "from torchweave.runtime import collectives as C",
        "from torchweave.runtime import p2p",
        *_imports(prog),
        "",
        "aten = torch.ops.aten",
        "",
    ]
    p2p = {c.dst: c.step for c in prog.comms() if isinstance(c.step, P2P)}
    lines.append(f"STEPS = {{{', '.join(f'{k!r}: {_p2p_literal(v)}' for k, v in p2p.items())}}}")
    lines += ["", ""]
    if prog.segments:
        for seg in prog.segments:
            lines += segment_function(prog, seg) + ["", ""]
        return "\n".join(lines).rstrip() + "\n"
    args = ", ".join(i.local for i in prog.inputs)
    lines.append(f"def forward(rt, p, {args}):" if args else "def forward(rt, p):")
    lines.append('    """This rank\'s pieces of the forward pass; returns its loss term."""')
    lines += body(prog, prog.instrs, {prog.loss or ""})
    lines.append(f"    return {prog.loss or 'None'}")
    return "\n".join(lines) + "\n"


def segment_function(prog: Program, seg: Segment) -> list[str]:
    """One pipeline stage's part of this rank's forward, as ``stage{s}(rt, p, *inputs, b)``.

    ``b`` holds what the stage receives from other ranks and from this rank's
    other stages; the function returns its loss term (or None) and the
    tensors it hands on.
    """
    args = ", ".join([i.local for i in prog.inputs] + ["b"])
    recv = ", ".join(f"{k.key} (from ranks {sorted({t.src for t in k.step.transfers if t.dst == prog.rank})})"
                     for k in seg.recvs) or "nothing from other ranks"
    sends = ", ".join(f"{k.local} (to ranks {sorted({t.dst for t in k.step.transfers if t.src == prog.rank})})"
                      for k in seg.sends) or "nothing to other ranks"
    lines = [f"def stage{seg.stage}(rt, p, {args}):",
             f'    """Stage {seg.stage} for one micro-batch. Receives {recv}; sends {sends}."""']
    for name in [k.key for k in seg.recvs] + seg.inputs:
        lines.append(f"    {name} = b[{name!r}]")
    keep = set(seg.outputs) | {seg.loss or ""}
    lines += body(prog, seg.instrs, keep)
    read = {n for ins in seg.instrs for n in reads(ins)}
    for prm in prog.params:
        if prm.local in seg.outputs and prm.local not in read:
            lines.append(f"    {prm.local} = p[{prm.path!r}]  # sent to another stage")
    outs = ", ".join(f"{n!r}: {n}" for n in seg.outputs)
    lines.append(f"    return {seg.loss or 'None'}, {{{outs}}}")
    return lines


def body(prog: Program, instrs: list, keep: set[str]) -> list[str]:
    """Lines of a function body running ``instrs`` (recompute groups wrapped)."""
    lines: list[str] = []
    instrs = fuse_cross_entropy(prog, fuse_bias(prog, instrs, keep), keep)
    first_use = units.first_uses(prog, instrs)
    for run in recompute_runs(prog, instrs):
        if isinstance(run, RecomputeRun):
            lines += run.render(prog, first_use, keep, line)
            continue
        i, ins = run
        for prm in first_use.get(i, []):
            lines.append(param_line(prm))
        text = line(prog, ins)
        if text:
            lines.append(text)
    return lines


def param_line(prm) -> str:
    box = ", ".join(f"{a}:{b}" for a, b in prm.box)
    return f"    {prm.local} = p[{prm.path!r}]  # [{box}] of {tuple(prm.full_shape)}"


def line(prog: Program, ins) -> str:
    """One instruction as one line of code (with its four-space indent)."""
    if isinstance(ins, Compute):
        call = ", ".join([literal(a) for a in ins.args]
                         + [f"{k}={literal(v)}" for k, v in ins.kwargs.items()])
        outs = [o or "_" for o in ins.outputs]
        lhs = outs[0] if ins.structure == "single" else ", ".join(outs) + ("," if len(outs) == 1 else "")
        text = f"    {lhs} = {_callable(ins.fn)}({call})"
        return f"{text}  # {comment(ins.comment)}" if ins.comment else text
    if isinstance(ins, Comm):
        return f"    {_comm_line(prog, ins)}  # {comment(ins.comment)}"
    if isinstance(ins, Free):
        return f"    del {', '.join(ins.names)}"
    return ""


def _p2p_literal(step: P2P) -> str:
    return (f"dict(transfers={literal([tuple(t.__dict__.values()) for t in step.transfers])}, "
            f"shapes={literal(step.shapes)}, "
            f"grad_back={literal([tuple(t.__dict__.values()) for t in step.grad_back])}, "
            f"grad_scale={literal(step.grad_scale)})")


def write(programs: list[Program], directory: str) -> list[str]:
    """Write ``rank{r}.py`` for each program into ``directory``; return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for prog in programs:
        path = os.path.join(directory, f"rank{prog.rank}.py")
        with open(path, "w") as f:
            f.write(render(prog))
        paths.append(path)
    return paths

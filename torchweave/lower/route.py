"""Routed exchanges: send a row only to the pieces its routing index names.

An op may declare that one input routes its rows along a summed dim
(:attr:`torchweave.ops.registry.OpSpec.route`): a mixture of experts' ``index[t, j]`` names
the experts ``e`` that token ``t``'s output sums over. Where a plan splits ``e`` over a group
whose members hold different rows, lowering first derives what it derives for any sum
split that way: each row input gathered over the group (every member sees every row), the
piece computing the terms of its own experts, and the partial outputs reduce-scattered back.

That program is correct, and moves every row to every member. Each member's terms of a row
are zero unless the row's index names one of its experts, so a row is needed only where its
index routes it. This pass finds that pattern in the derived program and replaces it:

* the index's all-gather becomes a :class:`~torchweave.lower.steps.Route` (each row of the
  index sent to the members owning one of its coordinates);
* every other row input's all-gather becomes a :class:`~torchweave.lower.steps.Dispatch`
  along that route;
* the reduce-scatter of the output becomes a :class:`~torchweave.lower.steps.Combine`: the
  terms sent back and summed into their rows.

The piece's own call is unchanged: it computes its experts' terms of whatever rows it holds.
The exchange is chosen from the layouts and the declaration, never written into a policy.
Every member of a group must take the same form, so a node is rewritten on every device or
on none: where any device's program differs from the pattern (a gathered input another node
also reads, a partial output summed some other way, pieces that do not split the dim over
the gathering group), the gather and reduce-scatter stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torchweave.lower.defer import renamed_reads
from torchweave.lower.pieces import node_pieces
from torchweave.lower.program import Comm, Compute, Program
from torchweave.lower.stages import reads, writes
from torchweave.lower.steps import AllGather, Combine, Dispatch, ReduceScatter, Route
from torchweave.ops import REGISTRY, info

if TYPE_CHECKING:
    from torchweave.lower.lower import Lowering

Group = tuple[int, ...]


def route_exchanges(low: Lowering) -> None:
    """Replace gather, compute, reduce-scatter by a routed exchange wherever a node declares a
    route and every device's program has that form (see the module's text)."""
    routed = {s.name for s in REGISTRY.specs.values() if s.route is not None}
    looked: dict[int, _Index] = {}  # each program read once; every node's edits found on it
    edited: dict[int, list[dict[int, Comm | Compute]]] = {}
    for node in low.graph.nodes:
        if node.target not in routed:
            continue
        found = _rewrites(low, node, looked)
        for d, edits in (found or {}).items():
            edited.setdefault(d, []).append(edits)
    for d, per_node in edited.items():
        low.programs[d].instrs = _apply(low.programs[d], per_node)


@dataclass(frozen=True)
class _Index:
    """Where each local name of one program is made by a Comm, and which instructions read it."""

    made: dict[str, int]
    readers: dict[str, list[int]]

    @staticmethod
    def of(prog: Program) -> _Index:
        made = {ins.dst: i for i, ins in enumerate(prog.instrs) if isinstance(ins, Comm)}
        readers: dict[str, list[int]] = {}
        for i, ins in enumerate(prog.instrs):
            for name in reads(ins):
                readers.setdefault(name, []).append(i)
        return _Index(made, readers)


def _rewrites(low: Lowering, node, looked: dict[int, _Index]
              ) -> dict[int, dict[int, Comm | Compute]] | None:
    """Device → {instruction position → new instruction} for ``node``, or None where any device's
    program is not the pattern."""
    oi = info(low.graph, node)
    pos, dim = oi.spec.route
    ann = oi.bound.annotation
    if any(t.opaque or not t.axes or not t.axes[0].dims for t in ann.inputs):
        return None
    row_dim = ann.inputs[pos].axes[0].dims[0].name
    if len(ann.outputs) != 1 or ann.outputs[0].opaque or not ann.outputs[0].axes \
            or [d.name for d in ann.outputs[0].axes[0].dims[:1]] != [row_dim]:
        return None  # the output's rows are the inputs' rows, as the combine returns them
    rows = [i for i, t in enumerate(ann.inputs) if t.axes[0].dims[0].name == row_dim]
    refs = node.input_refs()
    floats = {i for i in rows if low.graph.values[refs[i].name].meta.dtype.is_floating_point}
    shape = low.graph.values[refs[pos].name].meta.shape
    top_k = math.prod(shape[1:])
    size = oi.bound.sizes[dim]
    pieces: dict[int, dict] = {}
    for p in node_pieces(low.plan, node.name):
        if p.device in pieces:  # several pieces on one device (co-shard): not this form
            return None
        pieces[p.device] = p.chunks
    stage = low.plan.pipeline.stage_of if low.plan.pipeline is not None else {}
    out: dict[int, dict[int, Comm | Compute]] = {}
    for d, chunks in pieces.items():
        if d not in looked:
            looked[d] = _Index.of(low.programs[d])
        edits = _device(low.programs[d], looked[d], node.name, len(ann.inputs), rows, floats,
                        pos, top_k, dim, size, chunks, pieces)
        # the route is read where it is made: a stage handover would not carry it
        if edits is None or len({stage.get(c.consumer or node.name) for c in edits.values()
                                 if isinstance(c, Comm)}) > 1:
            return None
        out[d] = edits
    return out


def _device(prog: Program, index: _Index, node: str, n_inputs: int, rows: list[int],
            floats: set[int], pos: int, top_k: int, dim: str, size: int, chunks: dict,
            pieces: dict[int, dict]) -> dict[int, Comm | Compute] | None:
    """The edits on one device, or None."""
    at, readers = index.made, index.readers
    calls = [i for i, ins in enumerate(prog.instrs)
             if isinstance(ins, Compute) and ins.node == node and not ins.aux]
    if len(calls) != 1:
        return None
    call: Compute = prog.instrs[calls[0]]
    inputs, outputs = call.reads(), [o for o in call.outputs if o]
    if len(outputs) != 1 or len(inputs) != n_inputs:
        return None
    group: Group | None = None
    gathers: dict[int, int] = {}  # input position → the instruction gathering it
    for i in rows:
        j = at.get(inputs[i])
        ins = prog.instrs[j] if j is not None else None
        if ins is None or not isinstance(ins.step, AllGather) or ins.step.axis != 0 \
                or readers.get(inputs[i]) != [calls[0]]:
            return None
        # read by different pieces, its gradient summed over the group (R'), as a
        # dispatch's backward sums it; or an index, which has none
        if ins.step.bwd != ("reduce_scatter" if i in floats else "slice"):
            return None
        mine = _mine(ins.step.groups, prog.rank)
        if group not in (None, mine):
            return None
        group, gathers[i] = mine, j
    after = readers.get(outputs[0], [])
    if len(after) != 1 or not isinstance(prog.instrs[after[0]], Comm):
        return None
    scatter: Comm = prog.instrs[after[0]]
    if not isinstance(scatter.step, ReduceScatter) or scatter.step.axis != 0 \
            or _mine(scatter.step.groups, prog.rank) != group:
        return None
    owners = _owners(group, dim, size, chunks, pieces)
    if owners is None:
        return None
    index = prog.instrs[gathers[pos]]
    edits = {gathers[pos]: replace(index, step=Route(index.step.groups, owners, top_k),
                                   comment=f"route for {node}")}
    shape, sep, rest = call.comment.partition(")")
    if sep and shape.startswith("("):  # the call's rows are the routed ones, known at run time
        edits[calls[0]] = replace(call, comment=f"(routed rows, {shape.split(', ', 1)[-1]}){rest}")
    for i, j in gathers.items():
        if i != pos:
            g = prog.instrs[j]
            edits[j] = replace(g, step=Dispatch(g.step.groups, owners, top_k),
                               extra=(index.dst,), comment=f"dispatch for {node}")
    edits[after[0]] = replace(scatter, step=Combine(scatter.step.groups, owners, top_k),
                              extra=(index.dst,), comment=f"combine for {node}")
    return edits


def _mine(groups: tuple[Group, ...], rank: int) -> Group | None:
    return next((g for g in groups if rank in g), None)


def _owners(group: Group, dim: str, size: int, chunks: dict,
            pieces: dict[int, dict]) -> tuple[tuple[int, int], ...] | None:
    """Each member's range along ``dim``, in group order, where the members split ``dim``
    among themselves, one part each, and agree on every other dim; else None."""
    n = len(group)
    rest = {k: v for k, v in chunks.items() if k != dim}
    owners, seen = [], set()
    for m in group:
        theirs = pieces.get(m)
        if theirs is None or theirs.get(dim, (0, 1))[1] != n \
                or {k: v for k, v in theirs.items() if k != dim} != rest:
            return None
        k = theirs[dim][0]
        seen.add(k)
        owners.append((k * size // n, (k + 1) * size // n))
    return tuple(owners) if len(seen) == n and size % n == 0 else None


def _apply(prog: Program, per_node: list[dict[int, Comm | Compute]]) -> list:
    """``prog``'s instructions with each node's edits, each node's dispatches moved just after
    its route, and each edited result named for its step (``x_all_gather5`` → ``x_dispatch5``)."""
    edits = {j: c for e in per_node for j, c in e.items()}
    rename = {}
    for c in edits.values():
        if not isinstance(c, Comm):
            continue
        for was in ("_all_gather", "_reduce_scatter"):
            head, sep, tail = c.dst.rpartition(was)
            if sep and tail.isdigit():
                rename[c.dst] = f"{head}_{c.step.NAME}{tail}"
    taken = {n for ins in prog.instrs for n in (writes(ins) + reads(ins))}
    rename = {a: b for a, b in rename.items() if b not in taken}
    after: dict[int, list[int]] = {}  # a route's position → its node's dispatches
    for e in per_node:
        route = next(j for j, c in e.items() if isinstance(c, Comm) and type(c.step) is Route)
        after[route] = sorted(j for j, c in e.items()
                              if isinstance(c, Comm) and type(c.step) is Dispatch)
    moved = {j for js in after.values() for j in js}
    out = []
    for i, ins in enumerate(prog.instrs):  # each dispatch just after its route: its source is
        if i not in moved:                 # defined before its gather was, so before the route
            out.append(edits.get(i, ins))
        out += [edits[j] for j in after.get(i, ())]
    out = [renamed_reads(ins, rename) for ins in out]
    return [replace(ins, dst=rename.get(ins.dst, ins.dst)) if isinstance(ins, Comm) else ins
            for ins in out]

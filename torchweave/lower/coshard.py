"""Co-shard: the pieces of a node on one device, run one after another.

A node split into ``k`` pieces (one split transform) whose pieces are all
op-assigned to one device is *co-sharded*. Consecutive such nodes (same ``k``,
same device) form a region, lowered chunk by chunk: chunk ``j`` runs piece
``j`` of every node of the region, reading piece ``j`` of the values made
inside the region and a slice (a view) of the values made outside. Each
chunk is tagged, so codegen wraps it in its own recompute function: only one
chunk's intermediates exist at a time, forward and backward, and the peak
activation memory of the region falls by about ``(k-1)/k``.

Values leaving the region are combined once every chunk has run: pieces of a
split spatial dimension are concatenated, partial sums (a split reduction
dimension) are added as they arrive. The rest of the plan then sees one whole
piece on the device, as if the nodes had not been split.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from torchweave.errors import Problem
from torchweave.ir.graph import Node, Ref
from torchweave.lower.derive import Need
from torchweave.lower.pieces import PieceInfo, local_call, node_pieces, output_piece, tensor_box
from torchweave.lower.program import Compute, LocalRef
from torchweave.ops import info
from torchweave.plan.layout import Box, Layout, Piece, full_box, hull
from torchweave.plan.validate import PlanError


def coshard_key(plan, node: str) -> tuple[int, int] | None:
    """(device, k) when ``node`` is co-sharded, else None."""
    trans = plan.transforms(node)
    devices = set(plan.assignment.get(node, []))
    if len(trans) == 1 and trans[0].dim is not None and trans[0].parts > 1 and len(devices) == 1:
        return next(iter(devices)), trans[0].parts
    n = plan.num_pieces(node)
    if n > len(devices):
        raise PlanError(Problem(
            obj=f"node {node}", value=f"{n} pieces on devices {sorted(devices)}",
            rule="several pieces of a node share a device only when the node is split once and "
                 "every piece is on that one device (co-shard)",
            fix="split the node once and assign every piece to one device, or one piece per device"))
    return None


def lower_region(lw: Any, nodes: list[Node], device: int, k: int) -> None:
    """Emit ``nodes`` (co-sharded ``k`` ways on ``device``) chunk by chunk into ``lw``'s program."""
    graph, prog = lw.graph, lw.programs[device]
    region = lw.counter = lw.counter + 1
    inside = {o for n in nodes for o in n.outputs if o}
    pieces = {n.name: node_pieces(lw.plan, n.name) for n in nodes}
    # values made outside: provided once, as the union of what the chunks read
    outer: dict[str, tuple[str, Box]] = {}
    for n in nodes:
        bound = info(graph, n).bound
        for ref, tspec in zip(n.input_refs(), bound.annotation.inputs):
            if ref.name in inside or ref.name in outer:
                continue
            meta = graph.values[ref.name].meta
            if tspec.meta_only and device in lw.held.get(ref.name, {}):
                outer[ref.name] = (lw.local.get((ref.name, device), ref.name), ())
                continue
            union = hull([tensor_box(bound, tspec, meta.shape, p) for p in pieces[n.name]])
            name = lw._provide(ref.name, {device: Need(union, ("coshard", region))}, n)[device]
            outer[ref.name] = (name, union)
    users = graph.consumers()
    leaving = [o for o in sorted(inside) if o == graph.loss or o in graph.outputs
               or any(u.name not in {n.name for n in nodes} for u in users.get(o, []))]
    made: dict[str, list[tuple[str, Piece]]] = {}
    producer = {o: n.name for n in nodes for o in n.outputs if o}
    for j in range(k):
        chunk: dict[str, tuple[str, Box]] = {}
        for n in nodes:
            _emit_piece(lw, prog, n, pieces[n.name][j], j, region, outer, chunk, made)
        for value in leaving:  # partial sums are added as they arrive
            name, piece = made[value][j]
            if piece.is_partial and j > 0:
                acc = made[value][0][0] if j == 1 else value
                prog.instrs.append(Compute(producer[value], "aten.add.Tensor",
                                           (LocalRef(acc), LocalRef(name)), {}, (value,), "single",
                                           f"co-shard: partial sums 0..{j}"))
    for value in leaving:
        _combine(lw, prog, producer[value], value, made[value], device)


def _emit_piece(lw: Any, prog, node: Node, p: PieceInfo, j: int, region: int,
                outer: dict[str, tuple[str, Box]], chunk: dict[str, tuple[str, Box]],
                made: dict[str, list[tuple[str, Piece]]]) -> None:
    graph = lw.graph
    inf = info(graph, node)
    bound, spec = inf.bound, inf.spec
    names: list[str] = []
    for ref, tspec in zip(node.input_refs(), bound.annotation.inputs):
        box = tensor_box(bound, tspec, graph.values[ref.name].meta.shape, p)
        if ref.name in chunk:
            have, have_box = chunk[ref.name]
            if have_box != box and not tspec.meta_only:
                raise PlanError(Problem(
                    obj=f"node {node.name} piece {j}", value=f"reads {ref.name}{list(box)}",
                    rule=f"co-sharded pieces line up: piece {j} of its producer holds {list(have_box)}",
                    fix="split producer and consumer along the same dimension"))
            names.append(have)
            continue
        have, union = outer[ref.name]
        names.append(_narrow(lw, prog, node, have, union, box, j, region) if union else have)
    it = iter(names)
    args, kwargs = pytree.tree_map(lambda x: LocalRef(next(it)) if isinstance(x, Ref) else x,
                                   (node.args, node.kwargs))
    outs = graph.output_metas(node)
    out_box = tensor_box(bound, bound.annotation.outputs[0], outs[0].shape, p) if outs else ()
    fn, args, kwargs = local_call(spec, node.target, args, kwargs, bound, out_box, p)
    local = tuple(f"{o}_c{j}" if o else "" for o in node.outputs)
    comment = lw._comment(bound, outs, p) + f"  co-shard {j + 1}/{len(lw.plan.assignment[node.name])}"
    prog.instrs.append(Compute(node.name, fn, args, kwargs, local, node.output_structure, comment,
                               chunk=(region, j)))
    reduce = "lse" if spec is not None and spec.partial == "lse" else "sum"
    for i, (out, meta) in enumerate(zip(node.outputs, outs)):
        if not out:
            continue
        piece = output_piece(bound, bound.annotation.outputs[i], meta.shape, p, reduce)
        if piece.reduce != "sum" or (piece.is_partial and spec is not None and spec.partial == "avg"):
            raise PlanError(Problem(obj=f"node {node.name}", value=f"co-shard of a {spec.partial} reduction",
                                    rule="co-sharded reductions make partial sums",
                                    fix="co-shard along a spatial dimension of this op"))
        chunk[out] = (local[i], piece.box)
        made.setdefault(out, []).append((local[i], piece))


def _narrow(lw: Any, prog, node: Node, name: str, union: Box, box: Box, j: int, region: int) -> str:
    """A view of ``box`` from a tensor holding ``union`` (no copy)."""
    for axis, ((a, b), (c, d)) in enumerate(zip(union, box)):
        if (a, b) == (c, d):
            continue
        lw.counter += 1
        new = f"{name}_n{lw.counter}"
        prog.instrs.append(Compute(node.name, "aten.narrow.default", (LocalRef(name), axis, c - a, d - c),
                                   {}, (new,), "single", f"co-shard {j}: rows {c}:{d} of axis {axis}",
                                   chunk=(region, j)))
        name = new
    return name


def _combine(lw: Any, prog, node: str, value: str, parts: list[tuple[str, Piece]], device: int) -> None:
    """One whole local ``value`` from its co-sharded pieces (partial sums were added already)."""
    meta = lw.graph.values[value].meta
    boxes = [p.box for _, p in parts]
    if len(set(boxes)) > 1:
        axis = next(i for i in range(len(meta.shape)) if len({b[i] for b in boxes}) > 1)
        prog.instrs.append(Compute(node, "aten.cat.default", ([LocalRef(n) for n, _ in parts], axis),
                                   {}, (value,), "single", f"co-shard: pieces joined along axis {axis}"))
    lw.held[value] = {device: Piece(full_box(meta.shape))}
    lw.local[(value, device)] = value
    lw.layouts[value] = Layout.of(meta.shape, lw.held[value])

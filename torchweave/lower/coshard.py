"""Co-shard: several pieces of a node on each of its devices, run one after another.

A node whose last transform splits it ``k`` ways, with each run of ``k``
consecutive pieces (the pieces that differ only in that last split) op-assigned
to one device and every run to a different device, is *co-sharded*: the
transforms before the last place the node as any plan would (split over a data-
or tensor-parallel group, or whole on one device), and each device then runs
its share in ``k`` chunks. Consecutive such nodes (same devices, same ``k``)
form a region, lowered chunk by chunk on every device: chunk ``j`` runs piece
``j`` of the device's share of every node of the region, reading piece ``j`` of
the values made inside the region and a slice (a view) of the values made
outside. Each chunk is tagged, so codegen wraps it in its own recompute
function: only one chunk's intermediates exist at a time, forward and backward,
and the peak activation memory of the region falls by about ``(k-1)/k``.

Values leaving the region are combined on each device once every chunk has
run: pieces of a split spatial dimension are concatenated, partial sums (a split
reduction dimension) are added as they arrive. The rest of the plan then sees on
each device the piece the node would have had without the last split.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from torchweave.errors import Problem
from torchweave.ir.graph import Node, Ref
from torchweave.lower.derive import Need
from torchweave.lower.pieces import (
    PieceInfo, local_call, node_pieces, output_piece, piece_info, tensor_box,
)
from torchweave.lower.program import Compute, LocalRef
from torchweave.ops import info
from torchweave.plan.layout import Box, Layout, Piece, hull
from torchweave.plan.validate import PlanError


def coshard_regions(graph, plan) -> dict[str, int]:
    """Each co-sharded node's region: a run of consecutive graph nodes of one
    :func:`coshard_key`, numbered in graph order. Lowering runs a region as one, chunk by
    chunk, wherever an op-order moves it (``lower/op_order.py``)."""
    region: dict[str, int] = {}
    last, r = None, -1
    for n in graph.nodes:
        key = coshard_key(plan, n.name)
        if key is not None and key != last:
            r += 1
        if key is not None:
            region[n.name] = r
        last = key
    return region


def coshard_key(plan, node: str) -> tuple[tuple[int, ...], int] | None:
    """(the devices, in piece order, and ``k``) when ``node`` is co-sharded, else None."""
    trans = plan.transforms(node)
    devices = plan.assignment.get(node, [])
    if trans and trans[-1].dim is not None and trans[-1].parts > 1:
        k = trans[-1].parts
        runs = [devices[i:i + k] for i in range(0, len(devices), k)]
        owners = tuple(run[0] for run in runs)
        if all(len(set(run)) == 1 for run in runs) and len(set(owners)) == len(owners):
            return owners, k
    n = plan.num_pieces(node)
    if n > len(set(devices)):
        raise PlanError(Problem(
            obj=f"node {node}", value=f"{n} pieces on devices {sorted(set(devices))}",
            rule="several pieces of a node share a device only when they are the k pieces of the "
                 "node's last split, all on one device, each device holding one such run (co-shard)",
            fix="make the co-shard split the node's last transform and assign its k pieces to one "
                "device (policies.coshard.with_coshard does), or one piece per device"))
    return None


def coshare_id(plan, node: str, first: PieceInfo) -> tuple:
    """What a device's share of a co-sharded node reads, as a piece identity: the piece the
    node's transforms before the co-shard split make (shares that differ there sum their
    gradients, replicas do not; see ``lower.derive``)."""
    trans = plan.transforms(node)[:-1]
    return ("coshard", piece_info(trans, first.index[:-1], first.device).piece_id)


def lower_region(lw: Any, nodes: list[Node], owners: tuple[int, ...], k: int) -> None:
    """Emit ``nodes`` (co-sharded ``k`` ways on each of ``owners``) chunk by chunk into
    each owner's program."""
    graph = lw.graph
    region = lw.counter = lw.counter + 1
    inside = {o for n in nodes for o in n.outputs if o}
    pieces: dict[str, dict[int, list[PieceInfo]]] = {}
    for n in nodes:
        share = pieces[n.name] = {d: [] for d in owners}
        for p in node_pieces(lw.plan, n.name):
            share[p.device].append(p)
    # values made outside: provided once per device, as the union of what its chunks read
    outer: dict[str, dict[int, tuple[str, Box]]] = {}
    for n in nodes:
        bound = info(graph, n).bound
        for ref, tspec in zip(n.input_refs(), bound.annotation.inputs):
            if ref.name in inside or ref.name in outer:
                continue
            meta = graph.values[ref.name].meta
            held = lw.held.get(ref.name, {})
            if tspec.meta_only and all(d in held for d in owners):
                outer[ref.name] = {d: (lw.local.get((ref.name, d), ref.name), ()) for d in owners}
                continue
            unions = {d: hull([tensor_box(bound, tspec, meta.shape, p) for p in pieces[n.name][d]])
                      for d in owners}
            names = lw._provide(ref.name, {d: Need(u, coshare_id(lw.plan, n.name, pieces[n.name][d][0]))
                                           for d, u in unions.items()}, n)
            outer[ref.name] = {d: (names[d], unions[d]) for d in owners}
    users = graph.consumers()
    members = {n.name for n in nodes}
    leaving = [o for o in sorted(inside) if o == graph.loss or o in graph.outputs
               or any(u.name not in members for u in users.get(o, []))]
    producer = {o: n for n in nodes for o in n.outputs if o}
    for d in owners:
        prog = lw.programs[d]
        mine = {v: by_device[d] for v, by_device in outer.items()}
        made: dict[str, list[tuple[str, Piece]]] = {}
        for j in range(k):
            chunk: dict[str, tuple[str, Box]] = {}
            for n in nodes:
                _emit_piece(lw, prog, n, pieces[n.name][d][j], j, region, mine, chunk, made)
            for value in leaving:  # partial sums are added as they arrive
                name, piece = made[value][j]
                if j > 0 and piece.box == made[value][0][1].box:  # the co-shard split sums
                    acc = made[value][0][0] if j == 1 else value
                    prog.instrs.append(Compute(producer[value].name, "aten.add.Tensor",
                                               (LocalRef(acc), LocalRef(name)), {}, (value,), "single",
                                               f"co-shard: partial sums 0..{j}", aux=True))
        for value in leaving:
            _combine(lw, prog, producer[value], value, made[value], d, pieces[producer[value].name][d][0])
    for value in leaving:
        lw.layouts[value] = Layout.of(graph.values[value].meta.shape, lw.held[value])


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
            if made[ref.name][j][1].is_partial and not tspec.meta_only:
                raise PlanError(Problem(
                    obj=f"node {node.name} piece {j}", value=f"reads {ref.name}, a partial sum",
                    rule="a co-shard region holds no communication: a partial sum (a split "
                         "reduction) can only leave it, to be summed outside",
                    fix=f"end the co-shard chain before {node.name}"))
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
    comment = lw._comment(bound, outs, p) + f"  co-shard {j + 1}/{lw.plan.transforms(node.name)[-1].parts}"
    prog.instrs.append(Compute(node.name, fn, args, kwargs, local, node.output_structure, comment,
                               chunk=(region, j)))
    reduce = "lse" if spec is not None and spec.partial == "lse" else "sum"
    dim = lw.plan.transforms(node.name)[-1].dim
    for i, (out, meta) in enumerate(zip(node.outputs, outs)):
        if not out:
            continue
        ospec = bound.annotation.outputs[i]
        sums = bound.dim(dim).kind == "reduce" and (ospec.opaque or dim not in ospec.names())
        if sums and spec is not None and spec.partial in ("lse", "avg"):
            raise PlanError(Problem(obj=f"node {node.name}", value=f"co-shard of a {spec.partial} reduction",
                                    rule="co-sharded reductions make partial sums",
                                    fix="co-shard along a spatial dimension of this op"))
        piece = output_piece(bound, ospec, meta.shape, p, reduce)
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
                                   chunk=(region, j), aux=True))
        name = new
    return name


def _combine(lw: Any, prog, node: Node, value: str, parts: list[tuple[str, Piece]], device: int,
             first: PieceInfo) -> None:
    """The device's whole share of ``value`` from its co-sharded pieces (partial sums were
    added already): the piece the node's transforms before the co-shard split make."""
    meta = lw.graph.values[value].meta
    boxes = [p.box for _, p in parts]
    if len(set(boxes)) > 1:
        axis = next(i for i in range(len(meta.shape)) if len({b[i] for b in boxes}) > 1)
        prog.instrs.append(Compute(node.name, "aten.cat.default", ([LocalRef(n) for n, _ in parts], axis),
                                   {}, (value,), "single", f"co-shard: pieces joined along axis {axis}",
                                   aux=True))
    inf = info(lw.graph, node)
    share = piece_info(lw.plan.transforms(node.name)[:-1], first.index[:-1], device)
    reduce = "lse" if inf.spec is not None and inf.spec.partial == "lse" else "sum"
    lw.held.setdefault(value, {})[device] = output_piece(
        inf.bound, inf.bound.annotation.outputs[node.outputs.index(value)], meta.shape, share, reduce)
    lw.local[(value, device)] = value

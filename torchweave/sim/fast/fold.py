"""Repeated layers: find a model's ``L`` identical blocks and cut the graph to its first ``k``.

A transformer is a prefix (embeddings), ``L`` blocks that are the same ops on
the same shapes with the same plan decisions, and a suffix (final norm, head,
loss). The simulator lowers the model cut to 4 blocks (:func:`cut`: the suffix
reads block ``k-1``'s outputs where it read block ``L-1``'s) and copies block
2's tasks to make ``L`` (:mod:`torchweave.sim.fast.folded`); the 3-block cut gives
each block's memory, which is affine in the block count
(:func:`extrapolate`). Not blocks 0 and 1: block 0 reads the prefix, and the
copies need a block that reads one like itself.

Blocks are found by module path: a run of nodes under ``<prefix>.<i>.`` for
``i = 0 … L-1`` (``blocks.3.attn.q_proj``). They are *identical* when, node by
node, target, arguments, output shapes and dtypes, and the plan's transforms
and devices and whether it is recomputed agree, with each reference into the
block before, within the block
or to the block's own parameters at the same position. Anything else
(references that skip a block, a parameter shared between blocks, a plan that
treats one block differently) means no folding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch.utils._pytree as pytree

from torchweave.ir.graph import Graph, Node, Ref
from torchweave.plan.plan import Plan

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    """``spans[i]`` = ``(start, end)`` node indices of block ``i``."""

    prefix: str
    spans: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.spans)


def find_blocks(graph: Graph, plan: Plan, least: int = 6) -> Blocks | None:
    """The model's identical repeated blocks under ``plan`` (at least ``least``), or None."""
    if plan.orders:  # op-orders may differ between blocks: no block stands in for another
        return None
    keys = []
    for node in graph.nodes:
        m = _NUMBERED.match(node.module or "")
        keys.append((m.group(1), int(m.group(2))) if m else None)
    spans: list[tuple[int, int]] = []
    prefix = None
    i = 0
    while i < len(keys):
        if keys[i] is None or (prefix is not None and keys[i][0] != prefix):
            if spans and i < len(keys) and any(k is not None and k[0] == prefix for k in keys[i:]):
                return None  # a block interrupted, or blocks apart
            i += 1
            continue
        prefix = keys[i][0]
        j = i
        while j < len(keys) and keys[j] == keys[i]:
            j += 1
        if keys[i][1] != len(spans):
            return None
        spans.append((i, j))
        i = j
    if len(spans) < least:
        return None
    blocks = Blocks(prefix or "", tuple(spans))
    where, users = made_in(blocks, graph), _param_block(graph, blocks)
    sigs = [_signature(graph, plan, blocks, b, where, users) for b in range(len(spans))]
    if any(s is None for s in sigs) or any(s != sigs[1] for s in sigs[2:]):
        return None
    if not _compatible(sigs[0], sigs[1]):
        return None
    return blocks if _suffix_reads_last(graph, blocks, where) else None


def made_in(blocks: Blocks, graph: Graph) -> dict[str, tuple[int, int, int]]:
    """Value → (block, position in block, output index) for values made in blocks."""
    out = {}
    for b, (s, e) in enumerate(blocks.spans):
        for q in range(s, e):
            for j, o in enumerate(graph.nodes[q].outputs):
                out[o] = (b, q - s, j)
    return out


def _signature(graph: Graph, plan: Plan, blocks: Blocks, b: int, where: dict,
               users: dict) -> tuple | None:
    """Block ``b`` node by node, with references made relative (None: not foldable)."""
    s, e = blocks.spans[b]
    recomputed = {n for grp in plan.recompute for n in grp}
    sig = []
    for q in range(s, e):
        node = graph.nodes[q]
        bad = False

        def enc(x: Any) -> Any:
            nonlocal bad
            if not isinstance(x, Ref):
                return x
            w = where.get(x.name)
            if w is not None:
                if w[0] == b:
                    return ("in", w[1], w[2])
                if w[0] == b - 1:
                    return ("prev", w[1], w[2])
                bad = True
                return None
            v = graph.values[x.name]
            if v.kind in ("param", "buffer"):
                if users.get(x.name) != {b}:
                    bad = True
                return ("param", v.kind, v.meta.shape, v.meta.dtype, v.requires_grad)
            return ("ext", x.name)

        args = _map(enc, (node.args, node.kwargs))
        if bad:
            return None
        metas = tuple((m.shape, m.dtype) for m in graph.output_metas(node))
        trans = tuple((t.dim, t.parts) for t in plan.transforms(node.name))
        sig.append((node.target, repr(args), metas, node.output_structure, trans,
                    _devices(plan.assignment.get(node.name, ())), node.name in recomputed))
    return tuple(sig)


def _devices(devs) -> list:
    """A node's devices as compared between blocks (a list: compared without a copy)."""
    return devs if isinstance(devs, list) else list(devs)


def _param_block(graph: Graph, blocks: Blocks) -> dict[str, set[int | None]]:
    """Parameter → the blocks whose nodes read it (None: outside the blocks)."""
    owner: list[int | None] = [None] * len(graph.nodes)
    for b, (s, e) in enumerate(blocks.spans):
        for q in range(s, e):
            owner[q] = b
    users: dict[str, set[int | None]] = {}
    for q, node in enumerate(graph.nodes):
        for ref in node.input_refs():
            if graph.values[ref.name].kind in ("param", "buffer"):
                users.setdefault(ref.name, set()).add(owner[q])
    return users


def _map(fn, x: Any) -> Any:
    """``fn`` on every leaf of nested tuples, lists and dicts (faster than pytree here)."""
    if isinstance(x, (tuple, list)):
        return tuple(_map(fn, y) for y in x)
    if isinstance(x, dict):
        return tuple((k, _map(fn, v)) for k, v in x.items())
    return fn(x)


def _compatible(first: tuple, second: tuple) -> bool:
    """Block 0 reads the prefix where block 1 reads block 0: otherwise equal."""
    if len(first) != len(second):
        return False
    prev = re.compile(r"\('prev', \d+, \d+\)")
    ext = re.compile(r"\('ext', '[^']*'\)")
    for a, b in zip(first, second):
        if a[0] != b[0] or a[2:] != b[2:]:
            return False
        if ext.sub("X", a[1]) != prev.sub("X", ext.sub("X", b[1])):
            return False
    return True


def _suffix_reads_last(graph: Graph, blocks: Blocks, where: dict) -> bool:
    last = len(blocks) - 1
    end = blocks.spans[-1][1]
    for node in graph.nodes[end:]:
        if any(where.get(r.name, (last,))[0] != last for r in node.input_refs()):
            return False
    return all(where.get(o, (last,))[0] == last for o in graph.outputs)


def cut(graph: Graph, plan: Plan, blocks: Blocks, k: int) -> tuple[Graph, Plan]:
    """The graph and plan with only blocks ``0 … k-1``; the suffix reads block ``k-1``."""
    end = blocks.spans[-1][1]
    keep_end = blocks.spans[k - 1][1]
    ls, ks = blocks.spans[-1][0], blocks.spans[k - 1][0]
    rename = {}
    for q in range(ls, end):
        for o, o2 in zip(graph.nodes[q].outputs, graph.nodes[q - ls + ks].outputs):
            rename[o] = o2

    def remap(node: Node) -> Node:
        args, kwargs = pytree.tree_map(
            lambda x: Ref(rename[x.name]) if isinstance(x, Ref) and x.name in rename else x,
            (node.args, node.kwargs))
        return replace(node, args=args, kwargs=kwargs)

    nodes = graph.nodes[:keep_end] + [remap(n) for n in graph.nodes[end:]]
    kept = {n.name for n in nodes}
    used = {r.name for n in nodes for r in n.input_refs()}
    values = {name: v for name, v in graph.values.items()
              if v.kind not in ("param", "buffer") or name in used}
    g = Graph(nodes=nodes, values=values, inputs=list(graph.inputs),
              outputs=[rename.get(o, o) for o in graph.outputs], loss=rename.get(graph.loss, graph.loss),
              model_name=f"{graph.model_name} ({k} of {len(blocks)} {blocks.prefix})",
              meta=dict(graph.meta))
    p = replace(plan, trans={n: t for n, t in plan.trans.items() if n in kept},
                assignment={n: a for n, a in plan.assignment.items() if n in kept},
                orders=[o for o in plan.orders if o.before.node in kept and o.after.node in kept],
                recompute=[g for g in (tuple(n for n in grp if n in kept) for grp in plan.recompute) if g])
    return g, p


def extrapolate(x3: float, x4: float, blocks: int) -> float:
    """``x(L)`` from ``x(3)`` and ``x(4)``, affine in the number of blocks."""
    return x4 + (blocks - 4) * (x4 - x3)


__all__ = ["Blocks", "cut", "extrapolate", "find_blocks", "made_in"]

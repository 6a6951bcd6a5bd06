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
``i = 0 … L-1`` (``blocks.3.attn.q_proj``), at any depth (``stages.2.3``), one or two
numbered modules to a block; of several such runs, the one with the most identical
blocks. They are *identical* when, node by
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



@dataclass(frozen=True)
class Blocks:
    """``spans[i]`` = ``(start, end)`` node indices of block ``i``; a block is ``period``
    consecutive numbered modules under ``prefix`` (``stages.2.0`` and ``stages.2.1``: a Swin
    pair of a plain and a shifted window block)."""

    prefix: str
    spans: tuple[tuple[int, int], ...]
    period: int = 1
    twin: str | None = None
    """A second stack after this one with as many identical blocks (T5's decoder beside its
    encoder), cut with it by :func:`cut_stacks` (:func:`with_twin`; the search's proxies)."""

    def __len__(self) -> int:
        return len(self.spans)

    def index_of(self, path: str) -> int | None:
        """The block a module or parameter path is in (``blocks.3.attn.w`` → 3), or None."""
        i = _number_under(self.prefix, path)
        return i // self.period if i is not None else None

    def holds(self, path: str) -> bool:
        """Whether a module or parameter path lies in a block of this stack or of its twin."""
        return any(_number_under(p, path) is not None for p in (self.prefix, self.twin) if p)


def _number_under(prefix: str, path: str) -> int | None:
    """``i`` where ``path`` is ``<prefix>.<i>`` or lies under it, else None."""
    m = re.match(re.escape(prefix) + r"\.(\d+)(?:\.|$)", path)
    return int(m.group(1)) if m else None


PERIODS = (1, 2)
"""Numbered modules per block tried: one, or pairs that alternate (Swin's plain and
shifted windows)."""


def find_blocks(graph: Graph, plan: Plan, least: int = 6, *, nested: bool = True) -> Blocks | None:
    """The model's identical repeated blocks under ``plan`` (at least ``least``), or None.

    Every run of numbered modules (``<prefix>.<i>`` for ``i = 0 … L-1``, adjacent in graph
    order, at any depth: ``blocks.3``, ``encoder.3``, ``stages.2.3``) is a candidate, its
    modules taken one or two to a block; the candidate with the most blocks that are
    identical wins, the first in graph order on a tie (T5: the encoder). What lies before it
    is the prefix, after it the suffix. ``nested=False``: only runs at a path's first number,
    one module a block (the search's proxies: a stack inside a stage leaves a heavy rest,
    which its estimate does not price well)."""
    if plan.orders:  # op-orders may differ between blocks: no block stands in for another
        return None
    best: Blocks | None = None
    for prefix, spans in _runs(graph):
        deep = any(part.isdigit() for part in prefix.split("."))
        if deep and (plan.zero == 3 or not nested):
            continue  # ZeRO-3's units are keyed by the first number (lower/units.py): not these blocks
        for period in PERIODS if nested else (1,):
            n = len(spans) // period
            if n < least or (best is not None and n <= len(best)):
                break
            if len(spans) % period:
                continue
            blocks = Blocks(prefix, tuple((spans[i][0], spans[i + period - 1][1])
                                          for i in range(0, len(spans), period)), period)
            if _identical(graph, plan, blocks):
                best = blocks
                break
    return best


def _runs(graph: Graph) -> list[tuple[str, list[tuple[int, int]]]]:
    """(prefix, spans of ``<prefix>.0``, ``<prefix>.1``, …) for every prefix whose numbered
    modules are adjacent in graph order, one run each, numbered from 0 in order; in order of
    their first node."""
    members: dict[str, list[tuple[int, int]]] = {}
    for q, node in enumerate(graph.nodes):
        parts = (node.module or "").split(".")
        for j in range(1, len(parts)):
            if parts[j].isdigit():
                members.setdefault(".".join(parts[:j]), []).append((q, int(parts[j])))
    out = []
    for prefix, nodes in members.items():
        if nodes[-1][0] - nodes[0][0] + 1 != len(nodes):
            continue  # something else runs between its modules
        spans: list[tuple[int, int]] = []
        for q, i in nodes:
            if spans and i == len(spans) - 1:
                spans[-1] = (spans[-1][0], q + 1)
            elif i == len(spans):
                spans.append((q, q + 1))
            else:
                spans = []
                break  # a module again after another, or numbered out of order
        if spans:
            out.append((prefix, spans))
    return out


def _identical(graph: Graph, plan: Plan, blocks: Blocks) -> bool:
    """Whether ``blocks`` are the same ops on the same shapes under ``plan``, each reading the
    one before (block 0 the prefix), and the suffix reads only the last."""
    where, users = made_in(blocks, graph), _param_block(graph, blocks)
    sigs = [_signature(graph, plan, blocks, b, where, users) for b in range(len(blocks))]
    if any(s is None for s in sigs) or any(s != sigs[1] for s in sigs[2:]):
        return False
    return _compatible(sigs[0], sigs[1]) and _suffix_reads_last(graph, blocks, where)


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


def with_twin(graph: Graph, plan: Plan, blocks: Blocks | None) -> Blocks | None:
    """``blocks`` with its :attr:`~Blocks.twin`, where a second stack at a path's first number
    follows it with as many identical blocks (an encoder-decoder's decoder); else unchanged.
    Block ``i`` of each then stands for the pair: what the two stacks cost together is affine
    in their common depth, and only the embeddings and the head are left outside."""
    if blocks is None or blocks.period != 1:
        return blocks
    for prefix, spans in _runs(graph):
        if prefix == blocks.prefix or any(p.isdigit() for p in prefix.split(".")) \
                or len(spans) != len(blocks) or spans[0][0] < blocks.spans[-1][1]:
            continue
        if _identical(graph, plan, Blocks(prefix, tuple(spans))):
            return replace(blocks, twin=prefix)
    return blocks


def cut_stacks(graph: Graph, plan: Plan, blocks: Blocks, k: int) -> tuple[Graph, Plan]:
    """:func:`cut` of ``blocks`` and, where it has one, of its twin to the same ``k``."""
    g, p = cut(graph, plan, blocks, k)
    if blocks.twin is None:
        return g, p
    spans = dict(_runs(g)).get(blocks.twin)
    if spans is None or len(spans) != len(blocks):
        raise ValueError(f"the stack {blocks.twin!r} is not {len(blocks)} blocks after the cut")
    return cut(g, p, Blocks(blocks.twin, tuple(spans)), k)


def extrapolate(x3: float, x4: float, blocks: int) -> float:
    """``x(L)`` from ``x(3)`` and ``x(4)``, affine in the number of blocks."""
    return x4 + (blocks - 4) * (x4 - x3)


__all__ = ["Blocks", "cut", "cut_stacks", "extrapolate", "find_blocks", "made_in", "with_twin"]

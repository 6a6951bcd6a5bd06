"""Pipeline cuts the search chooses: stages balanced by seconds, inside blocks where that helps.

The pipeline policy cuts between whole blocks by FLOPs (:func:`~torchweave.policies.
stage_cuts.cut`). Where blocks differ (an encoder layer over 1,024 tokens against a
decoder layer over 256) or the rest is heavy (a 250k-word head, an embedding whose
backward writes the whole table), whole blocks cannot make the stages even and FLOPs
misjudge what the memory-bound ops cost. With ``seconds`` in the constraints' ``balance``
the search adds, for each pipelined point, the cut that minimises the largest stage's
roofline seconds on the cluster (:func:`balanced`), at the module boundaries the
constraints' ``cuts`` allow (by default a block's own start and its children's:
``encoder.7``, ``encoder.7.ff_norm``), written into the point's plan string as ``cuts=``.

Such a cut is offered only for models with two stacks of blocks (an encoder-decoder's
twin, :func:`~torchweave.sim.fast.fold.with_twin`): their pipelines the simulator runs
exactly whatever the cut. A GPT's whole-block stages are simulated by extrapolation
(:mod:`torchweave.sim.fast.stagefold`), which a cut inside a block would give up (GPT-3
175B on 1,024 GPUs: 1.4 s against 43 s a plan).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from torchweave.ir.graph import Graph
from torchweave.policies.stage_cuts import cut, cut_modules, module_starts
from torchweave.policies.spec import MODULE_PATH
from torchweave.search.constraints import Constraints
from torchweave.search.space import Point
from torchweave.sim.fast.fold import Blocks


def places(graph: Graph, blocks: Blocks, c: Constraints) -> list[int]:
    """Graph positions a stage may start at: the first op of a module at most one level
    below a block (the block, its attention, its norm, its MLP) or outside the blocks, and,
    where the constraints list ``cuts``, of a module they allow."""
    out = set()
    for name, i in module_starts(graph, depth=len(blocks.prefix.split(".")) + 2).items():
        if i > 0 and c.allows_cut(name):
            out.add(i)
    return sorted(out)


def seconds_points(graph: Graph, blocks: Blocks | None, c: Constraints, pts: list[Point],
                   seconds: np.ndarray) -> list[Point]:
    """For each pipelined point (one stage chain a rank, no experts), the same point cut by
    :func:`balanced` over ``seconds`` (each op's), where that cut differs from the policy's
    and names modules; none unless the constraints' ``balance`` has ``seconds`` and the
    model has two stacks (see the module docstring)."""
    if blocks is None or blocks.twin is None or "seconds" not in c.balance:
        return []
    where = places(graph, blocks, c)
    by_stages: dict[int, tuple[str, ...]] = {}
    out = []
    for pt in pts:
        if pt.pp < 2 or pt.schedule in ("none", "interlaced") or pt.ep > 1 or pt.cuts:
            continue
        stages = pt.pp * pt.virtual
        if stages not in by_stages:
            mine = balanced(seconds, stages, where)
            stage_of = cut(graph, stages)
            policy = [stage_of[n.name] for n in graph.nodes]
            theirs = [i for i in range(1, len(policy)) if policy[i] != policy[i - 1]]
            modules = cut_modules(graph, mine) if mine and mine != theirs else []
            # only cuts a plan string can write (a module named like `0.ff` cannot be)
            by_stages[stages] = tuple(modules) if all(MODULE_PATH.fullmatch(m) for m in modules) else ()
        if by_stages[stages]:
            out.append(replace(pt, cuts=by_stages[stages]))
    return out


def balanced(seconds: np.ndarray, stages: int, places: list[int]) -> list[int] | None:
    """Where stages 1, 2, … start, among graph positions ``places``, so that the
    largest stage's ``seconds`` (each op's, in graph order) are the least they can be
    (None: fewer places than cuts). A bisection on that largest stage, each bound
    tried greedily: every stage ends at the last place that keeps it within the
    bound; where fewer stages suffice, the largest is split again. Deterministic."""
    places = sorted(set(places))
    if len(places) < stages - 1:
        return None
    pre = np.concatenate([[0.0], np.cumsum(seconds)])
    n = len(seconds)

    def fill(bound: float) -> list[int] | None:
        cuts, start, k = [], 0, 0
        while pre[n] - pre[start] > bound:
            while k < len(places) and pre[places[k]] - pre[start] <= bound:
                k += 1
            if k == 0 or places[k - 1] <= start:
                return None  # the next op alone is over the bound
            start = places[k - 1]
            cuts.append(start)
        return cuts

    lo, hi = 0.0, float(pre[n])
    for _ in range(60):
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is not None and len(got) <= stages - 1:
            hi = mid
        else:
            lo = mid
    cuts = fill(hi) or []
    spare = [p for p in places if p not in cuts]
    while len(cuts) < stages - 1:  # fewer stages sufficed: split the largest that can be
        bounds = [0] + cuts + [n]
        inside = {j: [p for p in spare if bounds[j] < p < bounds[j + 1]] for j in range(len(bounds) - 1)}
        big = max((j for j in inside if inside[j]), key=lambda j: (pre[bounds[j + 1]] - pre[bounds[j]], -j))
        mid = (pre[bounds[big]] + pre[bounds[big + 1]]) / 2
        pick = min(inside[big], key=lambda p: (abs(pre[p] - mid), p))
        spare.remove(pick)
        cuts = sorted(cuts + [pick])
    return cuts


__all__ = ["balanced", "places", "seconds_points"]

"""``plan="auto"``: search the space a constraint set leaves for the fastest plan that fits.

1. **The space** (:mod:`torchweave.search.space`): every (tp, pp, dp, micro,
   schedule, virtual, recompute, ZeRO, sp) point the constraints allow whose
   arithmetic works for the world, the batch and the blocks.
2. **Partitions**: for each ``tp`` where the constraints allow ``split: solved``,
   the solver (:mod:`torchweave.search.intra`, an ILP) picks each op's split;
   a partition equal to Megatron's rules adds nothing and is dropped.
   **Proxies**: one short simulation per way of splitting a block (tp, sp,
   recompute, split) gives one block's and the rest's cost
   (:mod:`torchweave.search.estimate`); a split the model refuses or an op rule
   forbids takes its points out, with the reason. Degrees are tried in
   increasing order while they make a block faster: once a degree is no faster
   than a smaller one, larger ones are not tried (they only add communication),
   and the result says so.
3. **Estimate** every point by arithmetic, drop those over the memory budget.
4. **Re-rank**: the best ``top + 3`` points (48 on small models, :data:`CHEAP`; and the
   best point of the
   ``megatron`` preset, for comparison) are built as plans, checked against the
   constraints' op rules, cuts, pins and ties, and simulated in full by the event
   simulator. The ranking is the simulator's; the estimate's error on each is kept.

Models without at least 4 identical blocks are small enough to simulate every
point directly. Everything is deterministic: points are ordered by estimate,
then by their plan string.
"""

from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.policies.recompute import block_of
from torchweave.policies.spec import PlanSpec
from torchweave.search.constraints import Constraints, OpRule, preset
from torchweave.search.estimate import Estimate, Proxy, estimate, proxy
from torchweave.search.intra import Partition, describe, solve, tp_dims
from torchweave.search.space import Point, points
from torchweave.sim.cluster import Cluster
from torchweave.sim.fold import find_blocks
from torchweave.sim.simulate import SimResult, simulate

GiB = 2**30
CHEAP = 20_000
"""Graph nodes × ranks under which a simulation costs little: the search then simulates its
best 48 points instead of ``top + 3`` (the estimate is least accurate on small models,
where fixed per-op costs do not shrink with the micro-batch)."""


@dataclass
class Ranked:
    """One plan the search simulated."""

    point: Point
    estimate: Estimate | None
    """The search's own estimate (None: simulated directly, a model without blocks)."""
    result: SimResult
    plan: Plan

    @property
    def spec(self) -> str:
        return self.point.spec

    @property
    def estimate_error(self) -> float | None:
        """|estimate − simulated| / simulated step time."""
        if self.estimate is None or not self.result.step_time:
            return None
        return abs(self.estimate.step_s - self.result.step_time) / self.result.step_time

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by part (the busiest rank), and peak GiB."""
        r = self.result
        return {"step": r.step_time, "compute": max(r.compute_time, default=0.0),
                "comm": max(r.comm_time, default=0.0), "bubble %": 100 * (r.pipeline_bubble or 0.0),
                "peak GiB": max(m.peak for m in r.memory) / GiB}


@dataclass
class SearchResult:
    ranked: list[Ranked]
    """Simulated plans that fit, fastest first."""
    considered: int
    """Points of the space priced."""
    excluded: list[str]
    """Why parts of the space were left out."""
    over_memory: list[tuple[str, float]]
    """The closest points over the budget: (plan, GiB over per device)."""
    constraints: Constraints
    cluster: Cluster
    seconds: float
    reference: Ranked | None = None
    """The best simulated plan of the ``megatron`` preset (None: none was simulated)."""
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    def why(self) -> list[str]:
        """Why the winner beat the runner-up and the best megatron plan, point by point."""
        out = []
        win = self.best
        for label, other in (("runner-up", self.ranked[1] if len(self.ranked) > 1 else None),
                             ("best megatron plan", self.reference)):
            if other is None or other.spec == win.spec:
                if label != "runner-up" and other is not None:
                    out.append("is the best plan of the megatron preset's space too")
                continue
            a, b = win.breakdown(), other.breakdown()
            parts = [f"{k} {a[k]:.4g} vs {b[k]:.4g}" + (" s" if k in ("step", "compute", "comm")
                                                        else "")
                     for k in a if not math.isclose(a[k], b[k], rel_tol=1e-3)]
            out.append(f"beats the {label} `{other.spec}` ({b['step'] / a['step']:.3f}x): "
                       + "; ".join(parts))
        return out


def search(graph: Graph, cluster: Cluster, constraints: Constraints | str | None = None, *,
           world_size: int | None = None, top: int = 5, simulate_top: int | None = None,
           dtype: torch.dtype | None = None,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """The best plans for ``graph`` on ``cluster`` within ``constraints`` (a
    :class:`Constraints`, a preset name; default ``free``)."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    c = preset(constraints or "free") if not isinstance(constraints, Constraints) else constraints
    world = world_size or cluster.size
    if world > cluster.size:
        raise TorchweaveError(Problem(obj="world_size", value=str(world),
                                      rule=f"at most the cluster's {cluster.size} devices",
                                      fix="use a larger cluster"))
    budget = (c.memory_gib * GiB) if c.memory_gib else cluster.device.memory_bytes
    precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    batch = _batch(graph)
    base = PlanSpec.parse("dp").build(graph, 1)
    blocks = find_blocks(graph, base, least=4)
    numbered = len({k for k in (block_of(n.module or "") for n in graph.nodes) if k})
    pts, excluded = points(world, batch, len(blocks) if blocks else 0, c, numbered=numbered)
    say(f"{len(pts)} points in the space ({c.name}) for {world} ranks, batch {batch}, "
        f"{len(blocks) if blocks else 'no'} repeated blocks")
    ests: dict[Point, Estimate] = {}
    over: list[tuple[str, float]] = []
    parts: dict[int, Partition | None] = {}
    notes: list[str] = []
    for tp in sorted({p.tp for p in pts if p.split == "solved"}):
        say(f"solve each op's split for tp={tp}")
        parts[tp] = _solve(graph, cluster, tp, world, c, dtype, excluded, notes)
    pts = [p for p in pts if p.split != "solved" or parts.get(p.tp) is not None]
    if blocks is not None:
        proxies: dict[tuple, Proxy | None] = {}
        best_block, stop = math.inf, None
        for key in sorted({(p.tp, p.sp, p.recompute, p.split) for p in pts}):
            if stop is not None and key[0] > stop:
                proxies[key] = None
                continue
            if key[0] > 1 and key[1:] == (False, "none", "rule") and stop is None:
                # Larger degrees are tried while they make a block faster.
                prev = min((x.block_s for k, x in proxies.items() if x and k[0] < key[0]),
                           default=math.inf)
                best_block = prev
            say(f"proxy tp={key[0]} sp={key[1]} recompute={key[2]} split={key[3]}")
            part = parts.get(key[0]) if key[3] == "solved" else None
            try:
                px = proxy(graph, blocks, cluster, *key[:3], dtype=dtype, precision=precision,
                           dims=part.dims if part else None)
            except TorchweaveError as exc:
                excluded.append(f"tp={key[0]}{' (sp)' if key[1] else ''}: "
                                + "; ".join(f"{p.value}: {p.rule}" for p in exc.problems))
                proxies[key] = None
                continue
            bad = _op_rules(px.plan, graph, c.ops, key[0])
            if bad:
                excluded.append(f"tp={key[0]}: {bad}")
                proxies[key] = None
                continue
            proxies[key] = px
            if key[1:] == (False, "none", "rule") and key[0] > 1 and px.block_s >= best_block:
                stop = key[0]
                excluded.append(f"tp > {key[0]}: not tried; tp={key[0]} is no faster per block "
                                f"({px.block_s:.4g} s) than a smaller degree ({best_block:.4g} s)")
        direct = [pt for pt in pts if pt.schedule == "interlaced"]  # no estimate: simulated
        for pt in pts:
            if pt.schedule == "interlaced":
                continue
            px = proxies[(pt.tp, pt.sp, pt.recompute, pt.split)]
            if px is None:
                continue
            e = estimate(pt, px, cluster, len(blocks), precision=precision)
            if e.memory > budget:
                over.append((pt.spec, (e.memory - budget) / GiB))
            else:
                ests[pt] = e
        order = sorted(ests, key=lambda p: (ests[p].step_s, p.spec))
        n = simulate_top or (top + 3 if len(graph.nodes) * world > CHEAP else max(top + 3, 48))
        chosen = order[:n]
        ref = _reference(order)
        if ref is not None and ref not in chosen:
            chosen.append(ref)
        chosen += direct
    else:
        chosen = list(pts)
    ranked: list[Ranked] = []
    for i, pt in enumerate(chosen):
        say(f"simulate {i + 1}/{len(chosen)}: {pt.spec}")
        try:
            part = parts.get(pt.tp) if pt.split == "solved" else None
            plan = PlanSpec.parse(pt.spec).build(graph, world, dims=part.dims if part else None)
        except TorchweaveError as exc:
            excluded.append(f"{pt.spec}: " + "; ".join(p.rule for p in exc.problems))
            continue
        bad = _admissible(plan, graph, c, pt)
        if bad:
            excluded.append(f"{pt.spec}: {bad}")
            continue
        try:  # lowering may still refuse a plan the space allows: it is left out, with why
            res = simulate(graph, plan, cluster, dtype=dtype, timeline=False)
        except TorchweaveError as exc:
            excluded.append(f"{pt.spec}: " + "; ".join(f"{p.value}: {p.rule}" for p in exc.problems))
            continue
        peak = max(m.peak for m in res.memory)
        if peak > budget:
            over.append((pt.spec, (peak - budget) / GiB))
            continue
        plan.notes["spec"] = pt.spec
        ranked.append(Ranked(pt, ests.get(pt), res, plan))
    ranked.sort(key=lambda r: (r.result.step_time, r.spec))
    if not ranked:
        raise TorchweaveError(_nothing_fits(c, cluster, budget, over, excluded, len(pts)))
    mega = preset("megatron")
    reference = next((r for r in ranked if _in(mega, r.point)), None)
    over.sort(key=lambda x: (x[1], x[0]))
    return SearchResult(ranked[:max(top, 1)] if top else ranked, len(pts), excluded, over[:5], c,
                        cluster, time.perf_counter() - t0, reference, notes)


def _solve(graph: Graph, cluster: Cluster, tp: int, world: int, c: Constraints, dtype,
           excluded: list[str], notes: list[str]) -> Partition | None:
    """The solver's partition for ``tp``; None (and why, in ``excluded``) where it is
    Megatron's own or the constraints leave none. ``notes`` gets how it differs from
    Megatron's."""
    try:
        part = solve(graph, cluster, tp=tp, world=world, dtype=dtype, rules=c.ops)
    except TorchweaveError as exc:
        excluded.append(f"split=solved, tp={tp}: " + "; ".join(f"{p.obj}: {p.rule}"
                                                              for p in exc.problems))
        return None
    if part.batch_only and c.tp.allows(1):  # dp's own point is in the space
        excluded.append(f"split=solved, tp={tp}: the solver splits only the batch (the plan "
                        f"with dp×{tp}, a point of its own)")
        return None
    try:
        rule = tp_dims(PlanSpec.parse(f"tp:tp={tp},dp=1").build(graph, tp), graph)
    except TorchweaveError:
        return part
    if rule == part.dims:
        excluded.append(f"split=solved, tp={tp}: the solver's partition is Megatron's")
        return None
    diff = describe(graph, part.dims, rule)
    notes.append(f"split=solved, tp={tp} ({part.status}, {part.variables} variables, "
                 f"{part.seconds:.2f} s) splits, unlike Megatron's rules: " + "; ".join(diff[:8])
                 + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else ""))
    return part


def _batch(graph: Graph) -> int:
    for name in graph.inputs:
        shape = graph.values[name].meta.shape
        if shape:
            return int(shape[0])
    return 1


def _in(c: Constraints, pt: Point) -> bool:
    """Whether ``pt`` is in the space ``c`` leaves."""
    return (c.tp.allows(pt.tp) and c.pp.allows(pt.pp) and c.dp.allows(pt.dp)
            and pt.schedule in c.schedules and pt.recompute in c.recompute and pt.zero in c.zero
            and (c.sp or not pt.sp) and (pt.pp == 1 or c.micro.allows(pt.micro))
            and (pt.tp == 1 or pt.split in c.split)
            and (pt.schedule != "interleaved" or c.virtual.allows(pt.virtual)))


def _reference(order: list[Point]) -> Point | None:
    mega = preset("megatron")
    return next((p for p in order if _in(mega, p)), None)


def _op_rules(plan: Plan, graph: Graph, rules: tuple[OpRule, ...], tp: int, dp: int = 1
              ) -> str | None:
    """The first op rule ``plan`` breaks, in words (None: it keeps them all). Rules are
    about an op's partition inside one data-parallel replica: the batch split that data
    parallelism makes of every op (its first transform, ``dp`` parts) is not theirs."""
    for rule in rules:
        for node in graph.nodes:
            if node.name not in plan.trans or not rule.selects(node):
                continue
            trans = list(plan.transforms(node.name))
            if dp > 1 and trans and trans[0].parts == dp:
                trans = trans[1:]
            splits = [t for t in trans if t.dim is not None and t.parts > 1]
            if rule.replicate is False and not splits:
                return f"{rule} says {node.name} ({node.module}) is split, but tp={tp} keeps it whole"
            for t in splits:
                if rule.parts is not None and t.parts not in rule.parts:
                    return (f"tp={tp} splits {node.name} ({node.module}) into {t.parts}, but "
                            f"{rule} allows {list(rule.parts)}")
                if rule.split is not None and t.dim not in rule.split and str(t.dim) not in map(
                        str, rule.split):
                    return (f"tp={tp} splits {node.name} ({node.module}) on dim {t.dim}, but "
                            f"{rule} allows dims {list(rule.split)}")
            if rule.replicate is True and splits and rule.parts is None and rule.split is None:
                return f"{rule} keeps {node.name} ({node.module}) whole, but tp={tp} splits it"
    return None


def _admissible(plan: Plan, graph: Graph, c: Constraints, pt: Point) -> str | None:
    """The first constraint ``plan`` breaks (op rules, cuts, pins, ties), or None."""
    bad = _op_rules(plan, graph, c.ops, pt.tp, pt.dp)
    if bad:
        return bad
    pipe = plan.pipeline
    if pipe is not None and (c.cuts is not None or c.pin):
        first: dict[int, object] = {}
        for node in graph.nodes:
            s = pipe.stage_of.get(node.name)
            if s is not None and s not in first:
                first[s] = node
        if c.cuts is not None:
            for s, node in sorted(first.items()):
                if s and not any(fnmatch.fnmatchcase(node.module or "", g) or fnmatch.fnmatchcase(
                        (node.module or "") + ".x", g + ".*") for g in c.cuts):
                    return (f"stage {s} starts at {node.module or node.name}, not at a cut the "
                            f"constraints allow ({', '.join(c.cuts)})")
        last = pipe.stages - 1
        for glob, want in c.pin.items():
            stage = {"first": 0, "last": last}.get(want, want)
            for node in graph.nodes:
                if fnmatch.fnmatchcase(node.module or "", glob) and pipe.stage_of.get(
                        node.name, stage) != stage:
                    return (f"{node.module} is pinned to stage {want}, but the plan runs it on "
                            f"stage {pipe.stage_of[node.name]}")
    for group in c.ties:
        seen = None
        for node in graph.nodes:
            if any(fnmatch.fnmatchcase(node.module or "", g) for g in group):
                sig = tuple((t.dim, t.parts) for t in plan.transforms(node.name))
                if seen is not None and sig != seen[1]:
                    return (f"ties {list(group)}: {seen[0]} is split {seen[1]} but {node.name} "
                            f"{sig}")
                seen = seen or (node.name, sig)
    return None


def _nothing_fits(c: Constraints, cluster: Cluster, budget: float, over, excluded, n: int
                  ) -> list[Problem]:
    if over:
        spec, short = min(over, key=lambda x: (x[1], x[0]))
        relax = ("allow recompute (recompute: [none, selective, full])" if "full" not in
                 c.recompute else "allow ZeRO (zero: [0, 1, 2, 3])" if 3 not in c.zero else
                 "allow more pipeline or tensor parallelism, or use more devices")
        return [Problem(obj=f"constraints {c.name!r}",
                        value=f"the closest plan, {spec}, needs {short:.2f} GiB more per device",
                        rule=f"a plan fits {budget / GiB:.1f} GiB per device on {cluster}",
                        fix=f"raise memory_gib, {relax}")]
    why = "; ".join(excluded[:6]) or f"none of {n} points could be built"
    return [Problem(obj=f"constraints {c.name!r}", value=f"no plan on {cluster}",
                    rule=f"some plan satisfies every constraint ({why})",
                    fix="relax the constraint named above")]


__all__ = ["Ranked", "SearchResult", "search"]

"""One step of a model with ``L`` identical blocks, from 4 of them lowered (:mod:`torchweave.sim.fast.fold`).

Lowering is what costs (every node on every simulated rank); the event engine
is cheap. So the model is cut to 4 blocks (:func:`~torchweave.sim.fast.fold.cut`),
lowered, and each rank's forward and backward tasks (:meth:`Builder.unsynced`)
are **copied** to ``L`` blocks: block 2's tasks are repeated ``L − 4`` times
between blocks 2 and 3, each copy's names renamed (:class:`~torchweave.sim.step.signals.Renamed`), its reads of the
block before pointed at the previous copy, its collectives keyed apart, and
block 3 reads the last copy. Tasks correspond position by position because the
blocks are the same ops, shapes and plan decisions (``find_blocks``); where the
task lists do not say so (different lengths, kinds, durations or names that do
not map one to one), the copy is refused and the exact path runs.

Gradient sums are then placed on the full task list by the same rule as
always (:func:`~torchweave.sim.step.backward.place_syncs`): buckets fill and close
where they would on the whole model, each costed at its own size, and the
engine runs the ``L``-block lists, overlap included. Nothing is extrapolated
in time. Memory is: parameters, buffers and activations are affine in the block
count (``x(L) = x(4) + (L − 4)(x(4) − x(3))``, from the 3-block model's
footprint), the temporaries are the forward's (which do not grow with blocks)
or the largest bucket of the full list.
"""

from __future__ import annotations

from dataclasses import replace

from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.sim.step.backward import REACH, place_syncs
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.step.engine import Task
from torchweave.sim.fast.fold import Blocks, cut, extrapolate
from torchweave.sim.explain.result import SimResult
from torchweave.sim.fast.symmetry import lower_programs
from torchweave.sim.step.run import run_step
from torchweave.sim.step.build import Builder
from torchweave.sim.step.signals import Copying, Renamed
from torchweave.sim.step.state import Footprint, SyncInputs


def simulate_folded(graph: Graph, plan: Plan, cluster: Cluster, blocks: Blocks, *, dtype,
                    tokens_per_step: int | None, model: ComputeModel | None, bucket_bytes: int,
                    strict: bool, timeline: bool, symmetry: bool | None,
                    profiles=None, grad_accum: int = 1) -> SimResult | None:
    """None: the tasks do not copy block by block (the caller runs the exact path)."""
    n = len(blocks)
    model = model or ComputeModel.for_device(cluster.device)
    built = {}
    for k in (3, 4):
        g, p = cut(graph, plan, blocks, k)
        programs, rep = lower_programs(g, p, symmetry)
        block_of = {graph.nodes[q].name: b for b, (s, e) in enumerate(blocks.spans[:k])
                    for q in range(s, e)}
        builder = Builder(g, p, cluster, dtype, model, bucket_bytes, profiles=profiles,
                          meet=frozenset(range(rep.size)) if rep else None, block_of=block_of)
        built[k] = (programs, rep, builder, {prog.rank: builder.unsynced(prog) for prog in programs})
    programs, rep, builder, runs4 = built[4]
    feet3 = {r: foot for r, (_, foot, _) in built[3][3].items()}
    tasks: dict[int, list[Task]] = {}
    feet: dict[int, Footprint] = {}
    for r, (ts, foot, inputs) in runs4.items():
        lifted = lift(ts, foot.n_fwd, inputs, n)
        if lifted is None or r not in feet3:
            return None
        f3 = feet3[r]
        feet[r] = replace(foot, params=_ex(f3.params, foot.params, n),
                          buffers=_ex(f3.buffers, foot.buffers, n), kept=_ex(f3.kept, foot.kept, n),
                          activations=_ex(f3.activations, foot.activations, n),
                          temporaries=foot.held, bucket=0, grad_order=[])
        tasks[r] = place_syncs(builder, lifted[0], feet[r], lifted[1], r)
    flops3 = sum(c.model_flops for c in built[3][2].costs.values())
    flops4 = sum(c.model_flops for c in builder.costs.values())
    return run_step(graph, plan, cluster, tasks, feet, programs, rep, dtype=dtype, model=model,
                    strict=strict, timeline=timeline, grad_accum=grad_accum,
                    tokens_per_step=tokens_per_step, flops=extrapolate(flops3, flops4, n),
                    notes=(f"{n} identical '{blocks.prefix}' blocks: 4 lowered, their tasks "
                           f"copied to {n}",), folded_blocks=n)


def _ex(a: int, b: int, n: int) -> int:
    return max(0, round(extrapolate(a, b, n)))


def lift(tasks: list[Task], n_fwd: int, inputs: SyncInputs, total: int
         ) -> tuple[list[Task], SyncInputs] | None:
    """One rank's unsynced tasks of the 4-block model as the ``total``-block model's
    (and its parameters), or None where blocks 1 and 2 do not correspond task by task."""
    fwd, bwd = tasks[:n_fwd], tasks[n_fwd:]
    fs, bs = _spans(fwd, (0, 1, 2, 3)), _spans(bwd, (3, 2, 1, 0))
    if fs is None or bs is None:
        return None
    pairs = list(zip(fwd[slice(*fs[1])], fwd[slice(*fs[2])])) + list(
        zip(bwd[slice(*bs[1])], bwd[slice(*bs[2])]))
    if fs[1][1] - fs[1][0] != fs[2][1] - fs[2][0] or bs[1][1] - bs[1][0] != bs[2][1] - bs[2][0]:
        return None
    shift: dict = {}  # a name in block 1's tasks → the same in block 2's
    for a, b in pairs:
        if (a.kind, a.dur, a.group, a.nbytes, len(a.waits), len(a.sets)) != (
                b.kind, b.dur, b.group, b.nbytes, len(b.waits), len(b.sets)) or (
                (a.key is None) != (b.key is None)):
            return None
        for x, y in zip(_names(a), _names(b)):
            if shift.setdefault(x, y) != y:
                return None
    n1 = {x for a, _ in pairs for x in _names(a)}
    own2 = {y for _, b in pairs for y in _names(b)} - n1
    copies = total - 4

    blocked = {x for part, span in ((fwd, fs[2]), (bwd, bs[2])) for t in part[slice(*span)]
               for x in _names(t)}  # the names block 2's tasks use, renamed in each copy

    def in_copy(c: int) -> dict:
        out = {}
        for x in blocked:
            if x in own2:
                out[x] = _renamed(x, c)
                continue
            y = shift[x] if x in n1 else x
            out[x] = y if y == x or c == 1 else _renamed(y, c - 1)  # y == x: from outside
        return out

    last = {x: _renamed(x, copies) for x in own2}

    def copy(t: Task, ren: dict, c: int | None, block: int) -> Task:
        get = ren.get
        return Task(t.kind, get(t.name, t.name) if t.kind == REACH else t.name,
                    tuple([get(x, x) for x in t.waits]), tuple([get(x, x) for x in t.sets]),
                    t.dur, t.key if c is None or t.key is None else t.key._replace(block=c),
                    t.group, t.stage, t.crossing, t.nbytes, block, t.closes, t.latency)

    renames = {c: in_copy(c) for c in range(1, copies + 1)}

    def body(part: list[Task], span: tuple[int, int], c: int) -> list[Task]:
        return [copy(t, renames[c], c, 2 + c) for t in part[slice(*span)]]

    def three(part: list[Task], span: tuple[int, int]) -> list[Task]:
        return [copy(t, last, None, total - 1) for t in part[slice(*span)]]

    out = fwd[:fs[2][1]]
    for c in range(1, copies + 1):
        out += body(fwd, fs[2], c)
    out += three(fwd, fs[3]) + fwd[fs[3][1]:]
    out += bwd[:bs[3][0]] + three(bwd, bs[3])
    for c in range(copies, 0, -1):
        out += body(bwd, bs[2], c)
    out += bwd[bs[2][0]:]
    params, nbytes = dict(inputs.params), dict(inputs.nbytes)
    for p in [p for p in inputs.params if p in own2]:
        for c in range(1, copies + 1):
            params[renames[c][p]], nbytes[renames[c][p]] = inputs.params[p], inputs.nbytes[p]
    return out, SyncInputs(params, nbytes)


def _renamed(x, c: int) -> Renamed:
    return tuple.__new__(Renamed, (x, Copying.BLOCK, c))  # the fast way to make one (hot)


def _names(t: Task) -> tuple:
    return t.waits + t.sets + ((t.name,) if t.kind == REACH else ())


def _spans(tasks: list[Task], order: tuple[int, ...]) -> dict[int, tuple[int, int]] | None:
    """Block → its run ``(start, end)`` in ``tasks``, where the blocks come in ``order``,
    one run each, with only unblocked tasks before and after; else None."""
    runs: list[tuple[int, int, int]] = []
    for i, t in enumerate(tasks):
        if runs and runs[-1][0] == t.block:
            runs[-1] = (t.block, runs[-1][1], i + 1)
        else:
            runs.append((t.block, i, i + 1))
    inner = [x for x in runs if x[0] is not None]
    if [x[0] for x in inner] != list(order):
        return None
    first, end = runs.index(inner[0]), runs.index(inner[-1])
    if any(x[0] is None for x in runs[first:end + 1]):
        return None
    return {b: (s, e) for b, s, e in inner}


__all__ = ["lift", "simulate_folded"]

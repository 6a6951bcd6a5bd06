"""One rank's forward pass as tasks (step 1 of :mod:`torchweave.sim.step.build`).

The Program's instructions in order. A compute instruction is its node's time
(:class:`~torchweave.sim.step.context.StepContext`); a communication step is a
collective over the group that holds the rank; ZeRO-3 gathers each unit
(:mod:`torchweave.lower.units`) before its first reader. Along the way it
counts what the rank keeps for backward (:mod:`torchweave.sim.step.saved`:
distinct storages some op saves, less what a recompute group runs again) and
the temporaries, into the rank's :class:`~torchweave.sim.step.state.Footprint`.
"""

from __future__ import annotations

import math

from torchweave.lower import steps
from torchweave.lower.program import Comm, Compute, Program, zero_owns
from torchweave.lower.units import group_units, read_order, unit_key
from torchweave.sim.hardware.collective_cost import Collective
from torchweave.sim.step.context import StepContext
from torchweave.sim.step.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.step.saved import ALIAS_OPS, STRIDING_OPS, packet
from torchweave.sim.step.signals import Meet, Rendezvous
from torchweave.sim.step.state import Footprint, RankForward, mine


def forward(ctx: StepContext, prog: Program) -> tuple[list[Task], RankForward]:
    """One rank's forward tasks, and what they leave for backward."""
    r, g = prog.rank, ctx.graph
    foot = Footprint()
    params = {}
    state = RankForward(prog, foot, params)
    nbytes = state.nbytes
    sharded = ctx.plan.zero_group(r)
    for s in prog.params:
        n = math.prod(b - a for a, b in s.box)
        value = ctx.paths.get(s.path)
        nbytes[s.local] = n * (ctx.itemsize(value) if value else 4)
        if s.is_buffer:
            foot.buffers += int(nbytes[s.local])
        else:
            foot.params += n
            if s.requires_grad and ctx.plan.zero and not zero_owns(s, sharded):
                foot.kept += n
            if s.requires_grad:
                params[s.local] = s
    for s in prog.inputs:
        nbytes[s.local] = g.values[s.local].meta.nbytes if s.local in g.values else 0
    micro = ctx.plan.pipeline.micro_batches if ctx.plan.pipeline is not None else 1
    # Activations: distinct storages that some op saves for backward (saved.py).
    # ``root`` maps a value to the value owning its storage; ``strided`` holds
    # non-contiguous views (a reshape of one copies).
    not_act = {s.local for s in prog.params if not s.is_buffer}
    root: dict[str, str] = {}
    strided: set[str] = set()
    kept: dict[str, float] = {}
    shard_of: dict[str, str] = {}  # a regather all-gather's result → its source
    inner: dict[str, object] = {}  # value made here inside recompute group k (or co-shard chunk) → k
    fwd: list[Task] = []
    kept_stage: dict[str, int | None] = {}
    _zero3_units(ctx, state)
    for idx, ins in enumerate(prog.instrs):
        mark = len(fwd)
        if isinstance(ins, Compute) and ins.aux:
            refs = state.refs_of[idx] = ins.reads()
            _first_reads(ctx, state, refs, idx, fwd)
            if ins.fn == "aten.narrow.default" and refs and refs[0] in params:
                state.views[ins.outputs[0]] = refs[0]
            base = _aux(ctx, ins, refs, nbytes, root, inner)
            if base is not None and base not in not_act:
                kept[base] = nbytes.get(base, 0.0)
                kept_stage.setdefault(base, ctx.stage_of.get(ins.node))
            fwd.append(Task(LOCAL, f"{ins.node} ({ins.fn})", tuple(refs), ins.outputs))
        elif isinstance(ins, Compute):
            cost = ctx.costs[ins.node]
            refs = state.refs_of[idx] = ins.reads()
            _first_reads(ctx, state, refs, idx, fwd)
            for o, b in zip(ins.outputs, cost.out_bytes):
                nbytes[o] = b

            _storages(ctx, ins, refs, root, strided)
            sv, node = ctx.saves[ins.node], ctx.nodes[ins.node]
            group = ("co-shard", *ins.chunk) if ins.chunk is not None else ctx.group_of.get(ins.node)
            if group is not None:  # made here inside the group: recomputed, not kept
                inner.update((o, group) for o in ins.outputs)
            pos = refs if len(refs) == len(node.input_refs()) else []
            saved = [pos[i] for i in sv.inputs if i < len(pos)] + [
                ins.outputs[i] for i in sv.outputs if i < len(ins.outputs)] if cost.grad else []
            for v in saved:  # autograd saves nothing for an op with no gradient
                base = root.get(v, v)
                if group is not None and inner.get(v) == group:
                    continue  # recomputed in backward: only the group's inputs are kept
                if base in shard_of:  # saved as the shard, gathered again before backward
                    state.regather_readers.setdefault(idx, []).append(base)
                    base = root.get(shard_of[base], shard_of[base])
                if v not in not_act and base not in not_act:
                    kept[base] = nbytes.get(base, 0.0)
                    kept_stage.setdefault(base, ctx.stage_of.get(ins.node))
            if sv.extra and cost.out_bytes and group is None and cost.grad:
                foot.activations += int(sv.extra * cost.out_bytes[0])
            free = cost.fwd == 0.0
            if not free and cost.grad:  # one micro-batch's output at a time in a pipeline
                foot.temporaries = max(foot.temporaries,
                                       2 * max(cost.out_bytes, default=0) // micro)
            fwd.append(Task(LOCAL if free else COMPUTE, ins.node, tuple(refs), ins.outputs, cost.fwd))
        elif isinstance(ins, Comm):
            if ins.src in params:
                state.first_reader.setdefault(ins.src, idx)
            k = ctx.group_of.get(ins.consumer)
            if k is not None and inner.get(ins.src) == k:
                # made here inside the group's recompute run (codegen/recompute.py) from
                # a value of the run: run again in backward, not kept
                inner[ins.dst] = k
            fwd.append(_comm(ctx, ins, r, nbytes))
            if fwd[-1].kind == LOCAL:  # a local slice or an identity: same storage
                root[ins.dst] = root.get(ins.src, ins.src)
            elif getattr(ins.step, "regather", False):
                shard_of[ins.dst] = ins.src
                state.regather[ins.dst] = (ins.step, nbytes[ins.dst], ins.value)
                # backward holds two gathered again at most (runtime/regather.py), one
                # micro-batch's each
                foot.temporaries = max(foot.temporaries, int(2 * nbytes[ins.dst]) // micro)
        _tag(ctx, fwd, mark, ins, r, nbytes, foot)
    foot.activations += int(sum(kept.values()))
    for base, st in kept_stage.items():
        if st is not None:
            foot.stage_activations[st] = foot.stage_activations.get(st, 0) + int(kept[base])
    foot.n_fwd = len(fwd)
    foot.held = foot.temporaries
    return fwd, state


def _first_reads(ctx: StepContext, state: RankForward, refs: list[str], idx: int,
                 fwd: list[Task]) -> None:
    """Parameters ``refs`` reads for the first time: their first reader, and under ZeRO-3
    the gather of their unit."""
    params, foot, nbytes = state.params, state.foot, state.nbytes
    for p in refs:
        if p in params and p not in state.first_reader:
            state.first_reader[p] = idx
            if p in state.unit_of and state.unit_of[p] not in foot.gathered:
                u = state.unit_of[p]
                foot.gathered.append(u)
                grp = mine(params[p].grad_groups, state.prog.rank)
                size = sum(nbytes[q] for q in state.members[u])
                # The unit in use and the next one, prefetched.
                foot.temporaries = max(foot.temporaries, int(2 * size))
                fwd.append(Task(COMM, f"all_gather unit {u} ({params[p].path}...)", (),
                                tuple(state.members[u]),
                                ctx.comm(Collective.ALL_GATHER, size, grp),
                                Rendezvous(Meet.UNIT_FORWARD, u, grp), ctx.meet_of(grp)))


def _aux(ctx: StepContext, ins: Compute, refs: list[str], nbytes: dict[str, float],
         root: dict[str, str], inner: dict[str, object]) -> str | None:
    """A step lowering adds around a node's call (``Compute.aux``): its output's bytes and
    storage, and the value it keeps for backward (or None). Co-shard's slice of an outside
    value is a view of it, and the chunk keeps that value for its recompute (checkpoint
    keeps its inputs); sums and joins of pieces make a new tensor of their pieces' size; a
    rescale, of its input's."""
    if not refs:
        return None
    src = refs[0]
    if ins.fn == "aten.narrow.default":
        out = ins.outputs[0]
        nbytes[out] = nbytes.get(src, 0.0) / ctx.coshard.get(ins.node, 1)
        root[out] = root.get(src, src)
        if ins.chunk is None:
            return None
        inner[out] = ("co-shard", *ins.chunk)
        return None if src in inner else root.get(src, src)
    size = sum(nbytes.get(r, 0.0) for r in refs) if ins.fn == "aten.cat.default" else nbytes.get(src, 0.0)
    for o in ins.outputs:
        nbytes[o] = size
    return None


def _zero3_units(ctx: StepContext, state: RankForward) -> None:
    """ZeRO-3: the rank's owned parameters in units (:mod:`torchweave.lower.units`)."""
    if ctx.plan.zero < 3:
        return
    owned = [s for s in read_order(state.prog)
             if s.local in state.params and state.params[s.local].grad_groups]
    numel = [math.prod(b - a for a, b in s.box) for s in owned]
    for u, idx in enumerate(group_units([unit_key(s.path) for s in owned], [4 * n for n in numel])):
        state.members[u] = [owned[i].local for i in idx]
        state.unit_of.update((owned[i].local, u) for i in idx)


def _tag(ctx: StepContext, tasks: list[Task], mark: int, ins, r: int, nbytes,
         foot: Footprint) -> None:
    """Stage and block of the tasks made for ``ins``; a transfer's bytes count into the
    boundary of the stage that receives it. Work a micro-batch does not split counts once
    a micro-batch (:meth:`StepContext.per_micro`)."""
    stage, crossing = ctx.stage(ins)
    m = ctx.per_micro(ins)
    if crossing and any(t.dst == r for t in ins.step.transfers):
        into = ctx.stage_of.get(ins.consumer)
        if into is not None:
            foot.boundary[into] = foot.boundary.get(into, 0.0) + m * nbytes.get(ins.dst, 0.0)
    block = ctx.block(ins)
    for t in tasks[mark:]:
        t.stage, t.crossing, t.block = stage, crossing, block
        if stage is not None:
            t.dur *= m
            t.latency *= m


def _storages(ctx: StepContext, ins: Compute, refs: list[str], root: dict[str, str],
              strided: set[str]) -> None:
    """Record which of ``ins``'s outputs share an input's storage."""
    op = packet(ctx.nodes[ins.node])
    if not refs:
        return
    src = refs[0]
    alias = op in ALIAS_OPS or (op == "reshape" and src not in strided)
    if op == "to":  # returns its input when the dtype does not change
        g = ctx.graph.values
        alias = all(o in g and src in g and g[o].meta.dtype == g[src].meta.dtype
                    for o in ins.outputs)
    if alias:
        for o in ins.outputs:
            root[o] = root.get(src, src)
            if op in STRIDING_OPS or src in strided:
                strided.add(o)


def _comm(ctx: StepContext, ins: Comm, r: int, nbytes: dict[str, float]) -> Task:
    step, b = ins.step, nbytes.get(ins.src, 0.0)
    name = f"{steps.name_of(step)} {ins.value}"
    waits, sets = tuple(ins.reads()), (ins.dst,)
    if isinstance(step, steps.Narrow):
        box = dict(step.boxes).get(r)
        nbytes[ins.dst] = (math.prod(hi - lo for lo, hi in box) * ctx.itemsize(ins.value)
                           if box else b)
        if ctx.meet is not None or ctx.resized:  # the reduced plan's box: size it by ``plan``
            nbytes[ins.dst] = ctx.need_bytes(ins.consumer, ins.value, nbytes[ins.dst])
        return Task(LOCAL, name, waits, sets)
    if isinstance(step, steps.P2P):
        shape = dict(step.shapes).get(r)
        nbytes[ins.dst] = math.prod(shape) * ctx.itemsize(ins.value) if shape is not None else b
        if ctx.resized:
            nbytes[ins.dst] = ctx.need_bytes(ins.consumer, ins.value, nbytes[ins.dst])
        return Task(COMM, name, waits, sets, ctx.p2p(step.transfers, r, ins.value, ctx.times(ins)),
                    latency=ctx.p2p_latency(ins, step.transfers, r))
    grp = mine(step.groups, r)
    out = nbytes[ins.dst] = step.out_bytes(b, len(grp))
    coll = step.forward_collective()
    if coll is None:  # Split and GradAllReduce move nothing forward
        return Task(LOCAL, name, waits, sets)
    size = step.forward_bytes(b, out)
    coll = Collective(coll)
    return Task(COMM, name, waits, sets, ctx.comm_of(ins, coll, size, grp),
                Rendezvous(Meet.FORWARD, ins.dst, grp), ctx.meet_of(grp),
                latency=ctx.latency(ins, coll, size, grp))


__all__ = ["forward"]

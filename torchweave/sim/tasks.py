"""Programs → per-rank task lists for :mod:`torchweave.sim.engine`.

One training step per rank:

1. **forward**: the Program's instructions in order. A compute instruction is
   its node's roofline time scaled by the piece's share of the work (the
   product of ``1/parts`` over split transforms; replicas do the full work).
   A communication step is a collective over the group that holds the rank.
   ZeRO-3 gathers each parameter before its first reader.
2. **backward**: the instructions in reverse, with ``bwd`` times and each
   step's backward dual (``lower/steps.py``); integer tensors carry no
   gradient. The gradient sync of each parameter (its ``grad_groups``) joins a
   bucket once the backward of its first reader is done, DDP-style; a full
   bucket is all-reduced (reduce-scattered under ZeRO-2/3) on the comm stream,
   overlapping the rest of the backward.
3. **optimizer**: AdamW, memory-bound, after every gradient sync; ZeRO-1/2
   all-gather the updated shards afterwards.

Steps 2 and 3 are in :mod:`torchweave.sim.backward`. Compute times come from
the roofline (:mod:`torchweave.sim.cost`) or, where a node's piece was timed,
from :mod:`torchweave.sim.profile`. Pipelined plans: each task carries its
stage (:mod:`torchweave.sim.pipelined` reads them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.pieces import tensor_box
from torchweave.lower.program import Comm, Compute, LocalRef, Program
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.sim.cluster import Cluster
from torchweave.sim.comm import Collective, collective_time
from torchweave.sim.cost import ComputeModel, dtype_of, op_time
from torchweave.sim.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.profile import OpProfiles, first_piece, op_key, sync_key
from torchweave.sim.units import units
from torchweave.sim.saved import ALIAS_OPS, STRIDING_OPS, Saves, packet, saves



@dataclass(frozen=True)
class NodeCost:
    fwd: float
    bwd: float
    out_bytes: tuple[int, ...]
    """Local bytes of each output on a rank that runs a piece."""
    grad: bool
    """Whether any output is floating (carries a gradient)."""
    model_flops: float
    """Forward and backward FLOPs of the whole node."""


@dataclass
class Footprint:
    """What one rank's step allocates, besides the model state (bytes)."""

    params: int = 0
    """Parameter elements held."""
    stage_activations: dict[int, int] = field(default_factory=dict)
    """Pipelined plans: activation bytes by stage (for the whole batch)."""
    boundary: dict[int, float] = field(default_factory=dict)
    """Pipelined plans: bytes received into each stage from other stage groups."""
    n_fwd: int = 0
    """How many of the rank's tasks are forward (the rest: backward, sync, optimizer)."""
    gathered: list[int] = field(default_factory=list)
    """ZeRO-3: units in the order forward gathers them."""
    buffers: int = 0
    activations: int = 0
    temporaries: int = 0
    """The largest of what ``held`` counts and the gradient buckets."""
    held: int = 0
    """Forward's temporaries: twice the largest activation (one micro-batch's, in a
    pipeline), two ZeRO-3 units."""
    bucket: int = 0
    """The largest gradient bucket."""
    grad_order: list[tuple[str, tuple[int, ...], float]] = field(default_factory=list)
    """(parameter, group, bytes) in the order backward reaches each gradient sum."""


@dataclass
class Builder:
    graph: Graph
    plan: Plan
    cluster: Cluster
    dtype: torch.dtype | None
    model: ComputeModel
    bucket_bytes: int
    profiles: OpProfiles | None = None
    """Measured op times (``sim/profile.py``), used in place of the roofline where present."""
    meet: frozenset[int] | None = None
    """The ranks simulated, when only one data-parallel replica is (``sim/symmetry.py``):
    a collective meets among these members of its group; None: every rank."""
    resized: bool = False
    """The Programs are a reduced plan's (fewer data-parallel replicas): local slices and
    point-to-point receives are sized by ``plan``'s pieces instead (``meet`` implies it)."""
    block_of: dict[str, int] = field(default_factory=dict)
    """Node → the repeated block it is in (``sim/fold.py``), for :mod:`torchweave.sim.folded`;
    tasks carry it (``Task.block``)."""
    costs: dict[str, NodeCost] = field(default_factory=dict)
    saves: dict[str, Saves] = field(default_factory=dict)
    _comm_cache: dict = field(default_factory=dict)
    _first: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._paths = {path: v.name for v in self.graph.values.values()
                       if v.kind in ("param", "buffer") for path in (v.target, *v.aliases)}
        self._nodes = {node.name: node for node in self.graph.nodes}
        pipe = self.plan.pipeline
        self.stage_of: dict[str, int] = dict(pipe.stage_of) if pipe is not None else {}
        self.group_of = {n: k for k, grp in enumerate(self.plan.recompute) for n in grp}
        """Node → its recompute group's index (``Plan.recompute``)."""
        for node in self.graph.nodes:
            self.costs[node.name] = self._node_cost(node)
            self.saves[node.name] = saves(self.graph, node)

    # ---------------------------------------------------------------- sizes
    def itemsize(self, value: str) -> int:
        dt = self.graph.values[value].meta.dtype
        if self.dtype is not None and dt.is_floating_point:
            return self.dtype.itemsize
        return dt.itemsize

    def _node_cost(self, node) -> NodeCost:
        op = info(self.graph, node)
        dt = dtype_of(self.graph, node)
        if self.dtype is not None and dt.is_floating_point:
            op = replace(op, bytes=int(op.bytes * self.dtype.itemsize / dt.itemsize))
            dt = self.dtype
        t = op_time(op, self.cluster.device, dtype=dt, model=self.model)
        frac = 1.0 / math.prod(tr.parts for tr in self.plan.transforms(node.name) if tr.dim)
        specs = op.bound.annotation.outputs
        piece = first_piece(self.plan, node.name)
        self._first[node.name] = (op.bound, piece)
        out = []
        for i, name in enumerate(node.outputs):
            meta = self.graph.values[name].meta
            if piece is not None and i < len(specs):
                numel = math.prod(b - a for a, b in tensor_box(op.bound, specs[i], meta.shape, piece))
            else:
                numel = meta.numel
            out.append(numel * self.itemsize(name))
        grad = any(self.graph.values[o].meta.dtype.is_floating_point for o in node.outputs)
        fwd, bwd = t.fwd * frac, t.bwd * frac
        if self.profiles is not None:
            hit = self.profiles.lookup(op_key(self.graph, node, piece, self.dtype) or "")
            if hit is not None:
                fwd, bwd = hit
        if node.name in self.group_of:
            bwd += fwd  # its forward runs again before its backward
        return NodeCost(fwd, bwd if grad else 0.0, tuple(out), grad, op.flops + op.bwd_flops)

    def comm(self, collective: Collective, nbytes: float, group: tuple[int, ...]) -> float:
        key = (collective, int(nbytes), group)
        if key not in self._comm_cache:
            t = collective_time(self.cluster, collective, int(nbytes), group).seconds
            if self.profiles is not None and len(group) > 1:  # ranks arriving out of step
                t += (self.profiles.lookup(sync_key(len(group))) or (0.0,))[0]
            self._comm_cache[key] = t
        return self._comm_cache[key]

    # ---------------------------------------------------------------- one rank
    def tasks(self, prog: Program) -> tuple[list[Task], Footprint]:
        """One rank's step: forward, backward, gradient sums, optimizer."""
        from torchweave.sim.backward import place_syncs

        tasks, foot, inputs = self.unsynced(prog)
        return place_syncs(self, tasks, foot, inputs, prog.rank), foot

    def unsynced(self, prog: Program):
        """Forward and backward, with markers where gradient sums may start
        (``sim/backward.py``): tasks, footprint and what ``place_syncs`` needs."""
        r, g = prog.rank, self.graph
        nbytes: dict[str, float] = {}
        foot = Footprint()
        params = {}
        for s in prog.params:
            n = math.prod(b - a for a, b in s.box)
            value = self._paths.get(s.path)
            nbytes[s.local] = n * (self.itemsize(value) if value else 4)
            if s.is_buffer:
                foot.buffers += int(nbytes[s.local])
            else:
                foot.params += n
                if s.requires_grad:
                    params[s.local] = s
        for s in prog.inputs:
            nbytes[s.local] = g.values[s.local].meta.nbytes if s.local in g.values else 0
        zero = self.plan.zero
        micro = self.plan.pipeline.micro_batches if self.plan.pipeline is not None else 1
        # Activations: distinct storages that some op saves for backward (saved.py).
        # ``root`` maps a value to the value owning its storage; ``strided`` holds
        # non-contiguous views (a reshape of one copies).
        not_act = {s.local for s in prog.params if not s.is_buffer}
        root: dict[str, str] = {}
        strided: set[str] = set()
        kept: dict[str, float] = {}
        inner: dict[str, int] = {}  # value made here inside recompute group k → k
        fwd: list[Task] = []
        first_reader: dict[str, int] = {}
        refs_of: dict[int, list[str]] = {}
        kept_stage: dict[str, int] = {}
        owned = {p: s for p, s in params.items() if s.grad_groups} if zero >= 3 else {}
        unit_of = units(prog, owned, {p: math.prod(b - a for a, b in s.box) for p, s in owned.items()})
        members: dict[int, list[str]] = {}
        for p, u in unit_of.items():
            members.setdefault(u, []).append(p)
        for idx, ins in enumerate(prog.instrs):
            mark = len(fwd)
            if isinstance(ins, Compute):
                cost = self.costs[ins.node]
                refs = refs_of[idx] = _refs(ins)
                for p in refs:
                    if p in params and p not in first_reader:
                        first_reader[p] = idx
                        if p in unit_of and unit_of[p] not in foot.gathered:
                            u = unit_of[p]
                            foot.gathered.append(u)
                            grp = _mine(params[p].grad_groups, r)
                            size = sum(nbytes[q] for q in members[u])
                            # The unit in use and the next one, prefetched.
                            foot.temporaries = max(foot.temporaries, int(2 * size))
                            fwd.append(Task(COMM, f"all_gather unit {u} ({params[p].path}...)", (),
                                            tuple(members[u]),
                                            self.comm(Collective.ALL_GATHER, size, grp),
                                            ("zf", u, grp), self._meet(grp)))
                for o, b in zip(ins.outputs, cost.out_bytes):
                    nbytes[o] = b

                self._storages(ins, refs, root, strided)
                sv, node = self.saves[ins.node], self._nodes[ins.node]
                group = self.group_of.get(ins.node)
                if group is not None:  # made here inside the group: recomputed, not kept
                    inner.update((o, group) for o in ins.outputs)
                pos = refs if len(refs) == len(node.input_refs()) else []
                for v in [pos[i] for i in sv.inputs if i < len(pos)] + [
                        ins.outputs[i] for i in sv.outputs if i < len(ins.outputs)]:
                    base = root.get(v, v)
                    if group is not None and inner.get(v) == group:
                        continue  # recomputed in backward: only the group's inputs are kept
                    if v not in not_act and base not in not_act:
                        kept[base] = nbytes.get(base, 0.0)
                        kept_stage.setdefault(base, self.stage_of.get(ins.node, -1))
                if sv.extra and cost.out_bytes and group is None:
                    foot.activations += int(sv.extra * cost.out_bytes[0])
                free = cost.fwd == 0.0
                if not free and cost.grad:  # one micro-batch's output at a time in a pipeline
                    foot.temporaries = max(foot.temporaries,
                                           2 * max(cost.out_bytes, default=0) // micro)
                fwd.append(Task(LOCAL if free else COMPUTE, ins.node, tuple(refs), ins.outputs, cost.fwd))
            elif isinstance(ins, Comm):
                if ins.src in params:
                    first_reader.setdefault(ins.src, idx)
                k = self.group_of.get(ins.consumer)
                if k is not None and inner.get(ins.src) == k:
                    # made here inside the group's recompute run (codegen/recompute.py) from
                    # a value of the run: run again in backward, not kept
                    inner[ins.dst] = k
                fwd.append(self._comm_fwd(ins, r, nbytes))
                if fwd[-1].kind == LOCAL:  # a local slice or an identity: same storage
                    root[ins.dst] = root.get(ins.src, ins.src)
            self._tag(fwd, mark, ins, r, nbytes, foot)
        foot.activations += int(sum(kept.values()))
        for base, st in kept_stage.items():
            foot.stage_activations[st] = foot.stage_activations.get(st, 0) + int(kept[base])
        foot.n_fwd = len(fwd)
        foot.held = foot.temporaries
        from torchweave.sim.backward import SyncInputs, backward_tasks

        tasks = fwd + backward_tasks(self, prog, params, first_reader, refs_of, nbytes, foot,
                                     unit_of, members)
        return tasks, foot, SyncInputs(params, {p: nbytes[p] for p in params})

    def _stage(self, ins) -> int:
        """Pipelined plans: the stage an instruction belongs to (-2: a transfer between
        stage groups; -1: no pipeline)."""
        if not self.stage_of or not isinstance(ins, (Compute, Comm)):
            return -1
        stage = self.stage_of.get(ins.node if isinstance(ins, Compute) else ins.consumer, -1)
        if isinstance(ins, Comm) and isinstance(ins.step, steps.P2P) and stage >= 0:
            pipe = self.plan.pipeline
            if not steps.devices_of(ins.step) <= set(pipe.devices_of_stage(stage)):
                return -2
        return stage

    def _block(self, ins) -> int:
        """The repeated block an instruction belongs to (-1: none, or not asked)."""
        if not self.block_of or not isinstance(ins, (Compute, Comm)):
            return -1
        return self.block_of.get(ins.node if isinstance(ins, Compute) else ins.consumer, -1)

    def _tag(self, tasks: list[Task], mark: int, ins, r: int, nbytes, foot: Footprint) -> None:
        """Stage of the tasks made for ``ins``; a transfer's bytes count into the boundary
        of the stage that receives it."""
        stage = self._stage(ins)
        if stage == -2 and any(t.dst == r for t in ins.step.transfers):
            into = self.stage_of.get(ins.consumer, -1)
            foot.boundary[into] = foot.boundary.get(into, 0.0) + nbytes.get(ins.dst, 0.0)
        block = self._block(ins)
        for t in tasks[mark:]:
            t.stage, t.block = stage, block

    def _storages(self, ins: Compute, refs: list[str], root: dict[str, str],
                  strided: set[str]) -> None:
        """Record which of ``ins``'s outputs share an input's storage."""
        op = packet(self._nodes[ins.node])
        if not refs:
            return
        src = refs[0]
        alias = op in ALIAS_OPS or (op == "reshape" and src not in strided)
        if op == "to":  # returns its input when the dtype does not change
            g = self.graph.values
            alias = all(o in g and src in g and g[o].meta.dtype == g[src].meta.dtype
                        for o in ins.outputs)
        if alias:
            for o in ins.outputs:
                root[o] = root.get(src, src)
                if op in STRIDING_OPS or src in strided:
                    strided.add(o)

    def _comm_fwd(self, ins: Comm, r: int, nbytes: dict[str, float]) -> Task:
        step, b = ins.step, nbytes.get(ins.src, 0.0)
        name = f"{steps.name_of(step)} {ins.value}"
        waits, sets = (ins.src,), (ins.dst,)
        if isinstance(step, steps.Narrow):
            box = dict(step.boxes).get(r)
            nbytes[ins.dst] = (math.prod(hi - lo for lo, hi in box) * self.itemsize(ins.value)
                               if box else b)
            if self.meet is not None or self.resized:  # the reduced plan's box: size it by ``plan``
                nbytes[ins.dst] = self._need_bytes(ins.consumer, ins.value, nbytes[ins.dst])
            return Task(LOCAL, name, waits, sets)
        if isinstance(step, steps.P2P):
            shape = dict(step.shapes).get(r)
            nbytes[ins.dst] = math.prod(shape) * self.itemsize(ins.value) if shape is not None else b
            if self.resized:
                nbytes[ins.dst] = self._need_bytes(ins.consumer, ins.value, nbytes[ins.dst])
            return Task(COMM, name, waits, sets, self._p2p(step.transfers, r, ins.value))
        grp = _mine(step.groups, r)
        p = len(grp)
        coll = {steps.AllReduce: Collective.ALL_REDUCE, steps.GradAllReduce: None,
                steps.AllGather: Collective.ALL_GATHER, steps.ReduceScatter: Collective.REDUCE_SCATTER,
                steps.AllToAll: Collective.ALL_TO_ALL, steps.Split: None}[type(step)]
        out = b * p if isinstance(step, steps.AllGather) else (
            b / p if isinstance(step, (steps.ReduceScatter, steps.Split)) else b)
        nbytes[ins.dst] = out
        if coll is None:  # Split and GradAllReduce move nothing forward
            return Task(LOCAL, name, waits, sets)
        size = out if coll is Collective.ALL_GATHER else b
        return Task(COMM, name, waits, sets, self.comm(coll, size, grp), ("f", ins.dst, grp),
                    self._meet(grp))

    def _need_bytes(self, consumer: str, value: str, default: float) -> float:
        """Bytes of ``value`` that ``consumer``'s first piece reads, under the full plan."""
        bound, piece = self._first.get(consumer, (None, None))
        if piece is None:
            return default
        node = self._nodes[consumer]
        for ref, spec in zip(node.input_refs(), bound.annotation.inputs):
            if ref.name == value:
                shape = self.graph.values[value].meta.shape
                return math.prod(b - a for a, b in tensor_box(bound, spec, shape, piece)) * self.itemsize(value)
        return default

    def _meet(self, grp: tuple[int, ...]) -> tuple[int, ...]:
        """The members of ``grp`` a collective waits for in the engine."""
        return grp if self.meet is None else tuple(m for m in grp if m in self.meet)

    def _p2p(self, transfers, r: int, value: str) -> float:
        t = 0.0
        for tr in transfers:
            if r in (tr.src, tr.dst) and tr.src != tr.dst:
                n = math.prod(hi - lo for lo, hi in tr.src_box) * self.itemsize(value)
                t += self.comm(Collective.P2P, n, (tr.src, tr.dst))
        return t


def _refs(ins: Compute) -> list[str]:
    out: list[str] = []

    def walk(x) -> None:
        if isinstance(x, LocalRef):
            out.append(x.name)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(ins.args)
    walk(ins.kwargs)
    return out


def _mine(groups, rank: int) -> tuple[int, ...]:
    for grp in groups:
        if rank in grp:
            return tuple(grp)
    return (rank,)

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.pieces import PieceInfo, tensor_box
from torchweave.lower.program import Comm, Compute, LocalRef, Program
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.sim.cluster import Cluster
from torchweave.sim.comm import Collective, collective_time
from torchweave.sim.cost import ComputeModel, dtype_of, op_time
from torchweave.sim.engine import COMM, COMPUTE, LOCAL, Task
from torchweave.sim.saved import ALIAS_OPS, STRIDING_OPS, Saves, packet, saves

_DUAL = {  # forward step → collective its backward runs (None: local)
    steps.Split: Collective.ALL_GATHER, steps.ReduceScatter: Collective.ALL_GATHER,
    steps.GradAllReduce: Collective.ALL_REDUCE, steps.AllToAll: Collective.ALL_TO_ALL,
}


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
    buffers: int = 0
    activations: int = 0
    temporaries: int = 0


@dataclass
class Builder:
    graph: Graph
    plan: Plan
    cluster: Cluster
    dtype: torch.dtype | None
    model: ComputeModel
    bucket_bytes: int
    meet: frozenset[int] | None = None
    """The ranks simulated, when only one data-parallel replica is (``sim/symmetry.py``):
    a collective meets among these members of its group; None: every rank."""
    costs: dict[str, NodeCost] = field(default_factory=dict)
    saves: dict[str, Saves] = field(default_factory=dict)
    _comm_cache: dict = field(default_factory=dict)
    _first: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._paths = {path: v.name for v in self.graph.values.values()
                       if v.kind in ("param", "buffer") for path in (v.target, *v.aliases)}
        self._nodes = {node.name: node for node in self.graph.nodes}
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
        piece = _first_piece(self.plan, node.name)
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
        return NodeCost(t.fwd * frac, t.bwd * frac if grad else 0.0, tuple(out), grad,
                        op.flops + op.bwd_flops)

    def comm(self, collective: Collective, nbytes: float, group: tuple[int, ...]) -> float:
        key = (collective, int(nbytes), group)
        if key not in self._comm_cache:
            self._comm_cache[key] = collective_time(self.cluster, collective, int(nbytes), group).seconds
        return self._comm_cache[key]

    # ---------------------------------------------------------------- one rank
    def tasks(self, prog: Program) -> tuple[list[Task], Footprint]:
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
        # Activations: distinct storages that some op saves for backward (saved.py).
        # ``root`` maps a value to the value owning its storage; ``strided`` holds
        # non-contiguous views (a reshape of one copies).
        not_act = {s.local for s in prog.params if not s.is_buffer}
        root: dict[str, str] = {}
        strided: set[str] = set()
        kept: dict[str, float] = {}
        fwd: list[Task] = []
        first_reader: dict[str, int] = {}
        refs_of: dict[int, list[str]] = {}
        for idx, ins in enumerate(prog.instrs):
            if isinstance(ins, Compute):
                cost = self.costs[ins.node]
                refs = refs_of[idx] = _refs(ins)
                for p in refs:
                    if p in params and p not in first_reader:
                        first_reader[p] = idx
                        if zero >= 3 and params[p].grad_groups:
                            grp = _mine(params[p].grad_groups, r)
                            fwd.append(Task(COMM, f"all_gather {params[p].path}", (), (p,),
                                            self.comm(Collective.ALL_GATHER, nbytes[p], grp),
                                            ("zf", p, grp), self._meet(grp)))
                for o, b in zip(ins.outputs, cost.out_bytes):
                    nbytes[o] = b
                self._storages(ins, refs, root, strided)
                sv, node = self.saves[ins.node], self._nodes[ins.node]
                pos = refs if len(refs) == len(node.input_refs()) else []
                for v in [pos[i] for i in sv.inputs if i < len(pos)] + [
                        ins.outputs[i] for i in sv.outputs if i < len(ins.outputs)]:
                    base = root.get(v, v)
                    if v not in not_act and base not in not_act:
                        kept[base] = nbytes.get(base, 0.0)
                if sv.extra and cost.out_bytes:
                    foot.activations += int(sv.extra * cost.out_bytes[0])
                free = cost.fwd == 0.0
                if not free and cost.grad:
                    foot.temporaries = max(foot.temporaries, 2 * max(cost.out_bytes, default=0))
                fwd.append(Task(LOCAL if free else COMPUTE, ins.node, tuple(refs), ins.outputs, cost.fwd))
            elif isinstance(ins, Comm):
                if ins.src in params:
                    first_reader.setdefault(ins.src, idx)
                fwd.append(self._comm_fwd(ins, r, nbytes))
                if fwd[-1].kind == LOCAL:  # a local slice or an identity: same storage
                    root[ins.dst] = root.get(ins.src, ins.src)
        foot.activations += int(sum(kept.values()))
        tasks = fwd + self._backward(prog, params, first_reader, refs_of, nbytes, foot)
        return tasks, foot

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
            if self.meet is not None:  # boxes are the reduced plan's: size it by the full plan
                nbytes[ins.dst] = self._need_bytes(ins.consumer, ins.value, nbytes[ins.dst])
            return Task(LOCAL, name, waits, sets)
        if isinstance(step, steps.P2P):
            shape = dict(step.shapes).get(r)
            nbytes[ins.dst] = math.prod(shape) * self.itemsize(ins.value) if shape is not None else b
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

    def _backward(self, prog: Program, params, first_reader, refs_of, nbytes,
                  foot: Footprint) -> list[Task]:
        r, zero, out = prog.rank, self.plan.zero, []
        # ZeRO-1/2 reduce every owned gradient in one collective after backward
        # (runtime/zero.py ``finish_grads``); plain data parallel and ZeRO-3 in buckets.
        cap = math.inf if zero in (1, 2) else self.bucket_bytes
        buckets: dict[tuple, list[str]] = {}
        fill: dict[tuple, float] = {}
        count: dict[tuple, int] = {}
        synced: list[str] = []
        gathered: set[str] = set()

        def flush(grp: tuple) -> None:
            names = buckets.pop(grp, [])
            if not names:
                return
            coll = Collective.REDUCE_SCATTER if zero >= 2 else Collective.ALL_REDUCE
            n = count[grp] = count.get(grp, 0) + 1
            size = fill.pop(grp)
            foot.temporaries = max(foot.temporaries, int(size))
            tag = f"grad sync {n}"
            out.append(Task(COMM, f"{coll.value} grads #{n} ({len(names)} params)",
                            tuple("g:" + p for p in names), (tag,), self.comm(coll, size, grp),
                            ("g", n, grp), self._meet(grp)))
            synced.append(tag)

        def reached(p: str, idx: int) -> None:
            """The backward of ``p``'s first reader is issued: its gradient may sync."""
            if first_reader.get(p) != idx:
                return
            for grp in params[p].grad_groups:
                grp = _mine((grp,), r)
                buckets.setdefault(grp, []).append(p)
                fill[grp] = fill.get(grp, 0.0) + nbytes[p]
                if fill[grp] >= cap:
                    flush(grp)

        for idx in range(len(prog.instrs) - 1, -1, -1):
            ins = prog.instrs[idx]
            if isinstance(ins, Compute):
                cost = self.costs[ins.node]
                refs = refs_of[idx]
                if zero >= 3:
                    for p in refs:
                        if p in params and p not in gathered and params[p].grad_groups:
                            gathered.add(p)
                            grp = _mine(params[p].grad_groups, r)
                            out.append(Task(COMM, f"all_gather {params[p].path}", (), ("zb:" + p,),
                                            self.comm(Collective.ALL_GATHER, nbytes[p], grp),
                                            ("zb", p, grp), self._meet(grp)))
                if not cost.grad:
                    continue
                waits = tuple("g:" + o for o in ins.outputs) + tuple(
                    "zb:" + p for p in refs if p in gathered)
                out.append(Task(COMPUTE if cost.bwd else LOCAL, f"{ins.node} bwd", waits,
                                tuple("g:" + a for a in refs), cost.bwd))
                for p in refs:
                    reached(p, idx)
            elif isinstance(ins, Comm):
                out.append(self._comm_bwd(ins, r, nbytes))
                reached(ins.src, idx)
        for grp in list(buckets):
            flush(grp)
        local = sum(nbytes[p] for p in params)
        dp = max((len(_mine(s.grad_groups, r)) for s in params.values() if s.grad_groups), default=1)
        shard = local / dp if zero >= 1 else local
        bw = self.cluster.device.memory_bandwidth * self.model.bandwidth
        out.append(Task(COMPUTE, "optimizer (AdamW)", tuple(synced), ("opt",), 7 * shard / bw))
        if 1 <= zero <= 2 and dp > 1:
            grp = next(_mine(s.grad_groups, r) for s in params.values() if s.grad_groups)
            out.append(Task(COMM, "all_gather params", ("opt",), (),
                            self.comm(Collective.ALL_GATHER, local, grp), ("zp", grp), self._meet(grp)))
        return out

    def _comm_bwd(self, ins: Comm, r: int, nbytes) -> Task:
        step = ins.step
        name = f"{steps.name_of(step)} {ins.value} bwd"
        waits, sets = ("g:" + ins.dst,), ("g:" + ins.src,)
        if not self.graph.values[ins.value].meta.dtype.is_floating_point or isinstance(step, steps.Narrow):
            return Task(LOCAL, name, waits, sets)
        if isinstance(step, steps.P2P):
            return Task(COMM, name, waits, sets, self._p2p(step.grad_back, r, ins.value))
        coll = _DUAL.get(type(step))
        if isinstance(step, steps.AllReduce) and step.bwd == "all_reduce":
            coll = Collective.ALL_REDUCE
        if isinstance(step, steps.AllGather) and step.bwd == "reduce_scatter":
            coll = Collective.REDUCE_SCATTER
        if coll is None:
            return Task(LOCAL, name, waits, sets)
        grp = _mine(step.groups, r)
        # The dual of a split or reduce-scatter gathers the source's bytes; the others
        # move the destination's (the same, or the gathered tensor for a reduce-scatter).
        src = isinstance(step, (steps.Split, steps.ReduceScatter))
        size = nbytes.get(ins.src if src else ins.dst, 0.0)
        return Task(COMM, name, waits, sets, self.comm(coll, size, grp), ("b", ins.dst, grp),
                    self._meet(grp))


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


def _first_piece(plan: Plan, node: str) -> PieceInfo | None:
    """Piece ``(0, …, 0)`` of ``node`` (every piece of an even split has its size)."""
    devs = plan.assignment.get(node)
    if not devs:
        return None
    chunks: dict[str, tuple[int, int]] = {}
    for t in plan.transforms(node):
        if t.dim is not None:
            chunks[t.dim] = (0, chunks.get(t.dim, (0, 1))[1] * t.parts)
    return PieceInfo(tuple(0 for _ in plan.transforms(node)), chunks, 0, devs[0])


def _mine(groups, rank: int) -> tuple[int, ...]:
    for grp in groups:
        if rank in grp:
            return tuple(grp)
    return (rank,)

"""What every rank's step reads: the graph, the plan and the cluster, each node's cost,
and the cost of a collective (cached). :class:`~torchweave.sim.step.build.Builder`
is this plus the passes that make a rank's tasks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from torchweave.ir.graph import Graph
from torchweave.lower import steps
from torchweave.lower.coshard import coshard_key
from torchweave.lower.pieces import tensor_box
from torchweave.lower.program import Comm, Compute
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.hardware.compute import ComputeModel, dtype_of, op_time
from torchweave.sim.hardware.profile import OpProfiles, first_piece, op_key, sync_key
from torchweave.sim.step.saved import Saves, saves
from torchweave.sim.step.state import NodeCost


@dataclass
class StepContext:
    graph: Graph
    plan: Plan
    cluster: Cluster
    dtype: torch.dtype | None
    model: ComputeModel
    bucket_bytes: int
    profiles: OpProfiles | None = None
    """Measured op times (``sim/hardware/profile.py``), used in place of the roofline where present."""
    meet: frozenset[int] | None = None
    """The ranks simulated, when only one data-parallel replica is (``sim/fast/symmetry.py``):
    a collective meets among these members of its group; None: every rank."""
    resized: bool = False
    """The Programs are a reduced plan's (fewer data-parallel replicas): local slices and
    point-to-point receives are sized by ``plan``'s pieces instead (``meet`` implies it)."""
    block_of: dict[str, int] = field(default_factory=dict)
    """Node → the repeated block it is in (``sim/fast/fold.py``), for :mod:`torchweave.sim.fast.folded`;
    tasks carry it (``Task.block``)."""
    micro: int | None = None
    """The micro-batch count a stage's batch-free work repeats (:meth:`per_micro`), where the
    plan's is not the step's (:mod:`torchweave.sim.fast.stagefold`'s small schedules take a
    count their shape accepts); None: the plan's."""
    costs: dict[str, NodeCost] = field(default_factory=dict)
    saves: dict[str, Saves] = field(default_factory=dict)
    _comm_cache: dict = field(default_factory=dict)
    _first: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.paths = {path: v.name for v in self.graph.values.values()
                      if v.kind in ("param", "buffer") for path in (v.target, *v.aliases)}
        """Parameter or buffer path → its graph value."""
        self.nodes = {node.name: node for node in self.graph.nodes}
        pipe = self.plan.pipeline
        self.stage_of: dict[str, int] = dict(pipe.stage_of) if pipe is not None else {}
        self.group_of = {n: k for k, grp in enumerate(self.plan.recompute) for n in grp}
        """Node → its recompute group's index (``Plan.recompute``)."""
        self.coshard = {node.name: key[1] for node in self.graph.nodes
                        if (key := coshard_key(self.plan, node.name)) is not None}
        """Co-sharded node → its ``k`` (:mod:`torchweave.lower.coshard`): each chunk is run
        again before its backward, like a recompute group."""
        self.grads = self.graph.grad_values()
        """Values that carry a gradient (``Graph.grad_values``): only their ops and
        communication have a backward."""
        self.batched = self.graph.batched_values()
        """Values made from a graph input: a pipeline's micro-batches split their work."""
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
        grad = any(o in self.grads for o in node.outputs)
        fwd, bwd = t.fwd * frac, t.bwd * frac
        if self.profiles is not None:
            hit = self.profiles.lookup(op_key(self.graph, node, piece, self.dtype) or "")
            if hit is not None:
                fwd, bwd = hit
        if node.name in self.group_of or node.name in self.coshard:
            bwd += fwd  # its forward runs again before its backward
        return NodeCost(fwd, bwd if grad else 0.0, tuple(out), grad, op.flops + op.bwd_flops)

    def need_bytes(self, consumer: str, value: str, default: float) -> float:
        """Bytes of ``value`` that ``consumer``'s first piece reads, under the full plan."""
        bound, piece = self._first.get(consumer, (None, None))
        if piece is None:
            return default
        node = self.nodes[consumer]
        for ref, spec in zip(node.input_refs(), bound.annotation.inputs):
            if ref.name == value:
                shape = self.graph.values[value].meta.shape
                return math.prod(b - a for a, b in tensor_box(bound, spec, shape, piece)) * self.itemsize(value)
        return default

    # ---------------------------------------------------------------- communication
    def comm(self, collective: Collective, nbytes: float, group: tuple[int, ...]) -> float:
        key = (collective, int(nbytes), group)
        if key not in self._comm_cache:
            t = collective_time(self.cluster, collective, int(nbytes), group).seconds
            if self.profiles is not None and len(group) > 1:  # ranks arriving out of step:
                hit = self.profiles.lookup(sync_key(len(group)))  # measured, in place of the model
                if hit is not None:
                    t += hit[0] - self.cluster.device.collective_wait
            self._comm_cache[key] = t
        return self._comm_cache[key]

    def meet_of(self, grp: tuple[int, ...]) -> tuple[int, ...]:
        """The members of ``grp`` a collective waits for in the engine."""
        return grp if self.meet is None else tuple(m for m in grp if m in self.meet)

    def p2p(self, transfers, r: int, value: str, times: int = 1) -> float:
        """Seconds of ``r``'s share of ``transfers`` of ``value``, run ``times`` times over a
        ``1/times`` share of the bytes each (:meth:`times`)."""
        t = 0.0
        for tr in transfers:
            if r in (tr.src, tr.dst) and tr.src != tr.dst:
                n = math.prod(hi - lo for lo, hi in tr.src_box) * self.itemsize(value)
                t += times * self.comm(Collective.P2P, n / times, (tr.src, tr.dst))
        return t

    def comm_of(self, ins, collective: Collective, nbytes: float, group: tuple[int, ...]) -> float:
        """Seconds a step spends on ``ins``'s collective over ``nbytes`` (the whole batch's):
        :meth:`times` collectives of a share of the bytes each."""
        k = self.times(ins)
        return k * self.comm(collective, nbytes / k, group)

    def latency(self, ins, collective: Collective, nbytes: float, group: tuple[int, ...]) -> float:
        """Of :meth:`comm_of`, what does not shrink with the batch: each collective's latency
        (its cost for one byte) where ``ins`` moves a value the batch splits; the whole
        collective where it moves a batch-free one (:attr:`Task.latency`)."""
        return self.latency_of(ins.value, collective, nbytes, group, self.times(ins))

    def latency_of(self, value: str, collective: Collective, nbytes: float,
                   group: tuple[int, ...], times: int) -> float:
        """:meth:`latency` of ``times`` collectives of graph value ``value``. The latency is
        the collective's cost for one byte, which takes the cheapest algorithm at that size
        (a tree where a ring is cheaper for the whole): an approximation of the split."""
        if value not in self.batched:
            return self.comm(collective, nbytes, group)
        return times * self.comm(collective, 1, group)

    def p2p_latency(self, ins, transfers, r: int) -> float:
        """:meth:`latency` of ``r``'s share of point-to-point ``transfers``."""
        if ins.value not in self.batched:
            return self.p2p(transfers, r, ins.value)
        return self.times(ins) * sum(self.comm(Collective.P2P, 1, (tr.src, tr.dst)) for tr in transfers
                                     if r in (tr.src, tr.dst) and tr.src != tr.dst)

    def times(self, ins) -> int:
        """How many collectives a step runs for ``ins``, each over a ``1/times`` share of the
        bytes the whole batch's program moves: a pipelined plan lowers for the whole batch,
        but a stage's program runs once a micro-batch (``runtime/schedule_runner.py``), so a
        collective of a value the batch splits runs ``m`` times over a micro-batch's bytes
        and pays its latency each time. 1 outside a stage, between stages (the schedule
        costs a transfer each micro-batch) and for batch-free values (moved whole each
        micro-batch: :meth:`per_micro` counts those)."""
        if not isinstance(ins, Comm) or self.plan.pipeline is None:
            return 1
        stage, crossing = self.stage(ins)
        return 1 if crossing else self.repeats(stage, ins.value)

    def repeats(self, stage: int | None, value: str) -> int:
        """:meth:`times` of a collective of ``value`` in ``stage`` (None: no stage)."""
        pipe = self.plan.pipeline
        if pipe is None or stage is None or value not in self.batched:
            return 1
        return self.micro or pipe.micro_batches

    # ---------------------------------------------------------------- where a task belongs
    def stage(self, ins) -> tuple[int | None, bool]:
        """Pipelined plans: the stage an instruction belongs to (None: no stage), and
        whether it is a transfer between stage groups (then of no stage)."""
        if not self.stage_of or not isinstance(ins, (Compute, Comm)):
            return None, False
        stage = self.stage_of.get(ins.node if isinstance(ins, Compute) else ins.consumer)
        if stage is not None and isinstance(ins, Comm) and isinstance(ins.step, steps.P2P):
            pipe = self.plan.pipeline
            if not steps.devices_of(ins.step) <= set(pipe.devices_of_stage(stage)):
                return None, True
        return stage, False

    def per_micro(self, ins) -> int:
        """How many times a step pays ``ins``'s whole work: a pipelined plan lowers for the
        whole batch and a stage's cost is its tasks over the micro-batch count, which is right
        for what the batch splits. A value made from parameters and constants alone (T5's
        relative-position bias, rotary tables, a parameter itself) is made and moved whole
        with each micro-batch (``runtime/schedule_runner.py`` runs the stage's program once a
        micro-batch): its tasks count ``micro`` times. 1 outside a pipeline."""
        pipe = self.plan.pipeline
        if pipe is None or pipe.micro_batches == 1 or not isinstance(ins, (Compute, Comm)):
            return 1
        if isinstance(ins, Comm):
            made = ins.value in self.batched
        else:
            node = self.nodes.get(ins.node)
            made = node is None or any(o in self.batched for o in node.outputs if o)
        return 1 if made else (self.micro or pipe.micro_batches)

    def block(self, ins) -> int | None:
        """The repeated block an instruction belongs to (None: none, or not asked)."""
        if not self.block_of or not isinstance(ins, (Compute, Comm)):
            return None
        return self.block_of.get(ins.node if isinstance(ins, Compute) else ins.consumer)


__all__ = ["StepContext"]

"""The solver's priced problem (:mod:`torchweave.search.intra`): for ``tp`` devices of a
world, each op's choices on the ``tp`` axis (whole, or a dim its annotation splits) and
what each choice costs a step, from the cluster.

:class:`Model` prices an op under a choice (its compute, its parameters' gradient sums and
AdamW pass), an edge under its two ends' choices (the resharding forward and the gradient's
backward), and what a device holds (model state, kept outputs). The layouts are the
solver's small vocabulary: ``("R",)`` whole, ``("S", axis)`` split along an axis of the
tensor, ``("P",)`` partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph, Node
from torchweave.ops import OpInfo, info
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import propagate
from torchweave.policies.data import batch_inputs
from torchweave.search.constraints import OpRule
from torchweave.sim.hardware.cluster import Cluster
from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.hardware.compute import ComputeModel, dtype_of, op_time
from torchweave.sim.fast.fold import find_blocks
from torchweave.sim.hardware.memory import model_state_memory

WHOLE = None
"""The choice of running an op whole (replicated over ``tp``)."""


@dataclass(frozen=True)
class _Op:
    node: Node
    op: OpInfo
    choices: tuple[str | None, ...]
    compute: float
    """Forward + backward seconds of the whole op at the dp share of the batch."""


class Model:
    """The priced problem for one (graph, cluster, tp, dp)."""

    def __init__(self, graph: Graph, cluster: Cluster, tp: int, world: int, *,
                 dtype: torch.dtype | None, rules: tuple[OpRule, ...], batch: bool = True) -> None:
        if tp < 1 or world % tp:
            raise TorchweaveError(Problem(obj="partition search", value=f"tp={tp}",
                                          rule=f"tp divides the world ({world})"))
        dp = world // tp
        self.graph, self.cluster, self.tp, self.dp = graph, cluster, tp, dp
        precision = "bf16-mixed" if dtype in (torch.bfloat16, torch.float16) else "fp32"
        self.state_bytes = model_state_memory(1, precision=precision).total
        """Bytes one parameter costs a device: weights, gradient, AdamW state."""
        # AdamW reads and writes 7 fp32 words per parameter (as the simulator prices it)
        self.adam_s = 28 / (cluster.device.memory_bandwidth * ComputeModel.for_device(
            cluster.device).bandwidth)
        self.group = list(range(tp))
        self.dp_group = list(range(0, world, tp))
        # Gradients are summed in buckets (sim/backward.Buckets): seconds per byte at the
        # bucket's size, over the dp group or (a whole parameter under a split op) the world.
        self.grad_s = {False: self._coll(Collective.ALL_REDUCE, BUCKET_BYTES, self.dp_group)
                       / BUCKET_BYTES,
                       True: self._coll(Collective.ALL_REDUCE, BUCKET_BYTES, list(range(world)))
                       / BUCKET_BYTES}
        base = _batch_split(graph)
        blocks = find_blocks(graph, base, least=2, nested=False)
        self.rep: dict[str, str] = {n.name: n.name for n in graph.nodes}
        if blocks is not None:
            first, _ = blocks.spans[0]
            for start, end in blocks.spans[1:]:
                for i in range(start, end):
                    self.rep[graph.nodes[i].name] = graph.nodes[first + i - start].name
        self.count: dict[str, int] = {}
        """How many ops of the graph each representative stands for."""
        for name in self.rep.values():
            self.count[name] = self.count.get(name, 0) + 1
        self.producer = graph.producers()
        self.ops: dict[str, _Op] = {}
        self.batch: dict[str, set[str]] = {}
        """Each representative op's batch dims."""
        problems: list[Problem] = []
        for node in graph.nodes:
            if self.rep[node.name] != node.name:
                continue
            op = info(graph, node)
            self.batch[node.name] = {t.dim for t in base.transforms(node.name) if t.dim}
            choices, bad = _choices(node, op, tp, self.batch[node.name], world, rules, batch)
            if bad:
                problems.append(bad)
                continue
            t = op_time(op, cluster.device, dtype=dtype or dtype_of(graph, node))
            self.ops[node.name] = _Op(node, op, choices, (t.fwd + t.bwd) / dp)
        if problems:
            raise TorchweaveError(problems)

    # ------------------------------------------------------------ prices
    def _coll(self, kind: Collective, nbytes: float, group: list[int]) -> float:
        if nbytes <= 0 or len(group) < 2:
            return 0.0
        return collective_time(self.cluster, kind, int(nbytes), group).seconds

    def reshard(self, src: tuple, dst: tuple, nbytes: float) -> float:
        """Seconds to turn layout ``src`` into ``dst`` on the tp group (``nbytes``: whole tensor)."""
        if src == dst or (src[0] == "R" and dst[0] == "S"):
            return 0.0
        if src[0] == "S" and dst[0] == "R":
            return self._coll(Collective.ALL_GATHER, nbytes, self.group)
        if src[0] == "S" and dst[0] == "S":
            return self._coll(Collective.ALL_TO_ALL, nbytes / self.tp, self.group)
        if src[0] == "P" and dst[0] == "R":
            return self._coll(Collective.ALL_REDUCE, nbytes, self.group)
        if src[0] == "P" and dst[0] == "S":
            return self._coll(Collective.REDUCE_SCATTER, nbytes, self.group)
        return 0.0

    def node_cost(self, name: str, choice: str | None) -> float:
        """Seconds per step of every op ``name`` stands for, under ``choice``."""
        return self.count[name] * self._one(name, choice)

    def _one(self, name: str, choice: str | None) -> float:
        o = self.ops[name]
        own = o.compute if choice is None else o.compute / self.tp
        for k, ref in enumerate(o.node.input_refs()):
            v = self.graph.values[ref.name]
            if v.kind != "param":
                continue
            need = _need(o.op, k, choice)
            split = self.tp if need[0] == "S" else 1
            own += self.adam_s * v.meta.numel / split
            # A whole parameter read by a split op has a partial gradient on every device
            # of the tp group too: one sum over the world, not over dp.
            whole = choice is not None and need[0] == "R" and v.meta.dtype.is_floating_point
            own += self.grad_s[whole] * v.meta.nbytes / split
        return own

    def memory(self, name: str, choice: str | None) -> float:
        """Bytes a device holds for every op ``name`` stands for: parameters' state, outputs."""
        return self.count[name] * self._held(name, choice)

    def _held(self, name: str, choice: str | None) -> float:
        o = self.ops[name]
        total = 0.0
        for k, ref in enumerate(o.node.input_refs()):
            v = self.graph.values[ref.name]
            if v.kind == "param":
                need = _need(o.op, k, choice)
                total += self.state_bytes * v.meta.numel / (self.tp if need[0] == "S" else 1)
        for j, out in enumerate(o.node.outputs):
            if out:
                have = _out_placement(o.op, j, choice)
                total += self.graph.values[out].meta.nbytes / self.dp / (
                    self.tp if have[0] == "S" else 1)
        return total

    def edge_cost(self, producer: str, j: int, consumer: str, k: int, value: str,
                  a: str | None, b: str | None) -> float:
        meta = self.graph.values[value].meta
        nbytes = meta.nbytes / self.dp
        p = self.ops[producer]
        c = self.ops[consumer]
        have = _out_placement(p.op, j, a)
        need = _need(c.op, k, b)
        if need is None:  # '*': only the dtype is read
            return 0.0
        fwd = self.reshard(have, need, nbytes)
        if not meta.dtype.is_floating_point:
            return fwd
        grad = need if need[0] == "S" else (("P",) if b is not None else ("R",))
        want = have if have[0] == "S" else ("R",)
        return fwd + self.reshard(grad, want, nbytes)

    def edges(self) -> list[tuple[str, int, str, int, str, int]]:
        """``(producer, j, consumer, k, value, count)`` for every activation edge, ops named by
        their representative (the first block's op at the same position), counted."""
        counts: dict[tuple[str, int, str, int], int] = {}
        for node in self.graph.nodes:
            for k, ref in enumerate(node.input_refs()):
                src = self.producer.get(ref.name)
                if src is not None:
                    key = (self.rep[src.name], src.outputs.index(ref.name), self.rep[node.name], k)
                    counts[key] = counts.get(key, 0) + 1
        return [(p, j, c, k, self.graph.node(p).outputs[j], n) for (p, j, c, k), n in counts.items()]


def _batch_split(graph: Graph) -> Plan:
    """The batch split in two (or whole, for a batch of one): which dims each op's batch is."""
    batch = min((graph.values[n].meta.shape[0] for n in graph.inputs
                 if graph.values[n].meta.shape), default=1)
    parts = next((d for d in range(2, batch + 1) if batch % d == 0), 1)
    if parts == 1:
        plan = Plan(world_size=1)
        for node in graph.nodes:
            plan.assignment[node.name] = [0]
        return plan
    return propagate(graph, Mesh.of(dp=parts), inputs=batch_inputs(graph, "dp", parts))


def _choices(node: Node, op: OpInfo, tp: int, batch: set[str], world: int,
             rules: tuple[OpRule, ...], allow_batch: bool = True
             ) -> tuple[tuple[str | None, ...], Problem | None]:
    """An op's choices on ``tp``: whole, or a dim its annotation splits whose size divides
    (a batch dim, already split ``world / tp`` ways by data parallelism, by the world; not a
    choice at all unless ``allow_batch``)."""
    dims = [d for d in op.bound.splittable() if (allow_batch or d not in batch)
            and op.bound.sizes[d] % (world if d in batch else tp) == 0] if op.spec is not None else []
    whole = True
    for rule in rules:
        if not rule.selects(node):
            continue
        if rule.split is not None:
            dims = [d for d in dims if d in map(str, rule.split)]
        if rule.parts is not None and tp not in rule.parts:
            dims = []
        if rule.replicate is False:
            whole = False
        if rule.replicate is True and rule.parts is None and rule.split is None:
            dims = []
    if not whole and not dims:
        sizes = ", ".join(f"{d}={op.bound.sizes[d]}" for d in op.bound.splittable()) or "none"
        return (), Problem(obj=f"{node.name} ({node.module or node.target})",
                           value=f"tp={tp}",
                           rule=f"an ops rule says it is split, but no dim it may split divides "
                                f"by {tp} (splittable sizes: {sizes})",
                           fix="allow replication for it, or choose a tp that divides one of them")
    return ((WHOLE,) if whole else ()) + tuple(dims), None


def _out_placement(op: OpInfo, j: int, dim: str | None) -> tuple:
    if dim is None:
        return ("R",)
    spec = op.bound.annotation.outputs[j] if j < len(op.bound.annotation.outputs) else None
    if spec is not None and not spec.opaque:
        for a, ax in enumerate(spec.axes):
            if ax.dims and ax.dims[0].name == dim:
                return ("S", a)
    return ("P",) if op.bound.dim(dim).kind == "reduce" else ("R",)


def _need(op: OpInfo, k: int, dim: str | None) -> tuple | None:
    ins = op.bound.annotation.inputs
    spec = ins[k] if k < len(ins) else None
    if spec is not None and spec.meta_only:
        return None
    if dim is None or spec is None or spec.opaque:
        return ("R",)
    for a, ax in enumerate(spec.axes):
        if ax.dims and ax.dims[0].name == dim:
            return ("S", a)
    return ("R",)


__all__ = ["Model", "WHOLE"]

"""Within a stage: each op's partition over the tensor-parallel axis, by an integer linear program.

A partition is solved once per ``tp`` degree on a world: the batch is split
over the rest of the world (``dp = world / tp``) as data parallelism does, and
on ``tp`` every op may be split along any dim its annotation lets it
split (sizes permitting, and the constraints' op rules allowing) or run
whole. The solver picks one choice per op so that the step is fastest under
a model priced from the cluster:

- **compute**: the op's forward and backward seconds (:func:`~torchweave.sim.cost.op_time`),
  divided by ``tp`` when split, whole when replicated, at the ``1/dp`` share of
  the batch (a pipeline moves the same bytes per step in micro-batches, so
  one answer serves every point with that ``tp``);
- **resharding** on every edge from a producer's output layout to what the
  consumer reads, forward (``S→R`` all-gather, ``P→R`` all-reduce, ``P→S``
  reduce-scatter, ``S(a)→S(b)`` all-to-all, ``R→S`` a local slice) and the
  dual in backward (a split op that reads a whole input hands back a partial
  gradient: an all-reduce or reduce-scatter to what the producer needs);
- **parameters**: the gradient sum over ``dp`` of what each device holds (a
  split parameter holds ``1/tp``), over the whole world for a whole parameter
  read by a split op (a norm's weight under sequence splits, any weight under a
  batch split), priced per byte at the bucket size the runtime sums in (25 MiB),
  and AdamW's memory-bound pass over what each device holds;
- **memory**, where a budget is given: model state (parameters, gradients and
  AdamW's state, divided by ``tp`` when split) and the activations each op
  keeps (its outputs, divided by ``tp`` when split) stay within it.

The ``tp`` axis may split an op's batch too (where the batch divides by the
world): nnScaler's plan for a large vocabulary is exactly that, the blocks
data-parallel over every device and the embedding and head split along the
vocabulary. An answer that splits nothing but batches is the plan with a larger
``dp``, which the search prices as its own point; :func:`solve` then answers with
the best partition that splits the model (batch dims left out of the choices),
so ``split=solved`` is always a partition of the model where one meets the rules.

Identical blocks (:func:`~torchweave.sim.fold.find_blocks`) share one set of
variables, so a 96-layer model is one block's problem; an edge that joins a
block to the next at the same position (the residual stream) falls on the
diagonal. The program is Alpa's formulation: a one-hot binary per op, and per
edge a continuous choice pair whose rows and columns sum to the two ops'
choices, solved by HiGHS (``scipy.optimize.milp``) under a time limit.

The answer is a :class:`Partition` (each op's dim, or whole), which the plan
strings' ``split=solved`` (``tp:tp=8,split=solved``, ``1f1b:tp=4,pp=2,split=solved``)
turn into an ordinary :class:`~torchweave.plan.plan.Plan` through the same
propagation every policy uses (:func:`torchweave.policies.tensor.given`), so
lowering derives the communication and the event simulator, not this model,
ranks it. :func:`price` evaluates any
assignment (Megatron's, say) under the same model, for comparison.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph, Node
from torchweave.ops import OpInfo, info
from torchweave.plan.layout import Mesh
from torchweave.plan.plan import Plan
from torchweave.plan.propagate import propagate
from torchweave.policies.data import batch_inputs
from torchweave.search.constraints import OpRule
from torchweave.sim.cluster import Cluster
from torchweave.sim.comm import BUCKET_BYTES, Collective, collective_time
from torchweave.sim.cost import ComputeModel, dtype_of, op_time
from torchweave.sim.fold import find_blocks
from torchweave.sim.memory import model_state_memory

WHOLE = None
"""The choice of running an op whole (replicated over ``tp``)."""


@dataclass(frozen=True)
class Partition:
    """Each op's split on the ``tp`` axis (``None``: whole), for ``tp`` of ``world`` devices."""

    tp: int
    world: int
    dims: dict[str, str | None]
    cost: float
    """The objective: seconds per step under the solver's model."""
    status: str
    """``optimal``, or ``time limit`` (the best found in the time allowed)."""
    variables: int
    seconds: float
    batch_only: bool = False
    """It splits nothing but batches: data parallelism over ``tp`` too (the plan with a
    larger ``dp``), up to a few cheap ops left whole. :func:`solve` answers so only where
    no partition of the model meets the rules."""

    def key(self) -> tuple:
        return (self.tp, tuple(sorted((k, v or "") for k, v in self.dims.items())))


@dataclass(frozen=True)
class _Op:
    node: Node
    op: OpInfo
    choices: tuple[str | None, ...]
    compute: float
    """Forward + backward seconds of the whole op at the dp share of the batch."""


class _Model:
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
        blocks = find_blocks(graph, base, least=2)
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
        use_batch = batch
        self.ops: dict[str, _Op] = {}
        self.batch: dict[str, set[str]] = {}
        """Each representative op's batch dims."""
        problems: list[Problem] = []
        for node in graph.nodes:
            if self.rep[node.name] != node.name:
                continue
            op = info(graph, node)
            batch = self.batch[node.name] = {t.dim for t in base.transforms(node.name) if t.dim}
            choices, bad = _choices(node, op, tp, batch if use_batch else set(), world, rules,
                                    skip=set() if use_batch else batch)
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
             rules: tuple[OpRule, ...], skip: set[str] = frozenset()
             ) -> tuple[tuple[str | None, ...], Problem | None]:
    """An op's choices on ``tp``: whole, or a dim its annotation splits (not in ``skip``)
    whose size divides (a batch dim, already split ``world / tp`` ways by data parallelism,
    by the world)."""
    dims = [d for d in op.bound.splittable() if d not in skip
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


# ------------------------------------------------------------------ solve
def solve(graph: Graph, cluster: Cluster, *, tp: int, world: int, dtype: torch.dtype | None = None,
          rules: tuple[OpRule, ...] = (), memory: float | None = None,
          time_limit: float = 10.0) -> Partition:
    """The fastest partition of every op on the ``tp`` axis under the solver's model, within
    ``memory`` bytes per device where given.

    Where the fastest splits nothing but batches (data parallelism over ``tp``, which a
    search prices as its own point), the answer is the fastest that splits the model, batch
    dims left out of the choices; the batch-only answer stands only where no other meets
    the rules (:attr:`Partition.batch_only`)."""
    t0 = time.perf_counter()
    part = _solve(graph, cluster, tp, world, dtype, rules, memory, time_limit, batch=True)
    if part.batch_only:
        try:
            part = _solve(graph, cluster, tp, world, dtype, rules, memory, time_limit, batch=False)
        except TorchweaveError:
            pass
    return replace(part, seconds=time.perf_counter() - t0)


def _solve(graph: Graph, cluster: Cluster, tp: int, world: int, dtype: torch.dtype | None,
           rules: tuple[OpRule, ...], memory: float | None, time_limit: float, *,
           batch: bool) -> Partition:
    t0 = time.perf_counter()
    m = _Model(graph, cluster, tp, world, dtype=dtype, rules=rules, batch=batch)
    names = list(m.ops)
    col: dict[tuple[str, str | None], int] = {}
    cost: list[float] = []
    for name in names:
        for ch in m.ops[name].choices:
            col[(name, ch)] = len(cost)
            cost.append(m.node_cost(name, ch))
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries: list[tuple[int, float]], a: float, b: float) -> None:
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(a)
        hi.append(b)

    for name in names:  # one choice per op
        row([(col[(name, ch)], 1.0) for ch in m.ops[name].choices], 1.0, 1.0)
    binary = len(cost)
    if memory is not None:
        row([(col[(name, ch)], m.memory(name, ch))
             for name in names for ch in m.ops[name].choices], 0.0, memory)
    for p, j, c, k, value, n in m.edges():
        pa, cb = m.ops[p].choices, m.ops[c].choices
        if p == c:  # the same op in consecutive blocks: both take one choice
            for ch in pa:
                cost[col[(p, ch)]] += n * m.edge_cost(p, j, c, k, value, ch, ch)
            continue
        table = [[n * m.edge_cost(p, j, c, k, value, a, b) for b in cb] for a in pa]
        if len(pa) == 1 or len(cb) == 1:  # no pair variables needed
            for ia, a in enumerate(pa):
                for ib, b in enumerate(cb):
                    if len(pa) == 1:
                        cost[col[(c, b)]] += table[ia][ib]
                    else:
                        cost[col[(p, a)]] += table[ia][ib]
            continue
        if not any(any(r) for r in table):
            continue
        base = len(cost)
        cost.extend(v for r in table for v in r)
        for ia, a in enumerate(pa):  # rows sum to the producer's choice
            row([(base + ia * len(cb) + ib, 1.0) for ib in range(len(cb))]
                + [(col[(p, a)], -1.0)], 0.0, 0.0)
        for ib, b in enumerate(cb):  # columns to the consumer's
            row([(base + ia * len(cb) + ib, 1.0) for ia in range(len(pa))]
                + [(col[(c, b)], -1.0)], 0.0, 0.0)
    nvar = len(cost)
    integrality = np.zeros(nvar)
    integrality[:binary] = 1
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    res = milp(np.asarray(cost), constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"time_limit": time_limit, "presolve": True})
    if res.x is None:
        if res.status == 2:
            least = sum(min(m.memory(n, ch) for ch in m.ops[n].choices) for n in names)
            raise TorchweaveError(Problem(
                obj=f"partition search tp={tp} of {world}", value=f"{memory / 2**30:.2f} GiB",
                rule=f"some partition fits the memory budget (the leanest choice of every op "
                     f"needs about {least / 2**30:.2f} GiB)",
                fix="raise the budget, or use more tensor, pipeline or ZeRO parallelism"))
        raise TorchweaveError(Problem(obj=f"partition search tp={tp} of {world}", value=res.message,
                                      rule="the program has a solution within the time limit",
                                      fix="raise the time limit, or constrain the ops"))
    dims: dict[str, str | None] = {}
    for name in names:
        dims[name] = max(m.ops[name].choices, key=lambda ch: res.x[col[(name, ch)]])
    for node in graph.nodes:
        dims[node.name] = dims[m.rep[node.name]]
    status = "optimal" if res.status == 0 else "time limit"
    # Data parallelism over tp, up to ties: nothing split but batches (a few cheap ops the
    # objective is indifferent about, such as the loss's tail, may stay whole).
    batch_only = any(dims[n] for n in names) and all(dims[n] is None or dims[n] in m.batch[n]
                                                      for n in names)
    return Partition(tp, world, dims, float(res.fun), status, nvar, time.perf_counter() - t0,
                     batch_only)


def price(graph: Graph, cluster: Cluster, dims: dict[str, str | None], *, tp: int, world: int,
          dtype: torch.dtype | None = None) -> float:
    """Seconds per step of any assignment of dims under the solver's model (a choice the
    model does not allow counts as whole)."""
    m = _Model(graph, cluster, tp, world, dtype=dtype, rules=())

    def ch(name: str) -> str | None:
        d = dims.get(name)
        return d if d in m.ops[name].choices else None

    total = sum(m.node_cost(n, ch(n)) for n in m.ops)
    for p, j, c, k, value, n in m.edges():
        total += n * m.edge_cost(p, j, c, k, value, ch(p), ch(c) if c != p else ch(p))
    return total


def tp_dims(plan: Plan, graph: Graph) -> dict[str, str | None]:
    """Each node's dim on the ``tp`` axis of a plan over a mesh with a ``tp`` axis (``tp``,
    ``sp`` and pipelines: the last transform of each node; ``None``: whole)."""
    if plan.mesh is None or "tp" not in dict(plan.mesh.axes) or plan.mesh.dim("tp") < 2:
        return {node.name: None for node in graph.nodes}
    out = {}
    for node in graph.nodes:
        ts = plan.transforms(node.name)
        out[node.name] = ts[-1].dim if ts else None
    return out


def describe(graph: Graph, a: dict[str, str | None], b: dict[str, str | None]) -> list[str]:
    """Ops split differently in ``a`` than in ``b``, grouped by module kind, as lines."""
    diff: dict[tuple, int] = {}
    for node in graph.nodes:
        x, y = a.get(node.name), b.get(node.name)
        if x != y:
            where = _generic(node.module or node.target)
            key = (where, node.target.split(".")[1] if "." in node.target else node.target,
                   x or "whole", y or "whole")
            diff[key] = diff.get(key, 0) + 1
    return [f"{where} {op}: {x} instead of {y}" + (f" (×{n})" if n > 1 else "")
            for (where, op, x, y), n in sorted(diff.items())]


def _generic(module: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


__all__ = ["Partition", "WHOLE", "describe", "price", "solve", "tp_dims"]

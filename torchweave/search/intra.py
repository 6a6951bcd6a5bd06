"""Within a stage: each op's partition over the tensor-parallel axis, by an integer linear program.

A partition is solved once per ``tp`` degree on a world: the batch is split
over the rest of the world (``dp = world / tp``) as data parallelism does, and
on ``tp`` every op may be split along any dim its annotation lets it
split (sizes permitting, and the constraints' op rules allowing) or run
whole. The solver picks one choice per op so that the step is fastest under
a model priced from the cluster:

- **compute**: the op's forward and backward seconds (:func:`~torchweave.sim.hardware.compute.op_time`),
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

Identical blocks (:func:`~torchweave.sim.fast.fold.find_blocks`) share one set of
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

from torchweave.errors import Problem, TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.plan.plan import Plan
from torchweave.search.admit import tied
from torchweave.search.constraints import OpRule
from torchweave.search.pricing import WHOLE, Model
from torchweave.sim.hardware.cluster import Cluster

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


# ------------------------------------------------------------------ solve
def solve(graph: Graph, cluster: Cluster, *, tp: int, world: int, dtype: torch.dtype | None = None,
          rules: tuple[OpRule, ...] = (), memory: float | None = None,
          ties: tuple[tuple[str, ...], ...] = (), time_limit: float = 10.0) -> Partition:
    """The fastest partition of every op on the ``tp`` axis under the solver's model, within
    ``memory`` bytes per device where given, the ops each tie lines up
    (:func:`~torchweave.search.admit.tied`) taking one choice: equalities of the program.

    Where the fastest splits nothing but batches (data parallelism over ``tp``, which a
    search prices as its own point), the answer is the fastest that splits the model, batch
    dims left out of the choices; the batch-only answer stands only where no other meets
    the rules (:attr:`Partition.batch_only`)."""
    t0 = time.perf_counter()
    part = _solve(graph, cluster, tp, world, dtype, rules, memory, ties, time_limit, batch=True)
    if part.batch_only:
        try:
            part = _solve(graph, cluster, tp, world, dtype, rules, memory, ties, time_limit,
                          batch=False)
        except TorchweaveError:
            pass
    return replace(part, seconds=time.perf_counter() - t0)


def _solve(graph: Graph, cluster: Cluster, tp: int, world: int, dtype: torch.dtype | None,
           rules: tuple[OpRule, ...], memory: float | None,
           ties: tuple[tuple[str, ...], ...], time_limit: float, *, batch: bool) -> Partition:
    t0 = time.perf_counter()
    m = Model(graph, cluster, tp, world, dtype=dtype, rules=rules, batch=batch)
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
    for group in ties:  # tied ops take one choice; a choice one of them lacks, neither
        for column in tied(graph, group):
            reps = list(dict.fromkeys(m.rep[n] for n in column))

            def choices(r: str) -> tuple:  # an op the model leaves no choice runs whole
                return tuple(m.ops[r].choices) if r in m.ops else (WHOLE,)

            for other in reps[1:]:
                for ch in dict.fromkeys(choices(reps[0]) + choices(other)):
                    if ch not in choices(reps[0]) or ch not in choices(other) or {
                            reps[0], other} <= set(m.ops):
                        row([(col[(r, ch)], sign) for r, sign in ((reps[0], 1.0), (other, -1.0))
                             if r in m.ops and ch in m.ops[r].choices], 0.0, 0.0)
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
    # scipy on first solve only: importing it costs every process that imports torchweave
    # (each rank of a job) 0.4 s, and most never solve
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

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
    m = Model(graph, cluster, tp, world, dtype=dtype, rules=())

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

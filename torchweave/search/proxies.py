"""The search's proxies: one block of the model and the rest, under one way of splitting a
block, each priced by the event simulator once.

A proxy (:func:`proxy`) is the model cut to 3 and to 4 of its identical blocks
(:func:`torchweave.sim.fast.fold.cut_stacks`), planned with the split alone on ``tp``
devices of the target cluster and simulated; the difference is one block, the rest is
what 4 blocks leave. :func:`~torchweave.search.estimate.estimate` prices every point of
the space from its split's proxy. :func:`by_degree` makes them a degree at a time: a
larger ``tp`` while Megatron's split of the last one makes a block faster than a smaller
degree did (the solver's split is no guide: it may split the batch, which always scales)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from torchweave.errors import TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.lower.pieces import node_pieces, tensor_box
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.policies.expert import expert_axis
from torchweave.policies.recompute import block_of
from torchweave.policies.spec import PlanSpec
from torchweave.policies.stage_cuts import shared_lookups
from torchweave.search.admit import op_rules
from torchweave.search.constraints import Constraints
from torchweave.search.intra import Partition
from torchweave.search.pool import Failed, Runner
from torchweave.search.space import Point
from torchweave.sim.fast.fold import Blocks, cut_stacks
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.hardware.memory import model_state_memory
from torchweave.sim.hardware.profile import first_piece
from torchweave.sim.simulate import simulate


@dataclass(frozen=True)
class Proxy:
    """One block and the rest of the model under one tensor-parallel split, at the whole batch."""

    block_s: float
    """Forward, backward and tensor-parallel communication of one block (optimizer excluded)."""
    rest_s: float
    block_act: int
    rest_act: int
    block_params: int
    """Parameter elements of one block on one rank."""
    rest_params: int
    boundary_bytes: int
    """What one block hands the next (its output), at the whole batch, on one rank."""
    plan: Plan
    """The proxy's plan on the 4-block model (op rules are checked on it)."""
    ep: int = 1
    """Devices the experts are split over (1: no expert parallelism). The proxy then runs
    on ``ep · tp`` devices with the batch split over ``ep``, so its seconds and activations
    are one rank's share already."""
    expert_params: int = 0
    """Of ``block_params``, the experts' elements on one rank (their gradients are summed
    over ``dp`` only; the rest of the block's over ``dp · ep``)."""
    block_comm: float = 0.0
    rest_comm: float = 0.0
    """Of ``block_s`` and ``rest_s``, the seconds of communication (tensor-parallel
    collectives: as long in backward as in forward, unlike compute)."""
    reads: dict[str, float] = field(default_factory=dict)
    """Of each value a pipeline cut may carry, the share one rank of the stage after the
    cut receives under this split (:func:`read_shares`)."""
    tied: int = 0
    """Elements of the parameters read both before the blocks and after them (a tied
    embedding and LM head): in a pipeline the first and the last stage each keep a copy,
    summed between them once a step (``lower/copies.py``)."""
    tied_copied: bool = True
    """Whether those readers read the same piece on each rank under this split, as lowering
    needs to copy the weight; where not (a solved split that shards the embedding and
    the head differently), lowering sends it whole with every micro-batch instead."""
    tied_sent: int = 0
    """Of ``tied``, the elements ``tied=send`` leaves no copy of: parameters whose readers
    after the blocks are all lookups (an encoder-decoder's decoder embedding), which that
    plan runs on the first stage (``stage_cuts.send_lookups``)."""
    per_block: tuple = ()
    """What one more block adds to the simulated cut-down model: (step seconds, the busiest
    rank's communication seconds, the peak rank's parameter bytes and activation bytes,
    that rank's communication latency); a co-sharded sibling reuses it (:func:`proxy`'s
    ``like``)."""
    block_lat: float = 0.0
    """Of ``block_comm``, what does not shrink with the batch: each collective's latency
    (the simulator's ``SimResult.comm_latency``). A micro-batch runs every collective of
    its pass once, over its share of the bytes (:meth:`block_at`)."""
    rest_lat: float = 0.0
    """Of ``rest_comm``, the same."""

    def block_at(self, f: float) -> float:
        """One block's seconds on ``f`` of the batch: its collectives' latency whole, the
        rest scaled."""
        return self.block_lat + f * (self.block_s - self.block_lat)

    def rest_at(self, f: float) -> float:
        """:meth:`block_at` of the rest of the model."""
        return self.rest_lat + f * (self.rest_s - self.rest_lat)


def sub_cluster(cluster: Cluster, n: int) -> Cluster:
    """The first ``n`` devices of ``cluster``, nodes as in it."""
    per = min(n, cluster.devices_per_node)
    return replace(cluster, nodes=math.ceil(n / per), devices_per_node=per,
                   name=f"{n} of {cluster.name or cluster}")


def proxy(graph: Graph, blocks: Blocks, cluster: Cluster, tp: int, sp: bool, recompute: str, *,
          dtype, precision: str, dims: dict[str, str | None] | None = None, coshard: int = 0,
          ep: int = 1, like: Proxy | None = None) -> Proxy:
    """The proxy of ``(tp, sp, recompute, split, coshard, ep)``; raises the policy's error
    where the split does not apply to the model (e.g. heads not divisible by tp).

    ``like``: the proxy of the same split with ``coshard=0``. Co-sharding changes the output
    head only, so the blocks cost what they cost there: the 3-block model alone is simulated
    and ``like``'s per-block differences give the 4-block one (equal to simulating it:
    ``tests/unit/test_search_coshard.py``)."""
    rec = [f"recompute={recompute}"] if recompute != "none" else []
    if ep > 1:  # the experts over ep, the batch over ep, Megatron's tp inside
        text = "ep:" + ",".join([f"ep={ep}", "dp=1", f"tp={tp}"] + rec)
    else:
        opts = ([f"tp={tp}", "dp=1"] if tp > 1 else []) + rec + (
            ["split=solved"] if dims is not None else []) + ([f"coshard={coshard}"] if coshard else [])
        text = ("dp" if tp == 1 else "sp" if sp else "tp") + (":" + ",".join(opts) if opts else "")
    plan = PlanSpec.parse(text).build(graph, tp * ep, dims=dims)
    small = sub_cluster(cluster, tp * ep)
    derive = like is not None and coshard > 0 and like.per_block
    measured = []
    for k in ((3,) if derive else (3, 4)):
        g, p = cut_stacks(graph, plan, blocks, k)
        r = simulate(g, p, small, dtype=dtype, fold=False, timeline=False)
        peak = max(r.memory, key=lambda m: m.peak)
        busiest = max(range(len(r.comm_time)), key=r.comm_time.__getitem__, default=None)
        measured.append((r.step_time, r.comm_time[busiest] if busiest is not None else 0.0,
                         peak.params, peak.activations,
                         r.comm_latency[busiest] if busiest is not None and r.comm_latency
                         else 0.0))
    _, p4 = cut_stacks(graph, plan, blocks, 4) if derive else (g, p)
    x3 = measured[0]
    x4 = tuple(a + d for a, d in zip(x3, like.per_block)) if derive else measured[1]
    (step3, comm3, params3, act3, lat3), (step4, comm4, params4, act4, lat4) = x3, x4
    model = ComputeModel.for_device(cluster.device)
    bw = cluster.device.memory_bandwidth * model.bandwidth
    each = model_state_memory(1, precision=precision).params  # bytes a parameter holds
    pb = (params4 - params3) // each
    pr = max(0, params4 // each - 4 * pb)
    # The simulator's AdamW pass reads 7 fp32 words per parameter (sim/step/backward.py): the
    # search prices it per point instead.
    block = max(0.0, (step4 - step3) - 28 * pb / bw)
    rest = max(0.0, step4 - 4 * (step4 - step3) - 28 * pr / bw)
    block_comm = min(block, max(0.0, comm4 - comm3))
    rest_comm = min(rest, max(0.0, comm4 - 4 * (comm4 - comm3)))
    block_lat = min(block_comm, max(0.0, lat4 - lat3))
    rest_lat = min(rest_comm, max(0.0, lat4 - 4 * (lat4 - lat3)))
    end = blocks.spans[1][1] - 1
    out = graph.nodes[end].outputs[0]
    boundary = graph.values[out].meta.nbytes
    return Proxy(block, rest, act4 - act3, max(0, act4 - 4 * (act4 - act3)), pb, pr,
                 boundary, p4, ep, min(pb, _expert_elements(graph, blocks, tp * ep)) if ep > 1 else 0,
                 block_comm, rest_comm, read_shares(graph, plan), *_tied(graph, blocks, plan),
                 per_block=tuple(b - a for a, b in zip(x3, x4)), block_lat=block_lat,
                 rest_lat=rest_lat)


def _tied(graph: Graph, blocks: Blocks, plan: Plan) -> tuple[int, bool, int]:
    """Elements of the parameters read both before the first block and after the last,
    whether every such reader reads the same piece of them on each rank under ``plan``, and
    the elements of those whose readers after the blocks are all lookups (``tied_sent``)."""
    first, end = blocks.spans[0][0], blocks.spans[-1][1]
    sides: dict[str, set[bool]] = {}
    boxes: dict[str, set] = {}
    moved = set(shared_lookups(graph))
    late: dict[str, bool] = {}  # parameter -> every reader after the blocks is a lookup
    for i, node in enumerate(graph.nodes):
        if first <= i < end:
            continue
        bound = info(graph, node).bound
        for r, spec in zip(node.input_refs(), bound.annotation.inputs):
            if graph.values[r.name].kind != "param" or spec.meta_only:
                continue
            if i >= end:
                late[r.name] = late.get(r.name, True) and node.name in moved
            sides.setdefault(r.name, set()).add(i >= end)
            shape = graph.values[r.name].meta.shape
            boxes.setdefault(r.name, set()).add(tuple(sorted(
                (p.device, tensor_box(bound, spec, shape, p)) for p in node_pieces(plan, node.name))))
    tied = [v for v, s in sides.items() if len(s) == 2]
    return (sum(graph.values[v].meta.numel for v in tied),
            all(len(boxes[v]) == 1 for v in tied),
            sum(graph.values[v].meta.numel for v in tied if late.get(v)))


def _unit(module: str) -> str:
    """Where a pipeline cut may fall around an op of ``module``: its block and the block's
    child (``encoder.3.ff``; a cut by seconds starts a stage there, ``search/cuts.py``), or
    its top-level module outside the blocks (``lm_head``)."""
    key = block_of(module)
    if not key:
        return module.split(".")[0]
    rest = module[len(key):].lstrip(".")
    return key + ("." + rest.split(".")[0] if rest else "")


def read_shares(graph: Graph, plan: Plan) -> dict[str, float]:
    """Per value that a pipeline cut may carry (made in one block, a block's child module
    or a module outside the blocks, and read in another), the largest share of it one piece of a reader reads under
    ``plan``. That is what a rank of a later stage receives: lowering moves a value in the
    layout its readers need, so a value held in shards but read whole (by a
    column-parallel linear, T5's encoder output in cross-attention) crosses whole."""
    made = {o: n for n in graph.nodes for o in n.outputs if o}
    out: dict[str, float] = {}
    for node in graph.nodes:
        key = _unit(node.module or "")
        refs = [(i, r) for i, r in enumerate(node.input_refs())
                if r.name in made and _unit(made[r.name].module or "") != key]
        if not refs:
            continue
        bound = info(graph, node).bound
        specs = bound.annotation.inputs
        piece = first_piece(plan, node.name)
        for i, ref in refs:
            shape = graph.values[ref.name].meta.shape
            spec = specs[i] if i < len(specs) else None
            share = 1.0
            if spec is not None and spec.meta_only:  # only its dtype is read
                share = 0.0
            elif spec is not None and shape and piece is not None:
                box = tensor_box(bound, spec, shape, piece)
                share = math.prod(b - a for a, b in box) / max(1, math.prod(shape))
            out[ref.name] = max(out.get(ref.name, 0.0), share)
    return out


def _expert_elements(graph: Graph, blocks: Blocks, devices: int) -> int:
    """One rank's elements of block 1's expert weights (those an expert op indexes by its
    first axis: :func:`~torchweave.policies.expert.expert_axis`), split over the proxy's
    ``devices`` (experts over ep, each expert's hidden width over tp, as the ep policy
    splits them)."""
    start, end = blocks.spans[1]
    seen: set[str] = set()
    for node in graph.nodes[start:end]:
        if expert_axis(graph, node, info(graph, node)) is None:
            continue
        seen.update(r.name for r in node.input_refs() if graph.values[r.name].kind == "param"
                    and len(graph.values[r.name].meta.shape) >= 3)
    return sum(graph.values[n].meta.numel for n in seen) // devices


def by_degree(runner: Runner, graph: Graph, pts: list[Point], parts: dict[int, Partition | None],
             solve_tp: Callable[[int], Partition | None], c: Constraints, excluded: list[str],
             say: Callable[[str], None]) -> dict[tuple, Proxy | None]:
    """One proxy per way of splitting a block, a degree at a time (its ways at once), larger
    degrees while they make a block faster; a
    degree's solved split is solved (``solve_tp``, into ``parts``) when the degree is reached."""
    proxies: dict[tuple, Proxy | None] = {}
    keys = sorted({proxy_key(p) for p in pts})
    stop = None
    for tp in sorted({k[0] for k in keys}):
        group = [k for k in keys if k[0] == tp]
        if stop is None and any(k[3] == "solved" for k in group) and solve_tp(tp) is None:
            proxies.update((k, None) for k in group if k[3] == "solved")
            group = [k for k in group if k[3] != "solved"]
        if stop is not None:
            proxies.update((k, None) for k in group)
            continue
        best = min((x.block_s for k, x in proxies.items() if x and k[0] < tp and k[5] == 1),
                   default=math.inf)
        for key in group:
            say(f"proxy tp={key[0]} sp={key[1]} recompute={key[2]} split={key[3]} coshard={key[4]}"
                + (f" ep={key[5]}" if key[5] > 1 else ""))
        got = _proxies(runner, group, parts)
        for key, px in zip(group, got):
            proxies[key] = None
            if isinstance(px, Failed):
                excluded.append(f"tp={tp}{' (sp)' if key[1] else ''}: "
                                + "; ".join(f"{p.value}: {p.rule}" for p in px.problems))
                continue
            bad = op_rules(px.plan, graph, c.ops, tp, key[5])  # ep: the batch over ep is not tp's
            if bad:
                excluded.append(f"tp={tp}: {bad}")
                continue
            proxies[key] = px
            if key[1:] == (False, "none", "rule", 0, 1) and tp > 1 and px.block_s >= best:
                stop = tp
                excluded.append(f"tp > {tp}: not tried; tp={tp} is no faster per block "
                                f"({px.block_s:.4g} s) than a smaller degree ({best:.4g} s)")
    return proxies


def proxy_key(pt: Point) -> tuple:
    """The proxy that prices ``pt``: its way of splitting a block."""
    return (pt.tp, pt.sp, pt.recompute, pt.split, pt.coshard, pt.ep)


def _proxies(runner: Runner, group: list[tuple], parts: dict[int, Partition | None]) -> list:
    """The proxies of ``group`` (one degree's keys), in its order. A co-sharded key goes in
    one job with its ``coshard=0`` sibling, whose blocks it reuses (:func:`proxy`'s ``like``)."""
    def dims(key: tuple) -> dict | None:
        return parts[key[0]].dims if key[3] == "solved" and parts.get(key[0]) else None

    base = {key: [] for key in group if key[4] == 0}
    alone = []
    for key in group:
        sib = (*key[:4], 0, *key[5:])
        if key[4] and sib in base:
            base[sib].append(key)
        elif key not in base:
            alone.append(key)
    jobs = [(key, tuple(base[key]), dims(key)) for key in base] + \
        [(key, (), dims(key)) for key in alone]
    got = {}
    for (key, more, _), answers in zip(jobs, runner.map(_proxy_job, jobs)):
        got.update(zip((key, *more), answers if isinstance(answers, list) else [answers]))
    return [got[key] for key in group]


def _proxy_job(s: dict, key: tuple, more: tuple, dims: dict | None) -> list:
    """The proxy of ``key``, then of each co-sharded sibling in ``more`` (a failure, as
    :class:`Failed`, in its place)."""
    def one(k: tuple, like: Proxy | None):
        try:
            return proxy(s["graph"], s["blocks"], s["cluster"], *k[:3], coshard=k[4], ep=k[5],
                         dtype=s["dtype"], precision=s["precision"], dims=dims, like=like)
        except TorchweaveError as exc:
            return Failed(list(exc.problems))

    first = one(key, None)
    like = first if isinstance(first, Proxy) else None
    return [first, *(one(k, like) for k in more)]


__all__ = ["Proxy", "by_degree", "proxy", "proxy_key", "read_shares", "sub_cluster"]

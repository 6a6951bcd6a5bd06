"""The search's own cost model: every point of the space priced in microseconds of CPU.

For each tensor-parallel way of splitting a block — ``(tp, sp, recompute, split)``, the
split being Megatron's rules or the solver's partition (:mod:`~torchweave.search.intra`) — the
event simulator runs once on a **proxy**: the model cut to 3 and to 4 of its
identical blocks (:func:`torchweave.sim.fast.fold.cut_stacks`: an encoder-decoder's two
stacks together, a block being one layer of each), planned with that split
alone on ``tp`` devices of the target cluster. The difference is one block: its
forward, backward and tensor-parallel communication seconds, its activations
and its parameters, at the whole batch; the rest (embeddings, head, loss) is
what 4 blocks leave. A point then costs, per micro-batch of ``1/(dp·micro)`` of
the batch, by arithmetic:

- **compute** (with tensor-parallel collectives): blocks per stage × one block,
  plus the rest, scaled by the micro-batch's share of the batch, but for the
  collectives' latency, which each micro-batch pays whole (:meth:`Proxy.block_at`);
- **bubble**: the schedule's fill and drain, ``(pp − 1)`` stage times for GPipe and
  1F1B, ``(pp − 1)/virtual`` for interleaved, a third of 1F1B's for ZB-H1;
- **gradient sum** over ``dp`` (with expert parallelism, the experts' over ``dp`` and the
  rest over ``dp × ep``; the proxy, planned with ``ep`` on ``ep · tp`` devices, already
  holds the sums within ``ep`` and the dispatch and combine), in the compute dtype: costed by the simulator's
  collective model; for plain data parallelism in 25 MiB buckets, all but the last
  hidden behind the backward where it is long enough (not with tensor or expert
  parallelism: their collectives in backward queue behind the buckets on the one
  communication stream, and the backward waits for them); after the pipeline flush otherwise; ZeRO-1 one all-reduce (ZeRO-2 one reduce-scatter) and one gather of the
  updated shards (ZeRO-3 and interlaced points are not estimated: :func:`estimable`);
- **optimizer**: AdamW's memory-bound pass over the rank's (shard of) parameters;
- **memory**: the rank's model state (:func:`~torchweave.sim.hardware.memory.model_state_memory`)
  and activations: one block's × blocks per stage × micro-batches in flight
  (1 without a pipeline, ``min(micro, pp)`` for 1F1B and ZB, ``micro`` for GPipe,
  ``pp + (pp − 1)/virtual`` for interleaved).

Pipelined points: the search passes each point's schedule run on its stages' costs
from the real cut (:mod:`~torchweave.search.timed`, ``schedule_s``), which replaces
the compute, bubble and point-to-point arithmetic above, and, without ZeRO or experts,
the gradient sums too: each stage's starts when that stage's backward is done. That arithmetic charges
every stage the whole rest and assumes stages of equal cost: 14% off on average on
a 250k-vocabulary T5's uneven cut, up to 40% (``bench/search_estimate.py``).

It is an estimate: scaling a block's seconds linearly with the micro-batch
ignores that small matrix products run less efficiently. The search ranks every
point by it, simulates the best ones in full, and reports both, so its error is
measured on every plan it returns (``SearchResult.estimate_error``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from torchweave.ir.graph import Graph
from torchweave.lower.pieces import node_pieces, tensor_box
from torchweave.ops import info
from torchweave.plan.plan import Plan
from torchweave.policies.expert import expert_axis
from torchweave.policies.stage_cuts import shared_lookups
from torchweave.policies.recompute import block_of
from torchweave.policies.spec import PlanSpec
from torchweave.search.space import Point
from torchweave.search.timed import Priced
from torchweave.sim.hardware.cluster import Cluster
from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.fast.fold import Blocks, cut_stacks
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


@dataclass(frozen=True)
class Estimate:
    step_s: float
    compute_s: float
    bubble_s: float
    sync_s: float
    """Gradient sums left exposed."""
    p2p_s: float
    optimizer_s: float
    memory: int
    """Peak bytes on the busiest rank."""


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


def estimable(pt: Point) -> bool:
    """Whether :func:`estimate` prices ``pt``. Not the interlaced pipeline (its stages are
    not runs of blocks) nor ZeRO-3: its exposed time is each unit's gather against the
    compute of the unit before, unit by unit (``runtime/zero3.py``'s one-unit prefetch),
    which arithmetic on whole blocks misses by 6-12% (GPT-3 13B on 64 A100s). The
    search simulates these points directly; there are few (ZeRO-3 is ``dp`` only).
    Expert-parallel points are priced from a proxy planned with ``ep`` (:func:`proxy`)."""
    return pt.schedule != "interlaced" and pt.zero < 3


def estimate(pt: Point, px: Proxy, cluster: Cluster, n_blocks: int, *, precision: str,
             schedule_s: Priced | None = None) -> Estimate:
    """The cost of ``pt`` from its split's proxy (see the module docstring); ``pt`` must be
    :func:`estimable`. ``schedule_s``: a pipelined point's schedule already run on its
    stages' costs (:class:`~torchweave.search.timed.Priced`), which replaces the
    arithmetic's compute, bubble and point-to-point terms, and, where it has them, its
    gradient sums: each stage's starts when that stage's backward is done, so in an
    interleaved schedule most of them run under the last chunks' backward."""
    if not estimable(pt):
        raise ValueError(f"{pt.spec}: not priced by the estimate (see estimable)")
    f = 1.0 / (pt.dp * pt.micro)
    per_rank_blocks = n_blocks / pt.pp
    stage = (per_rank_blocks / pt.virtual) * px.block_at(f)
    rest = px.rest_at(f)
    work = pt.micro * (per_rank_blocks * px.block_at(f)) + pt.micro * rest
    if pt.pp == 1:
        bubble = 0.0
    elif pt.schedule == "interleaved":
        bubble = (pt.pp - 1) / pt.virtual * (stage * pt.virtual + rest)
    elif pt.schedule == "zb":
        bubble = (pt.pp - 1) * (stage + rest) / 3
    else:
        bubble = (pt.pp - 1) * (stage + rest)
    elems = int(per_rank_blocks * px.block_params + px.rest_params)
    # Gradients are summed, and ZeRO's shards gathered, in the compute dtype (as the
    # simulator's tasks do: sim/step/build.py ``itemsize``).
    item = 2 if precision == "bf16-mixed" else 4
    param_bytes = item * elems
    sync = 0.0
    if pt.dp > 1:
        # (bytes, group) of each gradient sum over data parallelism: with ``ep``, the experts'
        # over their dp replicas, the rest over dp × ep (its sum within ep is the proxy's).
        experts = item * int(per_rank_blocks * px.expert_params)
        sums = [(param_bytes - experts, _dense_group(pt)), (experts, _dp_group(pt, cluster))]
        sums = [(b, g) for b, g in sums if b > 0]
        if pt.zero == 0:
            full = last = 0.0
            for nbytes, group in sums:
                n = max(1, math.ceil(nbytes / BUCKET_BYTES))
                last = _seconds(cluster, Collective.ALL_REDUCE, nbytes / n, group)
                full += n * last
            if pt.pp == 1 and pt.tp == 1 and pt.ep == 1:
                backward = work * 2 / 3
                sync = max(last, full - backward)
            else:  # after the flush; or, with tp (ep), the backward's tensor-parallel
                sync = full  # (expert) collectives queue behind the buckets on the one comm stream
        else:  # ZeRO-1: one all-reduce after backward (ZeRO-2: a reduce-scatter), one gather
            # of the updated shards after AdamW
            coll = Collective.REDUCE_SCATTER if pt.zero == 2 else Collective.ALL_REDUCE
            sync = sum(_seconds(cluster, coll, nbytes, group)
                       + _seconds(cluster, Collective.ALL_GATHER, nbytes, group)
                       for nbytes, group in sums)
    p2p = 0.0
    if pt.pp > 1 and schedule_s is not None:  # transfers are among the schedule's waits
        work, bubble = schedule_s.busy_s, schedule_s.step_s - schedule_s.busy_s
        if schedule_s.sums_s is not None:
            sync = schedule_s.sums_s
    elif pt.pp > 1:
        hop = px.boundary_bytes * f / (max(pt.tp, 1) * pt.ep)
        link = cluster.inter if pt.tp * pt.dp * pt.ep >= cluster.devices_per_node else cluster.intra
        p2p = 2 * (pt.pp - 1) * (link.latency + hop / link.bandwidth)
    tied = px.tied - (px.tied_sent if pt.tied == "send" else 0)  # send: its lookups' tables uncopied
    if pt.pp > 1 and tied and px.tied_copied and (schedule_s is None or schedule_s.sums_s is None):
        # the tied copies' sum between the first and the last stage (timed.py prices it
        # among the stages' sums where those overlap the schedule)
        size = pt.tp * pt.dp * pt.ep
        ends = tuple(q * size + j for q in (0, pt.pp - 1) for j in range(0, size, pt.tp))
        sync += _seconds(cluster, Collective.ALL_REDUCE, item * tied / (pt.tp * pt.ep), ends)
    bw = cluster.device.memory_bandwidth * ComputeModel.for_device(cluster.device).bandwidth
    shard = 4 * elems / (pt.dp if pt.zero >= 1 else 1)  # AdamW's fp32 words
    opt = 7 * shard / bw
    # a tied weight's copy on each pipeline rank that reads it is summed across stage
    # groups, so ZeRO keeps it whole (sim/step/run.memory_use, runtime/zero.py)
    kept = min(elems, tied // (pt.tp * pt.ep)) if pt.pp > 1 and px.tied_copied and pt.zero else 0
    state = model_state_memory(elems - kept, dp=pt.dp, stage=pt.zero, precision=precision)
    whole = model_state_memory(kept, precision=precision).total
    temps = min(BUCKET_BYTES, param_bytes) if pt.zero == 0 else 0
    if pt.zero in (1, 2) and pt.dp > 1:
        temps = model_state_memory(elems - kept, precision=precision).grads
    if pt.pp == 1:
        flight = 1.0
    elif pt.schedule == "gpipe":
        flight = pt.micro
    elif pt.schedule == "interleaved":
        flight = min(pt.micro, pt.pp + (pt.pp - 1) / pt.virtual)
    else:
        flight = min(pt.micro, pt.pp)
    acts = px.block_act * f * per_rank_blocks * flight + px.rest_act * f
    memory = int(state.total + whole + acts + temps)
    step = work + bubble + sync + p2p + opt
    if pt.pp > 1 and cluster.share < 1 and pt.tp * pt.pp * pt.dp * pt.ep <= cluster.devices_per_node:
        # ranks sharing one node's cores: those waiting in the bubble leave their cores to
        # the others, so the step is the mean rank's work or the shared step at a whole
        # core's speed (sim/step/run.shared_cores_step)
        mean = pt.micro * (n_blocks * px.block_at(f) + px.rest_at(f)) / pt.pp + sync + opt
        shared = max(mean, step * cluster.share)
        bubble, step = max(0.0, bubble - (step - shared)), shared
    return Estimate(step, work, bubble, sync, p2p, opt, memory)


def _seconds(cluster: Cluster, c: Collective, nbytes: float, group: tuple[int, ...]) -> float:
    return _collective_s(cluster, c, int(nbytes), tuple(group))


@functools.lru_cache(maxsize=1 << 16)
def _collective_s(cluster: Cluster, c: Collective, nbytes: int, group: tuple[int, ...]) -> float:
    """Kept: a search prices tens of thousands of points with a few hundred distinct sums."""
    return collective_time(cluster, c, nbytes, group).seconds


def _dp_group(pt: Point, cluster: Cluster) -> tuple[int, ...]:
    """Rank 0's data-parallel group as the policies lay them out (``dp × ep × tp``, tp
    innermost)."""
    return tuple(range(0, pt.tp * pt.ep * pt.dp, pt.tp * pt.ep))


def _dense_group(pt: Point) -> tuple[int, ...]:
    """Rank 0's group for the gradients of what is not an expert: every rank of its stage
    with its tensor-parallel index (its data-parallel group when there is no ``ep``)."""
    return tuple(range(0, pt.tp * pt.ep * pt.dp, pt.tp))


__all__ = ["Estimate", "Proxy", "estimable", "estimate", "proxy", "read_shares", "sub_cluster"]

"""The search's own cost model: every point of the space priced in microseconds of CPU.

For each tensor-parallel way of splitting a block — ``(tp, sp, recompute, split)``, the
split being Megatron's rules or the solver's partition (:mod:`~torchweave.search.intra`) — the
event simulator runs once on a **proxy** (:mod:`~torchweave.search.proxies`): the model cut
to 3 and to 4 of its identical blocks (:func:`torchweave.sim.fast.fold.cut_stacks`: an
encoder-decoder's two stacks together, a block being one layer of each), planned with that
split alone on ``tp`` devices of the target cluster. The difference is one block: its
forward, backward and tensor-parallel communication seconds, its activations
and its parameters, at the whole batch; the rest (embeddings, head, loss) is
what 4 blocks leave. A point then costs, per micro-batch of ``1/(dp·micro)`` of
the batch, by arithmetic:

- **compute** (with tensor-parallel collectives): blocks per stage × one block,
  plus the rest, scaled by the micro-batch's share of the batch, but for the
  collectives' latency, which each micro-batch pays whole (:meth:`~torchweave.search.proxies.Proxy.block_at`);
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
from dataclasses import dataclass

from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.search.proxies import Proxy
from torchweave.search.space import Point
from torchweave.search.timed import Priced
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.hardware.compute import ComputeModel
from torchweave.sim.hardware.memory import model_state_memory



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


def estimable(pt: Point) -> bool:
    """Whether :func:`estimate` prices ``pt``. Not the interlaced pipeline (its stages are
    not runs of blocks) nor ZeRO-3: its exposed time is each unit's gather against the
    compute of the unit before, unit by unit (``runtime/zero3.py``'s one-unit prefetch),
    which arithmetic on whole blocks misses by 6-12% (GPT-3 13B on 64 A100s). The
    search simulates these points directly; there are few (ZeRO-3 is ``dp`` only).
    Expert-parallel points are priced from a proxy planned with ``ep``
    (:func:`~torchweave.search.proxies.proxy`)."""
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
    # ZeRO shards over the dp group (``Plan.zero_group``; none where dp is 1) what is summed
    # over it; a tied weight's copies (summed across stages too) and, with ep, what is not an
    # expert (summed over dp × ep) keep whole gradients and optimizer state, as the runtime
    # runs them (lower.program.zero_owns)
    zero = pt.zero if pt.dp > 1 else 0
    tied = px.tied - (px.tied_sent if pt.tied == "send" else 0)  # send: its lookups' tables uncopied
    kept_tied = min(elems, tied // (pt.tp * pt.ep)) if pt.pp > 1 and px.tied_copied and zero else 0
    experts_elems = int(per_rank_blocks * px.expert_params)
    owned = experts_elems if pt.ep > 1 else elems - kept_tied
    sync = 0.0
    if pt.dp > 1:
        # (bytes, group) of each gradient sum over data parallelism: with ``ep``, the experts'
        # over their dp replicas, the rest over dp × ep (its sum within ep is the proxy's).
        experts = item * experts_elems
        sums = [(param_bytes - experts, _dense_group(pt)), (experts, _dp_group(pt, cluster))]
        sums = [(b, g) for b, g in sums if b > 0]
        if zero == 0:
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
        else:  # ZeRO-1: one all-reduce after backward (ZeRO-2: a reduce-scatter of what it
            # owns), one gather of the updated shards after AdamW
            for nbytes, group in sums:
                if group != _dp_group(pt, cluster):  # summed over dp × ep: kept whole
                    sync += _seconds(cluster, Collective.ALL_REDUCE, nbytes, group)
                    continue
                coll = Collective.REDUCE_SCATTER if zero == 2 else Collective.ALL_REDUCE
                sync += _seconds(cluster, coll, nbytes, group)
                sync += _seconds(cluster, Collective.ALL_GATHER, item * owned, group)
    p2p = 0.0
    if pt.pp > 1 and schedule_s is not None:  # transfers are among the schedule's waits
        work, bubble = schedule_s.busy_s, schedule_s.step_s - schedule_s.busy_s
        if schedule_s.sums_s is not None:
            sync = schedule_s.sums_s
    elif pt.pp > 1:
        hop = px.boundary_bytes * f / (max(pt.tp, 1) * pt.ep)
        link = cluster.inter if pt.tp * pt.dp * pt.ep >= cluster.devices_per_node else cluster.intra
        p2p = 2 * (pt.pp - 1) * (link.latency + hop / link.bandwidth)
    if pt.pp > 1 and tied and px.tied_copied and (schedule_s is None or schedule_s.sums_s is None):
        # the tied copies' sum between the first and the last stage (timed.py prices it
        # among the stages' sums where those overlap the schedule)
        size = pt.tp * pt.dp * pt.ep
        ends = tuple(q * size + j for q in (0, pt.pp - 1) for j in range(0, size, pt.tp))
        sync += _seconds(cluster, Collective.ALL_REDUCE, item * tied / (pt.tp * pt.ep), ends)
    bw = cluster.device.memory_bandwidth * ComputeModel.for_device(cluster.device).bandwidth
    kept = elems - owned if zero else 0
    shard = 4 * (owned / pt.dp + kept if zero else elems)  # AdamW's fp32 words
    opt = 7 * shard / bw
    state = model_state_memory(owned if zero else elems, dp=pt.dp, stage=zero, precision=precision)
    whole = model_state_memory(kept, precision=precision).total
    temps = min(BUCKET_BYTES, param_bytes) if zero == 0 else 0
    if zero in (1, 2):
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
    if pt.pp > 1 and schedule_s is not None and schedule_s.shared_s is not None:
        # ranks sharing one node's cores: those waiting in the bubble leave their cores to
        # the others (the simulator's rule, on the schedule timed.py ran; a point priced
        # without its schedule is held to its shares)
        shared = step - (schedule_s.step_s - schedule_s.shared_s)
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


__all__ = ["Estimate", "estimable", "estimate"]

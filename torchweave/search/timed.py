"""Pipelined points priced by running their own schedule on per-stage costs from the real cut.

The arithmetic of :func:`~torchweave.search.estimate.estimate` charges every pipeline
rank ``blocks / pp`` blocks and the whole rest (embeddings, head, loss) and adds the
textbook bubble. That is right for stages of equal cost. It is not where the cut is
uneven: an encoder-decoder's stages hold whole layers whose costs differ (an mT5
encoder layer over 1,024 tokens costs several decoder layers over 256), a
250k-word head makes the last stage the slowest, and in an interleaved schedule
every rank waits for the slowest stage of the chain, not for its own share.
``bench/search_estimate.py`` measured the arithmetic 14% off on average on a
250k-vocabulary T5 and 8% on GPT-3 1.3B, up to 40%.

Here a point's stages are costed from the cut its plan will have
(:func:`torchweave.policies.stage_cuts.cut`, FLOP-balanced over ``pp ×
virtual`` stages): the proxy's seconds of the blocks and of the rest are shared
among the stages by each op's roofline seconds (forward and backward apart), and
each boundary carries the bytes that cross it. The point's schedule then runs on
those costs by the simulator's own rules (the same dependencies and transfers as
:func:`torchweave.sim.step.schedule.simulate_schedule`; tested equal), vectorised
over every split of the block that shares the schedule, so that all points of a
``(schedule, pp, virtual, micro)`` cost one pass.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from torchweave.ir.graph import Graph
from torchweave.lower.buckets import BUCKET_BYTES
from torchweave.ops import info
from torchweave.plan.schedules.builtin import builtin
from torchweave.search.makespan import Compiled, compile_schedule, exposed_sums, makespans
from torchweave.search.shares import Shares
from torchweave.sim.fast.fold import Blocks
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.collective_cost import Collective, collective_time
from torchweave.sim.hardware.compute import op_time
from torchweave.sim.step.backward import Buckets
from torchweave.sim.step.run import shared_cores, shared_cores_step

@dataclass(frozen=True)
class Priced:
    """A pipelined point's schedule run on its stages' costs."""

    step_s: float
    busy_s: float
    """The busiest rank's compute seconds."""
    sums_s: float | None
    """How much the gradient sums over ``dp`` and of a tied weight's copies add to the step,
    each stage's starting once its gradients are made (None where the estimate's arithmetic
    prices them: with ZeRO, whose sums wait for the last action, or expert parallelism)."""
    shared_s: float | None = None
    """The schedule's seconds where its ranks share one node's cores, those waiting in the
    bubble leaving theirs to the others (the simulator's rule,
    :func:`~torchweave.sim.step.run.shared_cores_step`); None elsewhere."""


def _with_comm(fwd: np.ndarray, bwd: np.ndarray, comm: float) -> tuple[np.ndarray, np.ndarray]:
    """Shares of forward and backward seconds per stage when ``comm`` of the seconds are
    collectives: compute splits as the roofline has it (backward about twice forward),
    the collectives half and half (each forward all-gather or all-reduce has its mirror
    in backward)."""
    half = 0.5 * comm * (fwd + bwd)
    return (1 - comm) * fwd + half, (1 - comm) * bwd + half


class Timing:
    """Per-stage shares of each cut and compiled schedules of one graph, kept across
    the points of a search."""

    def __init__(self, graph: Graph, blocks: Blocks, cluster: Cluster, dtype: torch.dtype | None,
                 batch: int):
        self.graph, self.cluster, self.batch, self._blocks = graph, cluster, batch, blocks
        self.half = dtype in (torch.float16, torch.bfloat16)
        self._ops = []  # (fwd, bwd, in a block, reads a parameter: where tp's collectives are)
        for n in graph.nodes:
            op = info(graph, n)
            t = op_time(op, cluster.device, dtype=dtype or torch.float32)
            self._ops.append((t.fwd, t.bwd, bool(n.module) and blocks.holds(n.module),
                              any(graph.values[r.name].kind == "param" for r in n.input_refs())))
        self._batched = graph.batched_values()  # values a micro-batch splits (as the simulator has them)
        self._shares: dict[tuple[int, str, tuple[int, ...]], Shares] = {}
        self._compiled: dict[tuple[str, int, int, int], Compiled] = {}
        self._links: dict[int, tuple[float, float]] = {}
        self._sums_s: dict[tuple, np.ndarray] = {}  # each stage's gradient sum, by split and cut
        self._reduce_s: dict[tuple, float] = {}
        self._starts: dict[str, int] | None = None  # module → its first op (cuts by name)

    def shares(self, stages: int, tied: str = "copy", cuts: tuple[int, ...] = ()) -> Shares:
        """The cut into ``stages`` as the pipeline policy makes it: at ``cuts`` (graph
        positions where stages 1, 2, … start; empty: its FLOP-balanced cut), with ``tied=send``
        its lookups of an earlier stage's parameters moved there (``send_lookups``)."""
        if (stages, tied, cuts) not in self._shares:
            from torchweave.policies.stage_cuts import cut, cut_at, send_lookups

            g = self.graph
            stage_of = cut_at(g, list(cuts), stages) if cuts else cut(g, stages)
            if tied == "send":
                stage_of = send_lookups(g, stage_of)
            where = [stage_of[n.name] for n in g.nodes]
            parts = np.zeros((4, stages))
            param_ops = np.zeros((2, stages))  # ops that read a parameter
            for s, (f, b, inside, reads) in zip(where, self._ops):
                parts[0 if inside else 2, s] += f
                parts[1 if inside else 3, s] += b
                param_ops[0 if inside else 1, s] += reads
            blk, rest = parts[:2].sum(), parts[2:].sum()
            made = {o: s for n, s in zip(g.nodes, where) for o in n.outputs if o}
            later: dict[str, list[int]] = defaultdict(list)  # value -> later stages reading it
            first: dict[str, int] = {}  # parameter -> the stage that holds it
            for n, s in zip(g.nodes, where):
                for ref in n.input_refs():
                    if ref.name in made:
                        if s > made[ref.name] and s not in later[ref.name]:
                            later[ref.name].append(s)
                    elif g.values[ref.name].kind == "param":
                        if first.setdefault(ref.name, s) < s and s not in later[ref.name]:
                            later[ref.name].append(s)
            # batch-free value -> the stages of its batch-split readers
            fixed: dict[str, list[int]] = defaultdict(list)
            for n, s in zip(g.nodes, where):
                if not any(o in self._batched for o in n.outputs if o):
                    continue
                for ref in n.input_refs():
                    if ref.name in made and ref.name not in self._batched and \
                            g.values[ref.name].meta.dtype.is_floating_point and s not in fixed[ref.name]:
                        fixed[ref.name].append(s)
            crossing: list[tuple[str, int, tuple[int, ...], int, str]] = []
            for name, readers in later.items():
                meta = g.values[name].meta
                narrow = self.half and meta.dtype == torch.float32  # sent in the compute dtype
                if name in made:
                    kind = "batch" if name in self._batched else "fixed"
                    start = made[name]
                else:
                    kind, start = "weight", first[name]
                crossing.append((name, start, tuple(sorted(readers)),
                                 meta.nbytes // (2 if narrow else 1), kind))
            held = np.zeros((2, stages))  # parameter elements, the blocks' and the rest's
            params: list[list[int]] = [[] for _ in range(stages)]
            for name, s in reversed(first.items()):
                v = g.values[name]
                held[0 if self._blocks.holds(v.target or name) else 1, s] += v.meta.numel
                params[s].append(v.meta.numel)
            self._shares[(stages, tied, cuts)] = Shares(parts[0] / (blk or 1), parts[1] / (blk or 1),
                                          parts[2] / (rest or 1), parts[3] / (rest or 1),
                                          tuple(crossing),
                                          held[0] / (held[0].sum() or 1),
                                          held[1] / (held[1].sum() or 1),
                                          tuple(tuple(p) for p in params),
                                          *(x / x.sum() if x.sum() else None for x in param_ops),
                                          tuple((v, made[v], tuple(sorted(st)), self._nbytes(v))
                                                for v, st in fixed.items()))
        return self._shares[(stages, tied, cuts)]

    @property
    def op_seconds(self) -> np.ndarray:
        """Each op's roofline seconds, forward and backward, whole (graph order)."""
        return np.array([f + b for f, b, *_ in self._ops])

    def _positions(self, modules: tuple[str, ...], stages: int) -> tuple[int, ...]:
        """A point's ``cuts`` (module names) as graph positions (empty: the policy's cut)."""
        if not modules:
            return ()
        if self._starts is None:
            from torchweave.policies.stage_cuts import module_starts

            self._starts = module_starts(self.graph)
        return tuple(self._starts[m] for m in modules)  # the search's own: valid names

    def _nbytes(self, value: str) -> int:
        """A value's bytes as sent and summed: a float32 one in the compute dtype."""
        meta = self.graph.values[value].meta
        return meta.nbytes // (2 if self.half and meta.dtype == torch.float32 else 1)

    def _link(self, peer: int) -> tuple[float, float]:
        """(latency, seconds per byte) of a transfer from device 0 to ``peer``, the next
        stage group's first device, as the simulator prices it (``sim/step/pipelined.py``)."""
        if peer not in self._links:
            big = 1 << 24
            t0 = collective_time(self.cluster, Collective.P2P, 0, (0, peer)).seconds
            t1 = collective_time(self.cluster, Collective.P2P, big, (0, peer)).seconds
            self._links[peer] = (t0, (t1 - t0) / big)
        return self._links[peer]

    def price(self, items: list, n_blocks: int) -> dict[object, Priced]:
        """The pipeline schedule of each ``(point, proxy)`` in ``items`` (pipelined points
        only), with its gradient sums where they overlap the schedule (see :class:`Priced`)."""
        groups: dict[tuple[str, int, int, int, str, tuple[str, ...]], list] = defaultdict(list)
        for pt, px in items:
            groups[(pt.schedule, pt.pp, pt.virtual, pt.micro, pt.tied, pt.cuts)].append((pt, px))
        out = {}
        for (*shape, tied, modules), members in groups.items():
            key = tuple(shape)
            schedule, pp, virtual, micro = key
            if key not in self._compiled:
                self._compiled[key] = compile_schedule(builtin(schedule, pp, virtual, micro))
            sh = self.shares(pp * virtual, tied, self._positions(modules, pp * virtual))
            cols = {}
            for pt, px in members:  # points differing by ZeRO stage alone share a column
                cols.setdefault((id(px), pt.dp, pt.tp * pt.ep), (pt, px))
            fwd, bwd, hop = (np.zeros((pp * virtual, len(cols))) for _ in range(3))
            for k, (pt, px) in enumerate(cols.values()):
                f = 1.0 / (pt.dp * pt.micro)
                whole = n_blocks * px.block_s
                block_f, block_b = _with_comm(sh.block_f, sh.block_b, px.block_comm / (px.block_s or 1))
                rest_f, rest_b = _with_comm(sh.rest_f, sh.rest_b, px.rest_comm / (px.rest_s or 1))
                if pt.recompute == "full":  # the proxy's block holds its forward twice; the
                    # second runs in backward (as the simulator's stage costs have it)
                    scale = 1.0 / (1.0 + block_f.sum())
                    block_f, block_b = block_f * scale, (block_b + block_f) * scale
                fwd[:, k] = (block_f * whole + rest_f * px.rest_s) * f
                bwd[:, k] = (block_b * whole + rest_b * px.rest_s) * f
                # a micro-batch runs each collective of its stage once: their latency is
                # paid whole, not scaled with the micro-batch (Proxy.block_at), where the
                # stage's ops that read parameters are (an encoder layer over 4x the tokens
                # has the seconds of several decoder layers but fewer collectives), half of
                # it in forward and half in backward, as _with_comm shares the seconds
                by_block = sh.block_n if sh.block_n is not None else block_f + block_b
                by_rest = sh.rest_n if sh.rest_n is not None else rest_f + rest_b
                paid = 0.5 * (1 - f) * (by_block * n_blocks * px.block_lat + by_rest * px.rest_lat)
                fwd[:, k] += paid
                bwd[:, k] += paid
                lat, per_byte = self._link(pt.tp * pt.dp * pt.ep)
                # bytes a stage's rank receives, as the simulator sizes them: of each value,
                # what one reader's piece reads under the split (a sequence-split residual,
                # its shard; a value a column-parallel linear reads, a whole copy), per
                # micro-batch; a value without the batch dim (a relative-position bias) whole
                # with each micro-batch. A tied weight crosses no boundary: each stage that
                # reads it keeps a copy (lower/copies.py)
                acts = sh.received(pp, "batch", px.reads, 1.0 / (pt.ep * (pt.tp if pt.sp else 1))) * f
                fixed = sh.received(pp, "fixed", px.reads, 1.0)
                # a tied weight its readers read differently: sent with every micro-batch
                tied = 0.0 if px.tied_copied else sh.received(pp, "weight", {}, 1.0 / (pt.tp * pt.ep))
                hop[:, k] = lat + (acts + fixed + tied) * per_byte
                if not px.tied_copied and pt.tp > 1:  # and its gradient summed over tp with
                    for _, made, _, nbytes, kind in sh.crossing:  # each, where it is held
                        if kind == "weight":
                            bwd[made, k] += self._all_reduce(nbytes, tuple(range(pt.tp)))
                if pt.dp * pt.ep > 1:  # a batch-free value's gradient, summed a micro-batch
                    # over the ranks the batch is split over (rank 0's, tp innermost)
                    group = tuple(range(0, pt.tp * pt.ep * pt.dp, pt.tp))
                    bwd[:, k] += sh.fixed_sums(pp, px.reads, 1.0 / (pt.tp * pt.ep),
                                               lambda n, g=group: self._all_reduce(n, g))
            run = makespans(self._compiled[key], fwd, bwd, hop)
            sums = np.zeros((pp * virtual, len(cols)))
            tied = np.zeros((pp * virtual, len(cols)))  # summed once the schedule is done
            for k, (pt, px) in enumerate(cols.values()):
                if pt.ep == 1:
                    if px.tied_copied:
                        tied[:, k] = self._tied_sums(pt, sh, pp)
                    if pt.dp > 1:
                        sums[:, k] = self._sums(pt, px, sh, n_blocks, pp if px.tied_copied else 0)
            exposed = exposed_sums(run, sums, tied)
            shared = None
            if self.cluster.share < 1:  # each action on its pipeline rank's group of ranks
                group = np.array([[pt.dp * pt.tp * pt.ep / self.cluster.devices_per_node
                                   for pt, _ in cols.values()]])
                shared = shared_cores_step(run.starts, run.finishes,
                                           np.broadcast_to(group, run.starts.shape), self.cluster.share)
            col = {c: k for k, c in enumerate(cols)}
            for pt, px in members:
                k = col[(id(px), pt.dp, pt.tp * pt.ep)]
                overlapped = pt.zero == 0 and pt.ep == 1
                on_one = shared is not None and shared_cores(self.cluster, pp * pt.dp * pt.tp * pt.ep)
                out[pt] = Priced(float(run.step[k]), float(run.busy[k]),
                                 float(exposed[k]) if overlapped else None,
                                 float(shared[k]) if on_one else None)
        return out

    def _sums(self, pt, px, sh: Shares, n_blocks: int, pp: int) -> np.ndarray:
        """Each stage's gradient sum over ``dp`` in seconds (``dp > 1``, no experts): its
        parameters' gradients in the compute dtype (the proxy's bytes on one rank), in
        buckets by the runtime's rule (:class:`~torchweave.sim.step.backward.Buckets`: a
        bucket is summed once it holds 25 MiB, so a larger parameter is a sum of its own)."""
        key = (id(px), pt.dp, pt.tp, id(sh), pp)  # the cut (and its moved lookups) by its Shares
        if key not in self._sums_s:
            item = 2 if self.half else 4
            group = tuple(range(0, pt.tp * pt.dp, pt.tp))  # rank 0's replicas (tp innermost)
            out = np.zeros(len(sh.block_p))
            copied = self._copied(sh, pp) if pp else []  # pp 0: no copies
            seen: dict[tuple, float] = {}  # a pipeline's middle stages hold alike parameters
            for s, sizes in enumerate(sh.params):
                nbytes = item * (sh.block_p[s] * n_blocks * px.block_params
                                 + sh.rest_p[s] * px.rest_params)
                scale = nbytes / (sum(sizes) or 1)  # the graph's elements, as one rank holds them
                sizes = list(sizes)
                for made, numel in copied:  # a tied weight's copies are summed with each other
                    if made == s and numel in sizes:
                        sizes.remove(numel)
                alike = (tuple(sizes), scale)
                if alike not in seen:
                    seen[alike] = sum(self._all_reduce(int(size), group)
                                      for size in _buckets(alike[0], scale) if size)
                out[s] = seen[alike]
            self._sums_s[key] = out
        return self._sums_s[key]

    def _tied_sums(self, pt, sh: Shares, pp: int) -> np.ndarray:
        """Each stage's sums of a tied weight's copies (lower/copies.py): every
        pipeline rank that reads it keeps a copy of its ``tp`` piece, summed once a step over
        all holders of that piece, on each holder once its schedule is done (the runtime
        launches that sum after the rank's sends: runtime/schedule_runner.py)."""
        out = np.zeros(len(sh.block_p))
        size = pt.tp * pt.dp * pt.ep  # a stage group
        for name, made, readers, nbytes, kind in sh.crossing:
            first = self._holders(made, readers, pp) if kind == "weight" else {}
            if len(first) < 2:
                continue
            group = tuple(q * size + j for q in sorted(first)
                          for j in range(0, pt.tp * pt.ep * pt.dp, pt.tp))
            seconds = self._all_reduce(int(nbytes / (pt.tp * pt.ep)), group)
            for t in first.values():
                out[t] += seconds
        return out

    @staticmethod
    def _holders(made: int, readers: tuple[int, ...], pp: int) -> dict[int, int]:
        """Pipeline rank -> its first stage reading a weight (each keeps a copy)."""
        first: dict[int, int] = {}
        for t in (made, *readers):
            first.setdefault(t % pp, t)
        return first

    def _copied(self, sh: Shares, pp: int) -> list[tuple[int, int]]:
        """``(stage holding it first, its elements)`` of each weight with copies on other
        pipeline ranks."""
        return [(made, self.graph.values[name].meta.numel)
                for name, made, readers, _, kind in sh.crossing
                if kind == "weight" and len(self._holders(made, readers, pp)) > 1]

    def _all_reduce(self, nbytes: int, group: tuple[int, ...]) -> float:
        if (nbytes, group) not in self._reduce_s:
            self._reduce_s[(nbytes, group)] = collective_time(
                self.cluster, Collective.ALL_REDUCE, nbytes, group).seconds
        return self._reduce_s[(nbytes, group)]


@functools.lru_cache(maxsize=4096)
def _buckets(sizes: tuple[int, ...], scale: float) -> tuple[float, ...]:
    """The bytes of each gradient sum when parameters of ``sizes`` elements (``scale`` bytes
    each), in the order backward makes them, are bucketed by the runtime's rule
    (:class:`~torchweave.sim.step.backward.Buckets`, whose arithmetic this repeats)."""
    buckets, closed = Buckets(BUCKET_BYTES), []
    for i, n in enumerate(sizes):
        closed += buckets.add(str(i), (), n * scale)
    return tuple(size for _, _, size in closed + buckets.drain())


__all__ = ["Priced", "Timing"]

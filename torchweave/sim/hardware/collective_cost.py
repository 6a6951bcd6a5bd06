"""Collective times: an α-β model per collective and algorithm, hierarchy aware.

A message of ``n`` bytes over a link costs ``α + n/β`` (latency ``α``, bandwidth
``β`` per device per direction). Per collective, over ``p`` ranks and ``B`` bytes:

==============  ============  ==================================================
collective      algorithm     time
==============  ============  ==================================================
all_reduce      ring          2(p-1)/p · B/β + 2(p-1) α
all_reduce      tree          2⌈log2 p⌉ · (α + B/β)   (binomial reduce + broadcast)
all_gather      ring          (p-1)/p · B/β + (p-1) α   (B: the gathered output)
reduce_scatter  ring          (p-1)/p · B/β + (p-1) α   (B: the full input)
all_to_all      direct        (p-1)/p · B/β + (p-1) α   (B: one rank's send buffer)
broadcast       ring          B/β + (p-1) α   (pipelined chain, large messages)
broadcast       tree          ⌈log2 p⌉ · (α + B/β)
p2p             direct        α + B/β
==============  ============  ==================================================

These are the algorithms NCCL offers (ring and tree all-reduce; ring
all-gather and reduce-scatter), with the classic costs of Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA, 2005).

A group whose ranks span nodes pays the network: a flat algorithm runs at the
slowest link's rate (``inter``). The *hierarchical* algorithm splits the work
the way NCCL's does: all-reduce = intra-node reduce-scatter, inter-node
all-reduce of ``B/k`` (``k`` ranks per node, in ``k`` parallel rings, one per
NIC), intra-node all-gather. :func:`collective_time` picks the cheapest.
"""

from __future__ import annotations

import enum
import math
import types
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from torchweave.errors import Problem, SimError
from torchweave.lower import steps
from torchweave.sim.hardware.cluster import Cluster
from torchweave.sim.hardware.devices import Link



class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P = "p2p"


class Algorithm(enum.Enum):
    RING = "ring"
    TREE = "tree"
    DIRECT = "direct"
    """Pairwise messages (all-to-all, point-to-point)."""
    HIERARCHICAL = "hierarchical"
    """Intra-node step, inter-node step over a shard, intra-node step."""
    LOCAL = "local"
    """A group of one rank: nothing moves."""


_FLAT: Mapping[Collective, tuple[Algorithm, ...]] = types.MappingProxyType({
    Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE),
    Collective.ALL_GATHER: (Algorithm.RING,),
    Collective.REDUCE_SCATTER: (Algorithm.RING,),
    Collective.ALL_TO_ALL: (Algorithm.DIRECT,),
    Collective.BROADCAST: (Algorithm.RING, Algorithm.TREE),
    Collective.P2P: (Algorithm.DIRECT,),
})
"""The flat algorithms of each collective (NCCL's set)."""


@dataclass(frozen=True, kw_only=True)
class CommCost:
    """The predicted time of one collective on one group."""

    collective: Collective
    algorithm: Algorithm
    seconds: float
    nbytes: int
    ranks: int
    nodes: int
    """Nodes the group spans."""

    def __str__(self) -> str:
        where = f"{self.ranks} ranks" + (f" on {self.nodes} nodes" if self.nodes > 1 else "")
        return (f"{self.collective.value} {self.nbytes / 2**20:.3g} MiB over {where}: "
                f"{self.algorithm.value} {self.seconds * 1e3:.3g} ms")


def flat_time(collective: Collective, algorithm: Algorithm, nbytes: float, p: int, link: Link) -> float:
    """Seconds for one collective over ``p`` ranks that all use ``link``."""
    a, bw = link.latency, link.bandwidth
    if p <= 1:
        return 0.0
    logp = math.ceil(math.log2(p))
    c, alg = collective, algorithm
    if c is Collective.ALL_REDUCE and alg is Algorithm.RING:
        return 2 * (p - 1) / p * nbytes / bw + 2 * (p - 1) * a
    if c is Collective.ALL_REDUCE and alg is Algorithm.TREE:
        return 2 * logp * (a + nbytes / bw)
    if c in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (p - 1) / p * nbytes / bw + (p - 1) * a
    if c is Collective.BROADCAST and alg is Algorithm.RING:
        return nbytes / bw + (p - 1) * a
    if c is Collective.BROADCAST and alg is Algorithm.TREE:
        return logp * (a + nbytes / bw)
    if c is Collective.P2P:
        return a + nbytes / bw
    raise SimError(Problem(obj=c.value, value=alg.value, rule="no such algorithm for this collective",
                           fix=f"use one of: {', '.join(x.value for x in _FLAT[c])}"))


def _best_flat(c: Collective, nbytes: float, p: int, link: Link) -> float:
    return min(flat_time(c, alg, nbytes, p, link) for alg in _FLAT[c])


def _hierarchical(c: Collective, nbytes: float, n: int, k: int, cluster: Cluster) -> float | None:
    """Seconds over ``n`` nodes × ``k`` ranks each, or None where not defined."""
    intra, inter = cluster.intra, cluster.inter
    ring = Algorithm.RING
    if c is Collective.ALL_REDUCE:
        return (flat_time(Collective.REDUCE_SCATTER, ring, nbytes, k, intra)
                + _best_flat(Collective.ALL_REDUCE, nbytes / k, n, inter)
                + flat_time(Collective.ALL_GATHER, ring, nbytes, k, intra))
    if c in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return flat_time(c, ring, nbytes / k, n, inter) + flat_time(c, ring, nbytes, k, intra)
    if c is Collective.BROADCAST:
        return _best_flat(c, nbytes, n, inter) + _best_flat(c, nbytes, k, intra)
    return None


def _all_to_all_spanning(nbytes: float, p: int, k: int, cluster: Cluster) -> float:
    """Pairwise exchange: the on-node and off-node shares move at once."""
    on, off = (k - 1) * nbytes / p, (p - k) * nbytes / p
    return (max(on / cluster.intra.bandwidth, off / cluster.inter.bandwidth)
            + (k - 1) * cluster.intra.latency + (p - k) * cluster.inter.latency)


def _check_group(cluster: Cluster, collective: Collective, group: Sequence[int]) -> None:
    problems = []
    bad = [r for r in group if not (isinstance(r, int) and 0 <= r < cluster.size)]
    if bad:
        problems.append(Problem(obj=f"{collective.value} group {tuple(group)}", value=f"ranks {bad}",
                                rule=f"ranks must be in [0, {cluster.size}) for cluster {cluster}",
                                fix="use a smaller group or a larger cluster"))
    dup = sorted(r for r, n in Counter(group).items() if n > 1)
    if dup:
        problems.append(Problem(obj=f"{collective.value} group {tuple(group)}", value=f"repeats {dup}",
                                rule="each rank appears once in a group", fix="remove the repeats"))
    if not group or (collective is Collective.P2P and len(group) != 2):
        problems.append(Problem(obj=f"{collective.value} group", value=repr(tuple(group)),
                                rule="p2p takes (src, dst); other collectives one rank or more",
                                fix="pass the ranks that take part"))
    if problems:
        raise SimError(problems)


def collective_options(cluster: Cluster, collective: Collective, nbytes: int,
                       group: Sequence[int]) -> list[CommCost]:
    """Every algorithm that applies to ``group``, cheapest first."""
    _check_group(cluster, collective, group)
    per_node = Counter(cluster.node_of(r) for r in group)
    p, n, k = len(group), len(per_node), max(per_node.values())

    wait = cluster.device.collective_wait if p > 1 else 0.0  # ranks arriving out of step

    def cost(alg: Algorithm, seconds: float) -> CommCost:
        return CommCost(collective=collective, algorithm=alg, seconds=seconds + wait,
                        nbytes=nbytes, ranks=p, nodes=n)

    if p == 1:
        return [cost(Algorithm.LOCAL, 0.0)]
    if n == 1:
        return sorted((cost(a, flat_time(collective, a, nbytes, p, cluster.intra))
                       for a in _FLAT[collective]), key=lambda c: c.seconds)
    if collective is Collective.ALL_TO_ALL:
        return [cost(Algorithm.DIRECT, _all_to_all_spanning(nbytes, p, k, cluster))]
    # Flat algorithms across nodes run at the network's rate (one NIC per device).
    out = [cost(a, flat_time(collective, a, nbytes, p, cluster.inter)) for a in _FLAT[collective]]
    if k > 1:
        h = _hierarchical(collective, nbytes, n, k, cluster)
        if h is not None:
            out.append(cost(Algorithm.HIERARCHICAL, h))
    return sorted(out, key=lambda c: c.seconds)


def collective_time(cluster: Cluster, collective: Collective, nbytes: int, group: Sequence[int],
                    *, algorithm: Algorithm | None = None) -> CommCost:
    """The cost of one collective: the cheapest algorithm, or the one asked for."""
    options = collective_options(cluster, collective, nbytes, group)
    if algorithm is None:
        return options[0]
    for option in options:
        if option.algorithm is algorithm:
            return option
    raise SimError(Problem(
        obj=f"{collective.value} over {len(group)} ranks", value=algorithm.value,
        rule=f"applies here: {', '.join(o.algorithm.value for o in options)}",
        fix="pass one of those, or algorithm=None for the cheapest"))


def collective_of(step: steps.Step) -> Collective | None:
    """The collective a lowering step's forward runs; None for local steps (split, narrow,
    and the forward of a gradient all-reduce, which moves nothing)."""
    name = step.forward_collective()
    return None if name is None else Collective(name)

"""The search's proxies (:func:`~torchweave.search.estimate.proxy`), one per way of splitting
a block, tried a degree at a time: a larger ``tp`` while Megatron's split of the last one
makes a block faster than a smaller degree did (the solver's split is no guide: it may split
the batch, which always scales)."""

from __future__ import annotations

import math
from typing import Callable

from torchweave.errors import TorchweaveError
from torchweave.ir.graph import Graph
from torchweave.search.admit import op_rules
from torchweave.search.constraints import Constraints
from torchweave.search.estimate import Proxy, proxy
from torchweave.search.intra import Partition
from torchweave.search.pool import Failed, Runner
from torchweave.search.space import Point


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


__all__ = ["by_degree", "proxy_key"]

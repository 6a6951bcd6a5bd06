"""The search's proxies (:func:`~torchweave.search.estimate.proxy`), one per way of splitting
a block, tried a degree at a time: a larger ``tp`` only while some split of the last one
makes the whole model faster than a smaller degree did."""

from __future__ import annotations

import math
from typing import Callable

from torchweave.ir.graph import Graph
from torchweave.search.admit import op_rules
from torchweave.search.constraints import Constraints
from torchweave.search.estimate import Proxy, proxy
from torchweave.search.intra import Partition
from torchweave.search.pool import Failed, Runner
from torchweave.search.space import Point


def by_degree(runner: Runner, graph: Graph, pts: list[Point], parts: dict[int, Partition | None],
             solve_tp: Callable[[int], Partition | None], c: Constraints, excluded: list[str],
             say: Callable[[str], None], n_blocks: int) -> dict[tuple, Proxy | None]:
    """One proxy per way of splitting a block, a degree at a time (its ways at once), larger
    degrees only while they make the model (its ``n_blocks`` blocks and the rest) faster; a
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
        best = min((_whole(x, n_blocks) for k, x in proxies.items() if x and k[0] < tp and k[5] == 1),
                   default=math.inf)
        for key in group:
            say(f"proxy tp={key[0]} sp={key[1]} recompute={key[2]} split={key[3]} coshard={key[4]}"
                + (f" ep={key[5]}" if key[5] > 1 else ""))
        got = runner.map(_proxy_job, [(key, parts[tp].dims if key[3] == "solved" and parts.get(tp)
                                       else None) for key in group])
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
        here = min((_whole(proxies[k], n_blocks) for k in group if proxies.get(k) and k[5] == 1),
                   default=math.inf)
        if tp > 1 and here >= best:  # no way of splitting at this degree beats a smaller one
            stop = tp
            excluded.append(f"tp > {tp}: not tried; no split at tp={tp} is faster over the whole "
                            f"model ({here:.4g} s) than at a smaller degree ({best:.4g} s)")
    return proxies


def _whole(px: Proxy, n_blocks: int) -> float:
    """A proxy's seconds for the whole model on its devices: every block and the rest (the
    rest may weigh more than the blocks: Swin's high-resolution early stages)."""
    return n_blocks * px.block_s + px.rest_s


def proxy_key(pt: Point) -> tuple:
    """The proxy that prices ``pt``: its way of splitting a block."""
    return (pt.tp, pt.sp, pt.recompute, pt.split, pt.coshard, pt.ep)


def _proxy_job(s: dict, key: tuple, dims: dict | None) -> Proxy:
    return proxy(s["graph"], s["blocks"], s["cluster"], *key[:3], coshard=key[4], ep=key[5],
                 dtype=s["dtype"],
                 precision=s["precision"], dims=dims)


__all__ = ["by_degree", "proxy_key"]

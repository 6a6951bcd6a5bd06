"""``torchweave explain``: per op, a plan's partition, devices, communication, time and memory;
its top costs; and ``--vs`` another plan side by side.

It shares the capture, plan and cluster helpers of :mod:`torchweave.commands.sim`; the
table itself is :func:`torchweave.sim.op_table.explain_plan`.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchweave.commands.sim import (
    GiB, _capture, _dtype, _mib, _ms, _plan_for, gantt_path, load_cluster, write_gantt,
)
from torchweave.errors import Problem, TorchweaveError
from torchweave.sim.op_table import Explained, explain_plan


def plan_and_model(args: argparse.Namespace) -> tuple[str, str]:
    """``explain MODEL --plan PLAN``, as every other command takes a plan, or the older
    ``explain PLAN MODEL``."""
    given = list(args.model)
    if args.plan_option is not None and len(given) == 1:
        return args.plan_option, given[0]
    if args.plan_option is None and len(given) == 2:
        return given[0], given[1]
    raise TorchweaveError(Problem(
        obj="torchweave explain", value=" ".join(given) + (f" --plan {args.plan_option}"
                                                           if args.plan_option else ""),
        rule="one model and one plan: MODEL --plan PLAN (or the older PLAN MODEL)",
        fix="e.g. torchweave explain gpt-small --plan 1f1b:tp=2 --cluster 8xA100-80GB-SXM"))


def explain_cmd(args: argparse.Namespace, console: Console) -> int:
    args.plan, args.model = plan_and_model(args)
    cluster = load_cluster(args.cluster)
    graph = _capture(args.model, args.meta)
    dtype = _dtype(args.dtype)
    plan = _plan_for(args.plan, graph, cluster, args.world_size)
    mine = explain_plan(graph, plan, cluster, dtype=dtype)
    _op_table(mine, console, limit=None if args.all else 60)
    _top_costs(mine, console, k=args.top)
    fits = _fit(mine, cluster, console)
    write_gantt(mine.result, gantt_path(args, plan.name), console)
    if args.vs:
        other_plan = _plan_for(args.vs, graph, cluster, plan.world_size)
        other = explain_plan(graph, other_plan, cluster, dtype=dtype)
        _compare(mine, other, console, k=args.top)
    return 0 if fits else 1


def _fit(ex: Explained, cluster, console: Console) -> bool:
    """Whether the plan fits the cluster: devices (checked before simulating) and memory."""
    r = ex.result
    cap = cluster.device.memory_bytes
    used = f"uses {r.world_size} of the cluster's {cluster.size} devices"
    if not r.oom:
        worst = max(range(len(r.memory)), key=lambda i: r.memory[i].peak)
        console.print(f"fits: {used}; peak memory {r.memory[worst].peak / GiB:.3g} GiB on rank "
                      f"{worst} of {cap / GiB:.3g} GiB ({cluster.device.name})",
                      highlight=False, markup=False)
        return True
    o = r.oom[0]
    console.print(f"does not fit: OUT OF MEMORY on {len(r.oom)} of {r.world_size} ranks; rank "
                  f"{o.rank} needs {o.peak / GiB:.3g} GiB, {o.device} has {o.capacity / GiB:.3g} "
                  f"GiB (rule: a rank's predicted peak memory must fit its device); biggest: "
                  + ", ".join(f"{w} {n / GiB:.3g} GiB" for w, n in o.contributors[:3])
                  + "; fix: shard more (zero, tp, pipeline stages), recompute, or use bigger devices",
                  highlight=False, markup=False)
    return False


def _op_table(ex: Explained, console: Console, limit: int | None) -> None:
    r = ex.result
    t = Table(title=f"plan {r.plan_name!r} on {r.cluster}: per op (time = fwd+bwd of one piece, "
                    "memory = local outputs)", title_justify="left")
    staged = any(row.stage is not None for row in ex.rows)
    cols = ("node", "op") + (("stage",) if staged else ()) + (
        "partition", "devices", "communication before", "time", "memory")
    for col in cols:
        t.add_column(col, no_wrap=col != "communication before",
                     justify="right" if col in ("time", "memory") else "left")
    rows = ex.rows if limit is None else ex.rows[:limit]
    for row in rows:
        comm = "; ".join(row.comm) + (f" ({_ms(row.comm_time)})" if row.comm else "")
        t.add_row(*map(Text, (row.node, row.op, *((str(row.stage),) if staged else ()),
                              row.partition, row.devices, comm or "-", _ms(row.time),
                              _mib(row.memory))))
    console.print(t)
    if limit is not None and len(ex.rows) > limit:
        console.print(f"... {len(ex.rows) - limit} more ops (--all shows every op)")


def _top_costs(ex: Explained, console: Console, k: int) -> None:
    r = ex.result
    console.print(f"step {_ms(r.step_time)}, comm/rank {_ms(sum(r.comm_time) / len(r.comm_time))}, "
                  f"peak memory {max(r.peak_memory) / GiB:.3g} GiB, MFU {r.mfu:.1%}",
                  highlight=False, markup=False)
    for note in r.notes:
        console.print(f"  {note}", highlight=False, markup=False)
    console.print(f"top {k} ops by time:", highlight=False)
    for row in sorted(ex.rows, key=lambda x: -x.time)[:k]:
        console.print(f"  {_ms(row.time):>12}  {row.node} ({row.op}, {row.partition})",
                      highlight=False, markup=False)
    console.print(f"top {k} collectives by time:", highlight=False)
    top = sorted(ex.collectives.items(), key=lambda x: -x[1])[:k]
    for name, secs in top:
        console.print(f"  {_ms(secs):>12}  {name}", highlight=False, markup=False)
    if not top:
        console.print("  (no communication)", highlight=False)


def _compare(a: Explained, b: Explained, console: Console, k: int) -> None:
    ra, rb = a.result, b.result
    t = Table(title=f"why not {rb.plan_name!r}? {ra.plan_name!r} against {rb.plan_name!r}",
              title_justify="left")
    for col in ("", ra.plan_name, rb.plan_name, f"{rb.plan_name} vs {ra.plan_name}"):
        t.add_column(col, justify="left" if not col else "right")

    def mean(x):
        return sum(x) / len(x)

    for what, x, y, fmt in (
            ("step time", ra.step_time, rb.step_time, _ms),
            ("comm time/rank", mean(ra.comm_time), mean(rb.comm_time), _ms),
            ("compute time/rank", mean(ra.compute_time), mean(rb.compute_time), _ms),
            ("peak memory", max(ra.peak_memory), max(rb.peak_memory), lambda n: f"{n / GiB:.3g} GiB"),
            ("MFU", ra.mfu, rb.mfu, lambda f: f"{f:.1%}")):
        rel = f"{(y - x) / x:+.0%}" if x else "-"
        t.add_row(*map(Text, (what, fmt(x), fmt(y), rel)))
    console.print(t)
    verdict = "faster" if ra.step_time < rb.step_time else "slower"
    ratio = ra.step_time / rb.step_time if rb.step_time else float("inf")
    oom = [r.plan_name for r in (ra, rb) if r.oom]
    console.print(f"{ra.plan_name!r} is {verdict} than {rb.plan_name!r}: its step is {ratio:.3g}x; "
                  + (f"out of memory: {', '.join(oom)}" if oom else "both fit in memory"),
                  highlight=False, markup=False)
    other = {row.node: row for row in b.rows}
    diffs = []
    for row in a.rows:
        o = other.get(row.node)
        if o is None:
            continue
        d = (o.time + o.comm_time) - (row.time + row.comm_time)
        diffs.append((d, row, o))
    diffs.sort(key=lambda x: -abs(x[0]))
    console.print(f"biggest per-op differences (time + communication, {rb.plan_name} - "
                  f"{ra.plan_name}):", highlight=False, markup=False)
    for d, row, o in diffs[:k]:
        if d == 0:
            break
        console.print(f"  {'+' if d > 0 else '-'}{_ms(abs(d))}  {row.node} ({row.op}): {row.partition} "
                      f"[{_ms(row.time + row.comm_time)}] vs {o.partition} "
                      f"[{_ms(o.time + o.comm_time)}]", highlight=False, markup=False)

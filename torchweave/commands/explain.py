"""``torchweave explain``: per op, a plan's partition, devices, communication, time and memory;
its top costs; and ``--vs`` another plan side by side.

It shares the capture, plan and cluster helpers of :mod:`torchweave.commands.sim`.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchweave.commands.sim import (
    GiB, Setup, _capture, _dtype, _mib, _ms, _plan_for, _sim, gantt_path, load_cluster, write_gantt,
)
from torchweave.errors import Problem, TorchweaveError
from torchweave.sim.hardware.collective_cost import BUCKET_BYTES


@dataclass
class OpRow:
    node: str
    op: str
    partition: str
    devices: str
    comm: list[str]
    comm_time: float
    time: float
    memory: int
    stage: int | None = None
    """Pipelined plans: the node's stage."""


@dataclass
class Explained:
    result: Any
    rows: list[OpRow]
    collectives: dict[str, float]
    """Collective event name → seconds (max over ranks)."""


def _devices(devs: list[int]) -> str:
    if not devs:
        return "-"
    uniq = sorted(set(devs))
    if uniq == list(range(uniq[0], uniq[-1] + 1)) and len(uniq) > 2:
        text = f"{uniq[0]}-{uniq[-1]}"
    else:
        text = ",".join(map(str, uniq))
    return text if len(uniq) == len(devs) else f"{text} (x{len(devs) // len(uniq)})"


def explain_plan(setup: Setup) -> Explained:
    """Per-op partition, devices, communication, time and memory of one plan."""
    from torchweave.lower import steps
    from torchweave.sim.hardware.compute import ComputeModel
    from torchweave.sim.step.build import Builder

    plan, cluster = setup.plan, setup.cluster
    if plan.world_size > cluster.size:  # before lowering: the plan must fit the cluster
        raise TorchweaveError(Problem(
            obj=f"plan {plan.name!r} world_size", value=str(plan.world_size),
            rule=f"a plan must fit the cluster: {cluster} has {cluster.size} devices",
            fix=f"use a cluster of at least {plan.world_size} devices, or a plan for {cluster.size}"))
    from torchweave.sim.fast.symmetry import lower_programs

    # One data-parallel replica lowered for all when the plan allows (sim/fast/symmetry.py);
    # the communication each node gets is the same on every replica.
    programs, _ = lower_programs(setup.graph, setup.plan, None)
    result = _sim(setup)
    model = ComputeModel.for_device(setup.cluster.device)
    costs = Builder(setup.graph, setup.plan, setup.cluster, setup.dtype, model, BUCKET_BYTES).costs
    # Collective time per event name: sum on each rank, max over ranks.
    per_rank: dict[tuple[int, str], float] = defaultdict(float)
    for e in result.timeline:
        if e.stream == "comm":
            per_rank[(e.rank, e.name)] += e.end - e.start
    coll: dict[str, float] = {}
    for (_, name), t in per_rank.items():
        coll[name] = max(coll.get(name, 0.0), t)
    inserted: dict[str, dict[str, None]] = defaultdict(dict)  # consumer → names, ordered
    for prog in programs:
        for c in prog.comms():
            if c.consumer:
                inserted[c.consumer][f"{steps.name_of(c.step)} {c.value}"] = None
    stand_in = _folded_values(setup, result)

    def seconds(name: str) -> float:
        """A collective's time; in a folded model, blocks past the 4th read block 3's."""
        kind, _, value = name.partition(" ")
        alt = f"{kind} {stand_in.get(value, value)}"
        return coll.get(name, coll.get(alt, 0.0)) + coll.get(name + " bwd", coll.get(alt + " bwd", 0.0))

    rows = []
    for node in setup.graph.nodes:
        cost = costs[node.name]
        names = list(inserted.get(node.name, {}))
        rows.append(OpRow(
            node=node.name, op=node.target.rsplit(".", 1)[0].removeprefix("aten."),
            partition=" ".join(map(str, setup.plan.transforms(node.name))) or "whole",
            devices=_devices(setup.plan.assignment.get(node.name, [])),
            comm=names,
            comm_time=sum(seconds(n) for n in names),
            time=cost.fwd + cost.bwd, memory=sum(cost.out_bytes),
            stage=setup.plan.pipeline.stage_of.get(node.name) if setup.plan.pipeline else None))
    return Explained(result, rows, coll)


def _folded_values(setup: Setup, result) -> dict[str, str]:
    """When the simulation folded the model's blocks (sim/fast/fold.py): each value made in
    a block past the 4th → the same value of block 3, the last one simulated."""
    if not result.folded_blocks:
        return {}
    from torchweave.sim.fast.fold import find_blocks, made_in

    blocks = find_blocks(setup.graph, setup.plan)
    if blocks is None or len(blocks) < 5:
        return {}
    start = blocks.spans[3][0]
    return {v: setup.graph.nodes[start + q].outputs[j]
            for v, (b, q, j) in made_in(blocks, setup.graph).items() if b >= 4}


def explain_cmd(args: argparse.Namespace, console: Console) -> int:
    cluster = load_cluster(args.cluster)
    graph = _capture(args.model, args.meta)
    dtype = _dtype(args.dtype)
    plan = _plan_for(args.plan, graph, cluster, args.world_size)
    mine = explain_plan(Setup(graph, plan, cluster, dtype))
    _op_table(mine, console, limit=None if args.all else 60)
    _top_costs(mine, console, k=args.top)
    fits = _fit(mine, cluster, console)
    write_gantt(mine.result, gantt_path(args, plan.name), console)
    if args.vs:
        other_plan = _plan_for(args.vs, graph, cluster, plan.world_size)
        other = explain_plan(Setup(graph, other_plan, cluster, dtype))
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

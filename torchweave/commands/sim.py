"""``torchweave simulate`` and ``torchweave explain``.

:mod:`torchweave.cli` parses the arguments and calls these; each takes the
parsed ``argparse.Namespace`` and a rich ``Console`` and returns the exit
status (0 ok, 1 the plan does not fit, 2 bad input via ``TorchweaveError``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchweave.errors import Problem, TorchweaveError

GiB = 2**30
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------- shared
def load_cluster(spec: str):
    """``--cluster``: a cluster string (``8xA100-80GB-SXM``) or a YAML path."""
    from torchweave.sim.cluster import load_cluster_yaml, parse_cluster

    if spec.endswith((".yaml", ".yml")) or os.sep in spec:
        if not Path(spec).is_file():
            raise TorchweaveError(Problem(
                obj="--cluster", value=repr(spec), rule="a cluster YAML path must exist",
                fix="check the path, or give a cluster string such as 8xA100-80GB-SXM"))
        return load_cluster_yaml(spec)
    return parse_cluster(spec)


@dataclass
class Setup:
    graph: Any
    plan: Any
    cluster: Any
    dtype: torch.dtype | None
    grad_accum: int = 1
    """Micro-batches per step (the graph is one micro-batch's)."""


def _capture(model: str, meta: bool, micro_batches: int = 1):
    """``model``'s graph on its example batch, or on one of ``micro_batches`` pieces of it."""
    import torchweave
    from torchweave.factory import load

    loaded = load(model, meta=meta)
    args = loaded.args
    if micro_batches != 1:
        batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 0)
        if micro_batches < 1 or batch % micro_batches:
            raise TorchweaveError(Problem(
                obj="--grad-accum", value=str(micro_batches),
                rule=f"the micro-batches divide the example batch (the global batch): "
                     f"{batch} % {micro_batches} != 0" if micro_batches >= 1 else "at least 1",
                fix="a K that divides the model's example batch, or an example batch that K divides"))
        args = tuple(a[: batch // micro_batches] if isinstance(a, torch.Tensor) and a.dim() else a
                     for a in args)
    return torchweave.capture(loaded.model, args, loaded.kwargs, name=loaded.name)


def _plan_for(spec: str, graph, cluster, world_size: int | None):
    from torchweave.plan.validate import validate
    from torchweave.policies import resolve

    n = world_size or cluster.size
    plan = resolve(spec, graph, n)
    validate(plan, graph, world_size=world_size or plan.world_size)
    return plan


def _dtype(name: str | None) -> torch.dtype | None:
    return _DTYPES[name] if name else None


def _sim(setup: Setup, *, programs=None, profiles=None):
    from torchweave.sim.simulate import simulate

    return simulate(setup.graph, setup.plan, setup.cluster, dtype=setup.dtype, programs=programs,
                    profiles=profiles, grad_accum=setup.grad_accum)


PROFILE_CACHE = Path.home() / ".cache" / "torchweave" / "op-profiles" / "ops.json"
"""Where ``--profile`` keeps measured op times (one table per device)."""


def _profiles(setup: Setup, console: Console):
    """Time the plan's op pieces here (1 thread), reusing the cache; the profiles."""
    from torchweave.sim.profile import OpProfiles, profile_graph

    device = f"{setup.cluster.device.name} on this machine, 1 thread"
    # On a cluster calibrated here, ranks beyond the cores share them (as calibrate's rates do).
    share = max(1.0, setup.plan.world_size / (os.cpu_count() or 1))
    profiles = OpProfiles.load(PROFILE_CACHE, device=device,
                               scale=share if setup.cluster.device.rates == "measured" else 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = profile_graph(setup.graph, setup.plan, profiles, dtype=setup.dtype)
    finally:
        torch.set_num_threads(before)
    profiles.save(PROFILE_CACHE)
    console.print(f"profiled {n} op pieces here ({len(profiles.table)} cached in {PROFILE_CACHE})",
                  highlight=False, markup=False)
    return profiles


def _ms(seconds: float) -> str:
    """Seconds in the unit that reads best: s, ms or us."""
    a = abs(seconds)
    if a >= 1:
        return f"{seconds:.4g} s"
    if a >= 1e-3 or a == 0:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


# ------------------------------------------------------------------ simulate
def simulate_cmd(args: argparse.Namespace, console: Console) -> int:
    specs = (args.plan if isinstance(args.plan, list) else [args.plan]) if args.plan else ["dp"]
    if len(specs) > 1 and (args.trace or args.gantt):
        raise TorchweaveError(Problem(
            obj="--trace/--gantt", value=f"{len(specs)} plans",
            rule="a timeline is written for one plan", fix="give one --plan with --trace or --gantt"))
    cluster = load_cluster(args.cluster)
    accum = getattr(args, "grad_accum", 1)
    start = time.perf_counter()
    graph = _capture(args.model, args.meta, accum)
    took = time.perf_counter() - start
    plans = [_plan_for(spec, graph, cluster, args.world_size) for spec in specs]  # all checked first
    if len(plans) > 1:
        console.print(f"captured {args.model} once in {took:.2f} s; {len(plans)} plans on it",
                      highlight=False, markup=False)
    rows, code = [], 0
    for spec, plan in zip(specs, plans):
        start = time.perf_counter()
        result = _simulate_one(args, console, Setup(graph, plan, cluster, _dtype(args.dtype), accum))
        code |= 1 if result.oom else 0
        rows.append((spec, result, time.perf_counter() - start))
    if len(rows) > 1:
        _ranking(rows, cluster, console)
    return code


def _ranking(rows: list, cluster, console: Console) -> None:
    """The plans, fastest first: step time, tokens/s, MFU, peak memory, fits, seconds taken."""
    t = Table(title=Text(f"{len(rows)} plans on {cluster}, fastest first"))
    for col in ("plan", "step", "tokens/s", "MFU", "peak memory", "fits", "simulated in"):
        t.add_column(col, justify="left" if col in ("plan", "fits") else "right")
    for spec, r, secs in sorted(rows, key=lambda x: (bool(x[1].oom), x[1].step_time)):
        peak = max(m.peak for m in r.memory)
        t.add_row(*map(Text, (spec, _ms(r.step_time), f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}",
                              f"{peak / GiB:.3g} GiB", "no (out of memory)" if r.oom else "yes",
                              f"{secs:.2f} s")))
    console.print(t)


def _simulate_one(args: argparse.Namespace, console: Console, setup: Setup):
    """Simulate and print one plan (its trace and Gantt chart if asked); the result."""
    from torchweave.sim.trace import save_gantt_png, to_chrome_trace

    cluster = setup.cluster
    result = _sim(setup, profiles=_profiles(setup, console) if getattr(args, "profile", False) else None)
    console.print(result.summary(), highlight=False, markup=False)
    per = [f"{r}: {m.peak / GiB:.3g}" for r, m in enumerate(result.memory)]
    shown = ", ".join(per[:8]) + (f", ... ({len(per) - 8} more)" if len(per) > 8 else "")
    console.print(f"  memory/rank    GiB of {cluster.device.memory_bytes / GiB:.3g}: {shown}",
                  highlight=False, markup=False)
    if result.oom:
        worst = result.oom[0]
        console.print(f"OUT OF MEMORY on {len(result.oom)} of {result.world_size} ranks "
                      f"({worst.device}); biggest contributors on rank {worst.rank}: "
                      + ", ".join(f"{w} {n / GiB:.3g} GiB" for w, n in worst.contributors[:3]),
                      highlight=False, markup=False)
        console.print(_leanest(setup), highlight=False, markup=False)
    if args.trace:
        import json

        with open(args.trace, "w") as f:
            json.dump(to_chrome_trace(result), f)
        console.print(f"wrote {args.trace} (open in https://ui.perfetto.dev)", highlight=False)
    if args.gantt:
        try:
            save_gantt_png(result, args.gantt)
            console.print(f"wrote {args.gantt}", highlight=False)
        except TorchweaveError as exc:
            console.print(f"no Gantt chart: {exc}", highlight=False, markup=False)
    return result


LEANEST = "zero3:recompute=full"
"""The plan an out-of-memory report measures against: every model state sharded, every
block keeping only its input."""


def _leanest(setup: Setup) -> str:
    """Whether the model fits the cluster's devices at all: :data:`LEANEST` on the same
    ranks, and by how much it misses, per device."""
    from torchweave.policies import resolve
    from torchweave.sim.simulate import simulate

    n = setup.plan.world_size
    try:
        lean = resolve(LEANEST, setup.graph, n)
    except TorchweaveError as e:  # a model without numbered blocks has nothing to recompute
        lean = resolve("zero3", setup.graph, n)
        note = f" (no full recompute: {str(e).splitlines()[0]})"
    else:
        note = ""
    r = simulate(setup.graph, lean, setup.cluster, dtype=setup.dtype, timeline=False,
                 grad_accum=setup.grad_accum)
    peak, cap = max(r.peak_memory), setup.cluster.device.memory_bytes
    if peak > cap:
        return (f"the model does not fit {n} x {setup.cluster.device.name} even as "
                f"{lean.notes.get('spec', lean.name)}{note}: {peak / GiB:.3g} GiB per device, "
                f"{(peak - cap) / GiB:.3g} GiB over its {cap / GiB:.3g} GiB; "
                f"fix: more devices, tensor or pipeline parallelism, or a bigger device")
    return (f"as {lean.notes.get('spec', lean.name)}{note} it fits: {peak / GiB:.3g} GiB per "
            f"device of {cap / GiB:.3g} GiB")


# ------------------------------------------------------------------- explain
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
    from torchweave.sim.cost import ComputeModel
    from torchweave.sim.tasks import Builder

    plan, cluster = setup.plan, setup.cluster
    if plan.world_size > cluster.size:  # before lowering: the plan must fit the cluster
        raise TorchweaveError(Problem(
            obj=f"plan {plan.name!r} world_size", value=str(plan.world_size),
            rule=f"a plan must fit the cluster: {cluster} has {cluster.size} devices",
            fix=f"use a cluster of at least {plan.world_size} devices, or a plan for {cluster.size}"))
    from torchweave.sim.simulate import lower_programs

    # One data-parallel replica lowered for all when the plan allows (sim/symmetry.py);
    # the communication each node gets is the same on every replica.
    programs, _ = lower_programs(setup.graph, setup.plan, None)
    result = _sim(setup)
    model = ComputeModel.for_device(setup.cluster.device)
    costs = Builder(setup.graph, setup.plan, setup.cluster, setup.dtype, model, 25 * 2**20).costs
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
    """When the simulation folded the model's blocks (sim/fold.py): each value made in
    a block past the 4th → the same value of block 3, the last one simulated."""
    if not any("identical" in n for n in result.notes):
        return {}
    from torchweave.sim.fold import find_blocks, made_in

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

"""``torchweave simulate`` (``torchweave explain`` is in :mod:`torchweave.commands.explain`).

:mod:`torchweave.cli` parses the arguments and calls these; each takes the
parsed ``argparse.Namespace`` and a rich ``Console`` and returns the exit
status (0 ok, 1 the plan does not fit, 2 bad input via ``TorchweaveError``).
"""

from __future__ import annotations

import argparse
import os
import re
import time
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
    from torchweave.sim.hardware.cluster import load_cluster_yaml, parse_cluster

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
    """``model``'s graph on its example batch, or on one of ``micro_batches`` pieces of it;
    ``model`` may be a saved graph (``*.graph.json``, :mod:`torchweave.graphfile`)."""
    import torchweave
    from torchweave.factory import load
    from torchweave.graphfile import is_graph_file, load_graph

    if is_graph_file(model):
        if micro_batches != 1:
            raise TorchweaveError(Problem(
                obj="--grad-accum (or the plan's accum)", value=str(micro_batches),
                rule=f"a saved graph ({model}) is one batch's and cannot be cut into micro-batches",
                fix="save the graph of one micro-batch (a factory whose example batch is one "
                    "micro-batch), or give the model itself"))
        if not Path(model).is_file():
            raise TorchweaveError(Problem(obj="model", value=model, rule="the graph file exists"))
        return load_graph(model)

    loaded = load(model, meta=meta)
    args = loaded.args
    if micro_batches != 1:
        batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 0)
        if micro_batches < 1 or batch % micro_batches:
            raise TorchweaveError(Problem(
                obj="--grad-accum (or the plan's accum)", value=str(micro_batches),
                rule=f"the micro-batches divide the example batch (the global batch): "
                     f"{batch} % {micro_batches} != 0" if micro_batches >= 1 else "at least 1",
                fix="a K that divides the model's example batch, or an example batch that K divides"))
        args = tuple(a[: batch // micro_batches] if isinstance(a, torch.Tensor) and a.dim() else a
                     for a in args)
    return torchweave.capture(loaded.model, args, loaded.kwargs, name=loaded.name)


def _plan_for(spec: str, graph, cluster, world_size: int | None):
    from torchweave.plan.validate import validate
    from torchweave.search import resolve

    n = world_size or cluster.size
    plan = resolve(spec, graph, n, cluster=cluster)  # auto: searched on this cluster
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
    """Time the plan's op pieces here, reusing the cache; the profiles.

    A plan without a pipeline on this machine's CPU ranks (a device whose rates were
    measured, such as ``CPU-2core``), more than one rank on a node: as many processes as
    a node's ranks time the ops at once, one thread each (the slowest rank's time per
    op), and what a collective costs when ranks come to it from computing
    (:func:`~torchweave.sim.hardware.profile.profile_sync`): every rank of such a plan
    computes at the same time, so the timings see the cores shared as training shares
    them. A pipeline's ranks do not (bubbles, waits for their stage's input): one
    process times the ops, one thread, each time divided by the share of a core the
    cluster gives a rank (``Cluster.share``: cores / ranks × what sharing costs), the
    units the schedule is simulated in before
    :func:`~torchweave.sim.step.run.shared_cores_step` lets ranks with work take the cores
    of those waiting."""
    from torchweave.sim.hardware.profile import OpProfiles, profile_graph

    cluster = setup.cluster
    ranks = min(setup.plan.world_size, cluster.devices_per_node)
    here = cluster.device.rates == "measured"
    if here and ranks > 1 and setup.plan.pipeline is None:
        device = f"{cluster.device.name} on this machine, 1 thread x{ranks} ranks"
        profiles = OpProfiles.load(PROFILE_CACHE, device=device)
        n = _profile_together(setup, profiles, ranks)
        how = f"on {ranks} ranks at once"
    else:
        device = f"{cluster.device.name} on this machine, 1 thread"
        # On a cluster calibrated here, ranks beyond the cores share them: each op is as slow
        # as the cluster makes a rank (its share of a core, ``Cluster.share``, with what
        # sharing costs); a calibrated device without ``cores``, by the ranks per core
        share = 1 / cluster.share if cluster.share < 1 else \
            max(1.0, setup.plan.world_size / (os.cpu_count() or 1))
        profiles = OpProfiles.load(PROFILE_CACHE, device=device, scale=share if here else 1.0)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            n = profile_graph(setup.graph, setup.plan, profiles, dtype=setup.dtype)
        finally:
            torch.set_num_threads(before)
        how = "here"
    profiles.save(PROFILE_CACHE)
    console.print(f"profiled {n} op pieces {how} ({len(profiles.table)} cached in {PROFILE_CACHE})",
                  highlight=False, markup=False)
    return profiles


def _profile_together(setup: Setup, profiles, ranks: int) -> int:
    """Time what ``profiles`` lacks on ``ranks`` gloo processes at once; keep the slowest
    rank's time of each. Returns how many entries were added."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=ranks, backend="gloo", timeout_s=600.0, threads_per_rank=1)
    per_rank = spawn(_time_on_rank, cfg, setup.graph, setup.plan, setup.dtype, dict(profiles.table),
                     profiles.device)
    added = set().union(*per_rank)
    for key in added:
        got = [r[key] for r in per_rank if key in r]
        profiles.table[key] = tuple(max(g[i] for g in got) for i in range(len(got[0])))
    return len(added)


def _time_on_rank(ctx, graph, plan, dtype, table: dict, device: str) -> dict:
    """One rank of :func:`_profile_together`: the entries it timed."""
    import torch.distributed as dist

    from torchweave.sim.hardware.profile import OpProfiles, profile_graph, profile_sync, sync_key

    mine = OpProfiles(device)
    mine.table = dict(table)
    dist.barrier()
    profile_graph(graph, plan, mine, dtype=dtype)
    dist.barrier()
    if sync_key(ctx.world_size) not in mine.table:
        profile_sync(mine, ranks=ctx.world_size, all_reduce=dist.all_reduce)
    return {k: v for k, v in mine.table.items() if k not in table}


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
    from torchweave.policies.spec import merged_accum

    cluster = load_cluster(args.cluster)
    # micro-batches per step: --grad-accum or each plan's accum; one capture per count
    accums = [merged_accum(spec, getattr(args, "grad_accum", 1), "--grad-accum") for spec in specs]
    start = time.perf_counter()
    graphs = {k: _capture(args.model, args.meta, k) for k in sorted(set(accums))}
    took = time.perf_counter() - start
    plans = [_plan_for(spec, graphs[k], cluster, args.world_size)  # all checked first
             for spec, k in zip(specs, accums)]
    if len(plans) > 1:
        times = "once" if len(graphs) == 1 else f"{len(graphs)} times (one per micro-batch size)"
        console.print(f"captured {args.model} {times} in {took:.2f} s; {len(plans)} plans on it",
                      highlight=False, markup=False)
    rows, code = [], 0
    for spec, plan, k in zip(specs, plans, accums):
        start = time.perf_counter()
        result = _simulate_one(args, console, Setup(graphs[k], plan, cluster, _dtype(args.dtype), k))
        code |= 1 if result.oom else 0
        rows.append((spec, result, time.perf_counter() - start))
    if len(rows) > 1:
        _ranking(rows, cluster, console)
    if getattr(args, "json", None):
        import json

        data = [{"spec": spec, **r.to_dict(), "simulated_in_s": secs} for spec, r, secs in rows]
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        console.print(f"wrote {args.json}", highlight=False, markup=False)
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
    from torchweave.sim.explain.trace import to_chrome_trace

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
    write_gantt(result, gantt_path(args, setup.plan.name), console)
    return result


def gantt_path(args: argparse.Namespace, plan: str) -> str | None:
    """Where the Gantt chart goes: ``--gantt PATH``; none under ``--no-gantt``; by default
    ``<model>-<plan>.gantt.png`` in the current directory when matplotlib is installed."""
    if getattr(args, "no_gantt", False):
        return None
    if getattr(args, "gantt", None):
        return args.gantt
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    name = Path(str(args.model)).name.removesuffix(".graph.json").removesuffix(".py")
    return f"{_slug(name)}-{_slug(plan)}.gantt.png"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_") or "plan"


def write_gantt(result: Any, path: str | None, console: Console) -> None:
    from torchweave.sim.explain.trace import save_gantt_png

    if path is None:
        return
    try:
        save_gantt_png(result, path)
        console.print(f"wrote {path} (Gantt chart; --no-gantt skips it)", highlight=False,
                      markup=False)
    except TorchweaveError as exc:
        console.print(f"no Gantt chart: {exc}", highlight=False, markup=False)


LEANEST = "zero3:recompute=full"
"""The plan an out-of-memory report measures against: every model state sharded, every
block keeping only its input."""


def _leanest(setup: Setup) -> str:
    """Whether the model fits the cluster's devices at all: :data:`LEANEST` on the same
    ranks, and by how much it misses, per device."""
    from torchweave.search import resolve
    from torchweave.sim.simulate import simulate

    n = setup.plan.world_size
    try:
        try:
            lean = resolve(LEANEST, setup.graph, n)
        except TorchweaveError as e:  # a model without numbered blocks has nothing to recompute
            lean = resolve("zero3", setup.graph, n)
            note = f" (no full recompute: {str(e).splitlines()[0]})"
        else:
            note = ""
        r = simulate(setup.graph, lean, setup.cluster, dtype=setup.dtype, timeline=False,
                     grad_accum=setup.grad_accum)
    except TorchweaveError as e:  # e.g. a batch that does not divide over all the ranks
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        lines = lines[1:] if lines and lines[0].endswith("problems:") else lines
        return (f"whether it fits at all (as {LEANEST} on {n} ranks) is not known: "
                + "; ".join(lines[:3]))
    peak, cap = max(r.peak_memory), setup.cluster.device.memory_bytes
    if peak > cap:
        return (f"the model does not fit {n} x {setup.cluster.device.name} even as "
                f"{lean.notes.get('spec', lean.name)}{note}: {peak / GiB:.3g} GiB per device, "
                f"{(peak - cap) / GiB:.3g} GiB over its {cap / GiB:.3g} GiB; "
                f"fix: more devices, tensor or pipeline parallelism, or a bigger device")
    return (f"as {lean.notes.get('spec', lean.name)}{note} it fits: {peak / GiB:.3g} GiB per "
            f"device of {cap / GiB:.3g} GiB")

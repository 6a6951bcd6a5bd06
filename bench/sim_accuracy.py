"""Simulator accuracy on this machine: predicted against measured step time and memory.

1. Calibrate: ``torchweave calibrate`` (its functions) at each world size, so
   the cluster spec holds this machine's measured per-rank matmul rate, copy
   bandwidth and gloo α-β, for that many ranks on these cores.
2. Measure: for each plan (dp, zero1, zero2, zero3, tp, sp, and the pipelines
   gpipe and 1f1b with one stage per rank) one launch of N
   gloo ranks (1 torch thread each) trains a GPT (d=256, 4 layers, 8 heads,
   vocab 4096, block 128, global batch 8 x 128; the workload of
   bench/parallel.py): 2 warm-up steps, then 5 timed ``train_step`` calls, each
   after a barrier; the time is the slowest rank's median.
   Memory per rank, in bytes of distinct tensor storages (not RSS):

   - *model state*: parameters, gradients and optimizer state held after
     backward (``module.params``, ZeRO's flat master and its gradient, AdamW
     state) — what ``RankModule.memory()`` counts;
   - *activations*: the most bytes of storages saved for backward alive at
     once during one step (a ``saved_tensors_hooks`` pack hook that holds each
     saved tensor in an object dying with it; parameters excluded); for plain
     plans that is everything forward saves, for pipelines the micro-batches
     in flight; under ZeRO-3 (its own hook) the distinct storages saved.

   The measured peak is state + activations; the simulated one is the same
   sum: ``params + grads + optimizer + activations`` of ``SimResult.memory``
   (its ``buffers`` and ``temporaries`` are printed but left out of both).
3. Simulate each plan with ``torchweave.sim.simulate(graph, plan, cluster)``
   twice: with the calibrated roofline, and with profiled op times
   (``torchweave.sim.hardware.profile``: each plan's op pieces and optimizer step timed
   by every rank at once, inside the measuring launch, one pass after each
   timed step, the median over the passes; so steps and timings sample the
   same minutes of the shared machine's load; the slowest rank's time per op;
   written to ``--profiles``, keyed by op, local shapes, dtype and device, the
   device naming how many ranks share the cores), and what a collective costs
   beyond its α-β time when the ranks come to it from computing
   (``profile_sync``: out-of-step ranks on shared cores), added to every
   collective. The table's "predicted" is the profiled one.
4. Print predicted vs measured with relative errors and the median absolute
   error; write it to bench/results-sim-accuracy.md.

Run: python bench/sim_accuracy.py [--worlds 2 4] [--plans dp zero1 ...] [--steps 5] [--readme]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections import namedtuple
import sys
import tempfile
import weakref
import time
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parallel import GPT_BATCH, GPT_KW, OPTIMIZER, make_gpt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results-sim-accuracy.md")
PLANS = ["dp", "zero1", "zero2", "zero3", "tp", "sp", "gpipe", "1f1b"]
MiB = 2**20


# --------------------------------------------------------------------------- calibrate


def calibrate(world: int, out: str) -> Any:
    """``torchweave calibrate --world-sizes world --out out``; the cluster it wrote."""
    from rich.console import Console

    from torchweave.commands import calibrate_cmd
    from torchweave.sim.hardware.cluster import load_cluster_yaml

    calibrate_cmd(argparse.Namespace(world_sizes=[world], out=out, quick=False), Console())
    return load_cluster_yaml(out)


# --------------------------------------------------------------------------- measure


def _saved_bytes_hooks(exclude: set[int], seen: dict[int, int]):
    """Pack hook that records the storages autograd saves (parameters excluded)."""

    def record(t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = s.nbytes()

    return record


def _measure_plan(ctx, plan: str, warmup: int, steps: int, profile) -> dict[str, Any]:
    """Timed steps, and after each one a pass of ``profile()`` (op timings), so that steps
    and timings sample the same minutes of this shared machine's load."""
    from torchweave.parallel import parallelize
    from torchweave.runtime.executor import StepConfig

    model, batch = make_gpt()
    module = parallelize(model, batch, plan=plan, groups=ctx.groups, optimizer=OPTIMIZER,
                         config=StepConfig(overlap=True, bucket_mb=25.0))
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        module.train_step(*batch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            profile()

    # One more step, split: activations saved during its forward, model state after backward.
    exclude = {p.untyped_storage().data_ptr() for p in module.params.values()}
    if module.zero_opt is not None:
        exclude.add(module.zero_opt.master.untyped_storage().data_ptr())
    seen: dict[int, int] = {}
    record = _saved_bytes_hooks(exclude, seen)
    if module.zero_opt is not None and module.zero_opt.stage >= 3:
        # ZeRO-3 saves its gathered pieces by its own rule (runtime/zero3.py, a packer
        # that forward_hooks applies): wrap it, and count what it leaves as a plain tensor
        # (its gathered units are parameters).
        stage3 = module.zero_opt.stage3

        def pack(t, _inner=stage3.pack):
            x = _inner(t)
            if x is None:
                record(t)
            return x

        stage3.pack = pack  # the instance's, in place of the method
        module.backward_step(*batch)
    else:
        # Saved storages alive at once, at the peak: each saved tensor is held by a
        # small object whose life is the saved tensor's (pipelines free a micro-batch's
        # activations before the next ones are saved).
        live: dict[int, int] = {}
        peak = [0]

        def release(ptr: int) -> None:
            live[ptr] -= 1

        def pack(t):
            record(t)
            held = _Held(t)
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                if live.get(ptr, 0) == 0:
                    live[ptr] = 0
                live[ptr] += 1
                weakref.finalize(held, release, ptr)
                peak[0] = max(peak[0], sum(seen[q] for q, n in live.items() if n > 0))
            return held

        # The rank's forward installs its own hooks where it saves a gathered activation as
        # its shard (sequence parallelism, runtime/regather.py), and the innermost hooks
        # are the only ones called: wrap them too, counting a shard where one is kept.
        import torchweave.runtime.regather as regather

        real = regather.saved_tensor_hooks

        def wrapped(*packers):
            inner = real(*packers)

            def pack_inner(t):
                x = inner.pack_hook(t)
                if x is t:
                    return pack(t)
                if type(x) is regather._Packed and x.owner is regather.REGATHER:
                    return _Both(x, pack(x.data[0].shard))
                return x

            def unpack_inner(x):
                if isinstance(x, _Held):
                    return x.t
                return inner.unpack_hook(x.packed if isinstance(x, _Both) else x)

            return torch.autograd.graph.saved_tensors_hooks(pack_inner, unpack_inner)

        regather.saved_tensor_hooks = wrapped
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
                module.backward_step(*batch)
        finally:
            regather.saved_tensor_hooks = real
        seen = {0: peak[0]}
    state = module.memory()
    module.optimizer_step()
    return {"s": statistics.median(times), "state": state, "act": sum(seen.values())}


class _Held:
    """A saved tensor, in an object that dies when autograd drops it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


_Both = namedtuple("_Both", "packed held")  # what the rank's own hooks packed; its bytes' holder


def _profiler(ctx, plan: str, passes: list[dict]):
    """A callable that times the plan's op pieces once on every rank at once (so the
    timings see the contention of training: N processes on these cores), plus what a
    collective costs after compute; each call appends one pass to ``passes``."""
    import torchweave
    from torchweave.policies import resolve
    from torchweave.sim.hardware.profile import OpProfiles, profile_graph, profile_sync

    model, batch = make_gpt()
    graph = torchweave.capture(model, batch)
    p = resolve(plan, graph, ctx.world_size)

    def once() -> None:
        profiles = OpProfiles("here")
        dist.barrier()
        profile_graph(graph, p, profiles, reps=1)
        dist.barrier()
        profile_sync(profiles, ranks=ctx.world_size, all_reduce=dist.all_reduce, reps=3)
        passes.append(profiles.table)

    return once


def _median_table(passes: list[dict]) -> dict[str, tuple[float, float]]:
    keys = set().union(*passes) if passes else set()
    return {k: (statistics.median(t[k][0] for t in passes if k in t),
                statistics.median(t[k][1] for t in passes if k in t)) for k in keys}


def rank_main(ctx, plans: list[str], warmup: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"profiles": {}}
    for plan in plans:
        passes: list[dict] = []
        try:
            out[plan] = _measure_plan(ctx, plan, warmup, steps, _profiler(ctx, plan, passes))
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[plan] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]}
        out["profiles"][plan] = _median_table(passes)
    return out


def measure(world: int, plans: list[str], warmup: int, steps: int,
            profiles: dict[str, Any]) -> dict[str, Any]:
    """Measured steps per plan; each plan's op timings (the slowest rank's) go into
    ``profiles[plan]``."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=world, backend="gloo", timeout_s=300.0, threads_per_rank=1)
    per_rank = spawn(rank_main, cfg, plans, warmup, steps)
    for plan in plans:
        table = profiles[plan].table
        for key in per_rank[0]["profiles"].get(plan, {}):
            got = [r["profiles"][plan][key] for r in per_rank if key in r["profiles"].get(plan, {})]
            table[key] = (max(g[0] for g in got), max(g[1] for g in got))
        print(f"{plan}: {len(table)} op pieces timed; a collective after compute costs "
              f"+{table.get(f'sync|{world}', (0,))[0] * 1e3:.2f} ms", flush=True)
    out = {}
    for plan in plans:
        rs = [r[plan] for r in per_rank]
        if any("error" in r for r in rs):
            out[plan] = next(r for r in rs if "error" in r)
            continue
        out[plan] = {"s": max(r["s"] for r in rs),  # the slowest rank's median
                     "mem": max(r["state"] + r["act"] for r in rs),
                     "state": max(r["state"] for r in rs), "act": max(r["act"] for r in rs)}
    return out


# --------------------------------------------------------------------------- simulate


def simulate_plans(world: int, plans: list[str], cluster, profiles) -> dict[str, Any]:
    """Each plan simulated twice: roofline (calibrated rates) and profiled op times."""
    import torchweave
    from torchweave.policies import resolve
    from torchweave.sim import simulate

    model, batch = make_gpt()
    graph = torchweave.capture(model, batch)
    out = {}
    for plan in plans:
        p = resolve(plan, graph, world)
        roof = simulate(graph, p, cluster)
        res = simulate(graph, p, cluster, profiles=profiles[plan])
        mems = [m.params + m.grads + m.optimizer + m.activations for m in res.memory]
        i = max(range(len(mems)), key=mems.__getitem__)
        m = res.memory[i]
        out[plan] = {"s": res.step_time, "roof": roof.step_time, "mem": mems[i],
                     "state": m.params + m.grads + m.optimizer, "act": m.activations,
                     "temp": m.temporaries, "compute": max(res.compute_time),
                     "comm": max(res.comm_time)}
    return out


# --------------------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--plans", nargs="+", default=PLANS, choices=PLANS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    ap.add_argument("--profiles", default=os.path.expanduser("~/.cache/torchweave/op-profiles/bench-cpu.json"),
                    help="op timing cache (JSON)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    header = ["| plan | world | predicted ms | measured ms | time err | roofline ms (err) | "
              "predicted MiB | measured MiB | mem err | sim compute / comm ms | "
              "state MiB pred/meas | activations MiB pred/meas |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows, terr, rerr, merr, specs = [], [], [], [], []
    for world in args.worlds:
        spec = os.path.join(tempfile.gettempdir(), f"tw-cpu-{world}.yaml")
        cluster = calibrate(world, spec)
        d = cluster.device
        specs.append(f"- {world} ranks: matmul {d.peak.fp32 / 1e9:.3g} GFLOP/s/rank, copy "
                     f"{d.memory_bandwidth / 1e9:.3g} GB/s, gloo α {d.intra.latency * 1e6:.0f} µs "
                     f"β {d.intra.bandwidth / 1e9:.3g} GB/s"
                     + (f", per-op overhead {d.op_overhead * 1e6:.1f} µs"
                        if getattr(d, "op_overhead", 0) else ""))
        print(specs[-1], flush=True)
        from torchweave.sim.hardware.profile import OpProfiles

        # Op timings by op, local shapes, dtype and device; the device includes how many
        # ranks share these cores, since that is what each rank's ops see. Re-measured on
        # every run (this machine is shared, its load changes), then cached for reuse.
        device = f"{d.name} 1 thread x{world} ranks"
        profiles = {plan: OpProfiles(device) for plan in args.plans}
        real = measure(world, args.plans, args.warmup, args.steps, profiles)
        cache = OpProfiles.load(args.profiles, device=device)
        for plan in args.plans:
            cache.table.update(profiles[plan].table)
        cache.save(args.profiles)
        sim = simulate_plans(world, args.plans, cluster, profiles)
        for plan in args.plans:
            p, r = sim[plan], real[plan]
            if "error" in r:
                rows.append(f"| {plan} | {world} | {p['s'] * 1e3:.1f} | failed: {r['error']} "
                            f"| | | | | | | | |")
                print(rows[-1], flush=True)
                continue
            te, me = p["s"] / r["s"] - 1, p["mem"] / r["mem"] - 1
            re_ = p["roof"] / r["s"] - 1
            terr.append(abs(te))
            rerr.append(abs(re_))
            merr.append(abs(me))
            rows.append(
                f"| {plan} | {world} | {p['s'] * 1e3:.1f} | {r['s'] * 1e3:.1f} | {te:+.0%} | "
                f"{p['roof'] * 1e3:.1f} ({re_:+.0%}) | "
                f"{p['mem'] / MiB:.1f} | {r['mem'] / MiB:.1f} | {me:+.0%} | "
                f"{p['compute'] * 1e3:.0f} / {p['comm'] * 1e3:.0f} | "
                f"{p['state'] / MiB:.1f} / {r['state'] / MiB:.1f} | "
                f"{p['act'] / MiB:.1f} / {r['act'] / MiB:.1f} |")
            print(rows[-1], flush=True)
    elapsed = time.perf_counter() - t_start
    summary = (f"Median absolute error: time {statistics.median(terr):.0%} (target ≤ 20%; "
               f"roofline alone {statistics.median(rerr):.0%}), "
               f"memory {statistics.median(merr):.0%} (target ≤ 15%), over {len(terr)} runs."
               if terr else "No successful runs.")
    print("\n" + summary)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    b, t = GPT_BATCH
    lines = [
        "# bench/sim_accuracy.py results", "",
        f"{stamp}; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank; GPT d={GPT_KW['d_model']} "
        f"L={GPT_KW['n_layer']} H={GPT_KW['n_head']} V={GPT_KW['vocab_size']}, batch {b}x{t}, "
        f"fp32, AdamW; warm-up {args.warmup}, median of {args.steps} timed steps (slowest rank); "
        f"run took {elapsed:.0f} s.", "",
        "Calibrated clusters:", "", *specs, "",
        *header, *rows, "", summary, "",
        "Memory = parameters + gradients + optimizer state + saved activations, bytes of "
        "distinct storages per rank (max over ranks); the simulator's buffers and temporaries "
        "are not in either column.", "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    if args.readme:
        from readme_section import write_section

        short = [" | ".join(r.split(" | ")[:9]) + " |" for r in rows]  # the first 9 columns
        head = ("| plan | world | predicted ms | measured ms | time err | roofline ms (err) | "
                "predicted MiB | measured MiB | mem err |\n|---|---|---|---|---|---|---|---|---|")
        write_section("sim-accuracy", "python bench/sim_accuracy.py " + " ".join(sys.argv[1:]),
                      head + "\n" + "\n".join(short) + "\n\n" + summary + "\n")
        print("wrote bench/README.md")


if __name__ == "__main__":
    main()

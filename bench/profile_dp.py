"""One ``dp`` step and one DDP step under torch.profiler, side by side: where the time goes.

    python bench/profile_dp.py                     # 2 ranks, the GPT of bench/parallel.py
    python bench/profile_dp.py --world 4 --readme  # also write the table into bench/README.md
    python bench/profile_dp.py --trace-dir /tmp/tr # and rank 0's Chrome traces, one per side

In one launch every rank builds both sides exactly as bench/parallel.py does
(same weights, same global batch: torchweave slices it, DDP gets its own slice;
25 MB buckets on both sides), warms both up, then times alternating steps
(the median of each, and their ratio torchweave / DDP: below 1, torchweave is
faster). Then every rank profiles one more step of each side, and rank 0's
profile is reported: the step's wall time, the total self CPU time of its ops,
the ops with the most self CPU time, and the collectives each side called.
The generated code, the gradient buckets and the loss's sum are what differ
between the two sides; an op that appears on one side only is the gap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import parallel  # bench/parallel.py (the script's folder is on sys.path)
from gpu_eager import profile_step  # bench/gpu_eager.py: one profiled step, its top ops
from readme_section import write_section

TOP = 12
COLLECTIVE_MARKS = ("c10d::", "gloo:", "nccl:")


def _collectives(side: Any) -> dict[str, int]:
    """Collective calls in one step of ``side`` (the profiler's c10d / backend records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step()
    return {e.key: e.count for e in prof.key_averages()
            if e.key.startswith(COLLECTIVE_MARKS) and "wait" not in e.key.lower()}


def rank_main(ctx, warmup: int, steps: int, trace_dir: str | None) -> dict[str, Any]:
    sides = {"torchweave dp": parallel.tw_dp(ctx, None), "DDP": parallel.torch_ddp(ctx, None)}
    times: dict[str, list[float]] = {n: [] for n in sides}
    for i in range(warmup + steps):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            sides[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {}
    cpu = torch.device("cpu")
    for name, side in sides.items():
        dist.barrier()
        t0 = time.perf_counter()
        top, total = profile_step(side, cpu, TOP)
        wall = time.perf_counter() - t0
        dist.barrier()
        calls = _collectives(side)
        out[name] = {"median_ms": statistics.median(times[name]) * 1e3, "wall_ms": wall * 1e3,
                     "self_ms": total, "top": top, "collectives": calls}
        if trace_dir and ctx.rank == 0:
            from torch.profiler import ProfilerActivity, profile

            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                side.step()
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"{name.replace(' ', '-')}.json"))
        elif trace_dir:
            dist.barrier()
            side.step()
    return out


def report(res: dict[str, Any], world: int, steps: int) -> str:
    tw, ddp = res["torchweave dp"], res["DDP"]
    lines = [
        f"GPT d=256, 4 layers, vocab 4096, global batch 8 x 128, {world} gloo ranks, 1 thread each; "
        f"median of {steps} alternating timed steps: torchweave {tw['median_ms']:.1f} ms, DDP "
        f"{ddp['median_ms']:.1f} ms, ratio torchweave / DDP {tw['median_ms'] / ddp['median_ms']:.2f}x "
        "(below 1: torchweave faster).", "",
        "Rank 0's profiled step (one each): " + "; ".join(
            f"{n}: wall {r['wall_ms']:.1f} ms, ops' self CPU {r['self_ms']:.1f} ms" for n, r in res.items()),
        "", "| # | torchweave dp op | self CPU ms | calls | DDP op | self CPU ms | calls |",
        "|---|---|---|---|---|---|---|"]
    for i in range(TOP):
        cells = []
        for r in (tw, ddp):
            name, ms, calls = r["top"][i] if i < len(r["top"]) else ("", 0.0, 0)
            cells += [f"`{name[:50]}`" if name else "", f"{ms:.2f}" if name else "",
                      str(calls) if name else ""]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    for n, r in res.items():
        calls = ", ".join(f"`{k}` {v}" for k, v in sorted(r["collectives"].items())) or "none recorded"
        lines.append(f"- {n} collectives in one step: {calls}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trace-dir", default=None, help="write rank 0's Chrome trace of each side here")
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args(argv)
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=args.world, backend="gloo", timeout_s=120.0, threads_per_rank=1)
    res = spawn(rank_main, cfg, args.warmup, args.steps, args.trace_dir)[0]
    text = report(res, args.world, args.steps)
    print(text)
    if args.readme:
        command = "python bench/profile_dp.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section("profile-dp", command.strip(), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

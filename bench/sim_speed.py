"""Simulation speed at search scale: GPT-3 175B and a 1T GPT on 64, 1,024 and 16,384 simulated GPUs.

For each model: one capture on the meta device (global batch ``--batch`` x
2048 tokens), then for each cluster size and plan string, the plan is built
(``torchweave.policies.resolve``, what ``--plan`` does) and one step simulated
(``torchweave.sim.simulate``, what ``torchweave simulate`` calls), each timed
on its own (wall clock, this process). Plans: Megatron tensor parallelism
inside each 8-GPU node with data parallelism across (``tp:tp=8``), and
pipelines of tp = 8 under the interleaved schedule and ZB-H1. Pipelined plans
take the stage fast path (``sim/fast/stagefold.py``), the others replica symmetry
and block folding (``sim/fast/symmetry.py``, ``sim/fast/fold.py``); the issue's target
is at most 5 s per plan after capture.

``--exact`` also compares, on 64 GPUs, the fast path with lowering and
simulating every rank and block, for the 175B pipelined plans.

Run: python bench/sim_speed.py [--batch 2048] [--exact] [--readme]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from readme_section import write_section

ROOT = Path(__file__).resolve().parent

MODELS = {  # name: (layers, d_model, heads), vocabulary 50304, sequence 2048
    "GPT-3 175B": (96, 12288, 96),
    "GPT 1T": (128, 25600, 160),  # Megatron-LM's 1T configuration (Narayanan et al., 2021)
}


def plans(model: str, gpus: int) -> list[str]:
    """Plan strings for a cluster of ``gpus``: tp x dp, interleaved and ZB pipelines."""
    pp = 8 if gpus <= 1024 else 16
    layers = MODELS[model][0]
    virtual = max(2, layers // (pp * 4))  # about four blocks a stage
    micro = {64: 64, 1024: 64}.get(gpus, 16)
    return ["tp:tp=8", f"interleaved:tp=8,pp={pp},virtual={virtual},micro={micro}",
            f"zb:tp=8,pp={pp},micro={micro}"]


def capture(name: str, batch: int):
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    layers, d, heads = MODELS[name]
    cfg = GPTConfig(vocab_size=50304, block_size=2048, n_layer=layers, n_head=heads, d_model=d)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.empty(batch, 2048, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name=name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048, help="global batch in sequences of 2048")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 16384])
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--readme", action="store_true", help="write the tables into bench/README.md")
    args = ap.parse_args()

    from torchweave.policies import resolve
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    rows, graphs = [], {}
    for name in MODELS:
        t0 = time.perf_counter()
        graphs[name] = g = capture(name, args.batch)
        took = time.perf_counter() - t0
        print(f"{name}: captured in {took:.2f} s ({len(g.nodes)} nodes)", flush=True)
        for gpus in args.sizes:
            cluster = parse_cluster(f"{gpus}xA100-80GB-SXM@8")
            for spec in plans(name, gpus):
                t0 = time.perf_counter()
                plan = resolve(spec, g, gpus)
                t1 = time.perf_counter()
                res = simulate(g, plan, cluster, dtype=torch.bfloat16, timeline=False)
                t2 = time.perf_counter()
                path = ("stages" if res.pipeline_bubble is not None and res.folded_blocks
                        else "replicas+fold" if res.replicas and res.folded_blocks
                        else "fold" if res.folded_blocks else "exact")
                rows.append((name, took, gpus, spec, t1 - t0, t2 - t1, path, res))
                print(f"  {gpus:>6} {spec:45s} plan {t1 - t0:5.2f} s  simulate {t2 - t1:5.2f} s  "
                      f"[{path}] step {res.step_time:.4g} s, MFU {res.mfu:.1%}", flush=True)
    text = ("| model | capture s | GPUs | plan | plan s | simulate s | fast path | step s | MFU |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    for name, took, gpus, spec, tp_, ts, path, res in rows:
        text += (f"| {name} | {took:.1f} | {gpus:,} | `{spec}` | {tp_:.2f} | **{ts:.2f}** | {path} | "
                 f"{res.step_time:.4g} | {res.mfu:.1%} |\n")
    worst = max(r[4] + r[5] for r in rows)
    text += f"\nSlowest plan + simulate: {worst:.2f} s (target: 5 s).\n"
    if args.exact:
        text += "\n" + exact_table(graphs["GPT-3 175B"])
    print("\n" + text)
    if args.readme:
        write_section("sim-speed", "python bench/sim_speed.py " + " ".join(sys.argv[1:]), text)
    return 0


def exact_table(g) -> str:
    """Fast against exact on 64 GPUs for the 175B pipelined plans."""
    from torchweave.policies import resolve
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    cluster = parse_cluster("64xA100-80GB-SXM@8")
    out = ("On 64 GPUs, GPT-3 175B, the fast path against lowering and simulating every "
           "rank and block (largest relative difference over ranks):\n\n"
           "| plan | fast s | exact s | step | compute | comm | peak memory | FLOPs |\n"
           "|---|---|---|---|---|---|---|---|\n")
    for spec in plans("GPT-3 175B", 64)[1:]:
        plan = resolve(spec, g, 64)
        t0 = time.perf_counter()
        fast = simulate(g, plan, cluster, dtype=torch.bfloat16, timeline=False)
        t1 = time.perf_counter()
        exact = simulate(g, plan, cluster, dtype=torch.bfloat16, timeline=False, fold=False)
        t2 = time.perf_counter()

        def worst(a, b) -> str:
            return f"{max(abs(x / y - 1) if y else abs(x) for x, y in zip(a, b)):.2e}"

        out += (f"| `{spec}` | {t1 - t0:.2f} | {t2 - t1:.2f} | "
                f"{worst([fast.step_time], [exact.step_time])} | "
                f"{worst(fast.compute_time, exact.compute_time)} | "
                f"{worst(fast.comm_time, exact.comm_time)} | "
                f"{worst(fast.peak_memory, exact.peak_memory)} | "
                f"{worst([fast.model_flops], [exact.model_flops])} |\n")
        print(out.splitlines()[-1], flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())

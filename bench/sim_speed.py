"""Simulation speed: one training step of GPT-3 175B (96 layers) on 1,024 simulated GPUs.

Phases, timed separately (wall clock, this process):

1. capture ``FACTORIES["gpt-175b"]`` on the meta device, with a global batch
   of ``--batch`` x 2048 tokens (the factory's batch of 1 does not split 128 ways);
2. plan: the ``tp`` policy with ``tp_size=8`` (Megatron TP inside each 8-GPU
   node, data parallel over the 128 nodes);
3. simulation: ``torchweave.sim.simulate(graph, plan, cluster)`` on
   ``1024xA100-80GB-SXM`` (the issue's target: under 5 s). It lowers and
   simulates one data-parallel replica (``sim/symmetry.py``) of a model cut to
   3 and 4 of its 96 identical blocks, and extrapolates (``sim/fold.py``);
4. with ``--exact``: the same plan on ``--exact-cluster`` (default 64 GPUs)
   both ways, every rank and block lowered and simulated against the fast
   path, to show what the fast path changes.

Run: python bench/sim_speed.py [--cluster 1024xA100-80GB-SXM] [--tp 8] [--batch 128] [--exact]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="1024xA100-80GB-SXM")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--exact", action="store_true",
                    help="also compare fast and exact simulation on --exact-cluster")
    ap.add_argument("--exact-cluster", default="64xA100-80GB-SXM")
    args = ap.parse_args()

    import torchweave
    from torchweave.lower.lower import lower
    from torchweave.models import FACTORIES
    from torchweave.policies.tensor import tp
    from torchweave.sim import simulate
    from torchweave.sim.cluster import parse_cluster

    cluster = parse_cluster(args.cluster)
    t = {}
    t0 = time.perf_counter()
    model, _ = FACTORIES["gpt-175b"]()
    with torch.device("meta"):
        idx = torch.empty(args.batch, 2048, dtype=torch.long)
        tgt = torch.empty(args.batch, 2048, dtype=torch.long)
    graph = torchweave.capture(model, (idx, tgt))
    t["capture"] = time.perf_counter() - t0
    print(f"capture: {t['capture']:.2f} s", flush=True)
    t0 = time.perf_counter()
    plan = tp(graph, cluster.size, tp_size=args.tp)
    t["plan"] = time.perf_counter() - t0
    print(f"plan: {t['plan']:.2f} s", flush=True)
    t0 = time.perf_counter()
    res = simulate(graph, plan, cluster, timeline=False)
    t["simulation"] = time.perf_counter() - t0
    print(f"simulation: {t['simulation']:.2f} s", flush=True)
    print(res.summary())
    print(f"\n{len(graph.nodes)} nodes, {cluster.size} ranks")
    print("| phase | seconds |\n|---|---|")
    for k, v in t.items():
        print(f"| {k} | {v:.2f} |")
    if args.exact:
        small = parse_cluster(args.exact_cluster)
        plan = tp(graph, small.size, tp_size=args.tp)
        t0 = time.perf_counter()
        fast = simulate(graph, plan, small, timeline=False)
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        programs = lower(graph, plan)
        t_lower = time.perf_counter() - t0
        exact = simulate(graph, plan, small, programs=programs, timeline=False)
        t_exact = time.perf_counter() - t0
        print(f"\n{small}: fast {t_fast:.2f} s, exact {t_exact:.2f} s (lowering {t_lower:.2f} s)")
        print("| quantity | exact | fast | fast/exact - 1 |\n|---|---|---|---|")
        for what, x, y in (("step time s", exact.step_time, fast.step_time),
                           ("compute/rank s", max(exact.compute_time), max(fast.compute_time)),
                           ("comm/rank s", max(exact.comm_time), max(fast.comm_time)),
                           ("peak memory GiB", max(exact.peak_memory) / 2**30,
                            max(fast.peak_memory) / 2**30),
                           ("model TFLOP", exact.model_flops / 1e12, fast.model_flops / 1e12)):
            print(f"| {what} | {x:.6g} | {y:.6g} | {y / x - 1:+.3%} |")


if __name__ == "__main__":
    main()

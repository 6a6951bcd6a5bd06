"""Simulation speed: one training step of GPT-3 175B (96 layers) on 1,024 simulated GPUs.

Phases, timed separately (wall clock, this process):

1. capture ``FACTORIES["gpt-175b"]`` on the meta device, with a global batch
   of ``--batch`` x 2048 tokens (the factory's batch of 1 does not split 128 ways);
2. plan: the ``tp`` policy with ``tp_size=8`` (Megatron TP inside each 8-GPU
   node, data parallel over the 128 nodes);
3. lowering: ``torchweave.lower.lower(graph, plan)``, one Program per rank;
4. simulation: ``torchweave.sim.simulate(graph, plan, cluster, programs=...)``
   on ``1024xA100-80GB-SXM`` (the issue's target: under 5 s).

Run: python bench/sim_speed.py [--cluster 1024xA100-80GB-SXM] [--tp 8] [--batch 128]
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
    programs = lower(graph, plan)
    t["lowering"] = time.perf_counter() - t0
    print(f"lowering: {t['lowering']:.2f} s", flush=True)
    t0 = time.perf_counter()
    res = simulate(graph, plan, cluster, programs=programs, timeline=False)
    t["simulation"] = time.perf_counter() - t0
    print(f"simulation: {t['simulation']:.2f} s", flush=True)
    print(res.summary())
    print(f"\n{len(graph.nodes)} nodes, {len(programs)} programs, "
          f"{sum(len(p.instrs) for p in programs):,} instructions")
    print("| phase | seconds |\n|---|---|")
    for k, v in t.items():
        print(f"| {k} | {v:.2f} |")
    print(f"| total | {sum(t.values()):.2f} |")


if __name__ == "__main__":
    main()

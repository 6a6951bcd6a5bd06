"""Pipelines on ranks that share a node's cores: the simulator's step against the measured one.

On ``NxCPU-2core@N`` every rank has a share of the node's 2 cores. A pipeline rank waiting
in the bubble leaves its cores to the ranks with work (``sim/step/run.shared_cores_step``).
For each plan, on the GPT of ``bench/parallel.py``, this prints the roofline prediction
with that rule ("now") and with every rank held to its share ("held", the rule switched
off by ``Cluster.share = 1``), each over the median measured step of ``--launches`` gloo
launches (2 warm-up and 5 timed steps each, the slowest rank's median). ``dp`` has no
bubble: the rule leaves it as it is, and its ratio is the roofline's level on this CPU.

Run: python bench/sim_shared_cores.py [--worlds 4 8] [--launches 3] [--readme]
(``--readme`` writes the table into docs/simulator.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from readme_section import write_section  # noqa: E402
from sim_accuracy import _measure_plan, make_gpt  # noqa: E402

PLANS = {
    4: ["dp", "1f1b:pp=4,micro=4", "1f1b:pp=4,micro=8", "gpipe:pp=4,micro=4",
        "1f1b:pp=2,dp=2,micro=4", "1f1b:tp=2,pp=2,micro=4",
        "interleaved:pp=2,dp=2,micro=4,virtual=2", "zb:pp=4,micro=4"],
    8: ["dp", "1f1b:pp=4,dp=2,micro=4", "1f1b:pp=2,dp=4,micro=2", "gpipe:pp=4,dp=2,micro=4"],
}


def predict(world: int, plans: list[str]) -> dict[str, tuple[float, float]]:
    """Per plan: (step with the rule, step with every rank held to its share), seconds."""
    import torchweave
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate

    graph = torchweave.capture(*make_gpt())
    shared = parse_cluster(f"{world}xCPU-2core@{world}")
    held = dataclasses.replace(shared, share=1.0)
    out = {}
    for plan in plans:
        p = resolve(plan, graph, world)
        out[plan] = tuple(simulate(graph, p, c, timeline=False).step_time for c in (shared, held))
    return out


def _rank(ctx, plans: list[str]) -> dict[str, float]:
    return {p: _measure_plan(ctx, p, 2, 5, lambda: None)["s"] for p in plans}


def measure(world: int, plans: list[str], launches: int) -> dict[str, float]:
    """Per plan: the median over launches of the slowest rank's median step, seconds."""
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=world, backend="gloo", timeout_s=900, threads_per_rank=1)
    runs = [spawn(_rank, cfg, plans) for _ in range(launches)]
    return {p: statistics.median(max(r[p] for r in run) for run in runs) for p in plans}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8], choices=sorted(PLANS))
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--readme", action="store_true", help="write the table into docs/simulator.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = ["| ranks | plan | predicted / measured, held to shares | now | measured ms |",
            "|---|---|---|---|---|"]
    for world in args.worlds:
        plans = PLANS[world]
        pred, real = predict(world, plans), measure(world, plans, args.launches)
        for plan in plans:
            now, held = pred[plan]
            rows.append(f"| {world} | `{plan}` | {held / real[plan]:.2f} | {now / real[plan]:.2f} | "
                        f"{real[plan] * 1e3:.1f} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + (f"\n\nGPT of bench/parallel.py, roofline; medians of {args.launches} "
                              f"launches of 5 timed steps; {time.perf_counter() - t0:.0f} s.\n")
    print(text)
    if args.readme:
        write_section("sim-shared-cores",
                      "python bench/sim_shared_cores.py --worlds "
                      + " ".join(map(str, args.worlds)) + f" --launches {args.launches} --readme",
                      text, path=HERE.parent / "docs" / "simulator.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

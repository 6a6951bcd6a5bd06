"""Capture speed and memory: torchweave.capture beside plain torch.export.

Each case runs in a fresh process (so peak RSS is its own) and reports the
median of repeats. Run: python bench/capture.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
import torchweave
from torchweave.models import FACTORIES
name, how = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model, inputs = FACTORIES[name]()
t0 = time.perf_counter()
if how == "torchweave":
    g = torchweave.capture(model, inputs)
    n = len(g.nodes)
else:
    ep = torch.export.export(model, inputs, strict=False)
    n = len(ep.graph.nodes)
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"seconds": dt, "rss_gib": rss, "nodes": n}))
"""

CASES = [("gpt-medium", "24 layers, d=1024, real tensors"),
         ("gpt-175b", "96 layers, d=12288, meta tensors")]


def measure(name: str, how: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, name, how], capture_output=True,
                             text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "rss_gib": max(r["rss_gib"] for r in runs), "nodes": runs[0]["nodes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| model | what | torchweave.capture s | torch.export s | ratio | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for name, what in CASES:
        tw = measure(name, "torchweave", args.repeats)
        ex = measure(name, "export", args.repeats)
        print(f"| {name} | {what} | {tw['seconds']:.2f} | {ex['seconds']:.2f} | "
              f"{tw['seconds'] / ex['seconds']:.2f}x | {tw['rss_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Plan search speed and quality: ``plan="auto"`` under the ``megatron`` and ``free`` presets.

For each model and cluster: one capture on the meta device (what ``torchweave
plan MODEL --plan auto`` does), then ``torchweave.search.search`` under each
preset, timed on its own (wall clock, this process, capture excluded and shown
apart). The table gives the winner, its simulated step time, the largest error
of the search's own estimate over the plans it returned (against the event
simulator), and for ``free`` the ratios against ``megatron``: search seconds
(megatron / free: how much faster the smaller space is searched) and predicted
throughput (free / megatron: ≥ 1 means free found a plan at least as fast).

The issue's targets: GPT-3 175B on 1,024 GPUs in at most 60 s with capture,
16,384 GPUs in at most 120 s, megatron at least 10x faster than free and at
most 2% worse.

Run: python bench/search.py [--sizes 1024 16384] [--readme]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from readme_section import write_section

ROOT = Path(__file__).resolve().parent
MODELS = {"GPT-3 175B": (96, 12288, 96)}  # layers, d_model, heads; vocabulary 50304, seq 2048
CLUSTERS = {1024: "1024xA100-80GB-SXM@8", 16384: "16384xH100-80GB-SXM@8", 64: "64xA100-80GB-SXM@8"}
BATCH = {64: 1536, 1024: 1536, 16384: 8192}
"""Global batch in sequences of 2048: Megatron's 1,536 for GPT-3 175B (Narayanan et al.,
2021); 16M tokens on 16,384 GPUs, as Llama 3 405B was trained (Dubey et al., 2024)."""


def capture(layers: int, d: int, heads: int, batch: int):
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50304, block_size=2048, n_layer=layers, n_head=heads, d_model=d)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(batch, 2048, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name="gpt")


def main() -> int:
    from torchweave.search import search
    from torchweave.search.pool import default_workers
    from torchweave.sim import parse_cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args()
    rows = ["| model | GPUs | batch | preset | capture s | search s | points | winner | step s | "
            "MFU | worst estimate error | megatron/free search s | free/megatron throughput |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, (layers, d, heads) in MODELS.items():
        for gpus in args.sizes:
            t0 = time.perf_counter()
            g = capture(layers, d, heads, BATCH[gpus])
            cap = time.perf_counter() - t0
            cluster = parse_cluster(CLUSTERS[gpus])
            got = {}
            for p in ("megatron", "free"):
                t0 = time.perf_counter()
                res = search(g, cluster, p, top=5, dtype=torch.bfloat16,
                             workers=default_workers(len(g.nodes), cluster.size))
                got[p] = (time.perf_counter() - t0, res)
                best = res.best
                err = max((r.estimate_error or 0.0) for r in res.ranked)
                print(f"{name} {gpus} {p}: {got[p][0]:.1f} s, {best.spec}, "
                      f"step {best.result.step_time:.4g} s, worst estimate error {100 * err:.1f}%",
                      flush=True)
            for p, (secs, res) in got.items():
                best = res.best
                err = max((r.estimate_error or 0.0) for r in res.ranked)
                ratio = speed = ""
                if p == "free":
                    speed = f"{got['megatron'][0] / secs:.2f}"
                    ratio = f"{got['megatron'][1].best.result.step_time / best.result.step_time:.3f}"
                rows.append(f"| {name} | {gpus:,} | {BATCH[gpus]:,} | {p} | {cap:.1f} | **{secs:.1f}** | "
                            f"{res.considered:,} | `{best.spec}` | {best.result.step_time:.4g} | "
                            f"{100 * best.result.mfu:.1f}% | {100 * err:.1f}% | {speed} | {ratio} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if args.readme:
        write_section("search", "python bench/search.py " + " ".join(sys.argv[1:]), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulator against published large-scale runs, through the call a user makes.

Each run is a GPT trained with Megatron-LM's tensor, sequence, pipeline and
data parallelism on A100 80GB SXM nodes (8 GPUs, NVLink inside, 8 x 200 Gb/s
InfiniBand between). Published numbers and run configurations, with sources
and which parts we could verify, are in docs/simulator.md.

Every row is one ``torchweave simulate`` of the run's model (a factory in this
file), plan string and cluster string, in bf16, and nothing else: the
script calls the same library functions the command calls (capture on the
meta device, ``torchweave.search.resolve``, ``torchweave.sim.simulate``) and
prints, for each row, the command that reproduces it. The cost model runs
with each device's published efficiency factors; nothing is fitted to these runs.

Throughput is the simulator's: MFU is its ``mfu`` (model FLOPs, forward and
backward once, over step time and peak). Narayanan et al. count hardware
teraFLOP/s, which include the recomputed forward; for that row the
recomputed FLOPs are the forward FLOPs of the ops the plan recomputes.

Run: python bench/sim_published.py [--only NAME ...] [--readme]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
DOC = HERE.parent.parent / "docs" / "simulator.md"


def _gpt(layers: int, hidden: int, heads: int, batch: int):
    """A GPT of the run's shape (vocabulary 51,200, sequence 2,048) on its global batch."""
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads,
                    d_model=hidden)
    idx = torch.zeros(batch, 2048, dtype=torch.long)
    return GPT(cfg), (idx, idx)


def gpt_1t_3072():
    return _gpt(128, 25600, 160, 3072)


def gpt_530b_2240():
    return _gpt(105, 20480, 128, 2240)


def gpt_175b_64():
    return _gpt(96, 12288, 96, 64)


def gpt_1t_512():
    return _gpt(128, 25600, 160, 512)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    factory: str
    cluster: str
    plan: str
    metric: str
    """"tflops": hardware teraFLOP/s per GPU; "mfu": model FLOPs utilization."""
    published: float


RUNS = [
    Run("GPT 1T, 3072 GPUs", "[1]", "gpt_1t_3072", "3072xA100-80GB-SXM@8",
        "interleaved:tp=8,pp=64,dp=6,micro=512,virtual=2,recompute=full", "tflops",
        502e15 / 3072 / 1e12),
    Run("GPT 530B, 2240 GPUs", "[2]", "gpt_530b_2240", "2240xA100-80GB-SXM@8",
        "interleaved:tp=8,pp=35,dp=8,micro=280,virtual=3,recompute=selective,split=sequence",
        "mfu", 0.542),
    Run("GPT 175B, 64 GPUs", "[3]", "gpt_175b_64", "64xA100-80GB-SXM@8",
        "interleaved:tp=8,pp=8,dp=1,micro=64,virtual=3,recompute=selective,split=sequence",
        "mfu", 0.514),
    Run("GPT 1T, 512 GPUs", "[3]", "gpt_1t_512", "512xA100-80GB-SXM@8",
        "interleaved:tp=8,pp=64,dp=1,micro=512,virtual=2,recompute=selective,split=sequence",
        "mfu", 0.563),
]
"""Micro-batches of one sequence each (Megatron's micro-batch size 1): ``micro`` is the
batch over ``dp``."""


def command(run: Run) -> str:
    return (f"torchweave simulate bench/sim_published.py:{run.factory} --meta "
            f"--cluster {run.cluster} --plan \"{run.plan}\" --dtype bf16")


def predict(run: Run) -> dict:
    """What ``command(run)`` computes: capture, resolve, simulate."""
    from torchweave.commands.sim import _capture, _plan_for, load_cluster
    from torchweave.ops import info
    from torchweave.sim.simulate import simulate

    t0 = time.perf_counter()
    graph = _capture(f"{HERE}:{run.factory}", True)
    cluster = load_cluster(run.cluster)
    plan = _plan_for(run.plan, graph, cluster, None)
    res = simulate(graph, plan, cluster, dtype=torch.bfloat16, timeline=False)
    if run.metric == "mfu":
        value = res.mfu
    else:  # hardware FLOPs: the model's, plus the forward of what is recomputed
        again = {n for grp in plan.recompute for n in grp}
        rerun = sum(info(graph, node).flops for node in graph.nodes if node.name in again)
        value = (res.model_flops + rerun) / (res.step_time * plan.world_size) / 1e12
    return {"step": res.step_time, "bubble": res.bubble, "value": value,
            "memory": max(m.peak for m in res.memory) / 2**30,
            "seconds": time.perf_counter() - t0}


def main() -> int:
    from readme_section import write_section

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="FACTORY", help="these runs (factory names)")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/simulator.md")
    args = ap.parse_args()
    rows = ["| run | source | plan (cluster) | metric | published | predicted | error | "
            "step s (bubble) | peak GiB | simulated in s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for run in RUNS:
        if args.only and run.factory not in args.only:
            continue
        p = predict(run)
        err = p["value"] / run.published - 1
        errors.append(abs(err))
        fmt = (lambda x: f"{x:.1%}") if run.metric == "mfu" else (lambda x: f"{x:.0f} TFLOP/s")
        rows.append(f"| {run.name} | {run.source} | `{run.plan}` ({run.cluster}) | "
                    f"{'MFU' if run.metric == 'mfu' else 'TFLOP/s per GPU'} | {fmt(run.published)} | "
                    f"{fmt(p['value'])} | {err:+.0%} | {p['step']:.2f} ({p['bubble']:.0%}) | "
                    f"{p['memory']:.1f} | {p['seconds']:.0f} |")
        print(rows[-1], f"\n  {command(run)}", flush=True)
    summary = (f"\nmedian |error| {sorted(errors)[len(errors) // 2]:.0%}, "
               f"largest {max(errors):.0%}\n" if errors else "")
    text = "\n".join(rows) + "\n" + summary
    print(text)
    if args.readme and not args.only:
        cmds = "\n".join(f"    {command(r)}" for r in RUNS)
        write_section("sim-published", "python bench/sim_published.py --readme",
                      text + "\nEach row is, from the repository's root:\n\n" + cmds + "\n",
                      path=DOC)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())

"""Simulator against published large-scale runs: predicted against published throughput.

Each run is a GPT trained with Megatron-LM's tensor, pipeline and data
parallelism on A100 80GB SXM nodes (8 GPUs, NVLink inside, 8 x 200 Gb/s
InfiniBand between). Published numbers and run configurations, with sources
and which parts we could verify, are in docs/simulator.md. How a step is
predicted, all from torchweave's own cost model, with its default efficiency
factors (nothing here is fitted to these runs):

1. **Per-layer costs.** GPTs with 2 and 3 blocks of the run's width (meta
   device, bf16, one micro-batch of ``micro`` x 2048 tokens) are captured and
   simulated with the ``tp`` (or ``sp``) policy on one 8-GPU node
   (``torchweave.sim.simulate``). The forward and backward spans of one block
   are the differences between them; what is left of the 2-block model is the
   embedding, final norm, head and loss.
2. **Pipeline.** ``torchweave.sim.pipeline.simulate_schedule`` runs the
   run's schedule (1F1B, or interleaved 1F1B) over ``pp`` stages of
   ``layers / pp`` blocks (the embedding on the first stage, the head on the
   last) with ``batch / (dp * micro)`` micro-batches. Full activation
   recomputation adds a forward to each backward. A stage boundary sends
   ``micro x 2048 x hidden`` bf16 values over InfiniBand, split over the 8
   tensor-parallel ranks (Megatron's scatter/gather of boundary tensors).
3. **Data parallelism and optimizer.** After the pipeline flushes, the bf16
   gradients of one GPU's parameters are all-reduced over the ``dp`` GPUs
   that hold them (``torchweave.sim.comm``, hierarchy aware), then the
   mixed-precision Adam step reads and writes 16 bytes per parameter at 80% of
   HBM bandwidth.

Throughput per GPU is FLOPs per step over step time and GPUs, with the FLOPs
counted as the source counts them: ``model`` (forward and backward of the
graph, from torchweave's FLOP counts) for MFU; ``hardware`` (plus the
recomputed forward) for Narayanan et al.'s teraFLOP/s, which include
recomputation.

Run: python bench/sim_published.py [--1f1b]     (about 20 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

PEAK_BF16 = 312e12  # A100 dense bf16, the catalog's value (and the papers')


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro: int
    schedule: str
    virtual: int
    recompute: str
    """"full" or "selective" (attention core only: taken as no recompute here)."""
    policy: str
    metric: str
    """"tflops": hardware teraFLOP/s per GPU; "mfu": model FLOPs utilization."""
    published: float
    vocab: int = 51200
    seq: int = 2048


RUNS = [
    Run("GPT 1T, 3072 GPUs", "Narayanan et al., SC'21, abstract",
        layers=128, hidden=25600, heads=160, tp=8, pp=64, gpus=3072, batch=3072, micro=1,
        schedule="interleaved", virtual=2, recompute="full", policy="tp", metric="tflops",
        published=502e15 / 3072 / 1e12),
    Run("GPT 530B, 2240 GPUs", "Korthikanti et al., arXiv:2205.05198, abstract",
        layers=105, hidden=20480, heads=128, tp=8, pp=35, gpus=2240, batch=2240, micro=1,
        schedule="interleaved", virtual=3, recompute="selective", policy="sp", metric="mfu",
        published=0.542),
    Run("GPT 175B, 64 GPUs", "Megatron-LM README (2022), MFU table (dp = 1)",
        layers=96, hidden=12288, heads=96, tp=8, pp=8, gpus=64, batch=64, micro=1,
        schedule="interleaved", virtual=3, recompute="selective", policy="sp", metric="mfu",
        published=0.514),
    Run("GPT 1T, 512 GPUs", "Megatron-LM README (2022), MFU table (dp = 1)",
        layers=128, hidden=25600, heads=160, tp=8, pp=64, gpus=512, batch=512, micro=1,
        schedule="interleaved", virtual=2, recompute="selective", policy="sp", metric="mfu",
        published=0.563),
]


@dataclass
class Block:
    """Per micro-batch on one tensor-parallel rank: one block, and the rest of the model."""

    fwd: float
    bwd: float
    rest_fwd: float
    rest_bwd: float
    flops_fwd: float
    """Forward FLOPs of one block (whole, all ranks)."""
    flops: float
    rest_flops_fwd: float
    rest_flops: float


def _spans(result) -> tuple[float, float]:
    """(forward, backward) spans of one simulated step, without gradient sync and optimizer."""
    fwd = max((e.end for e in result.timeline if not e.name.endswith("bwd")
               and "grads" not in e.name and "optimizer" not in e.name), default=0.0)
    bwd = max((e.end for e in result.timeline if e.name.endswith("bwd")), default=fwd)
    return fwd, bwd - fwd


def block_costs(run: Run) -> Block:
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.ops import info
    from torchweave.policies.tensor import sp, tp
    from torchweave.sim import parse_cluster, simulate

    out = {}
    for n in (2, 3):
        cfg = GPTConfig(vocab_size=run.vocab, block_size=run.seq, n_layer=n, n_head=run.heads,
                        d_model=run.hidden)
        with torch.device("meta"):
            model = GPT(cfg)
            idx = torch.empty(run.micro, run.seq, dtype=torch.long)
        g = torchweave.capture(model, (idx, idx), name=f"gpt-{n}")
        plan = (sp if run.policy == "sp" else tp)(g, run.tp, tp_size=run.tp)
        res = simulate(g, plan, parse_cluster(f"{run.tp}xA100-80GB-SXM"), dtype=torch.bfloat16,
                       fold=False)
        f, b = _spans(res)
        fl = sum(info(g, node).flops for node in g.nodes)
        out[n] = (f, b, fl, res.model_flops)
    (f2, b2, x2, m2), (f3, b3, x3, m3) = out[2], out[3]
    return Block(f3 - f2, b3 - b2, f2 - 2 * (f3 - f2), b2 - 2 * (b3 - b2), x3 - x2, m3 - m2,
                 x2 - 2 * (x3 - x2), m2 - 2 * (m3 - m2))


def predict(run: Run) -> dict:
    from torchweave.plan.schedules import interleaved_1f1b, one_f_one_b
    from torchweave.sim import parse_cluster
    from torchweave.sim.comm import Collective, collective_time
    from torchweave.sim.pipeline import StageCost, simulate_schedule

    blk = block_costs(run)
    dp = run.gpus // (run.tp * run.pp)
    m = run.batch // (dp * run.micro)
    stages = run.pp * run.virtual
    per = run.layers / stages
    full = run.recompute == "full"
    costs = []
    for s in range(stages):
        rest = 1.0 if s == stages - 1 else 0.0  # the head (and the small embedding) on the last
        costs.append(StageCost(fwd=per * blk.fwd + rest * blk.rest_fwd,
                               bwd=per * blk.bwd + rest * blk.rest_bwd, recompute=full))
    schedule = (interleaved_1f1b(run.pp, run.virtual, m) if run.schedule == "interleaved"
                else one_f_one_b(run.pp, m))
    cluster = parse_cluster(f"{run.gpus}xA100-80GB-SXM")
    boundary = run.micro * run.seq * run.hidden * 2 // run.tp
    hop = collective_time(cluster, Collective.P2P, boundary, (0, 8)).seconds
    pipe = simulate_schedule(schedule, costs, transfer=hop)
    params = 12 * run.layers * run.hidden ** 2 + (run.vocab + run.seq) * run.hidden
    local = params / (run.tp * run.pp)
    group = tuple(k * run.tp * run.pp for k in range(dp))
    sync = collective_time(cluster, Collective.ALL_REDUCE, int(2 * local), group).seconds if dp > 1 else 0.0
    opt = 16 * 2 * local / (cluster.device.memory_bandwidth * 0.8)
    step = pipe.step_time + sync + opt
    micro_batches = run.batch // run.micro
    model = micro_batches * (run.layers * blk.flops + blk.rest_flops)
    hardware = model + (micro_batches * (run.layers * blk.flops_fwd + blk.rest_flops_fwd) if full else 0)
    if run.metric == "mfu":
        value = model / (step * run.gpus * PEAK_BF16)
    else:
        value = hardware / (step * run.gpus) / 1e12
    return {"step": step, "bubble": pipe.bubble_fraction, "sync": sync, "value": value,
            "micro_batches": m, "dp": dp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--1f1b", dest="plain", action="store_true",
                    help="every run with plain 1F1B instead of the listed schedule (sensitivity)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    print("| run | source | tp x pp x dp, batch, schedule, recompute | metric | published | "
          "predicted | error | predicted step s (bubble, dp sync s) |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for run in RUNS:
        if args.plain:
            run = dataclasses.replace(run, schedule="1f1b", virtual=1)
        p = predict(run)
        err = p["value"] / run.published - 1
        errors.append(abs(err))
        fmt = (lambda x: f"{x:.1%}") if run.metric == "mfu" else (lambda x: f"{x:.0f} TFLOP/s")
        print(f"| {run.name} | {run.source} | {run.tp} x {run.pp} x {p['dp']}, {run.batch}, "
              f"{run.schedule}{f' (v={run.virtual})' if run.virtual > 1 else ''}, "
              f"{run.recompute} | {'MFU' if run.metric == 'mfu' else 'TFLOP/s per GPU'} | "
              f"{fmt(run.published)} | {fmt(p['value'])} | {err:+.0%} | "
              f"{p['step']:.2f} ({p['bubble']:.0%}, {p['sync']:.2f}) |", flush=True)
    print(f"\nmedian |error| {sorted(errors)[len(errors) // 2]:.0%}; "
          f"took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""Expert parallelism against data parallelism on one MoE model: tokens/s and bytes moved.

Both plans train the same MoE GPT (8 experts, top-2, fixed capacity) on the same
batches in one launch of 4 gloo ranks, interleaved step by step; each launch reports
rank 0's median step time and the bytes it sends per step (each collective the runtime
runs, at the bytes a ring algorithm sends for it: ``CommCounter.wire_bytes``), and the
table gives the medians over ``--launches`` launches and the
ratios plan / dp for ``ep`` (ep=4) and ``ep:ep=2`` (ep=2 × dp=2) (tokens/s: above 1 is
the ep plan faster; bytes: below 1 is it moving less).
Also the simulator's prediction of both plans on a GPU cluster for a larger model.
``--dropless``: the same with dropless routing (every expert has a slot for every token;
its own section of bench/README.md, without the simulator's larger model, whose dense
dropless dispatch would be [16384, 64, 16384] per layer).
``--hf``: transformers' Mixtral at the same sizes (dropless, its experts captured as one
``torchweave.moe_experts`` op each; its own section), and the simulator's larger model
built as a transformers Mixtral.

    python bench/ep.py [--launches 3] [--steps 6] [--dropless | --hf] [--no-readme]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.readme_section import write_section  # noqa: E402

WORLD, BATCH, SEQ = 4, 8, 64
PLANS = ("dp", "ep", "ep:ep=2")
"""dp over 4; ep=4 (two experts a rank); ep=2 × dp=2 (four experts a rank, their slots split on dp)."""


def model_and_batch(dropless: bool = False, hf: bool = False):
    from torchweave.models.moe import MoEConfig, MoEGPT

    torch.manual_seed(0)
    if hf:
        return hf_mixtral(d=128, layers=2, heads=4, ffn=512, experts=8, vocab=256, seq=SEQ), \
            _tokens(256, BATCH, SEQ)
    cfg = MoEConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, d_model=128,
                    ffn_hidden=512, n_expert=8, top_k=2,
                    capacity_factor=None if dropless else 1.25)
    return MoEGPT(cfg), _tokens(256, BATCH, SEQ, shift=True)


def _tokens(vocab: int, batch: int, seq: int, shift: bool = False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    if shift:  # next-token targets
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return ids[:, :-1].contiguous(), ids[:, :-1].contiguous()  # transformers shifts labels itself


def hf_mixtral(*, d: int, layers: int, heads: int, ffn: int, experts: int, vocab: int, seq: int):
    """transformers' Mixtral, top-2, returning its loss (labels = the inputs)."""
    import transformers as tf

    from torchweave.models.hf import HFCausalLM

    cfg = tf.MixtralConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=heads, num_local_experts=experts,
                           num_experts_per_tok=2, max_position_embeddings=seq)
    return HFCausalLM(tf.MixtralForCausalLM(cfg))


def rank_main(ctx, warmup: int, steps: int, dropless: bool = False,
              hf: bool = False) -> dict[str, dict[str, float]]:
    import torchweave

    model, batch = model_and_batch(dropless, hf)
    mods = {p: torchweave.parallelize(model, batch, plan=p, groups=ctx.groups) for p in PLANS}
    times = {p: [] for p in PLANS}
    sent = {p: 0 for p in PLANS}
    for i in range(warmup + steps):
        for p in (PLANS if i % 2 == 0 else PLANS[::-1]):
            dist.barrier()
            with ctx.groups.counter.window() as window:
                t0 = time.perf_counter()
                mods[p].train_step(*batch)
                dt = time.perf_counter() - t0
            if i >= warmup:
                times[p].append(dt)
                sent[p] = window.wire_bytes()
    return {p: {"ms": statistics.median(times[p]) * 1e3, "bytes": sent[p]} for p in PLANS}


def predicted(hf: bool = False) -> list[str]:
    """The simulator's step of a larger MoE (64 experts) under dp and ep on 8 A100s."""
    import torchweave
    from torchweave.models.moe import MoEConfig, MoEGPT
    from torchweave.policies import resolve
    from torchweave.sim.hardware.cluster import parse_cluster
    from torchweave.sim.simulate import simulate

    cfg = MoEConfig(vocab_size=32000, block_size=1024, n_layer=8, n_head=16, d_model=1024,
                    ffn_hidden=4096, n_expert=64, top_k=2)
    with torch.device("meta"):
        model = hf_mixtral(d=1024, layers=8, heads=16, ffn=4096, experts=64, vocab=32000,
                           seq=1024) if hf else MoEGPT(cfg)
        ids = torch.zeros(16, 1024, dtype=torch.long)
    graph = torchweave.capture(model, (ids, ids))
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    rows = []
    for plan in PLANS:
        r = simulate(graph, resolve(plan, graph, 8), cluster, dtype=torch.bfloat16)
        rows.append((plan, r.step_time * 1e3, max(m.peak for m in r.memory) / 2**30))
    return rows


def main() -> None:
    from torchweave.runtime.launch import LaunchConfig, spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dropless", action="store_true", help="dropless routing (capacity_factor=None)")
    ap.add_argument("--hf", action="store_true", help="transformers' Mixtral (dropless, grouped experts)")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    runs = []
    for _ in range(args.launches):
        cfg = LaunchConfig(world_size=WORLD, threads_per_rank=1, timeout_s=300.0)
        runs.append(spawn(rank_main, cfg, args.warmup, args.steps, args.dropless, args.hf)[0])
        print(runs[-1], flush=True)
    tokens = BATCH * SEQ
    med = {p: {k: statistics.median(r[p][k] for r in runs) for k in ("ms", "bytes")} for p in PLANS}
    lines = ["| plan | step ms (median) | tokens/s | bytes on the wire per step, rank 0 |",
             "|---|---|---|---|"]
    for p in PLANS:
        lines.append(f"| {p} | {med[p]['ms']:.1f} | {tokens / med[p]['ms'] * 1e3:.0f} | "
                     f"{med[p]['bytes'] / 1e6:.2f} MB |")
    lines.append("")
    for p in PLANS[1:]:
        lines.append(f"{p} / dp: tokens/s {med['dp']['ms'] / med[p]['ms']:.2f}x, bytes "
                     f"{med[p]['bytes'] / max(med['dp']['bytes'], 1):.2f}x")
    lines += ["", f"(medians of {args.launches} launches of {WORLD} ranks on 2 cores)", ""]
    if args.dropless:
        text = "\n".join(lines) + "\n"
        print(text)
        if not args.no_readme:
            write_section("ep-dropless", f"python bench/ep.py --dropless --launches {args.launches} "
                          f"--steps {args.steps}", text)
        return
    sim = predicted(args.hf)
    what = "transformers' Mixtral with 64 experts" if args.hf else "a 64-expert MoE"
    lines += [f"Predicted by the simulator, {what} (d 1024, 8 layers, batch 16 × 1024) "
              "on `8xA100-80GB-SXM@8`:", "", "| plan | step ms | peak memory GiB |", "|---|---|---|"]
    lines += [f"| {p} | {ms:.1f} | {gib:.1f} |" for p, ms, gib in sim]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_readme:
        flag = " --hf" if args.hf else ""
        write_section("ep-hf" if args.hf else "ep",
                      f"python bench/ep.py{flag} --launches {args.launches} --steps {args.steps}", text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Plan search quality: the best plan of each preset's space, per model and cluster, in the simulator.

For each (model, cluster): one capture on the meta device, then
``torchweave.search.search`` under ``megatron`` (Megatron-LM's 3D space:
tp ∈ {1, 2, 4, 8} by its rules, any pp with 1F1B or interleaved, dp, micro-
batches, no/selective/full recompute, ZeRO-1), ``nnscaler`` (the solver's
per-op splits, tp ≤ 8 in powers of two, 1F1B) and ``free`` (every degree,
schedule, recompute, ZeRO stage and split). Every plan in the table was
simulated in full by the event simulator; the search prices every point of
its space by its estimate and simulates the best (``megatron`` is therefore
the best of its space *as the search finds it*, not an exhaustive grid of
simulations).

With ``--grid``, a fourth row per model: the ``megatron`` space searched
exhaustively (``search(..., exhaustive=True)``: every point built and simulated,
none estimated), the issue's baseline; it takes minutes per model on this
machine, so clusters of more than 32 GPUs are left without it (marked "not run").

Columns: the winner and its simulated step time per preset, and "free/this": how
many times faster free's winner is than this row's (≥ 1: the whole space did at
least as well; on the nnscaler row, nnScaler's space is never better than free,
the issue's check). Seconds are this machine's search time.

Run: python bench/search_quality.py [--only NAME ...] [--grid] [--readme]
(``--readme`` rewrites the table in ``docs/search.md``.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from readme_section import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "search.md"
PRESETS = ("megatron", "nnscaler", "free")
GRID = "megatron grid"
"""The megatron space searched exhaustively (``--grid``)."""
SAME = "(the megatron row: no repeated blocks, so that search simulated every point)"
GRID_MAX = 32
"""Clusters up to this many GPUs get the exhaustive grid (32 RTX 3090s took about 20
minutes on this machine; larger ones take longer)."""


def gpt(layers: int, d: int, heads: int, batch: int, seq: int = 2048, vocab: int = 50304):
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, d_model=d)
    model = GPT(cfg)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx)


def llama70b(batch: int):
    from torchweave.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, block_size=4096, n_layer=80, n_head=64, n_kv_head=8,
                      d_model=8192, ffn_hidden=28672)
    idx = torch.zeros(batch, 4096, dtype=torch.long)
    return Llama(cfg), (idx, idx)


def t5_250k(batch: int):
    """mT5-XL's shape: a 250,112-token vocabulary, d=2048, 24 + 24 layers."""
    from torchweave.models.t5 import T5, T5Config

    cfg = T5Config(vocab_size=250112, block_size=1024, d_model=2048, d_kv=64, n_head=32,
                   d_ff=5120, n_enc_layer=24, n_dec_layer=24)
    src = torch.zeros(batch, 1024, dtype=torch.long)
    tgt = torch.zeros(batch, 256, dtype=torch.long)
    return T5(cfg), (src, tgt, tgt)


def swin_hires(batch: int):
    """Swin-B's widths at 1536×1536 (windows of 16): activations dwarf parameters."""
    from torchweave.models.swin import Swin, SwinConfig

    cfg = SwinConfig(image_size=1536, patch_size=4, num_classes=1000, embed_dim=128,
                     depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=16)
    return Swin(cfg), (torch.zeros(batch, 3, 1536, 1536), torch.zeros(batch, dtype=torch.long))


def mixtral(batch: int):
    """A Mixtral-like MoE: 8 experts, top 2, d=4096, 32 layers, each sequence of 4,096 tokens
    routed as one group (GShard's groups: the dense dispatch grows with the batch, where one
    group of the whole batch would grow with its square)."""
    from torchweave.models.moe import MoEConfig, MoEGPT

    cfg = MoEConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, d_model=4096,
                    ffn_hidden=14336, n_expert=8, top_k=2, group_size=4096)
    idx = torch.zeros(batch, 4096, dtype=torch.long)
    return MoEGPT(cfg), (idx, idx)


CASES = {  # name: (builder, cluster)
    "GPT-3 1.3B": (lambda: gpt(24, 2048, 16, 64), "8xA100-80GB-SXM@8"),
    "GPT-3 1.3B (RTX 3090)": (lambda: gpt(24, 2048, 16, 64), "32xRTX3090@4"),
    "GPT-3 13B": (lambda: gpt(40, 5120, 40, 256), "64xA100-80GB-SXM@8"),
    "GPT-3 175B": (lambda: gpt(96, 12288, 96, 1536), "1024xA100-80GB-SXM@8"),
    "GPT-3 175B (H100)": (lambda: gpt(96, 12288, 96, 8192), "16384xH100-80GB-SXM@8"),
    "Llama-2-70B-like": (lambda: llama70b(256), "64xA100-80GB-SXM@8"),
    "T5 250k vocab": (lambda: t5_250k(32), "8xA100-80GB-SXM@8"),
    "T5 250k vocab (RTX 3090)": (lambda: t5_250k(64), "32xRTX3090@4"),
    "Swin-B 1536px": (lambda: swin_hires(32), "8xA100-80GB-SXM@8"),
    "Mixtral-like": (lambda: mixtral(128), "64xA100-80GB-SXM@8"),
}


def main() -> int:
    import torchweave
    from torchweave.errors import TorchweaveError
    from torchweave.search import search
    from torchweave.policies.spec import PlanSpec
    from torchweave.search.pool import default_workers
    from torchweave.sim.fast.fold import find_blocks
    from torchweave.sim import parse_cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these rows (names as in CASES)")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/search.md")
    ap.add_argument("--grid", action="store_true",
                    help="also search the megatron space exhaustively (minutes per model)")
    args = ap.parse_args()
    rows = ["| model | cluster | batch | preset | winner | step s | search s | free/this |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (build, spec) in CASES.items():
        if args.only and name not in args.only:
            continue
        with torch.device("meta"):
            model, inputs = build()
        g = torchweave.capture(model, inputs)
        cluster = parse_cluster(spec)
        best: dict[str, tuple[str, float, float]] = {}
        repeated = find_blocks(g, PlanSpec.parse("dp").build(g, 1), least=4, nested=False) is not None
        runs = [(p, p, False) for p in PRESETS]
        if args.grid:
            runs.insert(1, (GRID, "megatron", True))
        for label, p, every in runs:
            if every and cluster.size > GRID_MAX:
                best[label] = (f"not run (over {GRID_MAX} GPUs: too slow here)", float("nan"), 0.0)
                continue
            if every and not repeated:  # the search already simulated every point
                spec_, step, secs = best["megatron"]
                best[label] = (f"{spec_} {SAME}", step, secs)
                continue
            t0 = time.perf_counter()
            try:
                res = search(g, cluster, p, top=1, dtype=torch.bfloat16, exhaustive=every,
                             workers=default_workers(len(g.nodes), cluster.size))
                best[label] = (res.best.spec, res.best.result.step_time, time.perf_counter() - t0)
            except TorchweaveError as exc:
                best[label] = (f"none fits ({exc.problems[0].value})", float("inf"),
                               time.perf_counter() - t0)
            print(f"{name} {label}: {best[label][0]} {best[label][1]:.4g} s "
                  f"({best[label][2]:.1f} s)", flush=True)
        free = best["free"][1]
        for label in [r[0] for r in runs]:
            spec_, step, secs = best[label]
            ratio = (f"{step / free:.3f}" if free < float("inf") and label != "free"
                     and step == step else "")
            shown = (f"`{spec_.removesuffix(' ' + SAME)}` {SAME}" if spec_.endswith(SAME)
                     else f"`{spec_}`")
            ran = step == step  # NaN: not run
            rows.append(f"| {name} | {spec} | {inputs[0].shape[0]} | {label} | {shown} | "
                        f"{f'{step:.4g}' if ran else ''} | {f'{secs:.1f}' if ran else ''} | {ratio} |")
        if args.readme:  # after every model, so that a long run keeps what it has
            write_section("search-quality", "python bench/search_quality.py --readme "
                          "(rows of other models kept from earlier runs with --only)",
                          "\n".join(_merged(rows)) + "\n", path=DOC)
    print("\n".join(rows))
    return 0


def _merged(rows: list[str]) -> list[str]:
    """This run's table rows, with the rows of models it did not run kept from the table in
    docs/search.md (a run with ``--only`` redoes some rows), in :data:`CASES` order. A model
    this run searched without ``--grid`` keeps its earlier grid row (the grid is the
    megatron space's exhaustive search, which no change to the other presets moves), its
    free/this ratio taken again against this run's free step."""
    text = DOC.read_text()
    begin, end = text.find("<!-- search-quality:begin -->"), text.find("<!-- search-quality:end -->")
    old = [line for line in text[begin:end].splitlines() if line.startswith("| ")
           and not line.startswith("| model") and begin >= 0]

    def cells(row: str) -> list[str]:
        return [c.strip() for c in row.strip().strip("|").split(" | ")]

    ran = {cells(r)[0] for r in rows[2:]}
    gridded = {cells(r)[0] for r in rows[2:] if cells(r)[3] == GRID}
    free = {cells(r)[0]: cells(r)[5] for r in rows[2:] if cells(r)[3] == "free"}
    kept = []
    for line in old:
        c = cells(line)
        if c[0] not in ran:
            kept.append(line)
        elif c[3] == GRID and c[0] not in gridded:
            if c[5] and free.get(c[0]):
                c[7] = f"{float(c[5]) / float(free[c[0]]):.3f}"
            kept.append("| " + " | ".join(c) + " |")
    order = {name: i for i, name in enumerate(CASES)}
    rank = {label: i for i, label in enumerate(("megatron", GRID) + PRESETS[1:])}
    body = sorted(kept + rows[2:], key=lambda r: (order.get(cells(r)[0], len(order)),
                                                   rank.get(cells(r)[3], len(rank))))
    return rows[:2] + body


if __name__ == "__main__":
    sys.exit(main())

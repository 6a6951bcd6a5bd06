"""Every pipeline schedule of one model in the simulator, side by side (the table in
docs/simulator.md's "Pipelines" section).

A GPT (d=1024, 8 layers, 16 heads, vocab 8192, batch 16 x 256) on 4 A100s, 4 pipeline
ranks and 8 micro-batches, captured once on the meta device, each schedule simulated by
``torchweave.sim.simulate`` (what ``torchweave simulate`` calls): the step, the bubble, the
micro-batches each pipeline rank holds at its peak (forward done, backward or W not yet:
``peak_in_flight`` of the plan's schedule) and rank 0's activation memory.

Run: python bench/sim_schedules.py [--readme]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PLANS = [("GPipe", "gpipe:pp=4,micro=8"), ("1F1B", "1f1b:pp=4,micro=8"),
         ("ZB-H1", "zb:pp=4,micro=8"),
         ("interleaved (2 per rank)", "interleaved:pp=4,virtual=2,micro=8")]
DOC = Path(__file__).resolve().parent.parent / "docs" / "simulator.md"


def table() -> str:
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig
    from torchweave.plan.schedules import peak_in_flight
    from torchweave.policies import resolve
    from torchweave.sim import simulate
    from torchweave.sim.hardware.cluster import parse_cluster

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=16, d_model=1024))
    idx = torch.zeros(16, 257, dtype=torch.long, device="meta")
    graph = torchweave.capture(model, (idx[:, :-1], idx[:, 1:]), name="gpt-d1024-l8")
    cluster = parse_cluster("4xA100-80GB-SXM")
    rows = ["| schedule | step ms | bubble | micro-batches in flight (per pipeline rank) | "
            "activations rank 0 MiB |", "|---|---|---|---|---|"]
    for label, spec in PLANS:
        plan = resolve(spec, graph, 4)
        res = simulate(graph, plan, cluster, timeline=False)
        live = peak_in_flight(plan.pipeline.schedule)
        rows.append(f"| {label} | {res.step_time * 1e3:.1f} | {res.bubble:.1%} | "
                    f"{', '.join(str(live[r]) for r in sorted(live))} | "
                    f"{res.memory[0].activations / 2**20:.0f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", action="store_true", help="write the table into docs/simulator.md")
    args = ap.parse_args()
    text = table()
    print(text)
    if args.readme:
        from readme_section import write_section  # bench/readme_section.py

        write_section("sim-schedules", "python bench/sim_schedules.py --readme", text, path=DOC)


if __name__ == "__main__":
    main()

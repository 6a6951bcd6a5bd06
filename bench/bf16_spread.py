"""How far apart correct and wrong bf16 plans are, in units of each tensor's bf16 spread.

A bf16 plan's tensor is judged against ``BF16_NOISE_FACTOR`` times its spread (how
far one device's bf16 run is from its fp32 run; see ``torchweave.verify``). This
script measures what that factor must be: for the bf16 draws of a fuzz run (every
failed one and a sample of the verified), and for each the same plan with every
gradient all-reduce dropped (a wrong plan), the factor the worst tensor needs.

    python bench/bf16_spread.py                       # bench/fuzz-run, 30 verified draws
    python bench/bf16_spread.py --sample 60 --out bench/fuzz-run

Heavy: several multi-rank launches; run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from collections import defaultdict
from pathlib import Path

from torchweave.fuzz import Draw
from torchweave.fuzz.run import case_of, tolerance
from torchweave.parallel import compile_plan
from torchweave.runtime.launch import LaunchConfig
from torchweave.verify import BF16_NOISE_FACTOR, Report, run_compiled


def need(rep: Report) -> tuple[float, str]:
    """The factor of its spread that the worst tensor over the tolerance needs."""
    worst, where = 0.0, ""
    for what, diffs, spread in (("grad", rep.grads, rep.bf16_grads),
                                ("param", rep.params, rep.bf16_params)):
        for path, d in diffs.items():
            if d <= rep.tolerance:
                continue
            k = d / max(spread.get(path, 0.0), 1e-30)
            if k > worst:
                worst, where = k, f"{what} {path}: {d:.3g} off, spread {spread.get(path, 0.0):.3g}"
    return worst, where


def _drop_all_reduces(comp) -> bool:
    hit = False
    for prog in comp.programs:
        if any(s.grad_groups for s in prog.params):
            hit = True
            prog.params[:] = [dataclasses.replace(s, grad_groups=()) for s in prog.params]
    return hit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/fuzz-run", help="the fuzz run whose outcomes.jsonl to read")
    ap.add_argument("--sample", type=int, default=30, help="verified bf16 draws to take (besides the failed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rows = [json.loads(line) for line in (Path(args.out) / "outcomes.jsonl").read_text().splitlines()]
    bf16 = [r for r in rows if r["draw"]["step"].get("precision") == "bf16" and r["status"] != "rejected"]
    verified = [r for r in bf16 if r["status"] == "verified"]
    picked = [r for r in bf16 if r["status"] == "failed"]
    picked += random.Random(args.seed).sample(verified, min(args.sample, len(verified)))
    by_size: dict[int, list[Draw]] = defaultdict(list)
    for r in picked:
        d = Draw.from_json(json.dumps(r["draw"]))
        by_size[d.world_size].append(d)

    right, wrong = [], []
    for ws, draws in sorted(by_size.items()):
        graphs: dict = {}
        jobs = []
        for d in draws:
            case = case_of(d)

            def build(case=case):
                return compile_plan(case.model, case.inputs, case.plan, world_size=ws,
                                    micro_batches=case.config.grad_accum,
                                    precision=case.config.precision, graphs=graphs)
            jobs.append((case, build(), False))
            bad = build()
            if _drop_all_reduces(bad):
                jobs.append((case, bad, True))
        for i in range(0, len(jobs), 8):
            part = jobs[i:i + 8]
            reports = run_compiled([c for c, _, _ in part], [k for _, k, _ in part],
                                   launch=LaunchConfig(world_size=ws, timeout_s=30.0), tolerance=1.0)
            for (case, comp, is_wrong), rep in zip(part, reports):
                rep.tolerance = tolerance(comp)
                if rep.error:
                    print(f"{case.name}: failed to run: {rep.error.splitlines()[0]}")
                    continue
                k, where = need(rep)
                (wrong if is_wrong else right).append(k)
                print(f"{case.name:10s} ws{ws} {'wrong' if is_wrong else 'correct':7s} "
                      f"needs {k:8.3g} x spread  {where}", flush=True)
    print(f"\ncorrect plans: {len(right)}, the worst needs {max(right, default=0):.3g} x its spread")
    print(f"wrong plans: {len(wrong)}, the least wrong needs {min(wrong, default=float('inf')):.3g} x")
    print(f"BF16_NOISE_FACTOR = {BF16_NOISE_FACTOR:g}: "
          f"{BF16_NOISE_FACTOR / max(max(right, default=0), 1e-30):.2g}x above the one, "
          f"{min(wrong, default=float('inf')) / BF16_NOISE_FACTOR:.2g}x below the other")


if __name__ == "__main__":
    main()

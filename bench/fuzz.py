"""Fuzz the whole plan space: N seeded plans, each rejected before launch or verified.

    python bench/fuzz.py --plans 40                       # seeds 0..39, all models, 2/4/8 ranks
    python bench/fuzz.py --plans 1000 --readme            # the run reported in bench/README.md
    python bench/fuzz.py --seeds 17 123                   # replay drawn seeds
    python bench/fuzz.py --replay fuzz-out/fail-17        # replay a saved failure (its plan.json)

Every plan is drawn from pp x tp x dp meshes, random SPMD splits, every schedule
(GPipe, 1F1B, interleaved, ZB, interlaced, multi-forward), stage cuts,
micro-batches, ZeRO 1-3, recompute, co-shard, accumulation, bf16 and clipping
(see torchweave/fuzz/draw.py). A plan refused before launch with torchweave's own
error counts as rejected; a crash, a hang or a mismatch with one device is a
failure, saved under --out as fail-<seed>/{case.json, plan.json, error.txt}.
Exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from torchweave.fuzz import MODELS, Draw, draw, run, table

ROOT = Path(__file__).resolve().parent
BEGIN, END = "<!-- fuzz-table:begin -->", "<!-- fuzz-table:end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", type=int, default=40, help="how many seeds to draw (from --start)")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, nargs="*", help="exactly these seeds")
    ap.add_argument("--replay", nargs="*", default=[], help="saved failure folders to run again")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="model families to draw from")
    ap.add_argument("--world-sizes", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--batch", type=int, default=8, help="cases per launch")
    ap.add_argument("--timeout", type=float, default=20.0, help="collective time-out (s): a hang fails")
    ap.add_argument("--out", default="fuzz-out", help="where failures are saved")
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case")
    args = ap.parse_args(argv)

    plans = {}
    if args.replay:
        draws = [Draw.from_json((Path(p) / "case.json").read_text()) for p in args.replay]
        plans = {d.seed: str(Path(p) / "plan.json") for d, p in zip(draws, args.replay)
                 if (Path(p) / "plan.json").exists()}
    else:
        seeds = args.seeds if args.seeds else range(args.start, args.start + args.plans)
        draws = [draw(s, models=tuple(args.models), world_sizes=tuple(args.world_sizes)) for s in seeds]
    start = time.monotonic()
    count = {"rejected": 0, "verified": 0, "failed": 0}

    def progress(o) -> None:
        count[o.status] += 1
        n = sum(count.values())
        if args.verbose or o.status == "failed" or n % 20 == 0:
            head = o.detail.splitlines()[0] if o.detail else ""
            print(f"[{n}/{len(draws)} {time.monotonic() - start:.0f}s] seed {o.draw.seed} "
                  f"{o.draw.model} ws{o.draw.world_size} {o.draw.plan}: {o.status} {head}", flush=True)

    outcomes = run(draws, out_dir=args.out, batch=args.batch, timeout_s=args.timeout, plans=plans,
                   progress=progress)
    minutes = (time.monotonic() - start) / 60
    text = (f"{len(outcomes)} plans (seeds {_seed_range(draws)}), world sizes "
            f"{'/'.join(map(str, args.world_sizes))}, {len(args.models)} model families, "
            f"{minutes:.0f} min: {count['verified']} verified, {count['rejected']} rejected "
            f"before launch, {count['failed']} failed.\n\n{table(outcomes)}\n")
    print(text)
    if args.readme:
        _write_readme(text, " ".join(sys.argv[1:]))
    return 1 if count["failed"] else 0


def _seed_range(draws: list[Draw]) -> str:
    seeds = [d.seed for d in draws]
    return f"{min(seeds)}..{max(seeds)}" if seeds else "none"


def _write_readme(text: str, args: str) -> None:
    path = ROOT / "README.md"
    body = f"{BEGIN}\n`python bench/fuzz.py {args}`:\n\n{text}{END}"
    old = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _m: body, old) if pattern.search(old) else old + "\n" + body + "\n")


if __name__ == "__main__":
    sys.exit(main())

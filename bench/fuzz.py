"""Fuzz the whole plan space: N seeded plans, each rejected before launch or verified.

    python bench/fuzz.py --plans 40                       # seeds 0..39, all models, 2/4/8 ranks
    python bench/fuzz.py --plans 1000 --readme            # the run reported in bench/README.md
    python bench/fuzz.py --seeds 17 123                   # replay drawn seeds
    python bench/fuzz.py --replay fuzz-out/fail-17        # replay a saved failure (its plan.json)
    python bench/fuzz.py --plans 1000 --resume --readme   # go on with a stopped run
    python bench/fuzz.py --table-only --readme            # the table of what the run has done

Every case's outcome is appended to --out/outcomes.jsonl as it ends.

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
import json
import sys
import time
from pathlib import Path

from readme_section import write_section
from torchweave.fuzz import MODELS, Draw, Outcome, draw, run, table

ROOT = Path(__file__).resolve().parent


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
    ap.add_argument("--resume", action="store_true",
                    help="skip seeds already in --out/outcomes.jsonl; the table covers them all")
    ap.add_argument("--table-only", action="store_true",
                    help="run nothing: the table of what --out/outcomes.jsonl holds")
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
    log = Path(args.out) / "outcomes.jsonl"
    earlier = _read_log(log) if (args.resume or args.table_only) else []
    done = {o.draw.seed for o in earlier}
    draws = [] if args.table_only else [d for d in draws if d.seed not in done]
    if not args.resume and not args.table_only and log.exists():
        log.unlink()
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    count = {"rejected": 0, "verified": 0, "failed": 0}
    for o in earlier:
        count[o.status] += 1

    def progress(o) -> None:
        with log.open("a") as f:  # one line per case, so that a stopped run keeps its results
            f.write(json.dumps({"draw": json.loads(o.draw.to_json()), "status": o.status,
                                "detail": o.detail.splitlines()[0] if o.detail else ""}) + "\n")
        count[o.status] += 1
        n = sum(count.values())
        if args.verbose or o.status == "failed" or n % 20 == 0:
            head = o.detail.splitlines()[0] if o.detail else ""
            print(f"[{n}/{len(draws)} {time.monotonic() - start:.0f}s] seed {o.draw.seed} "
                  f"{o.draw.model} ws{o.draw.world_size} {o.draw.plan}: {o.status} {head}", flush=True)

    outcomes = earlier + run(draws, out_dir=args.out, batch=args.batch, timeout_s=args.timeout,
                             plans=plans, progress=progress)
    minutes = (time.monotonic() - start) / 60
    families = len({o.draw.model for o in outcomes})
    sizes = "/".join(map(str, sorted({o.draw.world_size for o in outcomes})))
    took = "" if args.table_only or earlier else f", {minutes:.0f} min"
    text = (f"{len(outcomes)} plans (seeds {_seed_range([o.draw for o in outcomes])}), world sizes "
            f"{sizes}, {families} model families{took}: {count['verified']} verified, "
            f"{count['rejected']} rejected before launch, {count['failed']} failed.\n\n"
            f"{table(outcomes)}\n")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        text += "\nFailed: " + "; ".join(f"seed {o.draw.seed} ({o.detail})" for o in failed) + "\n"
    print(text)
    if args.readme:
        write_section("fuzz-table", "python bench/fuzz.py " + " ".join(sys.argv[1:]), text, dated=False)
    return 1 if count["failed"] else 0


def _read_log(path: Path) -> list[Outcome]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Outcome(Draw.from_json(json.dumps(r["draw"])), r["status"], r["detail"]) for r in rows]


def _seed_range(draws: list[Draw]) -> str:
    seeds = [d.seed for d in draws]
    return f"{min(seeds)}..{max(seeds)}" if seeds else "none"


if __name__ == "__main__":
    sys.exit(main())

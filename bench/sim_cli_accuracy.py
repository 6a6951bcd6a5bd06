"""`torchweave simulate --profile`, exactly as a user runs it, against the steps it predicts.

For each world size (2 and 4 gloo ranks on this machine's cores):

1. **Predict**: one run of the command, in its own process, with every plan
   of ``PLANS`` on the GPT of ``bench/parallel.py`` (d=256, 4 layers, vocab
   4096, batch 8 x 128, fp32, AdamW)::

       torchweave simulate bench/parallel.py:make_gpt --cluster NxCPU-2core@N \
           --plan dp --plan zero1 ... --profile --json OUT

   The built-in ``CPU-2core`` device models ranks sharing the node's cores and
   gloo's per-collective wait (``docs/simulator.md``, "Ranks sharing cores");
   ``--profile`` times each op piece here, one thread, and uses the times in
   place of the roofline. The command runs with an empty ``HOME``, so its op
   cache starts empty and it times ops now, under the load the measurement
   then sees (a user's cache may be older).
2. **Measure**: one gloo launch (1 thread per rank) trains each plan: 2
   warm-up steps, then 5 timed ``train_step`` calls (barrier before each); the
   slowest rank's median. Memory: parameters, gradients and optimizer state
   held after backward plus the most saved-for-backward storage alive at once
   (``bench/sim_accuracy.py``'s rule); predicted: ``params + grads + optimizer
   + activations`` of the command's JSON.

``--repeats R`` runs both R times; the table gives each plan's median over
them, and the median absolute error over all plans and worlds. Predicted /
measured is the ratio (above 1: the command predicted slower than it ran).

Unlike ``bench/sim_accuracy.py`` (which times ops inside the measuring launch,
between its steps, and measures each collective's extra wait there), nothing
here is fitted or measured in the launch: the prediction is the command's
alone.

Run: python bench/sim_cli_accuracy.py [--worlds 2 4] [--plans dp ...] [--repeats 1] [--readme]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from parallel import GPT_BATCH, GPT_KW  # noqa: E402
from sim_accuracy import PLANS, _measure_plan  # noqa: E402

MiB = 2**20


def predict(world: int, plans: list[str]) -> dict[str, dict[str, Any]]:
    """The command's JSON per plan (run from the repository root, as the README does)."""
    with tempfile.TemporaryDirectory() as home:
        out = os.path.join(home, "sim.json")
        cmd = [sys.executable, "-m", "torchweave", "simulate", "bench/parallel.py:make_gpt",
               "--cluster", f"{world}xCPU-2core@{world}", "--profile", "--json", out,
               *[x for p in plans for x in ("--plan", p)]]
        env = {**os.environ, "HOME": home}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True,
                              timeout=1200)
        if done.returncode not in (0, 1):  # 1: some plan out of memory (still reported)
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        print(f"  predicted {len(plans)} plans for {world} ranks in {time.perf_counter() - t0:.0f} s "
              f"(capture, profiling, simulation)", flush=True)
        with open(out) as f:
            return {d["spec"]: d for d in json.load(f)}


def _rank(ctx, plans: list[str], warmup: int, steps: int) -> dict[str, Any]:
    out = {}
    for plan in plans:
        try:
            out[plan] = _measure_plan(ctx, plan, warmup, steps, lambda: None)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[plan] = {"error": f"{type(e).__name__}: {e}"[:160]}
    return out


def measure(world: int, plans: list[str], warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    from torchweave.runtime.launch import LaunchConfig, spawn

    cfg = LaunchConfig(world_size=world, backend="gloo", timeout_s=300.0, threads_per_rank=1)
    per_rank = spawn(_rank, cfg, plans, warmup, steps)
    out = {}
    for plan in plans:
        rs = [r[plan] for r in per_rank]
        bad = next((r for r in rs if "error" in r), None)
        out[plan] = bad or {"s": max(r["s"] for r in rs),
                            "mem": max(r["state"] + r["act"] for r in rs)}
    return out


def _predicted_memory(d: dict[str, Any]) -> int:
    return max(m["params"] + m["grads"] + m["optimizer"] + m["activations"] for m in d["memory_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--plans", nargs="+", default=PLANS, choices=PLANS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args()
    t_start = time.perf_counter()
    rows, terr, merr = [], [], []
    for world in args.worlds:
        runs: dict[str, list[tuple[float, float, float, float]]] = {p: [] for p in args.plans}
        for rep in range(args.repeats):
            print(f"{world} ranks, run {rep + 1} of {args.repeats}", flush=True)
            pred = predict(world, args.plans)
            real = measure(world, args.plans, args.warmup, args.steps)
            for plan in args.plans:
                if "error" in real[plan]:
                    print(f"  {plan}: measurement failed: {real[plan]['error']}", flush=True)
                    continue
                p, r = pred[plan], real[plan]
                runs[plan].append((p["step_time_s"], r["s"], _predicted_memory(p), r["mem"]))
                print(f"  {plan}: predicted {p['step_time_s'] * 1e3:.1f} ms, measured "
                      f"{r['s'] * 1e3:.1f} ms", flush=True)
        for plan in args.plans:
            got = runs[plan]
            if not got:
                rows.append(f"| {plan} | {world} | failed | | | | | | |")
                continue
            ps, ms, pm, mm = (statistics.median(x[i] for x in got) for i in range(4))
            te = statistics.median(x[0] / x[1] for x in got)
            me = statistics.median(x[2] / x[3] for x in got)
            terr.append(abs(te - 1))
            merr.append(abs(me - 1))
            rows.append(f"| {plan} | {world} | {ps * 1e3:.1f} | {ms * 1e3:.1f} | {te:.2f} | "
                        f"{te - 1:+.0%} | {pm / MiB:.1f} | {mm / MiB:.1f} | {me - 1:+.0%} |")
    elapsed = time.perf_counter() - t_start
    b, t = GPT_BATCH
    table = "\n".join([
        "| plan | ranks | predicted ms | measured ms | predicted / measured | time error | "
        "predicted MiB | measured MiB | memory error |",
        "|---|---|---|---|---|---|---|---|---|", *rows])
    summary = (f"Median absolute error over {len(terr)} plan × world runs: time "
               f"**{statistics.median(terr):.0%}**, memory **{statistics.median(merr):.0%}**; "
               f"worst time {max(terr):.0%}. GPT d={GPT_KW['d_model']} L={GPT_KW['n_layer']} "
               f"V={GPT_KW['vocab_size']}, batch {b}x{t}, fp32, AdamW; medians of "
               f"{args.repeats} prediction + launch pair(s) per world, {args.steps} timed steps "
               f"each; {elapsed:.0f} s." if terr else "No successful runs.")
    print("\n" + table + "\n\n" + summary)
    if args.readme:
        from readme_section import write_section

        write_section("sim-cli-accuracy", "python bench/sim_cli_accuracy.py "
                      + " ".join(sys.argv[1:]), table + "\n\n" + summary + "\n")
        print("wrote bench/README.md")


if __name__ == "__main__":
    main()

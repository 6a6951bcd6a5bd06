"""One command that checks torchweave on one GPU and writes one markdown report.

    python bench/gpu_check.py --out bench/gpu-report.md          # about 8 min on one GPU
    python bench/gpu_check.py --cpu-smoke --out /tmp/report.md   # under a minute, no GPU

Sections (bench/gpu_sections.py, gpu_runs.py, gpu_eager.py) each run in their
own process under their own time budget, so a failure, a hang or a crash in one
is recorded in the report (with the error's first lines) and the next one runs:

- ``env``: torch, CUDA, NCCL, the device, the packages torchweave needs;
- ``unit-tests``: ``pytest tests/unit`` as a subprocess (pass/fail counts),
  running beside the sections that do not time anything;
- ``tensors``: capture, replay, the codegen round trip and the registry's
  split checks with CUDA tensors;
- ``nccl-policies``: every built-in policy at world size 1 on NCCL;
- ``gloo-cuda``: policies at world size 2 on gloo with CUDA tensors (both
  ranks share the GPU);
- ``bf16``: bf16 training against the bf16 one-device reference and fp32;
- ``sim``: op profiles on the GPU; the simulator's predicted step time for a
  GPT-2-small-sized model against the measured one;
- ``eager``: a GPT trained at world size 1 by eager PyTorch and by
  ``parallelize(plan="dp")``, in the section's own process: median step times and
  their ratio, the loss difference, peak memory, and each side's top ops under
  torch.profiler (bench/gpu_eager.py).

Without CUDA (or with ``--cpu-smoke``) the CUDA sections say "skipped: no CUDA"
and CPU stand-ins of the cheap ones run instead, so this script is exercised by
``tests/dist/test_gpu_check.py`` and cannot rot unseen.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (name, seconds on a GPU, seconds in the CPU smoke, has a CPU stand-in)
SECTIONS = [  # smoke budgets leave room for a loaded 2-core machine (about 5 s each when idle)
    # GPU budgets from the first run on an H200 (gVisor): a spawned process takes 6 s to
    # start and NCCL 10 s more to join, so each launch costs about 20 s before any step
    ("env", 30, 30, True),
    ("tensors", 75, 60, True),
    ("nccl-policies", 150, 60, True),
    ("gloo-cuda", 160, 0, False),  # seven launches of about 20 s each (100 s ran five)
    ("bf16", 75, 40, True),
    ("sim", 60, 60, True),
    ("eager", 60, 40, True),  # world size 1 in its own process, no spawned rank: 8 s in the smoke
]
TIMED = {"sim", "eager"}
"""Sections that time steps: the unit tests end before the first of them starts."""
UNIT_BUDGET = {False: 300, True: 60}
"""Seconds for ``pytest tests/unit`` (GPU run) or its stand-in (CPU smoke)."""


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    lines: list[str] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "gpu-report.md"), help="the report (markdown)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU stand-ins only (automatic without CUDA)")
    p.add_argument("--total-s", type=float, default=None,
                   help="budget of the whole run (default 520 s on a GPU, 240 s in the smoke)")
    p.add_argument("--only", nargs="*", default=None, help="run only these sections")
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--section-out", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.section:  # a child: one section, its lines into --section-out
        from gpu_sections import run_section  # bench/gpu_sections.py (the script's folder is on sys.path)

        return run_section(args.section, Path(args.section_out), smoke=args.cpu_smoke,
                           budget_s=args.budget)
    import torch

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    total = args.total_s or (240.0 if smoke else 520.0)
    start = time.monotonic()
    deadline = start + total
    only = set(args.only) if args.only is not None else None
    outcomes: list[Outcome] = []
    unit = None
    if only is None or "unit-tests" in only:
        unit = _start_unit_tests(smoke, min(UNIT_BUDGET[smoke], total - 10))
    with tempfile.TemporaryDirectory(prefix="tw-gpu-check-") as tmp:
        for name, gpu_s, smoke_s, stand_in in SECTIONS:
            if only is not None and name not in only:
                continue
            if name in TIMED and unit is not None:  # nothing else runs while steps are timed
                outcomes.append(_finish_unit_tests(unit))
                unit = None
            budget = min(smoke_s if smoke else gpu_s, deadline - time.monotonic() - 5)
            if smoke and not stand_in:
                outcomes.append(Outcome(name, "skipped: no CUDA", 0.0,
                                        ["- no CPU stand-in: tests/dist covers gloo on CPU"]))
            elif budget < 5:
                outcomes.append(Outcome(name, "not run: the total budget is spent", 0.0))
            else:
                outcomes.append(_run_child(name, budget, smoke, Path(tmp)))
        if unit is not None:
            outcomes.append(_finish_unit_tests(unit))
    order = ["env", "unit-tests"] + [s[0] for s in SECTIONS[1:]]
    outcomes.sort(key=lambda o: order.index(o.name))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_report(outcomes, smoke=smoke, total=total, elapsed=time.monotonic() - start))
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")
    for o in outcomes:
        print(f"  {o.name:14s} {o.status} ({o.seconds:.1f} s)")
    return 0


def _run_child(name: str, budget: float, smoke: bool, tmp: Path) -> Outcome:
    """One section in its own process group, killed at its budget; its lines kept either way."""
    lines_path = tmp / f"{name}.md"
    lines_path.write_text("")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--section-out",
           str(lines_path), "--budget", f"{budget:.0f}"] + (["--cpu-smoke"] if smoke else [])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=budget)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - t0
    lines = lines_path.read_text().splitlines()
    status_lines = [x for x in lines if x.startswith("STATUS ")]
    lines = [x for x in lines if not x.startswith("STATUS ")]
    if timed_out:
        status = f"timed out after {budget:.0f} s (the parts above finished)"
    elif status_lines:
        status = status_lines[-1][len("STATUS "):]
    else:
        status = f"crashed (exit code {proc.returncode})"
    if (timed_out or proc.returncode) and output.strip():
        lines += ["", "Last output of the section's process:", "```",
                  *output.strip().splitlines()[-15:], "```"]
    return Outcome(name, status, seconds, lines)


@dataclass
class _Unit:
    proc: subprocess.Popen
    log: Path
    budget: float
    started: float
    what: str


def _start_unit_tests(smoke: bool, budget: float) -> _Unit:
    """``pytest tests/unit`` in the background (smoke: one small file as a stand-in), spread
    over 8 workers where pytest-xdist is installed (the GPU machine's image has it)."""
    import importlib.util

    target = "tests/unit/test_grammar.py" if smoke else "tests/unit"
    workers = [] if smoke or importlib.util.find_spec("xdist") is None else ["-n", "8"]
    log = Path(tempfile.mkstemp(prefix="tw-gpu-check-pytest-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pytest", target, *workers, "-q", "-rfE", "-p", "no:cacheprovider",
           "--tb=line"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if workers:  # 8 workers beside the launching sections: 2 threads each, not all the cores
        env["OMP_NUM_THREADS"] = "2"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    what = (f"`pytest {target}`" + (f" on {workers[1]} workers" if workers else "")
            + (" (CPU smoke stand-in: one small file)" if smoke else ""))
    return _Unit(proc, log, budget, time.monotonic(), what)


def _finish_unit_tests(unit: _Unit) -> Outcome:
    left = unit.budget - (time.monotonic() - unit.started)
    try:
        unit.proc.wait(timeout=max(0.0, left))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(unit.proc.pid, signal.SIGKILL)
        unit.proc.wait()
        timed_out = True
    text = unit.log.read_text(errors="replace")
    unit.log.unlink()
    counts = _pytest_counts(text)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no test results"
    lines = [f"- {unit.what}: {summary}"]
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", text, re.M)
    lines += [f"  - failed: `{t}`" for t in failed[:25]]
    tail = [x for x in text.strip().splitlines()[-3:] if x.strip()]
    lines += ["- last lines:", "```", *tail, "```"]
    if timed_out:
        status = f"timed out after {unit.budget:.0f} s ({summary} so far)"
    elif unit.proc.returncode in (0, 1) and sum(counts.values()):
        status = "ok" if counts["failed"] + counts["error"] == 0 else f"failed ({summary})"
    else:
        status = f"pytest exited with code {unit.proc.returncode}"
    return Outcome("unit-tests", status, time.monotonic() - unit.started, lines)


_PROGRESS = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed",
             "X": "xpassed"}


def _pytest_counts(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 failed, 812 passed, 2 skipped in 9.1s"); a
    run killed at its budget has none, so its progress lines (``..F.s``) are counted."""
    counts = dict.fromkeys(("passed", "failed", "error", "skipped", "xfailed", "xpassed"), 0)
    summaries = re.findall(r"^=*\s*(\d+ \w+.*) in [\d.]+s", text, re.M)
    if summaries:
        for n, kind in re.findall(r"(\d+) (\w+)", summaries[-1]):
            key = {"errors": "error"}.get(kind, kind)
            if key in counts:
                counts[key] = int(n)
        return counts
    for line in re.findall(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", text, re.M):
        for ch in line:
            counts[_PROGRESS[ch]] += 1
    return counts


def _report(outcomes: list[Outcome], *, smoke: bool, total: float, elapsed: float) -> str:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    mode = "CPU smoke (CPU stand-ins; CUDA sections skipped)" if smoke else "GPU"
    lines = ["# torchweave GPU check", "",
             f"- written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} on {platform.node()}; "
             f"mode: {mode}",
             f"- torch {torch.__version__} (CUDA {torch.version.cuda}); device: {device}",
             f"- {elapsed:.0f} s in all (budget {total:.0f} s)", "",
             "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.1f} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.name}", "", f"Status: {o.status}", "", *o.lines]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

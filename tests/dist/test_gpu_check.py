"""bench/gpu_check.py in its CPU smoke mode: every section runs or says why not, so the
one-command GPU check cannot rot while no GPU runs it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_gpu_check_cpu_smoke_writes_a_report_with_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-smoke",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in text.splitlines() if line.startswith("| ") and line.count("|") == 4}
    assert rows["env"] == "ok" and rows["unit-tests"] == "ok", text
    for name in ("tensors", "nccl-policies", "bf16", "sim", "eager"):
        assert rows[name] == "skipped: no CUDA (CPU stand-in: ok)", (name, text)
    assert rows["gloo-cuda"] == "skipped: no CUDA", text
    for want in ("registry split checks on cpu tensors", "gpt-tiny/dp | ok",
                 "bf16 against fp32", "| fp32 |", "torchweave / eager =", "| eager op |"):
        assert want in text, want
    assert elapsed < 150, f"the smoke took {elapsed:.0f} s (about 30 s on an idle 2-core machine)"

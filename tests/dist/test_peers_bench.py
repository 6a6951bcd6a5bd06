"""bench/peers.py on its smallest path (dp against DDP, 2 ranks, 1 launch, 1 timed step, and
the time to first step): a row with a ratio comes out and the README section is written, so the one-job bench cannot
rot while nobody runs it in full."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_peers_quick_dp_row_has_a_ratio_and_writes_the_readme_section(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--quick",
                          "--worlds", "2", "--launches", "1", "--steps", "1", "--only", "dp", "first",
                          "--readme", "--readme-path", str(readme)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| dp | DDP | 2 |")]
    assert len(rows) == 1, run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert re.fullmatch(r"\d+\.\d\dx", cells[5]), rows[0]  # the median ratio
    assert "failed" not in rows[0] and "DIFFER" not in rows[0], rows[0]
    assert "rows meet their target" in run.stdout, run.stdout
    first = [line for line in run.stdout.splitlines() if line.startswith("| first step | DDP")]
    assert len(first) == 1 and "<= peer + 1 s" in first[0], run.stdout
    cells = [c.strip() for c in first[0].strip("|").split("|")]
    assert float(cells[3]) > 0 and float(cells[4]) > 0, first[0]  # both sides' times
    assert "failed" not in first[0] and "DIFFER" not in first[0], first[0]
    text = readme.read_text()
    assert "<!-- peers:begin -->" in text and "<!-- peers:end -->" in text, text
    assert rows[0] in text, text


@pytest.mark.dist
def test_rss_bench_gives_each_rank_a_ratio_and_writes_its_section(tmp_path: Path) -> None:
    """bench/rss.py on dp at 2 ranks, 1 step: each side ran in its own launch and each rank has
    a peak resident set ratio."""
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "rss.py"), "--worlds", "2",
                          "--steps", "1", "--only", "dp", "--readme", "--readme-path", str(readme)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| dp | DDP | 2 |")]
    assert rows, run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[3]) > 100 and float(cells[4]) > 100, rows[0]  # MiB: torch alone is more
    assert len(cells[6].split(",")) == 2, rows[0]  # one ratio a rank
    assert cells[8] in ("yes", "no"), rows[0]
    assert "<!-- peers-rss:begin -->" in readme.read_text()

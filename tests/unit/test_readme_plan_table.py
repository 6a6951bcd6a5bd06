"""The README's plan-string table lists every option each policy takes (policies/spec.py)."""

from __future__ import annotations

import re
from pathlib import Path

from torchweave.policies.spec import OPTIONS

README = Path(__file__).resolve().parents[2] / "README.md"


def _rows() -> dict[str, set[str]]:
    text = README.read_text().split("### Plan strings", 1)[1]
    table = text[text.index("| policy | options |"):].split("\n\n", 1)[0].splitlines()[2:]
    rows: dict[str, set[str]] = {}
    previous: set[str] = set()
    for line in table:
        names_cell, options_cell = line.strip("|").split("|", 1)
        names = re.findall(r"`([^`]+)`", names_cell)
        for stem, first, last in re.findall(r"`([a-z]+)(\d)`–`[a-z]+(\d)`", names_cell):
            names += [f"{stem}{i}" for i in range(int(first), int(last) + 1)]  # `zero1`–`zero3`
        options = set(re.findall(r"`([a-z]+)`", options_cell))
        if "the same" in options_cell:
            options |= previous
        previous = options
        for name in names:
            rows[name] = options
    return rows


def test_every_policy_has_a_row_listing_all_its_options() -> None:
    rows = _rows()
    missing = {p: sorted(set(opts) - rows.get(p, set())) for p, opts in OPTIONS.items()}
    missing = {p: m for p, m in missing.items() if m or p not in rows}
    assert not missing, f"README plan-string table lags policies/spec.py OPTIONS: {missing}"

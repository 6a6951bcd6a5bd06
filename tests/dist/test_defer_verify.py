"""Moved gradient sums (lower/defer.py) against one device on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_defer import _Nested, _Pos
from torchweave.verify import Case, verify_many


@pytest.mark.dist
def test_moved_and_kept_sums_match_one_device() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 4)
    models = {"nested": _Nested(), "pos": _Pos(False), "mixed": _Pos(True)}
    cases = [Case(m, (x,), plan, name=f"{name}/{plan}") for name, m in models.items()
             for plan in ("dp", "zero3")]
    for report in verify_many(cases, world_size=2):
        assert report.ok, str(report)

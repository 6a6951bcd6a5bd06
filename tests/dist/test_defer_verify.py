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


@pytest.mark.dist
def test_sums_moved_in_pipelines_match_one_device() -> None:
    """Per-block lookups of one table, their sums over dp moved to each stage's copy of it
    (and a GPT's position table, read on its own stage), and one parameter behind two sums
    over different groups (kept where they are read), against one device."""
    from tests.conftest import built
    from tests.unit.test_defer import _PerBlock, _TwoSums

    torch.manual_seed(0)
    x = torch.randn(8, 8, 4)
    gpt, inputs = built("gpt-tiny")[:2]
    cases = [Case(_PerBlock(), (x,), plan, name=f"per-block/{plan}")
             for plan in ("1f1b:pp=2,dp=2,micro=2", "interleaved:pp=2,dp=2,micro=2,zero=1")]
    cases.append(Case(gpt, inputs, "gpipe:pp=2,dp=2,micro=2", name="gpt/gpipe"))
    cases.append(Case(_TwoSums(), (x,), "tp:tp=2", name="two-sums/tp"))
    for report in verify_many(cases, world_size=4):
        assert report.ok, str(report)

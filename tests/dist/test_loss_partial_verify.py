"""A mean loss with no sum over ranks in forward (lower/loss.py) against one device on real
gloo ranks: ignored targets spread unevenly over the ranks, so each rank's own mean would
be wrong, a float mask whose count stays summed, and a learned denominator, whose sum
stays too."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_partial import _EarlyTargets, _LearnedScale, _Masked
from torchweave.verify import Case, verify_many


@pytest.mark.dist
def test_kept_terms_and_whole_counts_match_one_device() -> None:
    torch.manual_seed(0)
    x, t = torch.randn(4, 2, 16), torch.randint(0, 16, (4, 2))
    t[0, 0] = t[0, 1] = t[1, 0] = -100  # three of the first rank's four targets ignored
    xm, mask = torch.randn(8, 4), (torch.arange(8) % 3 != 0).float()
    cases = [Case(_EarlyTargets(), (x, t), plan, name=f"targets/{plan}")
             for plan in ("dp", "zero2", "1f1b:pp=2,micro=2")]
    cases += [Case(_Masked(), (xm, mask), "dp", name="mask/dp"),
              Case(_LearnedScale(), (xm,), "dp", name="learned-scale/dp")]
    for report in verify_many(cases, world_size=2):
        assert report.ok, str(report)
    (report,) = verify_many([Case(_EarlyTargets(), (x, t), "1f1b:pp=2,dp=2,micro=2")],
                            world_size=4)
    assert report.ok, str(report)

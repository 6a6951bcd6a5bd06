"""Which estimated points the search simulates: the best, and the best of each family.

The estimate (:mod:`torchweave.search.estimate`) is biased per *family* of points,
the points that share a way of splitting a block and pipelining or not. A bias
that pushes one family down the list would hide it from the simulator; these rules
keep every family that could win in view, and let the simulated points correct
their family's other estimates.
"""

from __future__ import annotations

from torchweave.search.estimate import Estimate
from torchweave.search.space import Point

MARGIN = 0.10
"""A family's best point is simulated when its estimate is within this of the best
estimate (the estimate's error on the plans it ranks, measured in ``bench/search.py``, is
mostly under it)."""
ROUNDS = 2
"""Rounds of re-simulating points that their family's measured bias says were under-rated."""


def family(pt: Point) -> tuple:
    """The points whose estimates share a bias: one split of the block (tp, sp, solved or
    Megatron's, the experts over ep), pipelined or not. (ZeRO-3 points, whose per-unit gathers the estimate
    cannot see, are not estimated at all: :func:`~torchweave.search.estimate.estimable`.)"""
    return (pt.tp, pt.sp, pt.split, pt.pp > 1, pt.ep)


def families(order: list[Point], ests: dict[Point, Estimate]) -> list[Point]:
    """The best-estimated point of each :func:`family` within :data:`MARGIN` of the best
    estimate: a family the estimate under-rates still has its best point simulated."""
    if not order:
        return []
    best = ests[order[0]].step_s
    seen: set[tuple] = set()
    out = []
    for p in order:
        if ests[p].step_s > best * (1 + MARGIN):
            break
        if family(p) not in seen:
            seen.add(family(p))
            out.append(p)
    return out


def corrected(order: list[Point], ests: dict[Point, Estimate], simulated: dict[Point, float],
              best: float, k: int) -> list[Point]:
    """Up to ``k`` points not yet simulated whose estimate, scaled by its family's measured
    bias (simulated / estimated step of the family's simulated points, the largest), beats
    ``best``, the best simulated step of a plan that fits; best first. (A family's best
    point may be refused or found over the memory budget once simulated: its next one is
    then worth simulating if the bias says it would win.)"""
    bias: dict[tuple, float] = {}
    for p, step in simulated.items():
        if p in ests and ests[p].step_s > 0:
            f = family(p)
            bias[f] = max(bias.get(f, 0.0), step / ests[p].step_s)
    out = [p for p in order if p not in simulated and family(p) in bias
           and ests[p].step_s * bias[family(p)] < best]
    return out[:max(k, 1)]


__all__ = ["MARGIN", "ROUNDS", "corrected", "families", "family"]

"""A plan with op-orders matches one device: loss, every gradient, parameters after steps."""

from __future__ import annotations

import functools

import pytest

from tests.conftest import built
from tests.unit.test_op_order import v_before_q
from torchweave.verify import Case, verify_many


@pytest.mark.dist
def test_op_ordered_plans_match_one_device() -> None:
    """(The unit tests check that lowering runs v before q; this runs it on gloo ranks.)"""
    model, inputs = built("gpt-tiny")[:2]
    cases = [Case(model, inputs, functools.partial(v_before_q, text=text), steps=3,
                  name=f"gpt-tiny/{text}+op-order") for text in ("tp", "zero3")]
    for report in verify_many(cases, world_size=2):
        assert report.ok, str(report)

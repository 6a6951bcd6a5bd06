"""Training features on real gloo ranks: accumulation, clipping, bf16, failures."""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import built
from torchweave.runtime.executor import StepConfig
from torchweave.runtime.launch import LaunchConfig, RankFailedError, spawn
from torchweave.verify import Case, verify_many


@pytest.mark.dist
def test_accumulation_and_clipping_match_one_device() -> None:
    model, inputs = built("gpt-tiny")[:2]
    accum = StepConfig(grad_accum=2)
    clip = StepConfig(clip_grad_norm=0.05)  # small enough that every step clips
    cases = [
        Case(model, inputs, "dp", config=accum, name="dp/accum2"),
        Case(model, inputs, "zero2", config=accum, name="zero2/accum2"),
        Case(model, inputs, "tp", config=clip, name="tp/clip"),
        Case(model, inputs, "zero3", config=clip, name="zero3/clip"),
        Case(model, inputs, "sp", config=StepConfig(grad_accum=2, clip_grad_norm=0.05),
             name="sp/accum2+clip"),
    ]
    for report in verify_many(cases, world_size=2):
        assert report.ok, str(report)


@pytest.mark.dist
def test_bf16_trains_close_to_fp32_with_fp32_masters() -> None:
    model, inputs = built("llama-tiny")[:2]
    bf16 = StepConfig(precision="bf16")
    reports = verify_many([Case(model, inputs, "dp", config=bf16, name="dp/bf16"),
                           Case(model, inputs, "zero3", config=bf16, name="zero3/bf16")],
                          world_size=2, tolerance=5e-2)
    for report in reports:
        assert report.ok, str(report)
        assert 0 < report.loss_diff, "bf16 compute should differ a little from fp32"


def _fail_mid_step(ctx, model, inputs):
    from torchweave.parallel import parallelize

    module = parallelize(model, inputs, plan="dp", groups=ctx.groups)
    module.train_step(*inputs)
    if ctx.rank == 1:
        raise RuntimeError("boom on rank 1 after one step")
    module.train_step(*inputs)  # rank 0 waits here for rank 1's gradients
    return "finished"


@pytest.mark.dist
def test_a_failing_rank_stops_every_rank_with_its_error() -> None:
    model, inputs = built("gpt-tiny")[:2]
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(_fail_mid_step, LaunchConfig(world_size=2, timeout_s=20.0), model, inputs)
    assert info.value.rank == 1
    assert "boom on rank 1" in str(info.value)
    assert time.monotonic() - start < 60

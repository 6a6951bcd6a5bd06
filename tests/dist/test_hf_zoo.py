"""Thirteen transformers families, built from small configs, each verified under dp, tp,
zero3, 1f1b and sp at 2 real gloo ranks against one device.

One launch runs every case; each test reads its own report. The families and what each
adds are listed in ``torchweave/models/hf_zoo.py``.
"""

from __future__ import annotations

import functools

import pytest

import torchweave

from tests.conftest import built
from torchweave.models.hf_zoo import MOE, ZOO
from torchweave.verify import Case, verify_many

ARCHS = ["hf-gpt2-tiny", "hf-llama-tiny", *ZOO]
POLICIES = ["dp", "tp", "zero3", "1f1b", "sp"]


@functools.lru_cache(maxsize=None)
def reports() -> dict[tuple[str, str], object]:
    cases, keys = [], []
    for name in ARCHS:
        model, inputs = built(name)[:2]
        for policy in (*POLICIES, "ep") if name in MOE else POLICIES:
            cases.append(Case(model, inputs, policy, steps=2, name=f"{name}/{policy}"))
            keys.append((name, policy))
    return dict(zip(keys, verify_many(cases, world_size=2)))


@pytest.mark.dist
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ARCHS)
def test_transformers_family_matches_one_device(name: str, policy: str) -> None:
    pytest.importorskip("transformers")
    report = reports()[(name, policy)]
    assert report.ok, str(report)
    assert len(report.losses) == 2 and report.grads and report.params and report.sgd
    assert sum(report.comm.values()) > 0, report.comm  # really distributed


@pytest.mark.dist
@pytest.mark.parametrize("name", MOE)
def test_moe_families_run_in_float64_and_say_why_they_are_judged_in_float32(name: str) -> None:
    """transformers' experts default to a grouped matmul with no float64 kernel: the float64
    reference runs their loop over experts instead, so these models run in float64 like
    the other decoders, and like them are judged at float32's tolerance because transformers
    computes the rotary tables in float32 (the report names the op)."""
    pytest.importorskip("transformers")
    report = reports()[(name, "dp")]
    assert report.tolerance == 1e-5 and "narrower dtype than float64" in report.precision
    assert "does not run in float64" not in report.precision


@pytest.mark.dist
@pytest.mark.parametrize("name", MOE)
def test_moe_families_under_ep_split_their_experts_and_match(name: str) -> None:
    """transformers' experts are captured as one op (``torchweave.moe_experts``): ``ep``
    splits the experts, each rank computing only the pairs routed to its own, and lowering
    derives the rest: each token sent only to the ranks that hold its experts, and their
    terms sent back and summed (the routed exchange, lower/route.py)."""
    pytest.importorskip("transformers")
    from torchweave.policies import resolve

    report = reports()[(name, "ep")]
    assert report.ok, str(report)
    # per MoE layer (two): the route's counts and index, two dispatches, one combine
    assert report.comm.get("all_to_all/fwd", 0) == 10, report.comm
    assert report.comm.get("reduce_scatter/fwd", 0) == 0, report.comm  # no gather and scatter
    model, inputs = built(name)[:2]
    plan = resolve("ep", torchweave.capture(model, inputs), 2)
    assert plan.notes["experts"] == "2 expert ops split over ep=2"


@pytest.mark.dist
def test_moe_families_under_ep_with_dp_tp_and_a_pipeline_match_at_4_ranks() -> None:
    """ep=2 × dp=2, ep=2 × tp=2 (the experts split over both), and ep inside the stages of
    a 1F1B pipeline, on both MoE families; ep=4 with full recompute and ep in a zero-bubble
    pipeline on one."""
    pytest.importorskip("transformers")
    cases = [Case(*built(name)[:2], plan, steps=2, name=f"{name}/{plan}")
             for name in MOE for plan in ("ep:ep=2", "ep:ep=2,tp=2", "1f1b:ep=2,pp=2,micro=2")]
    # the routed exchange run again in backward (recompute), and under a split backward
    cases += [Case(*built(MOE[0])[:2], plan, steps=2, name=f"{MOE[0]}/{plan}")
              for plan in ("ep:ep=4,recompute=full", "zb:ep=2,pp=2,micro=2")]
    for case, report in zip(cases, verify_many(cases, world_size=4)):
        assert report.ok, str(report)
        if "tp" in case.plan:  # the experts over four ranks, the tokens gathered over two
            assert report.comm.get("reduce_scatter/fwd", 0) >= 2, report.comm
        else:  # routed within each ep group
            assert report.comm.get("all_to_all/fwd", 0) >= 10, report.comm

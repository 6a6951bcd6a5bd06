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
def test_moe_families_are_judged_in_float32_and_say_why(name: str) -> None:
    """transformers' experts call a grouped matmul with no float64 kernel: verify runs those
    models in float32, at float32's tolerance, and the report says so."""
    pytest.importorskip("transformers")
    report = reports()[(name, "dp")]
    assert report.tolerance == 1e-5 and "does not run in float64" in report.precision


@pytest.mark.dist
@pytest.mark.parametrize("name", MOE)
def test_moe_families_under_ep_run_as_data_parallelism_and_match(name: str) -> None:
    """transformers' grouped experts split their rows at offsets known only at run time, so
    ``ep`` finds no expert op to split there: it runs as dp (the plan says so), correctly."""
    pytest.importorskip("transformers")
    from torchweave.policies import resolve

    report = reports()[(name, "ep")]
    assert report.ok, str(report)
    model, inputs = built(name)[:2]
    plan = resolve("ep", torchweave.capture(model, inputs), 2)
    assert "runs as data parallelism" in plan.notes["experts"]

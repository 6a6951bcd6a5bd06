"""The plan-space fuzzer in CI: 40 seeded plans over the whole space, each rejected before
launch with torchweave's own error or verified against one device (``bench/fuzz.py``
runs more; its 1,000-plan report is in bench/README.md)."""

from __future__ import annotations

import pytest

from torchweave.fuzz import MODELS, draw, run, table

PLANS = 40


@pytest.mark.dist
def test_drawn_plans_are_rejected_before_launch_or_match_one_device(tmp_path, request) -> None:
    pytest.importorskip("transformers")
    count = max(PLANS, request.config.getoption("--fuzz-plans"))
    draws = [draw(seed) for seed in range(count)]
    assert {d.model for d in draws} >= set(MODELS) - {"recycler-tiny"}, "draws cover the families"
    outcomes = run(draws, out_dir=tmp_path)
    print(table(outcomes))
    failed = [f"seed {o.draw.seed} ({o.draw.model}, {o.draw.world_size} ranks, {o.draw.plan}, "
              f"{o.draw.step}): {o.detail}" for o in outcomes if o.status == "failed"]
    assert not failed, "\n\n".join(failed)
    verified = sum(o.status == "verified" for o in outcomes)
    assert verified >= count // 2, f"only {verified} of {count} drawn plans ran: the draw is too often invalid"


@pytest.mark.dist
def test_drawn_plans_on_transformers_moe_models_match_one_device(tmp_path) -> None:
    """transformers' Mixtral and Qwen2-MoE, whose experts are one ``torchweave.moe_experts``
    op each: random splits (the experts' too), pipelines, co-shard, ZeRO, in float64 and
    bf16."""
    pytest.importorskip("transformers")
    draws = [draw(seed, models=("hf-mixtral-tiny", "hf-qwen2moe-tiny"), world_sizes=(2, 4))
             for seed in range(12)]
    outcomes = run(draws, out_dir=tmp_path)
    failed = [f"seed {o.draw.seed} ({o.draw.model}, {o.draw.plan}): {o.detail}"
              for o in outcomes if o.status == "failed"]
    assert not failed, "\n\n".join(failed)
    assert sum(o.status == "verified" for o in outcomes) >= 9


@pytest.mark.dist
def test_the_fuzzers_findings_stay_fixed(tmp_path) -> None:
    """Each file in fuzz_regressions/ is a case the fuzzer once failed (named for the bug);
    each must now verify, or, where its ``expect`` says so, be rejected before launch."""
    import json
    from pathlib import Path

    from torchweave.fuzz import Draw

    files = sorted((Path(__file__).parent / "fuzz_regressions").glob("*.json"))
    draws = [Draw.from_json(p.read_text()) for p in files]
    expect = [json.loads(p.read_text()).get("expect", "verified") for p in files]
    got = {o.draw.seed: o for o in run(draws, out_dir=tmp_path)}  # outcomes come as they end
    outcomes = [got[d.seed] for d in draws]
    assert [o.status for o in outcomes] == expect, "\n\n".join(
        f"{p.name}: {o.status}, expected {e}: {o.detail}"
        for p, o, e in zip(files, outcomes, expect) if o.status != e)

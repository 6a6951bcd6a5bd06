"""Pipeline cuts by module name (``cuts=`` in plan strings) and the search's cut balanced by
seconds (``search/cuts.py``). Stages that start inside blocks run against one device in
``tests/dist/test_pipeline.py``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import torchweave
from torchweave.errors import TorchweaveError
from torchweave.models.t5 import T5, T5Config
from torchweave.policies.stage_cuts import cut_modules, cut_positions
from torchweave.policies.spec import PlanSpec
from torchweave.search.constraints_file import load_constraints, preset
from torchweave.search.cuts import balanced, places, seconds_points
from torchweave.search.space import Point, points
from torchweave.sim.fast.fold import find_blocks, with_twin


@pytest.fixture(scope="module")
def t5():
    cfg = T5Config(vocab_size=512, block_size=16, d_model=32, d_kv=8, n_head=4, d_ff=64,
                   n_enc_layer=4, n_dec_layer=4)
    with torch.device("meta"):
        src, tgt = torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 8, dtype=torch.long)
        return torchweave.capture(T5(cfg), (src, tgt, tgt))


def _blocks(g):
    base = PlanSpec.parse("dp").build(g, 1)
    return with_twin(g, base, find_blocks(g, base, least=4, nested=False))


def test_stages_start_at_the_modules_named(t5) -> None:
    plan = PlanSpec.parse("1f1b:pp=3,cuts=encoder.2.ff+decoder.1.cross_attn").build(t5, 3)
    so = plan.pipeline.stage_of
    first = {}
    for n in t5.nodes:
        first.setdefault(so[n.name], n.module)
    assert first[1].startswith("encoder.2.ff") and first[2].startswith("decoder.1.cross_attn")
    assert all(so[n.name] == 0 for n in t5.nodes if n.module.startswith("encoder.2.attn"))
    positions = cut_positions(t5, ["encoder.2.ff", "decoder.1.cross_attn"], 3)
    assert cut_modules(t5, positions) == ["encoder.2.ff", "decoder.1.cross_attn"]


@pytest.mark.parametrize("text, words", [
    ("1f1b:pp=2,cuts=encoder.9", "a module of the model"),
    ("1f1b:pp=3,cuts=decoder.1+encoder.2", "graph order"),
    ("1f1b:pp=3,cuts=encoder.2", "3 stages start at 2 modules"),
    ("1f1b:pp=2,cuts=shared", "not at the first op"),
])
def test_bad_cuts_name_the_module_and_the_rule(t5, text: str, words: str) -> None:
    with pytest.raises(TorchweaveError) as exc:
        PlanSpec.parse(text).build(t5, int(text.split("pp=")[1][0]))
    assert words in str(exc.value)


def test_cut_text_is_checked_before_capture() -> None:
    with pytest.raises(TorchweaveError, match="joined by"):
        PlanSpec.parse("1f1b:pp=2,cuts=encoder..2")
    with pytest.raises(TorchweaveError, match="tp takes"):
        PlanSpec.parse("tp:tp=2,cuts=encoder.2")


def test_the_balanced_cut_is_the_least_largest_stage() -> None:
    """Against every choice of cuts on small random problems: the bisection's largest stage
    is the optimum's (to its precision), the stages all hold ops, and it is deterministic."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(4, 11))
        seconds = rng.uniform(0.1, 3.0, n)
        where = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(1, n)), replace=False).tolist())
        stages = int(rng.integers(2, 6))  # sometimes more stages than places allow
        got = balanced(seconds, stages, where)
        if len(where) < stages - 1:
            assert got is None
            continue
        pre = np.concatenate([[0.0], np.cumsum(seconds)])

        def worst(cuts):
            b = [0, *cuts, n]
            return max(pre[b[j + 1]] - pre[b[j]] for j in range(len(b) - 1))

        best = min(worst(c) for c in itertools.combinations(where, stages - 1))
        assert len(got) == stages - 1 and got == sorted(set(got)) and set(got) <= set(where)
        assert worst(got) == pytest.approx(best, rel=1e-9), (trial, seconds, where, stages)
        assert balanced(seconds, stages, where) == got


def test_places_are_block_and_sub_block_starts_the_constraints_allow(t5) -> None:
    blocks = _blocks(t5)
    names = cut_modules(t5, places(t5, blocks, preset("free")))
    assert {"encoder.2", "encoder.2.ff_norm", "decoder.1.cross_attn", "lm_head"} <= set(names)
    assert not any(m.count(".") > 2 for m in names)  # no deeper than a block's children
    only = cut_modules(t5, places(t5, blocks, load_constraints(
        "preset: free\ncuts: ['encoder.*', 'decoder.*']\n")))
    assert only and all(m.split(".")[0] in ("encoder", "decoder") for m in only)


def test_seconds_points_only_for_two_stacks_and_free(t5) -> None:
    from torchweave.search.timed import Timing
    from torchweave.sim import parse_cluster

    blocks = _blocks(t5)
    timing = Timing(t5, blocks, parse_cluster("8xA100-80GB-SXM@8"), torch.bfloat16, 8)
    pts, _ = points(8, 8, len(blocks), preset("free"))
    extra = seconds_points(t5, blocks, preset("free"), pts, timing.op_seconds)
    assert extra and all(p.cuts and "cuts=" in p.spec and p.pp > 1 for p in extra)
    for p in extra[:3]:  # every one builds: its modules start its stages
        PlanSpec.parse(p.spec).build(t5, 8)
    assert seconds_points(t5, blocks, preset("megatron"), pts, timing.op_seconds) == []
    from torchweave.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # one stack of blocks: its pipelines keep whole blocks
        idx = torch.zeros(8, 16, dtype=torch.long)
        gpt = torchweave.capture(GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=6, n_head=2,
                                               d_model=32)), (idx, idx))
    gpt_timing = Timing(gpt, _blocks(gpt), parse_cluster("8xA100-80GB-SXM@8"), torch.bfloat16, 8)
    assert _blocks(gpt).twin is None
    assert seconds_points(gpt, _blocks(gpt), preset("free"), pts, gpt_timing.op_seconds) == []
    assert Point(2, 2, 2, 4, "1f1b", 1, "none", 0, False, cuts=("a.1", "b")).spec.endswith(
        "cuts=a.1+b")


def test_constraints_read_balance() -> None:
    assert preset("free").balance == ("flops", "seconds") and preset("megatron").balance == ("flops",)
    with pytest.raises(TorchweaveError) as exc:
        load_constraints("preset: free\nbalance: [flops, time]\n")
    assert "line 2" in str(exc.value) and "flops, seconds" in str(exc.value)


def test_a_dominant_op_leaves_the_other_stages_even() -> None:
    """A head heavier than any even share sets the largest stage; the other stages then
    split the rest evenly rather than leaving slivers (the greedy fill needs fewer stages,
    and each further cut splits the largest stage that has a place inside)."""
    seconds = np.array([1.0] * 20 + [30.0])
    got = balanced(seconds, 5, list(range(1, 21)))
    assert got[-1] == 20  # the head alone
    sizes = np.diff([0, *got])
    assert sizes.min() >= 4 and sizes.max() <= 6, got


def test_seconds_alone_replaces_the_whole_block_points(t5) -> None:
    """``balance: [seconds]``: each point with a seconds cut stands in place of its
    whole-block twin; a point without one keeps the policy's cut."""
    from torchweave.search import search
    from torchweave.sim import parse_cluster

    c = load_constraints("preset: free\nbalance: [seconds]\ntp: [1]\ndp: [1, 2]\n"
                         "schedules: [1f1b]\nrecompute: [none]\nzero: [0]\ntied: [copy]\n"
                         "coshard: [0]\nmicro: {max: 4}\n")
    res = search(t5, parse_cluster("4xA100-80GB-SXM@4"), c, top=50, dtype=torch.bfloat16)
    pipelined = [r.spec for r in res.ranked if r.point.pp > 1]
    four = [s for s in pipelined if "pp=4" in s]
    assert four and all("cuts=" in s for s in four), pipelined  # in place of the block cut
    assert [s for s in pipelined if "pp=2" in s and "cuts=" not in s]  # the same cut: kept


def test_a_lookup_that_is_its_stages_only_op_stays() -> None:
    """Moving it would leave its stage with nothing to run."""
    from torchweave.policies.stage_cuts import send_lookups, shared_lookups

    cfg = T5Config(vocab_size=512, block_size=16, d_model=32, d_kv=8, n_head=4, d_ff=64,
                   n_enc_layer=2, n_dec_layer=2)
    with torch.device("meta"):
        g = torchweave.capture(T5(cfg), (torch.zeros(2, 16, dtype=torch.long),
                                          torch.zeros(2, 8, dtype=torch.long),
                                          torch.zeros(2, 8, dtype=torch.long)))
    (lookup,) = shared_lookups(g)
    at = [n.name for n in g.nodes].index(lookup)
    alone = {n.name: (0 if i < at else 1 if i == at else 2) for i, n in enumerate(g.nodes)}
    assert send_lookups(g, alone)[lookup] == 1
    shared = {n.name: (0 if i < at else 1) for i, n in enumerate(g.nodes)}
    assert send_lookups(g, shared)[lookup] == 0

"""``tied=send``: a lookup of a table several pipeline stages read runs on the table's stage
(``policies/pipeline_policy.send_lookups``), from the plan string to the search's space and
its estimate. Equivalence on real ranks: ``tests/dist/test_pipeline.py``."""

from __future__ import annotations

import pytest
import torch

import torchweave
from torchweave.errors import TorchweaveError
from torchweave.lower.lower import lower
from torchweave.models.t5 import T5, T5Config
from torchweave.policies.stage_cuts import send_lookups, shared_lookups
from torchweave.policies.spec import PlanSpec
from torchweave.search.constraints_file import load_constraints, preset
from torchweave.search.space import points


@pytest.fixture(scope="module")
def t5():
    cfg = T5Config(vocab_size=512, block_size=16, d_model=32, d_kv=8, n_head=4, d_ff=64,
                   n_enc_layer=3, n_dec_layer=3)
    torch.manual_seed(0)
    src = torch.randint(0, 512, (8, 16))
    tgt = torch.randint(0, 512, (8, 8))
    return torchweave.capture(T5(cfg), (src, tgt, tgt))


def _readers(graph, plan, param: str) -> set[int]:
    """The stages whose ops read ``param``."""
    return {plan.pipeline.stage_of[n.name] for n in graph.nodes
            if any(r.name == param for r in n.input_refs())}


def test_the_decoder_embedding_runs_where_the_vocabulary_is(t5) -> None:
    (lookup,) = shared_lookups(t5)  # the decoder's: the encoder's reads the table first
    table = next(r.name for r in t5.node(lookup).input_refs() if t5.values[r.name].kind == "param")
    copy = PlanSpec.parse("1f1b:pp=4").build(t5, 4)
    send = PlanSpec.parse("1f1b:pp=4,tied=send").build(t5, 4)
    assert copy.pipeline.stage_of[lookup] > 0 and _readers(t5, copy, table) == {0, copy.pipeline.stage_of[lookup]}
    assert send.pipeline.stage_of[lookup] == 0 and _readers(t5, send, table) == {0}
    # the rest of the cut is the policy's; the lookup's pieces are on stage 0's devices
    moved = {n for n in copy.pipeline.stage_of if copy.pipeline.stage_of[n] != send.pipeline.stage_of[n]}
    assert moved == {lookup}
    assert set(send.assignment[lookup]) <= set(send.pipeline.groups[0])
    assert "tied=send" in send.notes["policy"]
    # lowering: no stage copy of the table (lower/copies.py), so no sum of the copies
    path = t5.values[table].target or table
    for plan, holders in ((copy, 2), (send, 1)):
        programs = lower(t5, plan)
        assert len({p.rank for p in programs for slot in p.params if slot.path == path}) == holders


def test_models_without_such_lookups_build_the_same_plan() -> None:
    from tests.conftest import captured

    g = captured("gpt-tiny")  # its tied head reads an activation; its lookup reads first
    assert shared_lookups(g) == []
    a = PlanSpec.parse("1f1b:pp=2").build(g, 2)
    b = PlanSpec.parse("1f1b:pp=2,tied=send").build(g, 2)
    assert a.pipeline.stage_of == b.pipeline.stage_of and a.assignment == b.assignment
    assert send_lookups(g, a.pipeline.stage_of) == a.pipeline.stage_of


@pytest.mark.parametrize("text, words", [
    ("1f1b:pp=2,tied=move", "tied is copy"),
    ("dp:tied=send", "dp takes"),
    ("tp:tp=2,tied=send", "tp takes"),
])
def test_bad_tied_options_are_refused_before_capture(text: str, words: str) -> None:
    with pytest.raises(TorchweaveError) as exc:
        PlanSpec.parse(text)
    assert words in str(exc.value)


def test_constraints_choose_tied_and_presets_differ() -> None:
    assert preset("free").tied == ("copy", "send")
    assert preset("megatron").tied == ("copy",) and preset("nnscaler").tied == ("copy",)
    assert load_constraints("preset: megatron\ntied: [copy, send]\n").tied == ("copy", "send")
    with pytest.raises(TorchweaveError) as exc:
        load_constraints("preset: free\ntied: [copy, share]\n")
    assert "line 2" in str(exc.value) and "copy, send" in str(exc.value)


def test_the_space_has_sent_lookups_only_where_they_move_something() -> None:
    free = preset("free")
    with_lookups, _ = points(8, 16, 6, free, lookups=True)
    without, _ = points(8, 16, 6, free, lookups=False)
    sent = [p for p in with_lookups if p.tied == "send"]
    assert sent and all(p.pp > 1 and "tied=send" in p.spec for p in sent)
    assert {p for p in with_lookups if p.tied == "copy"} == set(without)
    assert not [p for p in points(8, 16, 6, preset("megatron"), lookups=True)[0] if p.tied == "send"]


def test_the_search_prices_the_sent_lookup_as_a_boundary_not_a_copy() -> None:
    from torchweave.search.timed import Timing
    from torchweave.sim import parse_cluster
    from torchweave.sim.fast.fold import find_blocks, with_twin

    cfg = T5Config(vocab_size=65536, block_size=256, d_model=256, d_kv=32, n_head=8, d_ff=512,
                   n_enc_layer=8, n_dec_layer=8)
    with torch.device("meta"):
        src = torch.zeros(16, 256, dtype=torch.long)
        tgt = torch.zeros(16, 64, dtype=torch.long)
        g = torchweave.capture(T5(cfg), (src, tgt, tgt))
    base = PlanSpec.parse("dp").build(g, 1)
    blocks = with_twin(g, base, find_blocks(g, base, least=4, nested=False))
    timing = Timing(g, blocks, parse_cluster("8xA100-80GB-SXM@8"), torch.bfloat16, 16)
    (lookup,) = shared_lookups(g)
    out = g.node(lookup).outputs[0]
    copy, send = timing.shares(4, "copy"), timing.shares(4, "send")
    assert [c for c in copy.crossing if c[4] == "weight"]  # the table, copied
    assert not [c for c in send.crossing if c[4] == "weight"]
    (sent,) = [c for c in send.crossing if c[0] == out]
    assert sent[1] == 0 and sent[4] == "batch" and min(sent[2]) > 0


@pytest.mark.parametrize("spec", ["1f1b:pp=4,micro=4", "zb:pp=4,micro=4",
                                  "interleaved:pp=2,dp=2,micro=2,zero=1"])
def test_the_dist_cases_move_the_lookup(spec: str) -> None:
    """tests/dist/test_pipeline.py's tied=send cases on its 3 + 3-layer T5 (batch 8) move
    something: otherwise they would verify the copy plan again."""
    from tests.dist.test_pipeline import _batch8

    model, inputs = _batch8("t5-3x3")
    g = torchweave.capture(model, tuple(x[: x.shape[0] // int(spec.split("micro=")[1][0])]
                                        for x in inputs))
    copy = PlanSpec.parse(spec).build(g, 4)
    send = PlanSpec.parse(spec + ",tied=send").build(g, 4)
    assert copy.pipeline.stage_of != send.pipeline.stage_of


def test_with_zero_the_estimate_holds_no_copy_of_a_sent_table() -> None:
    """Under ZeRO the schedule does not time the sums (they wait for the last action), so
    the estimate's arithmetic prices the tied copies: with ``tied=send`` there are none of
    the decoder's lookup (no sum of copies, no whole copy ZeRO cannot shard)."""
    from torchweave.search.estimate import estimate
    from torchweave.search.proxies import proxy
    from torchweave.search.space import Point
    from torchweave.search.timed import Timing
    from torchweave.sim import parse_cluster
    from torchweave.sim.fast.fold import find_blocks, with_twin

    cfg = T5Config(vocab_size=65536, block_size=256, d_model=256, d_kv=32, n_head=8, d_ff=512,
                   n_enc_layer=8, n_dec_layer=8)
    with torch.device("meta"):
        src, tgt = torch.zeros(16, 256, dtype=torch.long), torch.zeros(16, 64, dtype=torch.long)
        g = torchweave.capture(T5(cfg), (src, tgt, tgt))
    base = PlanSpec.parse("dp").build(g, 1)
    blocks = with_twin(g, base, find_blocks(g, base, least=4, nested=False))
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    px = proxy(g, blocks, cluster, 1, False, "none", dtype=torch.bfloat16, precision="bf16-mixed")
    assert px.tied and px.tied_sent == px.tied  # the shared vocabulary, read by a lookup alone
    timing = Timing(g, blocks, cluster, torch.bfloat16, 16)
    got = {}
    for tied in ("copy", "send"):
        pt = Point(tp=1, pp=4, dp=2, micro=4, virtual=1, schedule="1f1b", recompute="none",
                   zero=1, sp=False, tied=tied)
        got[tied] = estimate(pt, px, cluster, len(blocks), precision="bf16-mixed",
                             schedule_s=timing.price([(pt, px)], len(blocks))[pt])
    assert got["send"].sync_s < got["copy"].sync_s
    assert got["send"].memory < got["copy"].memory

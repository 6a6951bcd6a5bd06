"""The plan search (``torchweave.search``): constraints as data, the space, the ranking."""

from __future__ import annotations

import functools
import math
import json

import pytest
import torch

from tests.conftest import captured
from torchweave.errors import TorchweaveError
from torchweave.search import Constraints, Degrees, OpRule, load_constraints, preset, preset_names, search
from torchweave.search.estimate import estimable
from torchweave.search.search import _in
from torchweave.search.space import points
from torchweave.sim import parse_cluster


@functools.lru_cache(maxsize=None)
def _gpt(layers: int = 8, heads: int = 8, d: int = 256, batch: int = 32):
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=heads, d_model=d)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(batch, 64, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name=f"gpt-{layers}x{d}")


# ------------------------------------------------------------------ constraints
def test_every_preset_is_one_readable_yaml_file() -> None:
    assert preset_names() == ["alpa", "dp", "free", "megatron", "nnscaler", "zero3"]
    for name in preset_names():
        c = preset(name)
        assert c.name == name and c.description
    mega = preset("megatron")
    assert mega.tp == Degrees(only=(1, 2, 4, 8)) and "zb" not in mega.schedules
    assert preset("nnscaler").schedules == ("none", "1f1b")
    assert preset("zero3").zero == (3,)


def test_yaml_overrides_a_preset_and_reads_op_rules() -> None:
    c = load_constraints("preset: megatron\ntp: {max: 4}\nmemory_gib: 40\n"
                         "ops:\n  - {module: 'blocks.*.attn.*', parts: [1, 2]}\n")
    assert c.tp.allows(4) and not c.tp.allows(8) and c.memory_gib == 40
    assert c.schedules == preset("megatron").schedules
    assert c.ops == (OpRule(module="blocks.*.attn.*", parts=(1, 2), line=5),)


@pytest.mark.parametrize("text, line, words", [
    ("tp: [1, 2]\nbogus: 3\n", 2, "allowed keys: preset, tp"),
    ("ops:\n  - {module: 'a.*', partz: [2]}\n", 2, "allowed keys: type, module, name"),
    ("tp: [0]\n", 1, "whole numbers"),
    ("pp: {min: 4, max: 2}\n", 1, "1 ≤ min ≤ max"),
    ("schedules: [1f1b, pipedream]\n", 1, "among none, gpipe"),
    ("preset: nope\n", 1, "one of alpa"),
    ("tp: !!python/object/apply:os.system ['echo owned']\n", 1, "plain data"),
    ("tp: [1,\n", 2, "valid YAML"),
    ("- a list\n", 1, "a mapping"),
])
def test_bad_constraints_name_the_line_and_the_rule(text: str, line: int, words: str) -> None:
    with pytest.raises(TorchweaveError) as exc:
        load_constraints(text)
    assert f"line {line}" in str(exc.value) and words in str(exc.value)


def test_a_constraints_file_that_does_not_exist(tmp_path) -> None:
    with pytest.raises(TorchweaveError, match="must exist"):
        load_constraints(str(tmp_path / "missing.yaml"))
    path = tmp_path / "c.yaml"
    path.write_text("preset: zero3\n")
    assert load_constraints(str(path)).zero == (3,)


# ------------------------------------------------------------------ the space
def test_every_point_covers_the_world_and_splits_batch_and_blocks() -> None:
    pts, why = points(8, 16, 8, preset("free"))
    assert pts and not why
    for p in pts:
        assert p.tp * p.pp * p.dp == 8
        assert 16 % (p.dp * p.micro) == 0
        assert 8 % (p.pp * p.virtual) == 0
        assert p.pp == 1 or p.micro >= p.pp
    kinds = {p.schedule for p in pts}
    assert kinds == {"none", "gpipe", "1f1b", "interleaved", "zb", "interlaced"}
    assert all(_in(preset("free"), p) for p in pts)
    assert {p.spec for p in points(8, 16, 8, preset("zero3"))[0]} == {
        "zero3", "zero3:recompute=selective", "zero3:recompute=full"}


def test_a_space_with_no_point_says_why() -> None:
    pts, why = points(8, 16, 8, Constraints(tp=Degrees(only=(3,))))
    assert not pts and "no value divides the world (8)" in why[0]


# ------------------------------------------------------------------ the search
@functools.lru_cache(maxsize=None)
def _searched(name: str):
    return search(_gpt(), parse_cluster("8xA100-80GB-SXM"), name, top=5)


def test_search_ranks_by_the_simulator_and_is_deterministic() -> None:
    a, b = _searched("free"), search(_gpt(), parse_cluster("8xA100-80GB-SXM"), "free", top=5)
    assert [r.spec for r in a.ranked] == [r.spec for r in b.ranked]
    steps = [r.result.step_time for r in a.ranked]
    assert steps == sorted(steps) and len(a.ranked) == 5
    for r in a.ranked:  # every returned plan is simulated and carries the estimate's error
        assert (r.estimate is not None and r.estimate_error is not None) or not estimable(r.point)
        assert r.plan.notes["spec"] == r.spec
        assert set(r.breakdown()) == {"step", "compute", "comm", "bubble %", "peak GiB"}
    assert a.why() and "beats the runner-up" in a.why()[0]


def test_a_tie_with_the_runner_up_says_so() -> None:
    """Two plans the simulator cannot tell apart: the reason is the tie and its break, not
    an empty list."""
    import dataclasses

    a = _searched("free")
    first, second = a.ranked[0], a.ranked[1]
    twin = dataclasses.replace(second, result=first.result)  # the same numbers, another plan
    tied = dataclasses.replace(a, ranked=[first, twin], reference=None)
    (line,) = tied.why()
    assert line.endswith("the same within 0.1% on every count (step, compute, comm, bubble, "
                         "memory); first by name, the tie-break"), line


def test_free_is_never_worse_than_a_preset_inside_it() -> None:
    free = _searched("free").best.result.step_time
    for name in ("megatron", "nnscaler", "dp"):
        assert free <= _searched(name).best.result.step_time * (1 + 1e-9), name
    assert all(_in(preset("megatron"), r.point) for r in _searched("megatron").ranked)


def test_an_op_rule_takes_out_the_splits_it_forbids() -> None:
    c = Constraints(tp=Degrees(only=(1, 2, 4)), schedules=("none",), zero=(0,),
                    recompute=("none",), ops=(OpRule(module="blocks.*.attn.*", parts=(1, 2)),))
    # near-free links: the solver splits the model (on A100s its answer here is the batch)
    from tests.unit.test_search_intra import fast

    res = search(_gpt(), fast(8), c, top=10)
    assert {r.point.tp for r in res.ranked if r.point.split == "rule"} <= {1, 2}
    assert any("tp=4" in e and "allows [1, 2]" in e for e in res.excluded), res.excluded
    # the solver keeps the rule: at tp=4 it leaves attention whole
    g, seen = _gpt(), 0
    for r in res.ranked:
        if r.point.tp == 4:
            assert r.point.split == "solved"
            for node in g.nodes:
                if c.ops[0].selects(node):
                    seen += 1
                    assert r.plan.transforms(node.name)[-1].dim is None, node.name
    assert seen, "a solved tp=4 plan is among the ten"


def test_constraints_no_plan_satisfies_name_the_conflict() -> None:
    """6 heads do not split 4 ways: the tp policy keeps attention whole, which the rule
    forbids; the error names the degree, the op and the rule."""
    g = _gpt(heads=6, d=192)
    sdpa = "aten.scaled_dot_product_attention.default"
    c = Constraints(tp=Degrees(only=(4,)), pp=Degrees(only=(1,)), schedules=("none",),
                    split=("rule",), ops=(OpRule(type=sdpa, replicate=False),))
    with pytest.raises(TorchweaveError) as exc:
        search(g, parse_cluster("8xA100-80GB-SXM"), c)
    text = str(exc.value)
    assert "tp=4 keeps it whole" in text and "scaled_dot_product_attention" in text
    # The solver may split attention another way (its batch: with tp=1 outside the space
    # that answer is kept, not dropped as dp's); held to the heads, it names the op, the
    # sizes and the degree.
    assert search(g, parse_cluster("8xA100-80GB-SXM"), c.with_(split=("solved",))).ranked
    held = c.with_(split=("solved",), ops=(OpRule(type=sdpa, replicate=False, split=("h",)),))
    with pytest.raises(TorchweaveError) as exc:
        search(g, parse_cluster("8xA100-80GB-SXM"), held)
    text = str(exc.value)
    assert "scaled_dot_product_attention" in text and "h=6" in text and "by 4" in text
    # With 8 heads the same constraints are met.
    assert search(_gpt(), parse_cluster("8xA100-80GB-SXM"), c).best.point.tp == 4


def test_a_memory_budget_no_plan_fits_gives_the_shortfall_and_what_to_relax() -> None:
    c = Constraints(memory_gib=0.001, recompute=("none",), zero=(0,))
    with pytest.raises(TorchweaveError) as exc:
        search(_gpt(), parse_cluster("8xA100-80GB-SXM"), c)
    text = str(exc.value)
    assert "GiB more per device" in text and "allow recompute" in text


def test_auto_plan_strings() -> None:
    from torchweave.policies import resolve as resolve_policy
    from torchweave.policies.spec import PlanSpec
    from torchweave.search import resolve

    assert PlanSpec.parse("auto:preset=megatron").options == {"preset": "megatron"}
    with pytest.raises(TorchweaveError, match="preset is a preset's name"):
        PlanSpec.parse("auto:preset=../../etc")
    g = _gpt(layers=4, d=64, batch=8)
    with pytest.raises(TorchweaveError, match="needs a cluster"):
        resolve_policy("auto", g, 4)
    plan = resolve("auto:preset=dp", g, 4, cluster=parse_cluster("4xA100-80GB-SXM"))
    assert plan.notes["spec"] == "dp" and "auto (dp)" in plan.notes["search"]


def test_cli_plan_auto_prints_the_ranking_and_saves_the_winner(tmp_path, capsys, monkeypatch) -> None:
    from torchweave.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "this machine" is a CPU
    from torchweave.plan.plan import Plan

    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--plan", "auto", "--world-size", "4", "--top", "3",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the best plans on 4xCPU" in text and "estimate error" in text
    plan = Plan.from_json(out.read_text())
    assert plan.world_size == 4 and plan.notes["spec"] in text
    cfile = tmp_path / "c.yaml"
    cfile.write_text("preset: dp\nbogus: 1\n")
    assert main(["plan", "gpt-tiny", "--plan", "auto", "--constraints", str(cfile)]) == 2
    assert "line 2" in capsys.readouterr().out + capsys.readouterr().err
    json.loads(out.read_text())


def test_an_exhaustive_search_simulates_every_point_and_the_search_matches_it(capsys, monkeypatch) -> None:
    from torchweave.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "this machine" is a CPU
    g, cluster = _gpt(), parse_cluster("8xA100-80GB-SXM")
    every = search(g, cluster, "megatron", top=0, exhaustive=True)
    pts, _ = points(8, 32, 8, preset("megatron"))
    tried = len(every.ranked) + len(every.excluded) + len(every.over_memory)
    assert len(every.ranked) > 100 and tried >= len(pts) - 5  # over-memory list is the 5 closest
    assert all(r.estimate is None for r in every.ranked)  # simulated, never estimated
    found = _searched("megatron").best.result.step_time
    assert found <= every.best.result.step_time * 1.02
    assert main(["plan", "gpt-tiny", "--plan", "auto", "--preset", "dp", "--world-size", "2",
                 "--exhaustive"]) == 0
    assert "the best plans on 2xCPU" in capsys.readouterr().out
    # the same from a plan string, wherever a plan is taken
    import torchweave.search as ts

    asked, real = [], ts.search
    monkey = pytest.MonkeyPatch()
    monkey.setattr(ts, "search", lambda *a, **k: asked.append(k["exhaustive"]) or real(*a, **k))
    try:
        assert main(["plan", "gpt-tiny", "--plan", "auto:preset=dp,exhaustive=1",
                     "--world-size", "2"]) == 0
    finally:
        monkey.undo()
    assert asked == [True]
    tiny = captured("gpt-tiny")
    plan = ts.resolve("auto:preset=dp,exhaustive=1", tiny, 2)
    assert "auto (dp, exhaustive)" in plan.notes["search"]
    with pytest.raises(TorchweaveError, match="exhaustive is 1"):
        ts.resolve("auto:exhaustive=yes", tiny, 2)


@functools.lru_cache(maxsize=None)
def _small_space() -> tuple[float, float, int, float]:
    """4 blocks on 8 devices: the best simulated step of every point of the free space,
    the best of 200 plans drawn from the whole primitive space by the fuzzer (random
    SPMD meshes and per-op splits, uneven cuts, co-shard, recompute groups, every
    schedule), how many of those built, and the search's winner."""
    from torchweave.fuzz.draw import build_plan, draw
    from torchweave.policies.spec import PlanSpec
    from torchweave.sim.simulate import simulate

    g = _gpt(layers=4, d=128, batch=16)
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    pts, _ = points(8, 16, 4, preset("free"))
    assert len(pts) > 300
    best = math.inf
    for p in pts:
        try:
            plan = PlanSpec.parse(p.spec).build(g, 8)
        except TorchweaveError:
            continue
        best = min(best, simulate(g, plan, cluster, timeline=False).step_time)
    drawn, built = math.inf, 0
    for seed in range(200):
        d = draw(seed, models=("gpt-tiny",), world_sizes=(8,))
        if d.step.get("grad_accum", 1) > 1:
            continue  # a step option, not a plan
        try:
            plan = build_plan(d, g, 8)
            step = simulate(g, plan, cluster, timeline=False).step_time
        except TorchweaveError:
            continue  # a draw that breaks a rule on purpose
        built += 1
        drawn = min(drawn, step)
    return best, drawn, built, search(g, cluster, "free").best.result.step_time


def test_auto_finds_the_optimum_of_a_space_small_enough_to_enumerate() -> None:
    """4 blocks on 8 devices: every point of the free space built and simulated; the
    search's winner is within 2% of the best of them (the issue's target)."""
    best, _, _, found = _small_space()
    assert found <= best * 1.02, (found, best)


def test_no_plan_drawn_from_the_primitive_space_beats_auto_by_more_than_2_percent() -> None:
    """The primitive space is too large to enumerate even here (every op's split and
    device order, any cut, co-shard): 200 fuzzer draws of it stand in for it."""
    _, drawn, built, found = _small_space()
    assert built > 100
    assert found <= drawn * 1.02, (found, drawn)


def test_interlaced_pipelines_are_in_the_free_space_and_simulated_directly() -> None:
    from torchweave.search.space import interlaced_points

    pts = interlaced_points(8, 32, 8, preset("free"))
    assert [p.spec for p in pts] == ["interlaced:micro=8", "interlaced:micro=16"]
    assert not interlaced_points(8, 32, 4, preset("free"))  # fewer blocks than devices
    assert not interlaced_points(8, 32, 8, preset("megatron"))
    res = search(_gpt(), parse_cluster("8xA100-80GB-SXM"), "free", top=0, simulate_top=4)
    got = [r for r in res.ranked if r.point.schedule == "interlaced"]
    assert got and all(r.estimate is None and r.plan.pipeline.kind == "interlaced" for r in got)


def test_a_candidate_lowering_refuses_is_left_out_with_why(monkeypatch) -> None:
    """One plan the simulator cannot take (lowering refuses it) must not end the search."""
    import importlib

    from torchweave.errors import Problem

    s = importlib.import_module("torchweave.search.search")  # the module, not the function
    real = s.simulate

    def refusing(graph, plan, *a, **k):
        if plan.pipeline is not None:
            raise TorchweaveError(Problem(obj="value x", value="AllGather across stage groups",
                                          rule="values cross between stage groups by "
                                               "point-to-point transfers only"))
        return real(graph, plan, *a, **k)

    monkeypatch.setattr(s, "simulate", refusing)
    res = search(_gpt(), parse_cluster("8xA100-80GB-SXM"), "megatron", top=3)
    assert res.ranked and all(r.plan.pipeline is None for r in res.ranked)
    assert any("across stage groups" in e for e in res.excluded)


def test_zero_stages_are_one_point_without_data_parallelism() -> None:
    pts, _ = points(8, 16, 8, preset("free"))
    assert all(p.zero == 0 for p in pts if p.dp == 1)
    assert {p.zero for p in pts if p.dp > 1 and p.pp == 1 and p.tp == 1} == {0, 1, 2, 3}
    # A dp=1 point stays in a preset that allows only ZeRO-1 (the same plan).
    one = next(p for p in pts if p.dp == 1 and p.pp > 1 and p.schedule == "1f1b"
               and p.split == "rule" and p.recompute == "none" and p.tp <= 8)
    assert _in(preset("megatron"), one)


def test_each_family_under_rated_by_its_estimate_is_simulated() -> None:
    from torchweave.search.estimate import Estimate
    from torchweave.search.select import corrected, families, family
    from torchweave.search.space import Point

    def pt(tp: int, zero: int, micro: int = 1) -> Point:
        return Point(tp, 1, 8 // tp, micro, "none", 1, "none", zero, False)

    def est(s: float) -> Estimate:
        return Estimate(s, s, 0, 0, 0, 0, 0)

    ests = {pt(1, 3): est(1.00), pt(2, 0): est(1.02), pt(2, 1): est(1.03), pt(4, 0): est(1.08),
            pt(8, 0): est(1.20)}
    order = sorted(ests, key=lambda p: ests[p].step_s)
    # The best of each family within MARGIN (10%) of the best estimate; tp=8 is 20% off.
    assert families(order, ests) == [pt(1, 3), pt(2, 0), pt(4, 0)]
    assert family(pt(2, 0)) == family(pt(2, 1)) != family(pt(1, 3))
    # Simulated as estimated, or worse: no other point of a simulated family can win.
    sim = {pt(1, 3): 1.12, pt(2, 0): 1.02, pt(4, 0): 1.08}
    assert corrected(order, ests, sim, 1.02, 4) == []
    # tp=2's best point came out over the memory budget (1.00 s, 2% under its estimate):
    # its family's next point, 1.03 s estimated, would beat the best plan that fits (1.08).
    sim = {pt(1, 3): 1.12, pt(2, 0): 1.00, pt(4, 0): 1.08}
    assert corrected(order, ests, sim, 1.08, 4) == [pt(2, 1)]
    assert corrected(order, ests, sim, 1.0, 4) == []
    assert corrected(order, ests, {}, math.inf, 4) == []

"""The within-stage solver (``torchweave.search.intra``): each op's split on ``tp`` by an ILP."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from torchweave.errors import TorchweaveError
from torchweave.policies.spec import PlanSpec
from torchweave.search import OpRule, load_constraints, needs_search, preset, resolve, search
from torchweave.search.intra import describe, price, solve, tp_dims
from torchweave.sim import parse_cluster
from torchweave.sim.hardware.devices import Link

pytestmark = pytest.mark.usefixtures("in_tmp_dir")  # default Gantt charts land there


@functools.lru_cache(maxsize=None)
def _gpt(layers: int = 4, d: int = 256, heads: int = 8, batch: int = 16, seq: int = 64,
         vocab: int = 512):
    import torchweave
    from torchweave.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, d_model=d)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    return torchweave.capture(model, (idx, idx), name=f"gpt-{layers}x{d}")


def fast(n: int = 8):
    """A cluster whose links cost (almost) nothing: the solver then splits everything it can."""
    c = parse_cluster(f"{n}xA100-80GB-SXM@{n}")
    return dataclasses.replace(c, intra=Link(bandwidth=1e18, latency=1e-12))


def test_the_solver_is_no_worse_than_megatron_under_its_own_model() -> None:
    g = _gpt()
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    for tp in (2, 4, 8):
        part = solve(g, cluster, tp=tp, world=8)
        assert part.status == "optimal"
        for kind in ("tp", "sp"):
            rule = tp_dims(PlanSpec.parse(f"{kind}:tp={tp},dp={8 // tp}").build(g, 8), g)
            assert part.cost <= price(g, cluster, rule, tp=tp, world=8) * (1 + 1e-9), (tp, kind)
        # the objective is the price of its own answer
        assert price(g, cluster, part.dims, tp=tp, world=8) == pytest.approx(part.cost, rel=1e-6)


def test_identical_blocks_are_solved_once() -> None:
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    small, large = _gpt(layers=4), _gpt(layers=16)
    a, b = solve(small, cluster, tp=4, world=8), solve(large, cluster, tp=4, world=8)
    assert a.variables == b.variables  # one block's problem, whatever the depth
    block = [n for n in large.nodes if (n.module or "").startswith("blocks.3.")]
    first = [n for n in large.nodes if (n.module or "").startswith("blocks.0.")]
    assert [b.dims[n.name] for n in block] == [b.dims[n.name] for n in first]


def test_with_free_links_every_large_op_is_split_and_compute_divides() -> None:
    g = _gpt()
    part = solve(g, fast(), tp=4, world=4)
    mm = [n for n in g.nodes if n.target == "aten.linear.default"]
    assert mm and all(part.dims[n.name] is not None for n in mm)
    whole = price(g, fast(), {n.name: None for n in g.nodes}, tp=4, world=4)
    assert part.cost < 0.5 * whole
    assert describe(g, part.dims, {n.name: None for n in g.nodes})


def _batch_dims(g) -> dict[str, set[str]]:
    base = PlanSpec.parse("dp").build(g, 2)
    return {n.name: {t.dim for t in base.transforms(n.name) if t.dim} for n in g.nodes}


def test_a_large_vocabulary_splits_the_head_on_it_and_the_blocks_on_the_batch() -> None:
    """nnScaler's plan for a large vocabulary, found by the solver unprompted: the blocks
    data-parallel over every device, the head split along the vocabulary; the event
    simulator (not the solver's model) finds it faster than dp and than Megatron's tp."""
    from torchweave.sim import simulate

    g = _gpt(layers=2, d=256, heads=4, batch=32, seq=128, vocab=32768)
    cluster = parse_cluster("4xA100-80GB-SXM@4")
    part = solve(g, cluster, tp=4, world=4)
    assert not part.batch_only
    batch = _batch_dims(g)
    head = [n for n in g.nodes if n.module == "lm_head" and n.target == "aten.linear.default"]
    assert head and all(part.dims[n.name] == "n" for n in head)
    mm = [n for n in g.nodes if n.module.startswith("blocks.") and n.target == "aten.linear.default"]
    assert mm and all(part.dims[n.name] in batch[n.name] for n in mm)
    step = {spec: simulate(g, PlanSpec.parse(spec).build(g, 4, dims=part.dims if "solved" in spec
                                                          else None), cluster).step_time
            for spec in ("tp:tp=4,split=solved", "dp", "tp:tp=4")}
    assert step["tp:tp=4,split=solved"] < min(step["dp"], step["tp:tp=4"]), step


def test_where_the_best_splits_only_batches_the_answer_splits_the_model() -> None:
    """Splitting nothing but batches is dp's own point; ``split=solved`` then means the best
    partition of the model (batch dims out of the choices)."""
    from torchweave.search.intra import _solve

    g = _gpt(layers=2, d=256, heads=4, batch=32, seq=128, vocab=512)
    cluster = parse_cluster("4xA100-80GB-SXM@4")
    batch = _batch_dims(g)
    first = _solve(g, cluster, 4, 4, None, (), None, (), 10.0, batch=True)
    assert first.batch_only
    assert all(first.dims[n.name] in batch[n.name] | {None} for n in g.nodes)
    part = solve(g, cluster, tp=4, world=4)
    assert not part.batch_only
    assert any(part.dims[n.name] not in batch[n.name] | {None} for n in g.nodes)
    assert all(part.dims[n.name] not in batch[n.name] for n in g.nodes if part.dims[n.name])


def test_an_ops_rule_no_split_can_keep_names_the_op_and_sizes() -> None:
    g = _gpt(d=256)
    rule = OpRule(type="aten.linear.default", module="blocks.*.attn.q_proj", replicate=False,
                  split=("n",))
    with pytest.raises(TorchweaveError) as e:
        solve(g, parse_cluster("3xA100-80GB-SXM@3"), tp=3, world=3, rules=(rule,))
    text = str(e.value)
    assert "q_proj" in text and "n=256" in text and "divides by 3" in text
    # allowed dims are kept: only n for q_proj
    part = solve(g, fast(), tp=2, world=2, rules=(rule,))
    q = [n for n in g.nodes if n.module == "blocks.0.attn.q_proj" and n.target == "aten.linear.default"]
    assert q and all(part.dims[n.name] == "n" for n in q)


def test_a_memory_budget_no_partition_meets_says_so() -> None:
    g = _gpt()
    with pytest.raises(TorchweaveError) as e:
        solve(g, parse_cluster("8xA100-80GB-SXM@8"), tp=2, world=8, memory=1024)
    assert "fits the memory budget" in str(e.value)


# ------------------------------------------------------------------ plan strings
def test_split_is_a_plan_string_option_of_tp_and_pipelines() -> None:
    assert PlanSpec.parse("tp:tp=2,split=solved").solved
    assert PlanSpec.parse("1f1b:tp=2,pp=2,split=solved").solved
    assert not PlanSpec.parse("tp:tp=2,split=rule").solved
    with pytest.raises(TorchweaveError, match="split is one of rule, solved"):
        PlanSpec.parse("tp:tp=2,split=magic")
    with pytest.raises(TorchweaveError, match="dp takes dp, zero, recompute"):
        PlanSpec.parse("dp:split=solved")
    with pytest.raises(TorchweaveError, match="torchweave.search.resolve"):
        PlanSpec.parse("tp:tp=2,split=solved").build(_gpt(), 4)
    assert needs_search("tp:tp=2,split=solved") and needs_search("auto") and not needs_search("tp")


def test_resolve_solves_a_split_for_the_cluster_and_builds_a_valid_plan() -> None:
    from torchweave.plan.validate import validate

    g = _gpt()
    plan = resolve("tp:tp=2,dp=2,split=solved", g, 4, cluster=fast(4))
    validate(plan, g, world_size=4)
    assert plan.notes["spec"] == "tp:tp=2,dp=2,split=solved" and "solved" in plan.notes["policy"]
    assert tp_dims(plan, g) == solve(g, fast(4), tp=2, world=4).dims
    pipe = resolve("1f1b:tp=2,pp=2,micro=4,split=solved", g, 8, cluster=fast(8))
    validate(pipe, g, world_size=8)
    assert pipe.pipeline is not None and tp_dims(pipe, g) == solve(g, fast(8), tp=2, world=8).dims
    # the same dims on another capture of the model (a pipeline's micro-batch)
    again = resolve("1f1b:tp=2,pp=2,micro=4,split=solved", _gpt(batch=4), 8, like=pipe)
    assert tp_dims(again, _gpt(batch=4)) == tp_dims(pipe, g)


# ------------------------------------------------------------------ in the search
def test_constraints_choose_the_split_and_presets_say_theirs() -> None:
    assert preset("megatron").split == ("rule",)
    assert preset("nnscaler").split == ("solved",)
    assert set(preset("free").split) == {"rule", "solved"}
    assert load_constraints("split: [solved]\n").split == ("solved",)
    with pytest.raises(TorchweaveError) as e:
        load_constraints("tp: [2]\nsplit: [magic]\n")
    assert "line 2" in str(e.value) and "rule, solved" in str(e.value)


def test_the_search_ranks_solved_partitions_beside_megatrons() -> None:
    g = _gpt(layers=8)
    res = search(g, fast(8), "free", top=0, simulate_top=10)
    specs = [r.spec for r in res.ranked]
    assert any("split=solved" in s for s in specs)
    assert any("unlike Megatron's rules" in n for n in res.notes)  # what the solver changed
    nn = search(g, fast(8), "nnscaler", top=0, simulate_top=10)
    assert all("split=solved" in r.spec for r in nn.ranked if r.point.tp > 1)
    assert nn.best.result.step_time >= res.best.result.step_time * (1 - 1e-9)  # free ⊇ nnscaler


def test_split_solved_from_the_command_line_and_a_train_config(tmp_path, capsys) -> None:
    from torchweave.cli import main
    from torchweave.plan.plan import Plan
    from torchweave.train.config import ParallelConfig

    out = tmp_path / "solved.json"
    assert main(["plan", "gpt-tiny", "--plan", "tp:tp=2,dp=2,split=solved", "--cluster",
                 "4xA100-80GB-SXM@4", "--out", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.notes["spec"] == "tp:tp=2,dp=2,split=solved" and "solved" in plan.notes["policy"]
    assert main(["simulate", "gpt-tiny", "--cluster", "4xA100-80GB-SXM@4",
                 "--plan", "tp:tp=2,dp=2,split=solved", "--plan", "tp:tp=2,dp=2"]) == 0
    assert "split=solved" in capsys.readouterr().out
    cfg = ParallelConfig(plan="1f1b:tp=2,pp=2,split=solved", world_size=8, micro_batch=4,
                         global_batch=8)
    assert cfg.dp == 2


def test_a_folded_block_is_priced_once_per_layer() -> None:
    """All whole on tp=2 of 2 devices (no data parallelism): the price is every op's forward
    and backward plus AdamW's pass, summed over all layers, though the blocks are folded."""
    from torchweave.ops import info
    from torchweave.sim.hardware.compute import ComputeModel, dtype_of, op_time

    cluster = parse_cluster("2xA100-80GB-SXM@2")
    for layers in (4, 16):
        g = _gpt(layers=layers)
        compute = sum(sum(op_time(info(g, n), cluster.device, dtype=dtype_of(g, n)).__dict__[k]
                          for k in ("fwd", "bwd")) for n in g.nodes)
        bw = cluster.device.memory_bandwidth * ComputeModel.for_device(cluster.device).bandwidth
        adam = 28 / bw * sum(g.values[r.name].meta.numel for n in g.nodes for r in n.input_refs()
                             if g.values[r.name].kind == "param")
        whole = price(g, cluster, {n.name: None for n in g.nodes}, tp=2, world=2)
        assert whole == pytest.approx(compute + adam, rel=1e-9), layers


def test_ties_are_equalities_of_the_program_and_the_search_keeps_them() -> None:
    """``ties: [[q_proj, k_proj]]``: the two projections' matrix products take one split
    (and their bias additions one), posed to the solver, not checked after it."""
    from torchweave.search import Constraints, Degrees
    from torchweave.search.admit import admissible, tied
    from torchweave.search.space import Point

    g, cluster = _gpt(), fast(8)
    group = ("blocks.*.attn.q_proj", "blocks.*.attn.k_proj")
    cols = tied(g, group)
    assert cols and all(len({g.node(n).target for n in c}) == 1 for c in cols)
    rule = (OpRule(module="blocks.*.attn.k_proj", split=("k",)),)  # k_proj: rows only
    free = solve(g, cluster, tp=2, world=8, rules=rule)
    bound = solve(g, cluster, tp=2, world=8, rules=rule, ties=(group,))
    assert any(len({free.dims[n] for n in c}) > 1 for c in cols)  # untied: they differ
    assert all(len({bound.dims[n] for n in c}) == 1 for c in cols)
    assert bound.cost >= free.cost
    c = Constraints(tp=Degrees(only=(2,)), split=("solved",), ops=rule, ties=(group,))
    plan = PlanSpec.parse("tp:tp=2,dp=4,split=solved").build(g, 8, dims=bound.dims)
    pt = Point(2, 1, 4, 1, "none", 1, "none", 0, False, "solved")
    assert admissible(plan, g, c, pt) is None
    plan = PlanSpec.parse("tp:tp=2,dp=4,split=solved").build(g, 8, dims=free.dims)
    assert "ties" in admissible(plan, g, c, pt)

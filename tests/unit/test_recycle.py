"""Multi-forward (recycling) on CPU without processes: actions, placement, checks, plans, reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import captured
from torchweave.errors import TorchweaveError
from torchweave.plan.plan import Plan
from torchweave.plan.schedules import (
    Action, Kind, ScheduleError, add_communication, dry_run, from_csv, gpipe, interleaved_1f1b,
    loop_stage_to_rank, one_f_one_b, peak_in_flight, timeline, to_csv, zero_bubble_h1,
)
from torchweave.plan.schedules.recycle import in_bubbles, makespan, multi_forward, up_front
from torchweave.plan.validate import PlanError, validate
from torchweave.policies import resolve
from torchweave.policies.pipeline_policy import pipeline, with_recycle, with_schedule
from torchweave.sim.step.schedule import StageCost, simulate_schedule


def _bases(p: int, m: int):
    ident = loop_stage_to_rank(p, p)
    yield "gpipe", gpipe(p, m), ident
    yield "1f1b", one_f_one_b(p, m), ident
    yield "zb", zero_bubble_h1(p, m), ident
    if m % p == 0:
        yield "interleaved", interleaved_1f1b(p, 2, m), loop_stage_to_rank(2 * p, p)


GRID = [(p, m, passes) for p, m, passes in itertools.product((1, 2, 3, 4), (1, 2, 4, 6, 8), (1, 2, 3))]


# --- actions -----------------------------------------------------------------


def test_no_gradient_passes_print_and_parse_with_their_pass() -> None:
    for text in ("0R3.1", "2SEND_R0.0", "1RECV_R2.3"):
        a = Action.parse(text)
        assert str(a) == text and a.kind.value in text
    assert Action.parse("0R3.1") == Action(0, Kind.R, 3, 1)
    assert Kind.R.is_compute and Kind.SEND_R.is_comm
    sched = multi_forward(one_f_one_b(2, 2), {0: 0, 1: 1}, 2, 3)
    assert from_csv(to_csv(sched)) == sched


@pytest.mark.parametrize("text,rule", [
    ("1R0", "R takes its pass after a dot"),
    ("1F0.1", "only R, SEND_R and RECV_R carry a pass number"),
    ("1R0.x", "a pass number follows the dot"),
])
def test_bad_pass_numbers_point_at_the_text(text: str, rule: str) -> None:
    with pytest.raises(ScheduleError, match=rule):
        Action.parse(text)


# --- placement and the dry run --------------------------------------------------


@pytest.mark.parametrize("p,m,passes", GRID)
def test_every_placement_is_complete_and_deadlock_free(p: int, m: int, passes: int) -> None:
    for name, base, s2r in _bases(p, m):
        stages = max(s2r) + 1
        for sched in (multi_forward(base, s2r, m, passes), up_front(base, s2r, m, passes),
                      in_bubbles(base, s2r, m, passes, priority="pass")):
            dry_run(add_communication(sched, s2r), s2r, stages, m, passes)
            rs = [a for acts in sched.values() for a in acts if a.kind is Kind.R]
            assert len(rs) == stages * m * (passes - 1), name
            # op-order over the base: every rank keeps its F/B/I/W in the base's order
            assert {r: [a for a in acts if a.kind is not Kind.R] for r, acts in sched.items()} == base
            assert peak_in_flight(sched) == peak_in_flight(base), "R passes keep nothing for backward"


@pytest.mark.parametrize("p,m,passes", [(2, 4, 3), (4, 8, 2), (4, 8, 3), (3, 6, 4)])
def test_no_gradient_passes_add_no_idle_time_to_1f1b(p: int, m: int, passes: int) -> None:
    """R passes fill what would be idle: each rank's idle time equals the base schedule's."""
    ident = loop_stage_to_rank(p, p)
    base = one_f_one_b(p, m)
    sched = multi_forward(base, ident, m, passes)
    work = m * (1 + 2)
    assert makespan(sched) - (work + m * (passes - 1)) == pytest.approx(makespan(base) - work)


def test_placement_beats_a_fill_and_drain_per_pass_and_is_the_fastest_candidate() -> None:
    """Against running each no-gradient pass as its own pipeline pass (PyTorch's ``eval`` per
    pass, with a barrier between passes), and against each candidate placement."""
    gains = []
    for p, m, passes in GRID:
        for name, base, s2r in _bases(p, m):
            for costs in ({}, {"cost_r": 0.6}):
                fast = makespan(multi_forward(base, s2r, m, passes, **costs), **costs)
                for other in (up_front(base, s2r, m, passes),
                              in_bubbles(base, s2r, m, passes, priority="micro", **costs)):
                    assert fast <= makespan(other, **costs) + 1e-9, (name, p, m, passes, costs)
                forwards = {r: [a for a in acts if a.kind is Kind.F] for r, acts in base.items()}
                by_pass = (passes - 1) * makespan(forwards, **costs) + makespan(base, **costs)
                assert fast <= by_pass + 1e-9, (name, p, m, passes, costs)
                gains.append(by_pass / fast)
    assert max(gains) > 1.25


def test_timeline_and_simulator_agree_on_recycled_schedules() -> None:
    s2r = loop_stage_to_rank(4, 4)
    sched = multi_forward(one_f_one_b(4, 8), s2r, 8, 3)
    step = simulate_schedule(sched, [StageCost(fwd=1.0, bwd=2.0, activations=10)] * 4)
    assert step.step_time == pytest.approx(makespan(sched))
    assert step.in_flight == peak_in_flight(sched)
    assert len(timeline(sched)[0]) == len(sched[0])


def test_a_recycled_value_that_arrives_too_late_is_a_deadlock_with_the_grid() -> None:
    """Rank 0 wants micro-batch 1's second pass before rank 1 has run its first."""
    rows = {0: "0R0.0 0R1.0 0R1.1 0R0.1 0F0 0F1 0B0 0B1", 1: "1R0.0 1R0.1 1R1.0 1R1.1 1F0 1B0 1F1 1B1"}
    sched = {r: [Action.parse(t) for t in row.split()] for r, row in rows.items()}
    with pytest.raises(ScheduleError) as err:
        dry_run(add_communication(sched, {0: 0, 1: 1}), {0: 0, 1: 1}, 2, 2, 3)
    msg = str(err.value)
    assert "deadlocks" in msg and "[0RECV_R1.1]" in msg and "0RECV_R1.1 waits for 1SEND_R1.0" in msg


def test_missing_or_extra_passes_are_reported() -> None:
    s2r = {0: 0, 1: 1}
    sched = multi_forward(one_f_one_b(2, 2), s2r, 2, 3)
    short = {r: [a for a in acts if str(a) != f"{r}R1.1"] for r, acts in sched.items()}
    with pytest.raises(ScheduleError, match="no 0R1.1"):
        dry_run(add_communication(short, s2r), s2r, 2, 2, 3)
    with pytest.raises(ScheduleError, match="R runs only in multi-forward plans"):
        dry_run(add_communication(sched, s2r), s2r, 2, 2, 1)
    swapped = {r: list(acts) for r, acts in sched.items()}
    row = swapped[1]
    i, j = row.index(Action.parse("1R0.0")), row.index(Action.parse("1R0.1"))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match="a stage runs its passes in order"):
        dry_run(add_communication(swapped, s2r), s2r, 2, 2, 3)


def test_the_loop_back_is_sent_by_the_last_stage_and_received_before_stage_0s_next_pass() -> None:
    full = add_communication(multi_forward(one_f_one_b(2, 1), {0: 0, 1: 1}, 1, 3), {0: 0, 1: 1})
    assert [str(a) for a in full[1]][:4] == ["1RECV_R0.0", "1R0.0", "1SEND_R0.0", "1RECV_R0.1"]
    row0 = [str(a) for a in full[0]]
    assert row0.index("0RECV_R0.2") == row0.index("0F0") - 1
    assert row0.index("0RECV_R0.1") == row0.index("0R0.1") - 1


# --- plans ------------------------------------------------------------------------


def test_recycle_option_builds_a_checked_plan_that_round_trips() -> None:
    graph = captured("recycler-tiny")
    plan = resolve("1f1b:micro=4,recycle=3", graph, 2)
    validate(plan, graph, world_size=2)
    pipe = plan.pipeline
    assert pipe.passes == 3 and dict(pipe.recycle.links) == {"prev_single": "norm", "prev_coords": "structure"}
    assert sum(a.kind is Kind.R for acts in pipe.schedule.values() for a in acts) == 2 * 4 * 2
    assert Plan.from_json(plan.to_json()) == plan
    assert "3 passes" in plan.notes["recycle"]
    # user op-order keeps each stage's passes in order: pull 0F1 before 0R2.0
    orders = [(Action.parse("0F1"), Action.parse("0R2.0"))]
    reordered = with_schedule(plan, pipe.schedule, orders=orders)
    row = reordered.pipeline.schedule[0]
    assert row.index(Action.parse("0F1")) < row.index(Action.parse("0R2.0"))
    assert row.index(Action.parse("0R1.1")) < row.index(Action.parse("0F1"))
    # rank 1 runs every R first, so rank 0 waits for 1R1.1 behind 1R2.0, which waits for 0R2.0
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(reordered, graph, world_size=2)


def test_bad_recycle_links_are_rejected_before_launch() -> None:
    graph = captured("recycler-tiny")
    plan = resolve("1f1b:micro=4", graph, 2)
    with_recycle(plan, graph, 2, {"prev_single": "structure", "nope": "norm", "prev_coords": "missing"})
    with pytest.raises(PlanError) as err:
        validate(plan, graph)
    msg = str(err.value)
    assert "the recycled output has the input's shape and dtype" in msg  # [.., 3] into [.., 32]
    assert "'nope'" in msg and "forward argument" in msg
    assert "'missing'" in msg and "module path" in msg


def test_recycled_values_must_go_from_the_last_stage_to_stage_0() -> None:
    graph = captured("recycler-tiny")
    names = [n.name for n in graph.nodes]
    late = [names.index(n.name) + 1 for n in graph.nodes if n.module == "norm"][0]
    plan = with_recycle(pipeline(graph, 2, cuts=[late], micro=2), graph, 2)
    with pytest.raises(PlanError, match="the recycled output is made on the last stage"):
        validate(plan, graph)
    early = [i for i, n in enumerate(graph.nodes) if n.module == "recycle_norm"][0]
    plan = with_recycle(pipeline(graph, 2, cuts=[early], micro=2), graph, 2)
    with pytest.raises(PlanError, match="the recycled input is read on stage 0 only"):
        validate(plan, graph)


def test_recycling_needs_links_and_a_pipeline() -> None:
    graph = captured("gpt-tiny")
    with pytest.raises(TorchweaveError, match="give the model a class attribute"):
        resolve("1f1b:recycle=2", graph, 2)
    with pytest.raises(TorchweaveError, match="multi-forward runs on a pipelined plan"):
        with_recycle(resolve("dp", graph, 2), graph, 2, {"idx": "ln_f"})
    rgraph = captured("recycler-tiny")
    plan = with_recycle(resolve("interlaced", rgraph, 2), rgraph, 2)
    with pytest.raises(PlanError, match="multi-forward runs on pipelines without shared stages"):
        validate(plan, rgraph)


def test_lowering_carries_each_output_to_the_region_its_readers_need() -> None:
    from torchweave.lower.lower import lower

    graph = captured("recycler-tiny")
    programs = lower(graph, resolve("gpipe:pp=1,dp=2,micro=2,recycle=2", graph, 2))
    links = {link.input: link for link in programs[0].recycle}
    single = links["prev_single"]
    batch = graph.values["prev_single"].meta.shape[0]
    # data parallel: each rank receives its own half of the batch, from itself
    assert dict(single.boxes)[1][0] == (batch // 2, batch)
    assert {(t.src, t.dst) for t in single.step.transfers} == {(0, 0), (1, 1)}
    last = programs[0].segments[-1]
    assert single.output in last.outputs, "the recycled value outlives the stage function"


# --- the one-device reference ---------------------------------------------------------


def test_reference_loop_is_the_models_own_recycling_and_changes_the_loss() -> None:
    from torchweave.models import build
    from torchweave.verify import recycled_forward

    torch.manual_seed(0)
    model, batch = build("recycler-tiny")
    aatype, coords, single, pos = batch
    with torch.no_grad():
        for _ in range(2):
            single, pos = model.recycled(aatype, coords, single, pos)
    want = model(aatype, coords, single, pos)
    got = recycled_forward(model, batch, 3, {2: "norm", 3: "structure"})
    torch.testing.assert_close(got, want)
    assert abs(float(got.detach()) - float(model(*batch).detach())) > 1e-3, "recycling must matter for the test to mean much"
    assert not model.norm._forward_hooks, "hooks are removed"

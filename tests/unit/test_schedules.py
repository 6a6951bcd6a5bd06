"""Pipeline schedules as data: string and CSV forms, built-ins, communication, dry run, bubbles."""

from __future__ import annotations

import ast
import itertools
import random
from dataclasses import replace
from pathlib import Path

import pytest

from torchweave.errors import TorchweaveError
from torchweave.plan.schedules import (
    Action,
    Kind,
    ScheduleError,
    add_communication,
    bubble_fraction,
    check_stage_count,
    dry_run,
    format_schedule,
    from_csv,
    gpipe,
    infer_stage_to_rank,
    interleaved_1f1b,
    loop_stage_to_rank,
    one_f_one_b,
    peak_in_flight,
    to_csv,
    zero_bubble_h1,
)

SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 4), (4, 4), (4, 7), (4, 12), (6, 9)]


def _builtins():
    """(name, schedule, stage_to_rank, stages, micro) for every built-in at every size."""
    for p, m in SIZES:
        identity = loop_stage_to_rank(p, p)
        yield "gpipe", gpipe(p, m), identity, p, m
        yield "1f1b", one_f_one_b(p, m), identity, p, m
        yield "zb-h1", zero_bubble_h1(p, m), identity, p, m
    for ranks, v, m in [(1, 2, 3), (2, 1, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 3, 9)]:
        yield f"interleaved(v={v})", interleaved_1f1b(ranks, v, m), loop_stage_to_rank(ranks * v, ranks), \
            ranks * v, m


# --- actions, grid, CSV -----------------------------------------------------


def test_action_string_round_trips() -> None:
    rng = random.Random(0)
    actions = [Action(s, k, m) for s, k, m in itertools.product(range(3), Kind, range(3))]
    actions += [Action(rng.randrange(10**4), rng.choice(list(Kind)), rng.randrange(10**4)) for _ in range(500)]
    for a in actions:
        assert Action.parse(str(a)) == a
    assert str(Action(1, Kind.F, 0)) == "1F0"
    assert str(Action(0, Kind.SEND_F, 3)) == "0SEND_F3"
    assert Action.parse(" 2W1 ") == Action(2, Kind.W, 1)


@pytest.mark.parametrize("text, rule", [
    ("F0", "starts with its stage"), ("1F", "ends with its micro-batch"),
    ("1X0", "unknown kind 'X'"), ("12", "a kind follows"), ("1SEND0", "unknown kind 'SEND'"),
])
def test_action_parse_errors_point_at_the_text(text: str, rule: str) -> None:
    with pytest.raises(ScheduleError) as err:
        Action.parse(text)
    msg = str(err.value)
    assert isinstance(err.value, TorchweaveError)
    assert rule in msg and text in msg and "^" in msg


def test_csv_round_trips_every_builtin() -> None:
    for name, schedule, stage_to_rank, _, _ in _builtins():
        full = add_communication(schedule, stage_to_rank)
        assert from_csv(to_csv(full)) == full, name
    assert to_csv({0: [Action(0, Kind.F, 0)], 1: []}) == "0,0F0\n1\n"


def test_csv_reports_every_bad_cell() -> None:
    with pytest.raises(ScheduleError) as err:
        from_csv("0,0F0,0Q1\nx,1F0\n1,1F0,,1B0\n1,1F1\n")
    msg = str(err.value)
    assert "line 1, column 3" in msg and "'Q'" in msg
    assert "line 2, column 1" in msg and "line 4" in msg and "one row per rank" in msg


def test_grid_has_one_row_per_rank_and_marks_cells() -> None:
    grid = format_schedule(one_f_one_b(2, 2), marks={1: 1})
    lines = grid.splitlines()
    assert lines[0].split("|")[1].split() == ["0", "1", "2", "3"]
    assert lines[2].split("|")[1].split() == ["0F0", "0F1", "0B0", "0B1"]
    assert lines[3].split("|")[1].split() == ["1F0", "[1B0]", "1F1", "1B1"]


def test_stage_maps() -> None:
    assert loop_stage_to_rank(6, 3) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert infer_stage_to_rank(interleaved_1f1b(2, 2, 2)) == {0: 0, 1: 1, 2: 0, 3: 1}


# --- built-ins ---------------------------------------------------------------


def test_every_builtin_is_complete_ordered_and_deadlock_free() -> None:
    for name, schedule, stage_to_rank, stages, micro in _builtins():
        dry_run(add_communication(schedule, stage_to_rank), stage_to_rank, stages, micro)
        done: dict[tuple[int, int], set[Kind]] = {}
        for actions in schedule.values():
            for a in actions:
                kinds = done.setdefault((a.stage, a.micro), set())
                if a.kind in (Kind.B, Kind.I):
                    assert Kind.F in kinds, f"{name}: {a} before its F"
                kinds.add(a.kind)
        for s, m in itertools.product(range(stages), range(micro)):
            kinds = done[(s, m)]
            assert Kind.F in kinds and (Kind.B in kinds or {Kind.I, Kind.W} <= kinds), f"{name}: {s},{m}"


def test_communication_sits_next_to_its_compute() -> None:
    full = add_communication(one_f_one_b(2, 2), {0: 0, 1: 1})
    assert [str(a) for a in full[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0",
                                         "0RECV_B1", "0B1"]
    assert [str(a) for a in full[1]][:4] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]
    # stages on one rank hand over in memory
    assert all(a.kind.is_compute for a in add_communication(interleaved_1f1b(1, 3, 2), {0: 0, 1: 0, 2: 0})[0])


@pytest.mark.parametrize("p, m", [(2, 2), (2, 6), (4, 4), (4, 8), (8, 8), (8, 32)])
def test_gpipe_bubble_is_the_textbook_formula(p: int, m: int) -> None:
    assert bubble_fraction(gpipe(p, m), cost_f=1, cost_b=2) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(one_f_one_b(p, m), cost_f=1, cost_b=2) == pytest.approx((p - 1) / (m + p - 1))
    assert peak_in_flight(gpipe(p, m)) == {r: m for r in range(p)}


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_1f1b_holds_p_minus_r_micro_batches(p: int, m: int) -> None:
    assert peak_in_flight(one_f_one_b(p, m)) == {r: p - r for r in range(p)}
    # ZB-H1: stage r holds p - r micro-batches up to their I (as 1F1B), and r more up to
    # their deferred W: p on every stage, 1F1B's peak
    zb = zero_bubble_h1(p, m)
    assert peak_in_flight(zb) == {r: p for r in range(p)}
    until_i = {r: [a if a.kind is not Kind.I else replace(a, kind=Kind.B) for a in row
                   if a.kind is not Kind.W] for r, row in zb.items()}
    assert peak_in_flight(until_i) == {r: p - r for r in range(p)}


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_h1_beats_1f1b(p: int, m: int) -> None:
    zb = bubble_fraction(zero_bubble_h1(p, m), cost_f=1, cost_i=1, cost_w=1)
    ofob = bubble_fraction(one_f_one_b(p, m), cost_f=1, cost_b=2)
    assert zb < ofob
    # ZB-H1's idle time per rank is (p-1)(F + I - W) = p-1 against 3m of work (the paper's
    # bound; 1F1B's is (p-1)(F + I + W))
    assert zb == pytest.approx((p - 1) / (3 * m + (p - 1)))


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 16)])
def test_interleaved_beats_1f1b(p: int, v: int, m: int) -> None:
    inter = bubble_fraction(interleaved_1f1b(p, v, m))
    assert inter < bubble_fraction(one_f_one_b(p, m))
    assert inter == pytest.approx((p - 1) / (v * m + p - 1))


def test_bad_arguments_show_the_arithmetic() -> None:
    with pytest.raises(ScheduleError, match=r"micro\(3\) % ranks\(2\) != 0"):
        interleaved_1f1b(2, 2, 3)
    with pytest.raises(ScheduleError, match=r"stages\(4\) != ranks\(2\) \* virtual\(1\)"):
        interleaved_1f1b(2, 1, 4, stages=4)
    with pytest.raises(ScheduleError, match=r"stages\(5\) != ranks\(2\) \* virtual\(2\)"):
        check_stage_count(5, 2, 2)
    with pytest.raises(ScheduleError) as err:
        one_f_one_b(0, -1)
    assert "stages=0" in str(err.value) and "micro=-1" in str(err.value)


# --- the dry run rejects bad schedules -------------------------------------


def test_deadlock_prints_the_grid_with_stuck_cells() -> None:
    schedule = {
        0: [Action.parse(t) for t in ["0RECV_B0", "0F0", "0SEND_F0", "0B0"]],
        1: [Action.parse(t) for t in ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
    }
    with pytest.raises(ScheduleError) as err:
        dry_run(schedule, {0: 0, 1: 1}, 2, 1)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "[0RECV_B0]" in msg and "[1RECV_F0]" in msg
    assert "rank 0 | [0RECV_B0] 0F0" in msg
    assert "0RECV_B0 waits for 1SEND_B0" in msg and "1RECV_F0 waits for 0SEND_F0" in msg


def test_deadlock_midway_marks_each_rank_where_it_stops() -> None:
    full = add_communication(one_f_one_b(2, 2), {0: 0, 1: 1})
    # rank 1 runs micro-batch 1 before micro-batch 0's backward, but rank 0 waits for that gradient first
    full[0] = [a for a in full[0] if str(a) not in ("0F1", "0SEND_F1")]
    full[0].insert(full[0].index(Action.parse("0B0")) + 1, Action.parse("0F1"))
    full[0].insert(full[0].index(Action.parse("0F1")) + 1, Action.parse("0SEND_F1"))
    full[1] = [Action.parse(t) for t in
               ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1"]]
    with pytest.raises(ScheduleError) as err:
        dry_run(full, {0: 0, 1: 1}, 2, 2)
    assert "[0RECV_B0]" in str(err.value) and "[1RECV_F1]" in str(err.value)


def test_missing_backward_is_rejected() -> None:
    schedule = one_f_one_b(2, 3)
    schedule[1].remove(Action(1, Kind.B, 2))
    with pytest.raises(ScheduleError) as err:
        dry_run(add_communication(schedule, {0: 0, 1: 1}), {0: 0, 1: 1}, 2, 3)
    msg = str(err.value)
    assert "stage 1 micro-batch 2: no backward" in msg and "1B2" in msg


def test_order_and_placement_problems_are_all_reported() -> None:
    stage_to_rank = {0: 0, 1: 1}
    schedule = add_communication(zero_bubble_h1(2, 2), stage_to_rank)
    r0 = schedule[0]
    i, w = r0.index(Action(0, Kind.I, 0)), r0.index(Action(0, Kind.W, 0))
    r0[i], r0[w] = r0[w], r0[i]                      # W before I
    f, b = schedule[1].index(Action(1, Kind.F, 1)), schedule[1].index(Action(1, Kind.I, 1))
    schedule[1][f], schedule[1][b] = schedule[1][b], schedule[1][f]  # I before F
    schedule[0].append(Action(1, Kind.W, 1))         # stage 1 on rank 0
    with pytest.raises(ScheduleError) as err:
        dry_run(schedule, stage_to_rank, 2, 2)
    msg = str(err.value)
    assert "W runs after its I" in msg
    assert "the F of stage 1 micro-batch 1 precedes its backward" in msg
    assert "stage 1 runs on rank 1, not rank 0" in msg
    assert "problems:" in msg and "rank 0 |" in msg


def test_missing_communication_names_the_fix() -> None:
    with pytest.raises(ScheduleError, match="add_communication"):
        dry_run(one_f_one_b(2, 2), {0: 0, 1: 1}, 2, 2)


def test_package_imports_only_errors_and_the_standard_library() -> None:
    import sys

    pkg = Path(__file__).resolve().parents[2] / "torchweave" / "plan" / "schedules"
    for path in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = (name == "torchweave.errors" or name.startswith("torchweave.plan.schedules")
                      or (top in sys.stdlib_module_names and top != "torchweave"))
                assert ok, f"{path.name} imports {name}"

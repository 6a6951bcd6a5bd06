"""``lower.derive``: the communication each layout change becomes, one case per change.

Communication is derived, never written: this is the table a reader can check the
derivation against. A tensor of shape (8, 4); devices hold :class:`Piece` s (a box and a
partial-sum index) and each consumer piece needs a box (:class:`Need`, with the piece's
identity: devices that read the same box for different pieces sum their gradients).
"""

from __future__ import annotations

import pytest

from torchweave.lower.derive import Need, derive, point_to_point
from torchweave.lower.steps import (
    P2P, AllGather, AllReduce, AllToAll, GradAllReduce, Narrow, ReduceScatter, Split,
)
from torchweave.plan.layout import Piece

SHAPE = (8, 4)
FULL = ((0, 8), (0, 4))
ROWS = [((0, 4), (0, 4)), ((4, 8), (0, 4))]  # S(0) over 2 devices
COLS = [((0, 8), (0, 2)), ((0, 8), (2, 4))]  # S(1) over 2 devices


def _same(box, n: int = 2) -> dict[int, Need]:
    """Every device reads ``box`` for the same consumer piece (replicas)."""
    return {d: Need(box, 0) for d in range(n)}


def _each(boxes) -> dict[int, Need]:
    """Device d reads ``boxes[d]`` for piece d."""
    return {d: Need(b, d) for d, b in enumerate(boxes)}


def _kinds(der) -> list[type]:
    return [type(s) for s in der.steps]


def test_partial_sums_to_replicated_is_one_all_reduce() -> None:
    src = {0: Piece(FULL, (0, 2)), 1: Piece(FULL, (1, 2))}
    der = derive(SHAPE, src, _same(FULL))
    assert der.steps == [AllReduce(((0, 1),))]
    assert all(p.box == FULL and not p.is_partial for p in der.result.values())


def test_log_sum_exp_partials_reduce_with_their_own_op() -> None:
    src = {0: Piece(FULL, (0, 2), "lse"), 1: Piece(FULL, (1, 2), "lse")}
    (step,) = derive(SHAPE, src, _same(FULL)).steps
    assert isinstance(step, AllReduce) and step.op == "lse"


def test_partial_sums_to_a_chunk_each_is_one_reduce_scatter() -> None:
    src = {0: Piece(FULL, (0, 2)), 1: Piece(FULL, (1, 2))}
    der = derive(SHAPE, src, _each(ROWS))
    assert der.steps == [ReduceScatter(((0, 1),), 0)]
    assert [der.result[d].box for d in (0, 1)] == ROWS


def test_shards_to_replicated_is_one_all_gather() -> None:
    src = {d: Piece(b) for d, b in enumerate(ROWS)}
    der = derive(SHAPE, src, _same(FULL))
    assert der.steps == [AllGather(((0, 1),), 0)]


def test_shards_along_one_axis_to_shards_along_another_is_one_all_to_all() -> None:
    src = {d: Piece(b) for d, b in enumerate(ROWS)}
    der = derive(SHAPE, src, _each(COLS))
    assert _kinds(der) == [AllToAll]
    (step,) = der.steps
    assert (step.groups, step.split_axis, step.cat_axis) == (((0, 1),), 1, 0)
    assert [der.result[d].box for d in (0, 1)] == COLS


def test_replicated_to_shards_is_a_local_slice_with_no_communication() -> None:
    """Each device keeps a different chunk of a tensor it holds whole: forward moves
    nothing; backward gathers the gradient chunks (a Split), since every replica's
    producer needs the whole gradient."""
    src = {d: Piece(FULL) for d in (0, 1)}
    der = derive(SHAPE, src, _each(ROWS))
    assert _kinds(der) == [Split]
    assert der.steps[0].axis == 0


def test_replicated_to_the_same_chunk_is_a_narrow() -> None:
    src = {d: Piece(FULL) for d in (0, 1)}
    der = derive(SHAPE, src, _same(ROWS[0]))
    assert _kinds(der) == [Narrow]
    assert dict(der.steps[0].boxes) == {0: ROWS[0], 1: ROWS[0]}


def test_what_is_held_already_needs_nothing() -> None:
    src = {d: Piece(b) for d, b in enumerate(ROWS)}
    der = derive(SHAPE, src, _each(ROWS))
    assert der.steps == [] and der.grad_groups == ()


def test_a_permuted_device_order_ends_in_point_to_point() -> None:
    """Device 0 holds rows 0:4 and needs rows 4:8, device 1 the other way round. The
    regular phases gather, but no regular cut gives replicas of the gathered tensor
    different chunks with a correct gradient (the gather's backward keeps each member's
    own chunk), so the rest travels point to point, whose backward sends each gradient
    piece back to every holder. Across pipeline stages ``point_to_point`` moves just the
    pieces."""
    src = {d: Piece(b) for d, b in enumerate(ROWS)}
    der = derive(SHAPE, src, _each(ROWS[::-1]))
    assert _kinds(der) == [AllGather, P2P]
    assert [der.result[d].box for d in (0, 1)] == ROWS[::-1]
    direct = point_to_point(SHAPE, src, _each(ROWS[::-1]))
    (step,) = direct.steps
    local = ((0, 4), (0, 4))  # boxes are the sender's own piece, whole (its local indices)
    assert {(t.src, t.dst, t.src_box) for t in step.transfers} == {(0, 1, local), (1, 0, local)}


def test_a_replicated_tensor_read_by_different_pieces_sums_its_gradient() -> None:
    """R' : both devices read the whole tensor for different consumer pieces, so each
    holds part of its gradient. With nothing moved forward the sum is a GradAllReduce;
    a parameter defers it to the bucketed gradient sync instead."""
    src = {d: Piece(FULL) for d in (0, 1)}
    der = derive(SHAPE, src, _each([FULL, FULL]))
    assert der.steps == [GradAllReduce(((0, 1),))]
    deferred = derive(SHAPE, src, _each([FULL, FULL]), defer_grad_sum=True)
    assert deferred.steps == [] and deferred.grad_groups == ((0, 1),)


def test_the_gradient_sum_fuses_into_the_forward_collective() -> None:
    """When the forward collective already spans the summing group, its backward does
    the sum: an all-reduce's backward all-reduces, an all-gather's reduce-scatters."""
    partial = {0: Piece(FULL, (0, 2)), 1: Piece(FULL, (1, 2))}
    (ar,) = derive(SHAPE, partial, _each([FULL, FULL])).steps
    assert isinstance(ar, AllReduce) and ar.bwd == "all_reduce"
    shards = {d: Piece(b) for d, b in enumerate(ROWS)}
    (ag,) = derive(SHAPE, shards, _each([FULL, FULL])).steps
    assert isinstance(ag, AllGather) and ag.bwd == "reduce_scatter"
    (plain,) = derive(SHAPE, shards, _same(FULL)).steps
    assert plain.bwd == "slice"


def test_integer_tensors_never_sum_gradients() -> None:
    src = {d: Piece(FULL) for d in (0, 1)}
    der = derive(SHAPE, src, _each([FULL, FULL]), differentiable=False)
    assert der.steps == [] and der.grad_groups == ()


@pytest.mark.parametrize("n", [4])
def test_groups_are_the_narrowest_that_cover_each_need(n: int) -> None:
    """Rows split over 4 devices as 2 pairs of replicas of a dp×tp mesh: devices {0, 1}
    hold rows 0:4 split by columns, {2, 3} rows 4:8. Each needs its own rows whole: the
    gather runs inside each pair, never across."""
    src = {0: Piece(((0, 4), (0, 2))), 1: Piece(((0, 4), (2, 4))),
           2: Piece(((4, 8), (0, 2))), 3: Piece(((4, 8), (2, 4)))}
    dst = {0: Need(ROWS[0], 0), 1: Need(ROWS[0], 0), 2: Need(ROWS[1], 1), 3: Need(ROWS[1], 1)}
    der = derive(SHAPE, src, dst)
    assert der.steps == [AllGather(((0, 1), (2, 3)), 1)]


# A layout split over two mesh axes (experts on ep, their tokens' slots on dp): device
# d = 2·i + j holds block (j, i) of a (4, 8) tensor, rows by j and columns by i.
SHAPE2 = (4, 8)
FULL2 = ((0, 4), (0, 8))
BLOCKS = {2 * i + j: ((2 * j, 2 * j + 2), (4 * i, 4 * i + 4)) for i in (0, 1) for j in (0, 1)}


def test_partial_sums_to_blocks_over_two_axes_are_two_reduce_scatters() -> None:
    """No one axis scatters over all four: the sum runs as a reduce-scatter within pairs,
    then one across them, each member left with its block (no all-reduce, no slicing)."""
    src = {d: Piece(FULL2, (d, 4)) for d in range(4)}
    der = derive(SHAPE2, src, _each([BLOCKS[d] for d in range(4)]))
    assert der.steps == [ReduceScatter(((0, 1), (2, 3)), 0), ReduceScatter(((0, 2), (1, 3)), 1)]
    assert {d: der.result[d].box for d in range(4)} == BLOCKS
    assert not any(p.is_partial for p in der.result.values())


def test_blocks_over_two_axes_to_replicated_are_two_all_gathers() -> None:
    """One axis at a time; read by different pieces (R'), both backwards reduce-scatter,
    which together sum the gradient over all four."""
    src = {d: Piece(b) for d, b in BLOCKS.items()}
    der = derive(SHAPE2, src, _same(FULL2, 4))
    assert der.steps == [AllGather(((0, 1), (2, 3)), 0), AllGather(((0, 2), (1, 3)), 1)]
    assert all(s.bwd == "slice" for s in der.steps)
    summed = derive(SHAPE2, src, _each([FULL2] * 4))
    assert [type(s) for s in summed.steps] == [AllGather, AllGather]
    assert all(s.bwd == "reduce_scatter" for s in summed.steps)
    # summed over pairs only (two pieces, each read twice): the chain does not span
    # the summing groups, so the sum is a step of its own
    pairs = {d: Need(FULL2, d % 2) for d in range(4)}
    assert _kinds(derive(SHAPE2, src, pairs))[-1] is GradAllReduce


def test_parts_of_a_sum_are_labelled_by_their_terms_not_by_rank() -> None:
    """Two overlapping boxes, their terms on devices in different orders (from a review):
    after the partial reduce-scatter, equal boxes pair up by the terms they hold, so the
    second step adds each term once (it used to pair device 1's terms 0+1 with device 4's
    terms 0+1)."""
    a, b = ((0, 8), (0, 4)), ((4, 12), (0, 4))
    src = {0: Piece(a, (0, 4)), 1: Piece(a, (1, 4)), 6: Piece(a, (2, 4)), 7: Piece(a, (3, 4)),
           2: Piece(b, (2, 4)), 3: Piece(b, (3, 4)), 4: Piece(b, (0, 4)), 5: Piece(b, (1, 4))}
    rows = {0: 0, 1: 4, 6: 0, 7: 4, 2: 4, 3: 8, 4: 4, 5: 8}
    der = derive((12, 4), src, {d: Need(((r, r + 4), (0, 4)), d) for d, r in rows.items()})
    first, second = der.steps[:2]
    assert isinstance(first, ReduceScatter) and isinstance(second, AllReduce)
    terms = {d: {src[e].partial[0] for e in g} for g in first.groups for d in g}
    for g in second.groups:
        assert sorted(t for d in g for t in terms[d]) == [0, 1, 2, 3], (g, terms)

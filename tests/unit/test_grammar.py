"""The annotation language: parsing, errors with carets, binding to shapes."""

from __future__ import annotations

import pytest
import torch

from torchweave.errors import AnnotationError
from torchweave.ir import TensorMeta
from torchweave.ops import bind, parse

F32 = torch.float32


def meta(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), F32)


@pytest.mark.parametrize("text", [
    "b s k+, n k+ -> b s n",
    "b s (h d) -> b s h d",
    "a 1 c, c -> a 1 c",
    "... d^, d^ -> ... d^",
    "n c^, n -> ()",
    "?, a -> a",
    " -> n^",
])
def test_round_trip(text: str) -> None:
    ann = parse(text)
    assert parse(str(ann)) == ann


@pytest.mark.parametrize("text, column, rule", [
    ("a b -> a c+", 9, "appears in no output"),
    ("a $ b -> a", 2, "unexpected character"),
    ("a b -> a -> b", 9, "exactly one '->'"),
    ("a (b) -> a", 2, "two or more names"),
    ("a (b c -> a", 2, "closed by ')'"),
    ("a+ b, a^ -> b", 6, "one marker"),
    ("a ? -> a", 2, "stands alone"),
])
def test_errors_point_at_the_character(text: str, column: int, rule: str) -> None:
    with pytest.raises(AnnotationError) as info:
        parse(text)
    msg = str(info.value)
    assert rule in msg
    lines = msg.splitlines()
    shown = next(i for i, line in enumerate(lines) if line.strip() == text.strip())
    caret = lines[shown + 1]
    offset = lines[shown].index(text.strip()[0]) - (len(text) - len(text.lstrip()))
    assert caret.index("^") - offset == column, f"\n{lines[shown]}\n{caret}"


def test_bind_sizes_groups_and_splits() -> None:
    b = bind("b s (h d) -> b s h d", [meta(2, 8, 12)], [meta(2, 8, 3, 4)])
    assert b.sizes == {"b": 2, "s": 8, "h": 3, "d": 4}
    assert b.splittable() == ["b", "s", "h"]  # d is inside a group, not first
    assert [str(s) for s in b.splits(4)] == ["b/2", "s/2", "s/4", "h/3"]


def test_bind_expands_ellipsis_and_marks_reductions() -> None:
    b = bind("... k+, n k+ -> ... n", [meta(2, 3, 8), meta(4, 8)], [meta(2, 3, 4)])
    assert str(b) == "e0 e1 k+, n k+ -> e0 e1 n"
    assert {s.dim: s.kind for s in b.splits()}["k"] == "reduce"


def test_bind_reports_every_mismatch() -> None:
    with pytest.raises(AnnotationError) as info:
        bind("a b, b c -> a c", [meta(2, 3), meta(4, 5)], [meta(2, 6)])
    msg = str(info.value)
    assert "2 problems" in msg
    assert "b=4, elsewhere 3" in msg and "c=6, elsewhere 5" in msg


def test_bind_counts_tensors() -> None:
    with pytest.raises(AnnotationError, match="one entry per tensor input"):
        bind("a -> a", [meta(2), meta(2)], [meta(2)])


def test_bind_keeps_a_text_bound_to_the_same_shapes_and_still_refuses_a_bad_one() -> None:
    a = bind("b s k+, n k+ -> b s n", [meta(2, 8, 4), meta(6, 4)], [meta(2, 8, 6)])
    b = bind("b s k+, n k+ -> b s n", [meta(2, 8, 4), meta(6, 4)], [meta(2, 8, 6)])
    c = bind("b s k+, n k+ -> b s n", [meta(2, 8, 4), meta(5, 4)], [meta(2, 8, 5)])
    assert a is b and c is not a and c.sizes["n"] == 5
    for _ in range(2):  # an error is raised each time, never kept as an answer
        with pytest.raises(AnnotationError, match="one entry per tensor input"):
            bind("a -> a", [meta(2), meta(2)], [meta(2)])


def test_capture_binds_every_node_as_its_annotation_text_binds() -> None:
    """Capture binds each node once and keeps that for info(); it must equal what binding
    the node's annotation text gives (info's own path once the node is changed)."""
    from tests.conftest import captured
    from torchweave.ops import info
    from torchweave.ops.annotate import call_of

    for name in ("gpt-tiny", "t5-tiny", "moe-tiny"):
        g = captured(name)
        for node in g.nodes:
            call = call_of(g, node)
            again = bind(node.annotation, call.inputs, call.outputs, op=node.target)
            got = info(g, node).bound
            assert (got.annotation, got.sizes) == (again.annotation, again.sizes), node.name

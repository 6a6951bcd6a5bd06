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

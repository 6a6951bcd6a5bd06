"""The registry checks itself: one test per registered op, generated from it.

For every registered annotation, the calls come from real graphs (the bundled
tiny models and the op zoo) on the tensors those graphs really see; every
legal split into 2 and 4 parts must combine back into the whole op's result.
Nothing here states what any single op should do.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import TINY, built, captured, state_of
from tests.unit.opzoo import zoo_cases
from torchweave.ops import REGISTRY
from torchweave.ops.registry import OpSpec
from torchweave.ops.selfcheck import Case, check_case, dedupe, graph_cases


@functools.lru_cache(maxsize=None)
def all_cases() -> dict[str, list[Case]]:
    """Registered op name → deduplicated calls seen in real graphs."""
    cases: list[Case] = []
    for name in TINY:
        try:
            model, inputs = built(name)[:2]
        except pytest.skip.Exception:
            continue
        cases.extend(graph_cases(captured(name), state_of(model), inputs, name))
    cases.extend(zoo_cases())
    by_spec: dict[str, list[Case]] = {}
    for case in dedupe(iter(cases)):
        spec = REGISTRY.lookup(case.target)
        if spec is not None:
            by_spec.setdefault(spec.name, []).append(case)
    return by_spec


BUILT_IN = sorted(n for n in REGISTRY.specs if n.startswith("aten."))  # user ops: test_custom_ops


@pytest.mark.parametrize("op_name", BUILT_IN)
def test_annotation_matches_op(op_name: str) -> None:
    cases = all_cases().get(op_name, [])
    assert cases, f"{op_name} is registered but no graph exercises it; add it to tests/unit/opzoo.py"
    failures = [f"{c.where}: {f}" for c in cases[:12] for f in check_case(c)]
    assert not failures, "\n".join(failures)


def test_wrong_annotation_is_caught() -> None:
    """A softmax whose axis is marked spatial, a contraction marked spatial: both fail."""
    x = torch.randn(4, 8)
    case = Case("aten._softmax.default", torch.ops.aten._softmax.default, (x, -1, False), {})
    wrong = OpSpec(name="wrong", annotation="a b -> a b")
    failures = check_case(case, spec=wrong)
    assert any(f.split.dim == "b" for f in failures)
    mm = Case("aten.mm.default", torch.ops.aten.mm.default, (x, torch.randn(8, 4)), {})
    wrong_mm = OpSpec(name="wrong_mm", annotation="m k, k n -> m n")
    assert [f.split.dim for f in check_case(mm, spec=wrong_mm)] == ["k", "k"]
    right_mm = OpSpec(name="right_mm", annotation="m k+, k+ n -> m n")
    assert check_case(mm, spec=right_mm) == []


def test_cat_onto_an_empty_tensor_annotates_and_splits() -> None:
    """torch.cat skips a 1-D empty input beside rank-3 ones (a decoder's empty KV cache);
    its rule failed on it, and the cat replicated."""
    from torchweave.ops.selfcheck import bind_case

    case = Case("aten.cat.default", torch.cat,
                ([torch.zeros(0), torch.randn(4, 3, 2), torch.randn(4, 3, 5)], 2), {})
    _, bound, _ = bind_case(case)
    assert str(bound).startswith("e0^, a b x1^")
    assert {s.parts for s in bound.splits()} >= {2}
    assert check_case(case) == []

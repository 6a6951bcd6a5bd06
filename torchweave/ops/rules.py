"""Annotation rules for ops whose dimensions depend on their arguments.

Each rule takes a :class:`~torchweave.ops.registry.Call` and returns an
annotation string. Generic names are ``a b c …``; names with a marker are
written with it on every occurrence for readability.
"""

from __future__ import annotations

import math
import string
from typing import Sequence

from torchweave.ops.registry import Call

LETTERS = [c for c in string.ascii_lowercase] + [f"{c}{c}" for c in string.ascii_lowercase]


def fresh(taken: set[str], count: int, prefix: str = "") -> list[str]:
    """``count`` names not in ``taken`` (and now taken)."""
    out: list[str] = []
    if count <= 0:
        return out
    for name in (prefix + c if prefix else c for c in LETTERS):
        if name not in taken:
            out.append(name)
            taken.add(name)
            if len(out) == count:
                break
    return out


def join(*tensors: Sequence[str] | str) -> str:
    """Join tensors (lists of axis strings) with ', '."""
    parts = []
    for t in tensors:
        if isinstance(t, str):
            parts.append(t)
        else:
            parts.append(" ".join(t) if t else "()")
    return ", ".join(parts)


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def dims_arg(value: object, rank: int) -> list[int]:
    """A ``dim`` argument as sorted axes; None and ``[]`` mean every axis
    (``sum(x, dim=[])`` reduces all of them, ``roll(x, s, dims=[])`` rolls the
    flattened tensor)."""
    if value is None:
        return list(range(rank))
    if isinstance(value, int):
        value = [value]
    if len(value) == 0:  # type: ignore[arg-type]
        return list(range(rank))
    return sorted(norm_dim(int(d), rank) for d in value)  # type: ignore[union-attr]


def broadcast(call: Call) -> str:
    """Elementwise ops with broadcasting; every input and output aligned right."""
    out_shape = call.outputs[0].shape
    rank = len(out_shape)
    names = LETTERS[:rank]
    ins = []
    for meta in call.inputs:
        offset = rank - len(meta.shape)
        axes = []
        for i, size in enumerate(meta.shape):
            j = i + offset
            axes.append(names[j] if size == out_shape[j] or size != 1 else "1")
        ins.append(axes)
    outs = [names for _ in call.outputs]
    return f"{join(*ins)} -> {join(*outs)}"


def reduction(call: Call, dims: list[int], keepdim: bool, mark: str = "+") -> str:
    """Reduce ``dims`` of the first input; ``mark`` is '+' or '^'."""
    rank = call.rank
    names = LETTERS[:rank]
    ins = [f"{n}{mark}" if i in dims else n for i, n in enumerate(names)]
    outs = []
    for i, n in enumerate(names):
        if i in dims:
            if keepdim:
                outs.append("1")
        else:
            outs.append(n)
    rest = ["?"] * (len(call.inputs) - 1)
    out_all = [outs] * len(call.outputs)
    return f"{join(ins, *rest)} -> {join(*out_all)}"


def frozen_axes(call: Call, dims: list[int], *, inputs: int = 1) -> str:
    """Same shape in and out; ``dims`` may not be split (softmax, cumsum, roll)."""
    names = LETTERS[: call.rank]
    axes = [f"{n}^" if i in dims else n for i, n in enumerate(names)]
    rest = ["?"] * (len(call.inputs) - inputs)
    return f"{join(*([axes] * inputs), *rest)} -> {join(*([axes] * len(call.outputs)))}"


def reshape(call: Call) -> str:
    """Match input and output axes into groups whose sizes multiply equally."""
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    taken: set[str] = set()
    ins: list[str] = []
    outs: list[str] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            ins.append("1")
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            outs.append("1")
            j += 1
            continue
        a, b = [i], [j]
        pa, pb = src[i], dst[j]
        while pa != pb:
            if pa < pb:
                i += 1
                a.append(i)
                pa *= src[i]
            else:
                j += 1
                b.append(j)
                pb *= dst[j]
        i, j = i + 1, j + 1
        _match_group(a, b, src, dst, taken, ins, outs)
    rest = ["?"] * (len(call.inputs) - 1)
    return f"{join(ins, *rest)} -> {join(outs)}"


def squeeze(call: Call) -> str:
    """``squeeze(x, dim)``: addressed size-one axes disappear.

    A piece squeezes by its own shape, so an addressed axis of size > 1 (a
    no-op for the whole; every axis for ``squeeze(x)``) may not be split: a
    piece of size one would lose it.
    """
    shape = call.inputs[0].shape
    dims = call.arg(1, "dim")
    if dims is None:
        hit = set(range(len(shape)))
    else:  # unlike a reduction's, an empty list addresses no axis
        hit = {norm_dim(d, len(shape)) for d in ([dims] if isinstance(dims, int) else dims)}
    ins: list[str] = []
    outs: list[str] = []
    for i, (name, size) in enumerate(zip(LETTERS, shape)):
        if size == 1:
            ins.append("1")
            if i not in hit:
                outs.append("1")
            continue
        axis = f"{name}^" if i in hit else name
        ins.append(axis)
        outs.append(axis)
    return f"{join(ins)} -> {join(outs)}"


def _match_group(a, b, src, dst, taken, ins, outs) -> None:
    if len(a) == 1 and len(b) == 1:
        (n,) = fresh(taken, 1)
        ins.append(n if src[a[0]] != 1 else "1")
        outs.append(n if dst[b[0]] != 1 else "1")
    elif len(a) == 1 or len(b) == 1:
        many, one_side = (b, "in") if len(a) == 1 else (a, "out")
        shape = dst if one_side == "in" else src
        names = [fresh(taken, 1)[0] if shape[k] != 1 else "1" for k in many]
        real = [n for n in names if n != "1"]
        group = real[0] if len(real) == 1 else "(" + " ".join(real) + ")"
        if one_side == "in":
            ins.append(group)
            outs.extend(names)
        else:
            outs.append(group)
            ins.extend(names)
    else:  # n axes ↔ m axes with no common split: neither side may be split
        del sa, sb
        ins.extend(f"{n}^" for n in fresh(taken, len(a)))
        outs.extend(f"{n}^" for n in fresh(taken, len(b)))


def permute(call: Call, order: Sequence[int]) -> str:
    names = LETTERS[: call.rank]
    return f"{join(names)} -> {join([names[norm_dim(k, call.rank)] for k in order])}"


def transpose(call: Call) -> str:
    rank = call.rank
    order = list(range(rank))
    a, b = norm_dim(call.arg(1, "dim0"), rank), norm_dim(call.arg(2, "dim1"), rank)
    order[a], order[b] = order[b], order[a]
    return permute(call, order)


def replace_axis(call: Call, dim: int, new_in: list[str], new_out: list[list[str]]) -> str:
    """Input axis ``dim`` and each output's axis there are given their own names."""
    names = LETTERS[: call.rank]
    ins = names[:dim] + new_in + names[dim + 1 :]
    outs = [names[:dim] + o + names[dim + 1 :] for o in new_out]
    return f"{join(ins)} -> {join(*outs)}"


def outputs_only(call: Call) -> str:
    """Factories: inputs opaque, every output axis fixed."""
    taken: set[str] = set()
    outs = [[f"{n}^" for n in fresh(taken, len(m.shape))] for m in call.outputs]
    return f"{join(*(['?'] * len(call.inputs)))} -> {join(*outs)}"


def einsum(equation: str, ranks: list[int]) -> str:
    """An einsum equation: letters kept in the output are spatial, others sum."""
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if not rhs and "->" not in eq:
        letters = [c for c in lhs if c.isalpha()]
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if "." in eq:
        raise ValueError("einsum with '...' is annotated as opaque")
    out = set(rhs)

    def axis(c: str) -> str:
        return c if c in out else f"{c}+"

    ins = [[axis(c) for c in t] for t in terms]
    return f"{join(*ins)} -> {join(list(rhs))}"


def prod(shape: Sequence[int]) -> int:
    return math.prod(shape)

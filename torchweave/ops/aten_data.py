"""Annotations of the ATen ops that routing, masking and functionalized in-place code
produce: more elementwise maths, sorting, histograms, scatters into a slice, index
selection, and the grouped matmul of mixture-of-experts layers.

Each is checked by the registry's split test on the calls of ``tests/unit/opzoo.py``.
"""

from __future__ import annotations

from torchweave.ops import rules
from torchweave.ops.registry import Call, op
from torchweave.ops.rules import LETTERS, broadcast, join, norm_dim

# elementwise: torch.min(a, b) and torch.max(a, b) are min.other / max.other; copy
# (self, src) and fill (self, value) come from functionalized ``x[...] = y`` and ``fill_``
op(["aten.min.other", "aten.max.other", "aten.floor_divide", "aten.remainder.Tensor",
    "aten.remainder.Scalar", "aten.fmod.Tensor", "aten.fmod.Scalar", "aten.floor", "aten.ceil",
    "aten.round", "aten.trunc", "aten.sign", "aten.log1p", "aten.expm1", "aten.log2",
    "aten.clamp_min", "aten.clamp_max", "aten.isnan", "aten.isinf", "aten.logical_xor",
    "aten.atan2", "aten.leaky_relu", "aten.hardtanh", "aten.elu", "aten.softplus",
    "aten.hardsigmoid", "aten.hardswish", "aten.mish"], broadcast)
op(["aten.copy", "aten.fill.Tensor", "aten.fill.Scalar"], broadcast, flops_per_point=0.0)


def _sort(call: Call) -> str:
    """``sort(x, dim)`` (values, indices) and ``argsort``: the sorted dim is whole."""
    dim = call.arg(1, "dim", -1)
    if "stable" in call.target:  # sort.stable(self, *, stable, dim, descending)
        dim = call.kwargs.get("dim", -1)
    return rules.frozen_axes(call, [norm_dim(dim, call.rank)])


op(["aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable"],
   _sort, flops_per_point=0.0)


def _histc(call: Call) -> str:
    """``histc(x, bins, min, max)``: with a fixed range, the histogram of a split input is
    the sum of its pieces' histograms. With ``min == max`` the range is the data's own
    extremes, which one piece does not know: the op stays whole."""
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if lo == hi:
        return rules.outputs_only(call)
    return f"{join([f'{n}+' for n in LETTERS[: call.rank]])} -> bins^"


op("aten.histc", _histc)


def _slice_scatter(call: Call) -> str:
    """``slice_scatter(self, src, dim, …)`` / ``select_scatter(self, src, dim, index)``:
    ``src`` written into a slice of ``self`` along ``dim`` (whole); other axes aligned."""
    dim = norm_dim(call.arg(2, "dim", 0), call.rank)
    names = LETTERS[: call.rank]
    self_ = names[:dim] + ["x^"] + names[dim + 1 :]
    src = names[:dim] + ([] if "select" in call.target else ["y^"]) + names[dim + 1 :]
    return f"{join(self_, src)} -> {join(self_)}"


op(["aten.slice_scatter", "aten.select_scatter"], _slice_scatter, flops_per_point=0.0)


def _index_select(call: Call) -> str:
    """``index_select(x, dim, index)``: ``x`` whole along ``dim``; the index splits, and
    each piece selects its own entries."""
    dim = norm_dim(call.arg(1, "dim", 0), call.rank)
    names = LETTERS[: call.rank]
    x = names[:dim] + ["x^"] + names[dim + 1 :]
    return f"{join(x, ['i'])} -> {join(names[:dim] + ['i'] + names[dim + 1:])}"


op("aten.index_select", _index_select, flops_per_point=0.0)


def _grouped_mm(call: Call) -> str:
    """Mixture-of-experts grouped matmul: ``x [s, k]`` rows grouped by ``offs [e]`` (where
    each expert's rows end), ``w [e, k, n]``. The output features split (each piece one
    slice of every expert), and the contraction into partial sums; the rows and experts
    stay whole, since ``offs`` counts rows of every expert."""
    if [len(m.shape) for m in call.inputs] != [2, 3, 1]:
        return rules.outputs_only(call)
    return "s^ k+, e^ k+ n, e^ -> s^ n"


def _grouped_flops(call: Call, bound) -> float:
    (s, k), n = call.inputs[0].shape, call.inputs[1].shape[2]
    return 2.0 * s * k * n


# torch._grouped_mm itself traces in bf16 only, so its float32 self-check cannot run here;
# transformers' float32 fallback has the same arguments (tests/unit/test_custom_ops.py)
op("transformers.grouped_mm_fallback", _grouped_mm, flops=_grouped_flops)

"""Annotations of the ATen ops that torch.export's training dialect produces."""

from __future__ import annotations

from typing import Any

import torch

from torchweave.ops import kernels, rules
from torchweave.ops.registry import Call, op
from torchweave.ops.rules import LETTERS, broadcast, join, norm_dim

# ---------------------------------------------------------------- elementwise
UNARY = [
    "aten.gelu", "aten.silu", "aten.relu", "aten.tanh", "aten.sigmoid", "aten.neg",
    "aten.rsqrt", "aten.sqrt", "aten.exp", "aten.log", "aten.sin", "aten.cos", "aten.abs",
    "aten.pow.Tensor_Scalar", "aten.clamp", "aten.reciprocal", "aten.erf", "aten.square",
    "aten.logical_not", "aten.bitwise_not", "aten.gt.Scalar", "aten.lt.Scalar",
    "aten.ge.Scalar", "aten.le.Scalar", "aten.eq.Scalar", "aten.ne.Scalar",
    "aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar",
]
BINARY = [
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.rsub.Scalar", "aten.pow.Tensor_Tensor", "aten.maximum", "aten.minimum",
    "aten.gt.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.le.Tensor", "aten.eq.Tensor",
    "aten.ne.Tensor", "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.logical_and",
    "aten.logical_or", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.where.self",
    "aten.where.ScalarOther", "aten.where.ScalarSelf",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
]
op(UNARY + BINARY, broadcast)

# Copies and casts: same axes in and out; extra tensor arguments are opaque.
def same_axes(call: Call) -> str:
    names = LETTERS[: call.rank]
    rest = ["?"] * (len(call.inputs) - 1)
    return f"{join(names, *rest)} -> {join(*([names] * len(call.outputs)))}"


def like(call: Call) -> str:
    """``type_as(x, other)``: ``other`` gives only its dtype."""
    names = LETTERS[: call.rank]
    rest = ["*"] * (len(call.inputs) - 1)
    return f"{join(names, *rest)} -> {join(names)}"


op(["aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten._to_copy",
    "aten.contiguous", "aten.clone", "aten.alias", "aten.detach", "aten.lift_fresh_copy",
    "aten.zeros_like", "aten.ones_like", "aten.full_like"],
   same_axes, flops_per_point=0.0)
op("aten.type_as", like, flops_per_point=0.0)
op(["aten.dropout", "aten.rand_like", "aten.randn_like"], same_axes, random=True)


# ---------------------------------------------------------------- contractions
def _linear(call: Call) -> str:
    return "... k+, n k+ -> ... n" if len(call.inputs) == 2 else "... k^, n k^, n -> ... n"


def _matmul(call: Call) -> str:
    (sa, sb), out = (m.shape for m in call.inputs), call.outputs[0].shape
    if len(sa) == 1 or len(sb) == 1:
        return _matvec(len(sa), len(sb))
    names = LETTERS[: len(out) - 2]
    la = names[len(names) - (len(sa) - 2) :] + ["m", "k+"]
    rb = names[len(names) - (len(sb) - 2) :] + ["k+", "n"]
    return f"{join(_ones(la, sa, out, 2), _ones(rb, sb, out, 2))} -> {join(names + ['m', 'n'])}"


def _ones(axes: list[str], shape, out_shape, tail: int) -> list[str]:
    """Broadcast batch axes of size one become '1'."""
    off = len(out_shape) - len(shape)
    return [
        "1" if i < len(axes) - tail and shape[i] == 1 and out_shape[i + off] != 1 else a
        for i, a in enumerate(axes)
    ]


def _matvec(a: int, b: int) -> str:
    if a == 1 and b == 1:
        return "k+, k+ -> ()"
    if a == 1:
        batch = LETTERS[: b - 2]
        return f"{join(['k+'])}, {join(batch + ['k+', 'n'])} -> {join(batch + ['n'])}"
    batch = LETTERS[: a - 2]
    return f"{join(batch + ['m', 'k+'])}, k+ -> {join(batch + ['m'])}"


op("aten.linear", _linear, flops_per_point=2.0)
op(["aten.matmul", "aten.bmm", "aten.mm"], _matmul, flops_per_point=2.0)
op("aten.einsum", lambda c: rules.einsum(c.arg(0, "equation"), [len(m.shape) for m in c.inputs]),
   flops_per_point=2.0)


def _addmm(call: Call) -> str:
    """``beta * bias + alpha * (a @ b)``; the bias broadcasts against ``m n``.

    Capture turns plain addmm into mm + add; this is addmm with beta or alpha.
    Its contraction may not be split: every piece would add the bias.
    """
    out = call.outputs[0].shape
    off = len(out) - len(call.inputs[0].shape)
    bias = [n if size == out[i + off] else "1"
            for i, (n, size) in enumerate(zip(["m", "n"][off:], call.inputs[0].shape))]
    return f"{join(bias)}, m k^, k^ n -> m n"


op("aten.addmm", _addmm, flops_per_point=2.0)


def _conv(call: Call) -> str:
    groups = call.arg(6, "groups", 1)
    c = "c^" if len(call.inputs) == 3 or groups != 1 else "c+"
    o = "o" if groups == 1 else "o^"
    cw = c if groups == 1 else "cg^"  # a grouped weight holds c / groups input channels
    spatial = len(call.inputs[0].shape) - 2
    hs = [f"h{i}^" for i in range(spatial)]
    ks = [f"k{i}^" for i in range(spatial)]
    os_ = [f"q{i}^" for i in range(spatial)]
    bias = f", {o}" if len(call.inputs) == 3 else ""
    return f"n {c} {' '.join(hs)}, {o} {cw} {' '.join(ks)}{bias} -> n {o} {' '.join(os_)}"


def _conv_flops(call: Call, bound: Any) -> float:
    w = call.inputs[1].shape
    return 2.0 * call.outputs[0].numel * (w[1] * torch.Size(w[2:]).numel())


op("aten.conv2d", _conv, flops=_conv_flops)
op("aten.conv1d", _conv, flops=_conv_flops)


# ---------------------------------------------------------------- attention
def _sdpa(call: Call) -> str:
    causal = bool(call.arg(5, "is_causal", False))
    gqa = bool(call.kwargs.get("enable_gqa", False)) and call.inputs[0].shape[1] != call.inputs[1].shape[1]
    s = "s^" if causal else "s"
    hq = "(h g)" if gqa else "h"
    q, k, v = f"b {hq} {s} d^", "b h t^ d^", "b h t^ e"
    out = f"b {hq} {s} e"
    if len(call.inputs) == 4:
        m = call.inputs[3].shape
        names = ["b", "h", s, "t^"][4 - len(m):]
        full = call.inputs[0].shape[:2] + (call.inputs[0].shape[2], call.inputs[1].shape[2])
        off = 4 - len(m)
        mask = ["1" if size == 1 and full[i + off] != 1 else n for i, (n, size) in enumerate(zip(names, m))]
        if gqa and "h" in mask:
            mask = [("1" if x == "h" else x) for x in mask]
        return f"{q}, {k}, {v}, {' '.join(mask)} -> {out}"
    return f"{q}, {k}, {v} -> {out}"


def _sdpa_flops(call: Call, bound: Any) -> float:
    b, h, s, d = call.inputs[0].shape
    t, e = call.inputs[1].shape[2], call.inputs[2].shape[3]
    return 2.0 * b * h * s * t * (d + e) + 5.0 * b * h * s * t


op("aten.scaled_dot_product_attention", _sdpa, flops=_sdpa_flops)


# ---------------------------------------------------------------- normalization, softmax
def _layer_norm(call: Call) -> str:
    rank = call.rank
    k = len(call.arg(1, "normalized_shape"))
    names = LETTERS[:rank]
    norm = [f"{n}^" for n in names[rank - k :]]
    x = names[: rank - k] + norm
    params = [norm] * (len(call.inputs) - 1)
    return f"{join(x, *params)} -> {join(x)}"


op("aten.layer_norm", _layer_norm, flops_per_point=8.0)
op("aten.rms_norm", _layer_norm, flops_per_point=6.0)
op(["aten.softmax.int", "aten.log_softmax.int", "aten._softmax", "aten._log_softmax"],
   lambda c: rules.frozen_axes(c, [norm_dim(c.arg(1, "dim"), c.rank)]), flops_per_point=5.0)
op(["aten.cumsum", "aten.cumprod"],
   lambda c: rules.frozen_axes(c, [norm_dim(c.arg(1, "dim"), c.rank)]))


def _cross_entropy(call: Call) -> str:
    reduction = call.arg(3, "reduction", 1)
    extra = ", c^" if len(call.inputs) == 3 else ""
    x, t = ("n c^", "n") if call.rank == 2 else ("c^", "()")
    if call.rank > 2:
        rest = " ".join(LETTERS[: call.rank - 2])
        x, t = f"n c^ {rest}", f"n {rest}"
    if reduction == 0:
        return f"{x}, {t}{extra} -> {t}"
    if reduction == 2:
        x2, t2 = x.replace("n", "n+", 1), t.replace("n", "n+", 1)
        for ch in LETTERS[: max(call.rank - 2, 0)]:
            x2, t2 = x2.replace(f" {ch}", f" {ch}+"), t2.replace(f" {ch}", f" {ch}+")
        return f"{x2}, {t2}{extra} -> ()"
    frozen = x.replace("n", "n^", 1)
    return f"{frozen}, {t.replace('n', 'n^', 1)}{extra} -> ()"


op("aten.cross_entropy_loss", _cross_entropy, flops_per_point=5.0)


# ---------------------------------------------------------------- reductions
def _sum(call: Call, mark: str = "+") -> str:
    dims = rules.dims_arg(call.arg(1, "dim"), call.rank)
    return rules.reduction(call, dims, bool(call.arg(2, "keepdim", False)), mark)


op(["aten.sum.dim_IntList", "aten.sum.default"], _sum)
op(["aten.mean.dim", "aten.mean.default"], _sum, partial="avg")
op("aten.logsumexp", _sum, partial="lse", flops_per_point=3.0)


def _gather(call: Call) -> str:
    """``x.gather(dim, index)``: split the gathered dim and each piece gathers
    only the indices it holds (zeros elsewhere): partial sums."""
    dim = norm_dim(call.arg(1, "dim"), call.rank)
    xs, idx = call.inputs[0].shape, call.inputs[1].shape
    x, i = [], []
    for d, (a, b) in enumerate(zip(xs, idx)):
        if d == dim:
            x.append("c+")
            i.append("i^")
        elif a == b:
            x.append(LETTERS[d])
            i.append(LETTERS[d])
        else:
            x.append(f"x{d}^")
            i.append(f"i{d}^")
    return f"{join(x, i)} -> {join(i)}"


op("aten.gather", _gather, flops_per_point=0.0, local=kernels.gather_local)
op(["aten.amax", "aten.amin", "aten.argmax", "aten.argmin", "aten.max.dim", "aten.min.dim",
    "aten.var.correction", "aten.std.correction", "aten.all", "aten.any"],
   lambda c: _sum(c, "^"))
# var.dim / std.dim(self, dim, unbiased, keepdim): keepdim is the fourth argument.
op(["aten.var.dim", "aten.std.dim"], lambda c: rules.reduction(
    c, rules.dims_arg(c.arg(1, "dim"), c.rank), bool(c.arg(3, "keepdim", False)), "^"))
op("aten.topk", lambda c: rules.replace_axis(
    c, norm_dim(c.arg(2, "dim", -1), c.rank), ["x^"], [["y^"], ["y^"]]))


# ---------------------------------------------------------------- views and shapes
op(["aten.view", "aten.reshape", "aten._unsafe_view"], rules.reshape, shape_arg=(1, "size"),
   flops_per_point=0.0)
op("aten.flatten.using_ints", rules.reshape, flops_per_point=0.0)
op("aten.unsqueeze", rules.reshape, flops_per_point=0.0)
op("aten.squeeze", rules.squeeze, flops_per_point=0.0)
op("aten.transpose.int", rules.transpose, flops_per_point=0.0)
op("aten.t", lambda c: rules.permute(c, list(range(c.rank))[::-1]), flops_per_point=0.0)
op("aten.permute", lambda c: rules.permute(c, c.arg(1, "dims")), flops_per_point=0.0)


def _expand(call: Call) -> str:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    off = len(dst) - len(src)
    names = LETTERS[: len(dst)]
    ins = [names[i + off] if s == dst[i + off] else "1" for i, s in enumerate(src)]
    return f"{join(ins)} -> {join(names)}"


op("aten.expand", _expand, shape_arg=(1, "size"), flops_per_point=0.0)


def _repeat_interleave(call: Call) -> str:
    dim = call.arg(2, "dim")
    rank = call.rank
    if dim is None or len(call.inputs) != 1:
        return rules.outputs_only(call)
    dim = norm_dim(dim, rank)
    names = LETTERS[:rank]
    out = names[:dim] + [f"({names[dim]} rr^)"] + names[dim + 1 :]
    return f"{join(names)} -> {join(out)}"


op("aten.repeat_interleave.self_int", _repeat_interleave)


def _axis_op(dim_index: int, dim_name: str = "dim"):
    """Ops that change one axis (slice, select, pad one dim): it is fixed on both sides."""

    def rule(call: Call) -> str:
        dim = norm_dim(call.arg(dim_index, dim_name, 0), call.rank)
        drop = len(call.outputs[0].shape) < call.rank
        return rules.replace_axis(call, dim, ["x^"], [[] if drop else ["y^"]] * len(call.outputs))

    return rule


op("aten.slice.Tensor", _axis_op(1), flops_per_point=0.0)
op("aten.select.int", _axis_op(1), flops_per_point=0.0)
op("aten.narrow", _axis_op(1), flops_per_point=0.0)
def _diff(call: Call) -> str:
    dim = norm_dim(call.arg(2, "dim", -1), call.rank)
    names = LETTERS[: call.rank]
    extra = [names[:dim] + [f"p{i}^"] + names[dim + 1 :] for i in range(len(call.inputs) - 1)]
    x = names[:dim] + ["x^"] + names[dim + 1 :]
    return f"{join(x, *extra)} -> {join(names[:dim] + ['y^'] + names[dim + 1:])}"


op("aten.diff", _diff)
op(["aten.split.Tensor", "aten.split_with_sizes", "aten.chunk", "aten.unbind.int"],
   lambda c: rules.replace_axis(
       c, norm_dim(c.arg(2 if "chunk" not in c.target else 2, "dim", 0) if "unbind" not in c.target
                   else c.arg(1, "dim", 0), c.rank),
       ["x^"],
       [[f"y{i}^"] if len(m.shape) == c.rank else [] for i, m in enumerate(c.outputs)]),
   flops_per_point=0.0)


def _roll(call: Call) -> str:
    return rules.frozen_axes(call, rules.dims_arg(call.arg(2, "dims"), call.rank))


op("aten.roll", _roll, flops_per_point=0.0)


def _pad(call: Call) -> str:
    pad = call.arg(1, "pad")
    dims = [call.rank - 1 - i for i in range(len(pad) // 2)]
    names = LETTERS[: call.rank]
    ins = [f"{n}^" if i in dims else n for i, n in enumerate(names)]
    outs = [f"p{n}^" if i in dims else n for i, n in enumerate(names)]
    return f"{join(ins)} -> {join(outs)}"


op(["aten.pad", "aten.constant_pad_nd"], _pad, flops_per_point=0.0)


def _cat(call: Call) -> str:
    rank = len(call.outputs[0].shape)
    dim = norm_dim(call.arg(1, "dim", 0), rank)
    names = LETTERS[:rank]
    if "stack" in call.target:
        ins = [names[:dim] + names[dim + 1 :] for _ in call.inputs]
        return f"{join(*ins)} -> {join(names[:dim] + ['z^'] + names[dim + 1:])}"
    # torch.cat skips a 1-D empty input whatever the rank of the others (an empty KV
    # cache, say): it gets a dim of its own, never split
    ins = [[f"e{i}^"] if tuple(m.shape) == (0,) and rank != 1 else
           names[:dim] + [f"x{i}^"] + names[dim + 1 :] for i, m in enumerate(call.inputs)]
    return f"{join(*ins)} -> {join(names[:dim] + ['z^'] + names[dim + 1:])}"


op(["aten.cat", "aten.stack"], _cat, flops_per_point=0.0)


def _index(call: Call) -> str:
    """``x[idx0, idx1, …]``: indexed axes fixed; trailing axes shared with x."""
    indices = call.arg(1, "indices")
    k = len(indices)
    if any(i is None for i in indices):
        return rules.outputs_only(call)
    rank = call.rank
    names = LETTERS[:rank]
    x = [f"{n}^" for n in names[:k]] + names[k:]
    lead = len(call.outputs[0].shape) - (rank - k)
    out = [f"i{j}^" for j in range(lead)] + names[k:]
    return f"{join(x, *(['?'] * (len(call.inputs) - 1)))} -> {join(out)}"


op("aten.index.Tensor", _index, flops_per_point=0.0)
op(["aten.arange", "aten.zeros", "aten.ones", "aten.full", "aten.empty", "aten.scalar_tensor",
    "aten.scatter", "aten.scatter_add", "aten.repeat"],
   rules.outputs_only, flops_per_point=0.0)
op(["aten.new_ones", "aten.new_zeros", "aten.new_full", "aten.new_empty"],
   lambda c: rules.outputs_only(c).replace("?", "*", 1), flops_per_point=0.0)
op(["aten.triu", "aten.tril"], lambda c: rules.frozen_axes(c, [c.rank - 2, c.rank - 1]))


def _one_hot(call: Call) -> str:
    names = LETTERS[: call.rank]
    return f"{join(names)} -> {join(names + ['cls^'])}"


op("aten.one_hot", _one_hot, flops_per_point=0.0)


# ---------------------------------------------------------------- embedding
op("aten.embedding", "v+ d, ... -> ... d", flops_per_point=0.0, local=kernels.vocab_local)

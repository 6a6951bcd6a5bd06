"""What autograd saves for backward, per op: the simulator's activation memory.

An op's backward needs some of its forward tensors; only those stay alive
between forward and backward. The rule, by op (overload packet):

=====================================  =============================================
op                                     saved
=====================================  =============================================
views (``view``, ``transpose``, …),    nothing (and a view shares its input's
``add``, ``sub``, ``neg``, ``cat``,    storage)
``to``/casts, ``clone``, ``sum``,
``mean``, ``expand``, ``arange``, ops
with no floating output (``ne``, …),
``dropout`` with ``p = 0`` or in eval
contractions: ``linear``, ``matmul``,  the tensor inputs
``mm``, ``bmm``, ``addmm``,
``einsum``, ``conv*``
``embedding``, ``gather``,             the index input (an integer tensor)
``index_select``
``scaled_dot_product_attention``       the inputs, the output and the row
                                       log-sum-exp (fp32, one per query row:
                                       flash kernels, CPU and GPU)
``layer_norm``, ``rms_norm``,          the input, plus fp32 mean and 1/std per row
``group_norm``
elementwise nonlinear: ``gelu``,       the input
``silu``, ``relu``, ``tanh``,
``sigmoid``, ``sin``, ``cos``,
``log``, ``rsqrt``, ``pow``…
``exp``, ``softmax``, ``log_softmax``  the output
``logsumexp``                          the input and the output
``mul``, ``div`` (two tensors)         each input that the *other* input's
                                       gradient needs (``mul``: a, b; ``div``:
                                       the divisor, and the dividend when the
                                       divisor carries a gradient)
``dropout`` with ``p > 0``             a mask of the output's size (1 byte a
                                       value: CUDA's bool mask; the CPU kernel
                                       keeps a full-precision one)
anything else with a floating output   its floating tensor inputs (conservative)
=====================================  =============================================

Parameters are not activations (they are counted as model state) and a value
saved by several consumers, or saved through several views of one storage,
counts once: :mod:`torchweave.sim.step.build` adds up distinct storages.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchweave.ir.graph import Graph, Node

_NONE = frozenset({
    "add", "add_", "sub", "rsub", "neg", "cat", "stack", "to", "_to_copy", "clone",
    "contiguous", "sum", "mean", "expand", "arange", "zeros", "ones", "full", "copy",
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "unflatten", "flatten", "alias", "detach",
    "as_strided", "chunk", "unbind", "narrow", "repeat", "pad", "constant_pad_nd",
})
_INPUTS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d",
                     "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d"})
_INDEX = {"embedding": 1, "gather": 2, "index_select": 2}  # position of the index argument
_NORM = frozenset({"layer_norm", "rms_norm", "group_norm", "native_layer_norm"})
_OUTPUT = frozenset({"exp", "softmax", "_softmax", "log_softmax", "_log_softmax"})
_IN_OUT = frozenset({"logsumexp"})
_ATTENTION = frozenset({"scaled_dot_product_attention"})

ALIAS_OPS = frozenset({
    "view", "_unsafe_view", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "unflatten", "flatten", "alias", "detach",
    "as_strided", "chunk", "unbind", "narrow",
})
"""Ops whose outputs share their first input's storage."""
STRIDING_OPS = frozenset({"transpose", "t", "permute", "expand"})
"""Views that leave a non-contiguous tensor (a later ``reshape`` copies it)."""


def packet(node: Node) -> str:
    """``aten.linear.default`` → ``linear``."""
    parts = node.target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


@dataclass(frozen=True)
class Saves:
    """What one op keeps for its backward."""

    inputs: tuple[int, ...] = ()
    """Positions in ``node.input_refs()`` (parameters among them are dropped later)."""
    outputs: tuple[int, ...] = ()
    extra: float = 0.0
    """Further bytes (statistics, masks) per byte of the first output."""


def saves(graph: Graph, node: Node) -> Saves:
    """What ``node``'s backward needs from its forward (the table above)."""
    op = packet(node)
    refs = node.input_refs()
    metas = [graph.values[r.name].meta for r in refs]
    outs = [graph.values[o].meta for o in node.outputs]
    floating = [i for i, m in enumerate(metas) if m.dtype.is_floating_point]
    if op in _NONE or not any(m.dtype.is_floating_point for m in outs):
        return Saves()
    if op in _INPUTS:
        return Saves(inputs=tuple(range(len(refs))))
    if op in _INDEX:
        return Saves(inputs=tuple(i for i, m in enumerate(metas) if not m.dtype.is_floating_point))
    if op in _ATTENTION:
        o = outs[0]
        head = o.shape[-1] if o.shape else 1
        return Saves(inputs=tuple(floating), outputs=(0,), extra=4 / (head * o.dtype.itemsize))
    if op in _NORM:
        o = outs[0]
        normalized = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else [1]
        per_row = 1
        for s in normalized:
            per_row *= int(s)
        return Saves(inputs=tuple(floating[:1]), extra=2 * 4 / (per_row * o.dtype.itemsize))
    if op in _OUTPUT:
        return Saves(outputs=(0,))
    if op in _IN_OUT:
        return Saves(inputs=tuple(floating[:1]), outputs=(0,))
    if op == "dropout":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if not p or not train:
            return Saves()
        return Saves(extra=1 / outs[0].dtype.itemsize)
    if op in ("mul", "div"):
        if len(refs) < 2:  # times a scalar: nothing
            return Saves()
        grad = [m.dtype.is_floating_point for m in metas[:2]]
        if op == "mul":  # d(a*b)/da = b, d(a*b)/db = a
            return Saves(inputs=tuple(i for i in (0, 1) if grad[1 - i]))
        return Saves(inputs=((0, 1) if grad[1] else (1,)))
    return Saves(inputs=tuple(floating))

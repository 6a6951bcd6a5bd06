"""Fused bias in generated code: ``linear(x, w)`` then ``add(·, b)`` written as ``linear(x, w, b)``.

Capture splits every biased ``linear`` (and ``addmm``) into the product and a
separate bias ``add`` (:mod:`torchweave.capture.normalize`), so that a plan may
split the contraction dimension and add the bias once, after the sum. Where a
rank's program adds the bias straight onto its own product, with nothing in
between, the two are one fused call again: ``addmm`` on the CPU, the cuBLAS
epilogue on a GPU, one kernel and one pass over the output fewer.

This is a rendering choice only. The Program keeps both nodes (the simulator
costs them, :func:`torchweave.lower.check.check_program` checks them), and the
fused call computes the same sum: ``x @ w.T + b`` broadcast over the rows, the
bias gradient the same row sum. A contraction-split plan has a collective
between the product and the add, so its pair is never fused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from torchweave.lower.program import Compute, Free, Instr, LocalRef, Program
from torchweave.lower.stages import reads

PAIRS = {
    # product fn -> (suffix capture gives the product's node, fused fn, fused argument order)
    "aten.linear.default": ("_nobias", "aten.linear.default", lambda x, w, b: (x, w, b)),
    "aten.mm.default": ("_mm", "aten.addmm.default", lambda x, w, b: (b, x, w)),
}


def _group_key(prog: Program, ins: Compute) -> object:
    """What decides the recompute run or co-shard piece an instruction renders in."""
    if ins.chunk is not None:
        return ("co-shard", *ins.chunk)
    return next((k for k, group in enumerate(prog.recompute) if ins.node in group), None)


def _pair(prog: Program, instrs: list[Instr], i: int, keep: set[str],
          uses: Counter[str]) -> int | None:
    """The index of the bias add that fuses with the product at ``i``, or None."""
    mm = instrs[i]
    if not isinstance(mm, Compute) or mm.fn not in PAIRS or mm.aux or mm.kwargs \
            or len(mm.args) != 2 or len(mm.outputs) != 1 or mm.structure != "single":
        return None
    y = mm.outputs[0]
    suffix = PAIRS[mm.fn][0]
    if not y or y in keep or not mm.node.endswith(suffix) or uses[y] != 1:
        return None
    j = next(j for j in range(i + 1, len(instrs)) if y in reads(instrs[j]))
    add = instrs[j]
    if not isinstance(add, Compute) or add.fn != "aten.add.Tensor" or add.aux or add.kwargs \
            or add.node + suffix != mm.node or len(add.args) != 2 or add.args[0] != LocalRef(y) \
            or not isinstance(add.args[1], LocalRef) or add.structure != "single":
        return None
    if _group_key(prog, mm) != _group_key(prog, add):
        return None
    return j


def fuse_bias(prog: Program, instrs: list[Instr], keep: set[str]) -> list[Instr]:
    """``instrs`` with each fusable product and bias add as one call at the add's place.

    Frees between the two of the product's inputs move to just after the fused call;
    the product's own output no longer exists and leaves its ``del``.
    """
    out = list(instrs)
    uses = Counter(n for ins in out for n in reads(ins))
    i = 0
    while i < len(out):
        j = _pair(prog, out, i, keep, uses)
        if j is None:
            i += 1
            continue
        mm, add = out[i], out[j]
        y = mm.outputs[0]
        x, w = mm.args
        _, fn, order = PAIRS[mm.fn]
        fused = replace(add, fn=fn, args=order(x, w, add.args[1]),
                        comment=f"{mm.comment}  + bias" if mm.comment else add.comment)
        moved = set(reads(mm))
        late: list[str] = []
        for k in range(i + 1, j):
            ins = out[k]
            if isinstance(ins, Free) and moved & set(ins.names):
                late += [n for n in ins.names if n in moved]
                rest = tuple(n for n in ins.names if n not in moved)
                out[k] = Free(rest) if rest else None
        out[j] = fused
        for k in range(j + 1, len(out)):
            ins = out[k]
            if isinstance(ins, Free) and y in ins.names:
                rest = tuple(n for n in ins.names if n != y)
                out[k] = Free(rest) if rest else None
        if late:
            after = out[j + 1] if j + 1 < len(out) else None
            if isinstance(after, Free):
                out[j + 1] = Free(tuple(sorted(set(late) | set(after.names))))
            else:
                out.insert(j + 1, Free(tuple(sorted(set(late)))))
        out[i] = None
        out = [ins for ins in out if ins is not None]  # out[i] is now what followed the product
    return out

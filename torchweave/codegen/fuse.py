"""Fused calls in generated code: a bias, and a cross-entropy.

``linear(x, w)`` then ``add(·, b)`` is written as ``linear(x, w, b)``
(:func:`fuse_bias`); a cross-entropy captured as nine ops, as one
``cross_entropy_loss`` (:func:`fuse_cross_entropy`).

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


def _place(out: list[Instr | None], between: range, at: int, fused: Compute, *,
           moved: set[str], gone: set[str]) -> None:
    """Put ``fused`` at ``at``: the ``del`` of a name in ``moved`` found ``between`` goes to
    just after it, and names in ``gone`` (no longer made) leave every ``del`` (``None``
    stands for an instruction removed)."""
    late: list[str] = []
    for k in between:
        ins = out[k]
        if isinstance(ins, Free):
            late += [n for n in ins.names if n in moved]
            rest = tuple(n for n in ins.names if n not in moved and n not in gone)
            out[k] = Free(rest) if rest else None
    out[at] = fused
    for k in range(at + 1, len(out)):
        ins = out[k]
        if isinstance(ins, Free) and gone & set(ins.names):
            rest = tuple(n for n in ins.names if n not in gone)
            out[k] = Free(rest) if rest else None
    if late:
        after = out[at + 1] if at + 1 < len(out) else None
        if isinstance(after, Free):
            out[at + 1] = Free(tuple(sorted(set(late) | set(after.names))))
        else:
            out.insert(at + 1, Free(tuple(sorted(set(late)))))


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
        _place(out, range(i + 1, j), j, fused, moved=set(reads(mm)), gone={y})
        out[i] = None
        out = [ins for ins in out if ins is not None]  # out[i] is now what followed the product
    return out


# --------------------------------------------------------------------------- cross-entropy
CHAIN = ("lse", "valid", "safe", "index", "picked", "target_logit", "each", "kept", "sum")
"""The nodes capture writes a cross-entropy as (:mod:`torchweave.capture.normalize`), by
the suffix each name ends in: ``sum((logsumexp(x, 1) - gather(x, 1, t·valid)) · valid)``
with ``valid = t != ignore_index`` (under ``reduction="sum"`` the sum is the loss's own
node, named without a suffix)."""

_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _chain(instrs: list[Instr], i: int, keep: set[str], uses: Counter[str],
           prog: Program) -> dict[str, int] | None:
    """The positions of a whole cross-entropy chain starting at its ``logsumexp`` at ``i``,
    where each step reads only what the chain made, nothing else reads its values, and all
    run in one place (no recompute run or co-shard piece apart); else None."""
    lse = instrs[i]
    if not isinstance(lse, Compute) or lse.fn != "aten.logsumexp.default" \
            or not lse.node.endswith("_lse"):
        return None
    prefix = lse.node[:-len("_lse")]
    at: dict[str, int] = {}
    for j in range(len(instrs)):
        ins = instrs[j]
        if isinstance(ins, Compute) and ins.node.startswith(prefix + "_"):
            part = ins.node[len(prefix) + 1:]
            if part in CHAIN and part not in at:
                at[part] = j
    if "sum" not in at:  # reduction="sum": the loss's own node is the sum
        at.update({"sum": j for j, ins in enumerate(instrs) if isinstance(ins, Compute)
                   and ins.node == prefix and ins.fn == "aten.sum.default"})
    if len(at) != len(CHAIN):
        return None
    c = {part: instrs[j] for part, j in at.items()}
    if any(ins.aux or ins.structure != "single" or len(ins.outputs) != 1 or not ins.outputs[0]
           or _group_key(prog, ins) != _group_key(prog, lse) for ins in c.values()):
        return None
    if at["sum"] != max(at.values()):
        return None
    out = {part: LocalRef(ins.outputs[0]) for part, ins in c.items()}
    x = lse.args[0] if lse.args else None
    t = c["valid"].args[0] if c["valid"].args else None
    shapes = [
        (lse, "aten.logsumexp.default", (x, [1], False)),
        (c["valid"], "aten.ne.Scalar", (t, c["valid"].args[1] if len(c["valid"].args) == 2 else None)),
        (c["safe"], "aten.mul.Tensor", (t, out["valid"])),
        (c["index"], "aten.unsqueeze.default", (out["safe"], 1)),
        (c["picked"], "aten.gather.default", (x, 1, out["index"])),
        (c["each"], "aten.sub.Tensor", (out["lse"], out["target_logit"])),
        (c["kept"], "aten.mul.Tensor", (out["each"], out["valid"])),
        (c["sum"], "aten.sum.default", (out["kept"],)),
    ]
    if not isinstance(x, LocalRef) or not isinstance(t, LocalRef) \
            or not isinstance(c["valid"].args[-1], int) or isinstance(c["valid"].args[-1], bool):
        return None
    for ins, fn, args in shapes:
        if ins.fn != fn or tuple(ins.args) != args or ins.kwargs:
            return None
    view = c["target_logit"]
    if view.fn not in _VIEWS or len(view.args) != 2 or view.args[0] != out["picked"] or view.kwargs:
        return None
    reads_of = {"lse": 1, "safe": 1, "index": 1, "picked": 1, "target_logit": 1, "each": 1,
                "kept": 1}
    for part, n in reads_of.items():
        name = c[part].outputs[0]
        if name in keep or uses[name] != n:
            return None
    if uses[c["valid"].outputs[0]] > 2 or c["valid"].outputs[0] in keep:
        del at["valid"]  # read elsewhere too (a count of the targets): it stays
    return at


def fuse_cross_entropy(prog: Program, instrs: list[Instr], keep: set[str]) -> list[Instr]:
    """``instrs`` with each whole cross-entropy chain as one ``cross_entropy_loss`` call
    (reduction sum, the chain's ``ignore_index``) at the place of its sum.

    Capture writes a cross-entropy as nine ops so that a plan may split the classes (the
    ``logsumexp`` and the picked logit then meet a sum over ranks); where a rank's program
    runs the nine on its own rows with nothing between, one fused call computes the same
    sum: ``log_softmax`` and ``nll_loss`` in one pass each way, where the chain makes the
    class-wide ``x - logsumexp`` and its ``exp`` in backward and a scatter of the picked
    logits' gradient apart. The Program keeps the nine nodes (the simulator costs them).
    Frees of the logits or targets inside the chain move to just after the fused call.
    """
    out = list(instrs)
    uses = Counter(n for ins in out for n in reads(ins))
    i = 0
    while i < len(out):
        at = _chain(out, i, keep, uses, prog)
        if at is None:
            i += 1
            continue
        lse, total, safe = out[at["lse"]], out[at["sum"]], out[at["safe"]]
        x, t = lse.args[0], safe.args[0]
        ignore = next(ins.args[1] for ins in out if isinstance(ins, Compute)
                      and ins.outputs and LocalRef(ins.outputs[0]) == safe.args[1])
        gone = {out[j].outputs[0] for part, j in at.items() if part != "sum"}
        fused = replace(total, fn="aten.cross_entropy_loss.default",
                        args=(x, t, None, 2, ignore),
                        comment=f"{total.comment}  (the cross-entropy's {len(CHAIN)} ops in one)"
                        if total.comment else total.comment)
        for part, j in at.items():
            if part != "sum":
                out[j] = None
        _place(out, range(min(at.values()), at["sum"]), at["sum"], fused,
               moved={x.name, t.name}, gone=gone)
        out = [ins for ins in out if ins is not None]
        uses = Counter(n for ins in out for n in reads(ins))
    return out

"""A parameter read on several pipeline ranks: a copy on each (``Lowering._plan_params``).

Megatron-LM keeps the word embedding on its first and its last stage and sums the two
gradients once a step; lowering does the same for any parameter whose readers sit on
disjoint pipeline ranks (a tied embedding and LM head, T5's shared embedding), instead of
sending it whole with every micro-batch.
"""

from __future__ import annotations

from torchweave.ir.graph import Graph
from torchweave.lower.derive import Need, derive
from torchweave.lower.sums import sum_groups
from torchweave.plan.layout import Piece
from torchweave.plan.plan import Plan


def stage_copies(graph: Graph, plan: Plan, name: str, held: dict[int, Piece],
                 all_needs: list[dict[int, Need]]):
    """Where a pipeline's later stages read a parameter its first reader's stage holds (a
    tied embedding and LM head, a shared embedding of an encoder and a decoder), each of
    those stages' devices keeps a copy of the piece it reads, as Megatron-LM keeps the word
    embedding on its last stage: nothing moves with each micro-batch, and one sum over every
    holder of a piece, in the bucketed gradient sync, makes their gradients equal.

    ``(held, gradient groups)``, or ``None`` where the readers do not allow it (a reader
    that shares some devices with another but not all; a piece that then still needs a
    step; holders that cannot be grouped evenly; a buffer written in place)."""
    v = graph.values[name]
    shape = v.meta.shape
    if plan.pipeline is None or len(all_needs) < 2 or (
            v.kind == "buffer" and name in graph.meta.get("mutated_buffers", ())):
        return None
    full, blocks = dict(held), [set(held)]
    for needs in all_needs[1:]:
        inside = [d in full for d in needs]
        if all(inside):
            continue
        if any(inside):
            return None
        full.update({d: Piece(n.box) for d, n in needs.items()})
        blocks.append(set(needs))
    if len(blocks) == 1:
        return None
    if any(derive(shape, full, needs, defer_grad_sum=True).steps for needs in all_needs):
        return None
    # a device's gradient adds every reader's piece it runs: holders of one box whose
    # sets of pieces differ are summed together (sums.sum_groups, over the readers at once)
    if not (v.kind == "param" and v.requires_grad):
        return full, ()  # no gradient: each copy is the model's own tensor, never summed
    ids: dict[int, set] = {}
    for i, needs in enumerate(all_needs):
        for d, n in needs.items():
            ids.setdefault(d, set()).add((i, n.piece_id))
    groups = sum_groups({d: Need(full[d].box, frozenset(ids[d])) for d in full})
    # every holder is summed, with a holder of each copy (else copies would drift), and
    # no reader's piece twice (a replicated reader's whole contribution on two members)
    if not groups or {d for g in groups for d in g} != set(full) or \
            any(not set(g) & b for g in groups for b in blocks):
        return None
    for g in groups:
        pieces = [x for d in g for x in ids[d]]
        if len(pieces) != len(set(pieces)):
            return None
    return full, groups


__all__ = ["stage_copies"]

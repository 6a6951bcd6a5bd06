"""Backward split in two, for zero-bubble schedules: input gradients now, weight gradients later.

``I`` runs backward from the stage's roots to its inputs only. On the way it
passes every *frontier* node: a node on a path to the inputs with an edge
that leads only to parameters (a matmul, whose weight gradient is not needed
yet). A hook keeps the gradient each frontier node receives. ``W`` then runs
backward from those nodes, with those gradients, to the parameters: the
weight gradients, and nothing on the input path is computed twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node of ``t``; for a leaf, its AccumulateGrad node."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


class SplitBackward:
    """``I`` at construction; :meth:`weights` is ``W``."""

    def __init__(self, roots: list[torch.Tensor], grads: list[torch.Tensor],
                 inputs: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        to_input = {_grad_node(t) for t in inputs}
        to_param = {_grad_node(p) for p in self.params}
        reach_in: dict[Any, bool] = {}
        reach_param: dict[Any, bool] = {}
        self.parents: dict[Any, int] = {}  # node -> edges into it

        def walk(node: Any) -> None:
            stack = [(node, False)]
            while stack:
                n, done = stack.pop()
                if n in reach_in and not done:
                    continue
                children = [c for c, _ in n.next_functions if c is not None]
                if not done:
                    reach_in.setdefault(n, n in to_input)
                    reach_param.setdefault(n, n in to_param)
                    stack.append((n, True))
                    stack.extend((c, False) for c in children if c not in reach_in)
                    for c in children:
                        self.parents[c] = self.parents.get(c, 0) + 1
                    continue
                reach_in[n] = n in to_input or any(reach_in[c] for c in children)
                reach_param[n] = n in to_param or any(reach_param[c] for c in children)

        nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
        for n in nodes:
            walk(n)
        for r in roots:  # a root is a way in too (a stage that sends on a weight, or w.t())
            if r.requires_grad:
                n = r.grad_fn if r.grad_fn is not None else _grad_node(r)
                self.parents[n] = self.parents.get(n, 0) + 1
        self.frontier = [n for n in reach_in if reach_in[n] and n not in to_input and any(
            c is not None and reach_param[c] and not reach_in[c] for c, _ in n.next_functions)]
        # each frontier node's edges to parameters only: W's backward goes down these alone
        self.leaf_of = leaf_of = {_grad_node(p): p for p in self.params}
        self.is_param_edge = {n: [c is not None and reach_param[c] and not reach_in[c]
                                  for c, _ in n.next_functions] for n in self.frontier}
        self.edge_at = {n: [leaf_of.get(c, GradientEdge(c, nr)) if c is not None else None
                            for c, nr in n.next_functions] for n in self.frontier}
        self.edges = {n: [e for e, on in zip(self.edge_at[n], self.is_param_edge[n]) if on]
                      for n in self.frontier}
        self.direct = _shared_targets(self.frontier, reach_in, reach_param)
        self.own = {n: self._own_params(self.edges[n]) for n in self.frontier if n not in self.direct}
        # a root that is an input itself (a tensor the stage passes on unchanged): its
        # gradient is the input's, now
        through = [any(r is x for x in inputs) for r in roots]
        for r, g, x in zip(roots, grads, through):
            if x:
                _accumulate(r, g)
        # roots that never reach an input: their whole backward is weight gradient
        late = [not x and (r.grad_fn is None or not reach_in.get(r.grad_fn, False))
                for r, x in zip(roots, through)]
        self.later = [(r, g) for r, g, x in zip(roots, grads, late) if x]
        self.captured: dict[Any, tuple] = {}

        def keep(node: Any):
            def hook(grad_outputs: tuple) -> None:
                # a copy: the engine may reuse these buffers once the node has run
                self.captured[node] = tuple(None if g is None else g.clone() for g in grad_outputs)
            return hook

        handles = [n.register_prehook(keep(n)) for n in self.frontier]
        now = [(r, g) for r, g, x, y in zip(roots, grads, late, through) if not (x or y)]
        try:
            if now and inputs:
                if len(now) == 1:  # above the first node W reads: freed now (a loss, its logits)
                    now = _through_chain(now[0], set(self.frontier), to_input, reach_in)
                # the graph is kept for W
                torch.autograd.backward([r for r, _ in now], [g for _, g in now], inputs=inputs,
                                        retain_graph=True)
        finally:
            for h in handles:
                h.remove()

    def _own_params(self, edges: list[Any]) -> list[torch.Tensor] | None:
        """The parameters under a frontier node's parameter-only ``edges``, where every node
        on the way down has no other way in (so a backward from the node to those parameters
        cannot also come down its input edges); otherwise None."""
        out: dict[int, torch.Tensor] = {}
        stack = [_grad_node(e) if isinstance(e, torch.Tensor) else e.node for e in edges]
        seen: set[Any] = set()
        while stack:
            n = stack.pop()
            if n in seen or self.parents.get(n, 0) != 1:
                return None
            seen.add(n)
            if n in self.leaf_of:
                out[id(self.leaf_of[n])] = self.leaf_of[n]
            stack.extend(c for c, _ in n.next_functions if c is not None)
        return list(out.values())

    def weights(self) -> None:
        """Accumulate the parameters' gradients (``W``).

        First, from each frontier node, the gradients of its parameter-only
        edges (not through its other inputs, which ``I`` covered); then from
        those edges (and roots that reach no input) down to the parameters.
        """
        pending: dict[Any, torch.Tensor] = {}  # edge into the parameter-only graph -> gradient
        # storages a parameter's first gradient may not take over: the seeds (an identity-like
        # node hands one on as is) and every gradient already taken this pass (two parameters
        # can be handed the same tensor)
        taken = {_storage(g) for gs in self.captured.values() for g in gs if g is not None}
        taken |= {_storage(g) for _, g in self.later}

        def route(edge: Any, g: torch.Tensor | None) -> None:
            if g is None:
                return
            if isinstance(edge, torch.Tensor):
                _accumulate(edge, g, taken)
            else:
                key = (edge.node, edge.output_nr)
                pending[key] = g if key not in pending else pending[key] + g

        for node, gs in self.captured.items():
            edges = self.edges[node]
            if not edges or all(g is None for g in gs):
                continue
            if node in self.direct:
                # its parameter edges are also reached through its input edges: run the
                # node's own backward and keep only the parameter edges' results
                with torch.no_grad():  # its results are gradients, not a graph to record
                    found = node(*gs)
                for i, (c, nr) in enumerate(node.next_functions):
                    if c is not None and self.is_param_edge[node][i] and found[i] is not None:
                        route(self.edge_at[node][i], _as_input_of(c, nr, found[i]))
                continue
            seeds = [(GradientEdge(node, k), g) for k, g in enumerate(gs) if g is not None]
            own = self.own[node]
            if own is not None:
                # nothing else leads to these parameters: straight down to them, the engine
                # accumulating each gradient as it is made
                torch.autograd.backward([e for e, _ in seeds], [g for _, g in seeds],
                                        inputs=own, retain_graph=True)
                continue
            found = torch.autograd.grad([e for e, _ in seeds], edges, [g for _, g in seeds],
                                        allow_unused=True, retain_graph=True)
            for edge, g in zip(edges, found):
                route(edge, g)
        outs: list[Any] = [GradientEdge(n, nr) for n, nr in pending]
        grads: list[torch.Tensor] = list(pending.values())
        for r, g in self.later:
            outs.append(r)
            grads.append(g)
        self.captured.clear()
        if not outs or not self.params:
            return
        # the engine accumulates each parameter's gradient as it is made, as a plain backward
        # does: returning them all first (autograd.grad) held a micro-batch's every weight
        # gradient at once, and freeing them together handed the memory back to the OS, to be
        # faulted in again on the next W (42k page faults a step on ZB-H1's first stage here)
        torch.autograd.backward(outs, grads, inputs=self.params)


def _through_chain(root: tuple[torch.Tensor, torch.Tensor], frontier: set[Any], to_input: set[Any],
                   reach_in: dict[Any, bool]) -> list[tuple[Any, torch.Tensor]]:
    """Backward from ``root`` down the chain of nodes that each lead on to the inputs by one
    edge alone, up to the first frontier node or branch, with nothing kept; the (edge,
    gradient) to go on from there. ``W`` reads nothing on the chain (it starts at frontier
    nodes), so its saved tensors go now, not when ``W`` ends: on a last stage, the loss's
    inputs (its logits) for every micro-batch whose ``W`` is deferred."""
    tensor, grad = root
    node, edge = tensor.grad_fn, None
    while node is not None and node not in frontier:
        down = [(c, nr) for c, nr in node.next_functions if c is not None and reach_in.get(c, False)]
        if len(down) != 1 or down[0][0] in to_input:
            break
        node, edge = down[0][0], GradientEdge(*down[0])
    if edge is None:
        return [root]
    (g,) = torch.autograd.grad([tensor], [edge], [grad])
    return [(edge, g)]


def _shared_targets(frontier: list[Any], reach_in: dict[Any, bool], reach_param: dict[Any, bool]
                    ) -> set[Any]:
    """Frontier nodes whose parameter-only edges lead to a node that their input edges also
    reach (a weight read twice on the input path, a position bias added in every layer).

    ``torch.autograd.grad`` from such a node would follow both ways down and count the
    second path twice (``I``'s captured gradients cover it already), so ``W`` runs the
    node's own backward for them instead.
    """
    targets = {n: {c for c, _ in n.next_functions if c is not None and reach_param[c] and not reach_in[c]}
               for n in frontier}
    watch = set().union(*targets.values()) if targets else set()
    if not watch:
        return set()
    below: dict[Any, frozenset] = {}  # node -> watched nodes it reaches (itself included)
    for start in reach_in:
        stack = [(start, False)]
        while stack:
            n, done = stack.pop()
            if n in below:
                continue
            kids = [c for c, _ in n.next_functions if c is not None and c in reach_in]
            if not done:
                stack.append((n, True))
                stack.extend((c, False) for c in kids if c not in below)
                continue
            hit = frozenset({n}) if n in watch else frozenset()
            below[n] = hit.union(*(below[c] for c in kids))
    return {n for n in frontier if any(
        below.get(c, frozenset()) & targets[n]
        for c, _ in n.next_functions if c is not None and reach_in.get(c, False))}


def _as_input_of(node: Any, nr: int, g: torch.Tensor) -> torch.Tensor:
    """``g`` as the engine would hand it to ``node``'s input ``nr``: a node called directly
    skips the engine's own step that sums a broadcast gradient down to the shape its input
    had (a [1, h, q, k] position bias added to [b, h, q, k] scores) and casts its dtype."""
    meta = node._input_metadata[nr]
    if tuple(g.shape) != tuple(meta.shape):
        g = g.sum_to_size(meta.shape)
    return g if g.dtype == meta.dtype else g.to(meta.dtype)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _accumulate(p: torch.Tensor, g: torch.Tensor, taken: set[int] | None = None) -> None:
    """Add ``g`` to ``p.grad``. A first gradient is copied, except where ``taken`` is given and
    ``g`` fills a storage of its own that nothing else was handed (autograd's fresh result,
    perhaps seen through a view of it): then ``p.grad`` takes it over (a copy of every weight
    per step, 25 ms of a 680 ms ZB-H1 step of 8 MLP blocks on this machine)."""
    if p.grad is None:
        own = taken is not None and _storage(g) not in taken and g.is_contiguous() \
            and g.untyped_storage().nbytes() == g.numel() * g.element_size() \
            and g.dtype == p.dtype and g.shape == p.shape
        p.grad = g.detach() if own else g.detach().clone()
        if taken is not None:
            taken.add(_storage(p.grad))
    else:
        p.grad.add_(g)

"""Values that carry no gradient have no backward in the simulator, as in autograd.

A mixture-of-experts router builds its dispatch from masks (``new_zeros``, ``one_hot``,
compares): autograd records nothing for them, so nothing is saved for their backward and
no gradient of theirs is communicated. The simulator charged a backward collective for
every split of such a mask under ``ep`` (a third of an ep step on a Mixtral-like model).
"""

from __future__ import annotations

import torch

from tests.conftest import captured
from torchweave.policies import resolve
from torchweave.sim import parse_cluster
from torchweave.sim.simulate import simulate


def test_masks_made_from_activations_carry_no_gradient() -> None:
    g = captured("moe-tiny")
    grads = g.grad_values()
    by_target: dict[str, list[str]] = {}
    for node in g.nodes:
        by_target.setdefault(node.target, []).extend(node.outputs)
    assert by_target["aten.new_zeros.default"] and not set(by_target["aten.new_zeros.default"]) & grads
    assert not set(by_target["aten.one_hot.default"]) & grads  # integer
    assert not set(by_target["aten.cumsum.default"]) & grads  # of a one-hot mask
    assert set(by_target["aten.softmax.int"]) <= grads  # the router's probabilities
    assert set(by_target["aten.einsum.default"]) <= grads
    assert g.loss in grads and all(p.name in grads for p in g.params() if p.requires_grad)
    # a buffer (RoPE's tables) and what is sliced from it take none either
    llama = captured("llama-tiny")
    assert not {b.name for b in llama.buffers()} & llama.grad_values()


def test_no_backward_communication_for_a_value_without_gradient() -> None:
    g = captured("moe-tiny")
    grads = g.grad_values()
    res = simulate(g, resolve("ep", g, 4), parse_cluster("4xA100-80GB-SXM@4"), dtype=torch.bfloat16)
    backward_comms = [e.name for e in res.timeline
                      if e.stream == "comm" and e.name.endswith(" bwd") and e.end > e.start]
    assert backward_comms  # the experts' dispatch and combine still have theirs
    moved = {name.split(" ")[1] for name in backward_comms}
    assert moved <= grads, sorted(moved - grads)

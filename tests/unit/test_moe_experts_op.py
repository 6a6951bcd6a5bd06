"""transformers' experts captured as one op (``torchweave.moe_experts``), so that ``ep``
splits them: the op computes what the module computes, its pieces add up, capture
records it only where it is exact, and ``ep`` splits it (tests/dist/test_hf_zoo.py runs
the plans against one device)."""

from __future__ import annotations

import copy

import pytest
import torch

import torchweave
from tests.conftest import built
from torchweave.ops import REGISTRY
from torchweave.ops.moe import experts, experts_as_one_op, recognized
from torchweave.ops.selfcheck import Case, check_case


def _routed(t=12, d=8, f=6, e=4, k=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g, dtype=dtype)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    index[0] = 0  # an expert picked twice in a row, and (below) one nobody picks
    index[index == e - 1] = 1
    weights = torch.rand(t, k, generator=g, dtype=dtype)
    gate_up = torch.randn(e, 2 * f, d, generator=g, dtype=dtype)
    down = torch.randn(e, d, f, generator=g, dtype=dtype)
    return hidden, index, weights, gate_up, down


def test_the_op_is_the_sum_over_experts_of_each_routed_pair() -> None:
    hidden, index, weights, gate_up, down = _routed()
    got = torch.ops.torchweave.moe_experts(hidden, index, weights, gate_up, down, "silu", False)
    want = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = (gate_up[e] @ hidden[t]).chunk(2)
            want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the transposed layout ([e, d, 2f], [e, f, d]) computes the same
    got_t = torch.ops.torchweave.moe_experts(hidden, index, weights, gate_up.transpose(1, 2),
                                             down.transpose(1, 2), "silu", True)
    torch.testing.assert_close(got_t, want, rtol=0, atol=1e-12)


def test_every_split_of_tokens_and_experts_adds_up_to_the_whole_op() -> None:
    """The registry's own split test: tokens into 2 and 4, experts into 2 and 4 (partial
    sums, each piece computing from its first expert on), forward and values."""
    args = _routed()
    op = torch.ops.torchweave.moe_experts.default
    case = Case("torchweave.moe_experts.default", op, (*args, "silu", False), {})
    assert REGISTRY.lookup(case.target) is not None
    assert check_case(case) == []


def test_the_op_and_its_pieces_give_the_modules_gradients() -> None:
    """One op's backward (re-run under autograd) and the pieces' (plain autograd) match
    transformers' own experts module, in float64 (its loop over experts: the grouped
    matmul it runs by default has no float64 kernel; test_hf_zoo checks that one, in
    float32, through whole models)."""
    pytest.importorskip("transformers")
    model = copy.deepcopy(built("hf-mixtral-tiny")[0]).double()  # built() is shared
    module = model.model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, module.gate_up_proj.shape[2], generator=g, dtype=torch.float64)
    index = torch.randint(0, module.gate_up_proj.shape[0], (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g, dtype=torch.float64)

    def grads(run):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        module.zero_grad()
        out = run(h, w)
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
        return [out, h.grad, w.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()]

    impl, module.config._experts_implementation = module.config._experts_implementation, "eager"
    try:
        want = grads(lambda h, w: module(h, index, w))
    finally:
        module.config._experts_implementation = impl
    with experts_as_one_op(model) as paths:
        assert "model.model.layers.0.mlp.experts" in paths
        whole = grads(lambda h, w: module(h, index, w))
    half = module.gate_up_proj.shape[0] // 2
    pieces = grads(lambda h, w: sum(
        experts(h, index, w, module.gate_up_proj[a:b], module.down_proj[a:b], "silu", False, e0=a)
        for a, b in ((0, half), (half, None))))
    for got in (whole, pieces):
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    assert "forward" not in vars(module)  # the module's own forward is back


def test_capture_records_each_experts_module_as_one_op_and_ep_splits_it() -> None:
    pytest.importorskip("transformers")
    from torchweave.policies import resolve

    for name in ("hf-mixtral-tiny", "hf-qwen2moe-tiny"):
        model, inputs = built(name)[:2]
        graph = torchweave.capture(model, inputs)
        ops = [n for n in graph.nodes if str(n.op) == "torchweave.moe_experts.default"]
        assert len(ops) == 2 and len(graph.meta["experts"]) == 2, name
        assert not any("grouped_mm" in str(n.op) or "histc" in str(n.op) for n in graph.nodes)
        plan = resolve("ep", graph, 2)
        assert plan.notes["experts"] == "2 expert ops split over ep=2"
        assert all(tr.dim == "e" for n in ops for tr in plan.transforms(n.name))
        # data parallelism keeps each rank's tokens through the experts
        dp = resolve("dp", graph, 2)
        assert all(tr.dim == "t" for n in ops for tr in dp.transforms(n.name))
        # tensor parallelism (and ep with tp) shares the experts out instead of repeating them
        for spec, world in (("tp", 2), ("sp", 2), ("ep:ep=2,tp=2", 4)):
            plan = resolve(spec, graph, world)
            assert {tr.dim for n in ops for tr in plan.transforms(n.name)} == {"e"}, spec


def test_only_experts_the_op_computes_exactly_are_replaced() -> None:
    """Biases, a norm after the experts, a gate of the model's own, an activation the op
    does not know, or transformers' own expert parallelism: left to capture op by op."""
    pytest.importorskip("transformers")
    model = built("hf-mixtral-tiny")[0]
    module = model.model.model.layers[0].mlp.experts
    assert recognized(module) == "silu"
    from transformers.activations import ACT2FN

    for attr, value in (("has_bias", True), ("has_post_expert_norm", True),
                        ("_is_expert_parallel", True), ("is_concatenated", False),
                        ("act_fn", torch.nn.Tanh()),  # unknown
                        ("act_fn", torch.nn.ReLU6()), ("act_fn", ACT2FN["gelu_10"])):  # clip far out
        old = getattr(module, attr)
        setattr(module, attr, value)
        try:
            assert recognized(module) is None, attr
        finally:
            setattr(module, attr, old)
    module.forward = lambda *a: a[0]  # a forward of the instance's own
    try:
        assert recognized(module) is None
    finally:
        del module.forward
    impl = module.config._experts_implementation
    module.config._experts_implementation = "someone_elses_kernel"
    try:
        assert recognized(module) is None
    finally:
        module.config._experts_implementation = impl
    own_forward = type("OwnForward", (type(module),), {"forward": lambda self, *a: a[0]})
    module.__class__, cls = own_forward, type(module)
    try:
        assert recognized(module) is None
    finally:
        module.__class__ = cls
    own_gate = type("OwnGate", (type(module),), {"_apply_gate": lambda self, x: x})
    module.__class__, cls = own_gate, type(module)
    try:
        assert recognized(module) is None
    finally:
        module.__class__ = cls
    assert recognized(torch.nn.Linear(2, 2)) is None


def test_simulated_ep_holds_a_share_of_the_experts() -> None:
    """The simulator prices the op from its FLOPs and ep's derived collectives: under
    ``ep`` each device holds half the experts, so less memory than ``dp``."""
    pytest.importorskip("transformers")
    from torchweave.policies import resolve
    from torchweave.sim import parse_cluster, simulate

    model, inputs = built("hf-mixtral-tiny")[:2]
    graph = torchweave.capture(model, inputs)
    cluster = parse_cluster("2xA100-80GB-SXM@2")
    got = {p: simulate(graph, resolve(p, graph, 2), cluster) for p in ("dp", "ep")}
    expert_bytes = sum(v.meta.numel * v.meta.dtype.itemsize for v in graph.values.values()
                       if v.kind == "param" and len(v.meta.shape) == 3)
    saved = got["dp"].memory[0].params - got["ep"].memory[0].params
    assert saved == pytest.approx(expert_bytes / 2, rel=0.01)


def test_a_piece_whose_experts_get_no_pair_still_gives_every_input_a_gradient() -> None:
    """Under ``ep`` a rank whose experts no token chose still takes part in the backward's
    collectives: its piece's output depends on every input (with zero gradients), so autograd
    reaches the gathers' backward on every rank. The whole op with no tokens, likewise."""
    hidden, index, weights, gate_up, down = (t.requires_grad_(t.is_floating_point())
                                             for t in _routed())
    index = index % 2  # every pair to experts 0 and 1: the piece holding 2 and 3 gets none
    out = experts(hidden, index, weights, gate_up[2:], down[2:], "silu", False, e0=2)
    assert out.abs().max() == 0 and out.requires_grad
    grads = torch.autograd.grad(out.sum(), [hidden, weights, gate_up, down])
    assert all(g is not None and g.abs().max() == 0 for g in grads)
    none = torch.ops.torchweave.moe_experts(hidden[:0], index[:0], weights[:0], gate_up, down,
                                            "silu", False)
    grads = torch.autograd.grad(none.sum(), [gate_up, down])
    assert all(g is not None for g in grads)


def test_generated_code_calls_the_experts_function_split_or_whole() -> None:
    """Split or whole (a pipeline stage on one device), a rank calls ``experts`` itself, with
    plain autograd: the custom op's own backward, which runs the forward again, is left to
    capture's interpreter and the registry's self-check."""
    pytest.importorskip("transformers")
    from torchweave.lower.lower import lower
    from torchweave.lower.program import Compute
    from torchweave.policies import resolve

    model, inputs = built("hf-mixtral-tiny")[:2]
    graph = torchweave.capture(model, inputs)
    for spec, world in (("1f1b", 2), ("ep", 2), ("dp", 2)):
        calls = [ins for prog in lower(graph, resolve(spec, graph, world))
                 for ins in [*prog.computes(), *(i for seg in prog.segments for i in seg.instrs
                                                 if isinstance(i, Compute))]
                 if ins.node.startswith("moe_experts")]
        assert calls and {c.fn for c in calls} == {"torchweave.ops.moe.experts"}, spec

"""Zero-bubble's split backward: I gives the input gradients only, W the weight gradients after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchweave.runtime.zb import SplitBackward


def _stage(x, w1, b1, w2, table):
    h = F.gelu(F.linear(x, w1, b1))
    out = F.linear(h, w2.to(torch.float64).to(torch.float32))  # a cast between weight and op
    side = table.pow(2).sum()  # a root branch that never reaches the input
    return out, side


def test_input_gradients_first_weight_gradients_later_same_numbers() -> None:
    torch.manual_seed(0)
    params = [torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True),
              torch.randn(8, 32, requires_grad=True), torch.randn(5, requires_grad=True)]
    x = torch.randn(4, 16, requires_grad=True)
    g_out = torch.randn(4, 8)
    out, side = _stage(x, *params)
    torch.autograd.backward([out, side], [g_out, torch.ones(())])
    want_x, want = x.grad.clone(), [p.grad.clone() for p in params]
    for t in [x, *params]:
        t.grad = None

    out, side = _stage(x, *params)
    split = SplitBackward([out, side], [g_out, torch.ones(())], [x], params)
    torch.testing.assert_close(x.grad, want_x)
    assert all(p.grad is None for p in params), "I computes no weight gradient"
    assert len(split.frontier) >= 2  # the two linear layers (and the bias add)
    split.weights()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)


def test_a_stage_without_inputs_does_everything_in_w() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    y = (w @ w).sum()
    split = SplitBackward([y], [torch.ones(())], [], [w])
    assert w.grad is None
    split.weights()
    torch.testing.assert_close(w.grad, (torch.ones(3, 3) @ w.T + w.T @ torch.ones(3, 3)))


def test_a_weight_read_twice_on_and_off_the_input_path() -> None:
    """A tied table: looked up (off the input path) and used as the head (on it)."""
    torch.manual_seed(0)
    table = torch.randn(10, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    idx = torch.tensor([1, 4, 7])
    g = torch.randn(3, 10)

    def stage():
        return (x + F.embedding(idx, table)) @ table.t()

    torch.autograd.backward([stage()], [g])
    want_x, want = x.grad.clone(), table.grad.clone()
    x.grad = table.grad = None
    split = SplitBackward([stage()], [g], [x], [table])
    torch.testing.assert_close(x.grad, want_x)
    split.weights()
    torch.testing.assert_close(table.grad, want)


def test_an_input_passed_on_unchanged_gets_its_gradient_in_i() -> None:
    """A stage that forwards a received tensor as it is (its output *is* the input leaf),
    next to one it computes on: I must hand both gradients back (found by the fuzzer: a
    pipeline stage holding only mask arithmetic, between the embeddings and the blocks)."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    hidden = torch.randn(2, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    g_hidden, g_y = torch.randn(2, 4), torch.randn(2, 4)
    y = x @ w
    torch.autograd.backward([hidden, y], [g_hidden, g_y])
    want = hidden.grad.clone(), x.grad.clone(), w.grad.clone()
    for t in (hidden, x, w):
        t.grad = None
    y = x @ w
    split = SplitBackward([hidden, y], [g_hidden, g_y], [hidden, x], [w])
    torch.testing.assert_close(hidden.grad, want[0])
    torch.testing.assert_close(x.grad, want[1])
    assert w.grad is None
    split.weights()
    torch.testing.assert_close(w.grad, want[2])


def _emb_idx():
    return torch.tensor([1, 2, 3])


_SHARED = {
    # a position bias added in two layers (t5's relative attention bias; found by the fuzzer)
    "one bias, two layers": lambda x, w, m: (lambda b: torch.tanh(x + b) + b)(F.embedding(_emb_idx(), w)),
    # one weight matrix multiplied twice on the input path
    "one matrix, two matmuls": lambda x, w, m: torch.tanh(x @ m) @ m,
    # the bias broadcast over the batch, as t5's [1, heads, q, k] bias is over [b, heads, q, k]
    "one broadcast bias, two layers": lambda x, w, m: (lambda b: torch.tanh(x + b) + b)(
        F.embedding(_emb_idx()[:1], w)),
    # one matrix read through two transposes (two nodes of their own above the parameter:
    # a backward straight down to it from the second would also come down the input path)
    "one matrix, two transposes": lambda x, w, m: torch.tanh(x @ m.t()) @ m.t(),
    # a tied table: looked up, then the head, through linear's own transpose
    "tied table, linear head": lambda x, w, m: F.linear(torch.tanh(x + F.embedding(_emb_idx(), w)), w),
    "both": lambda x, w, m: (lambda b: torch.tanh(torch.tanh(x @ m + b) @ m) + b)(F.embedding(_emb_idx(), w)),
}


@pytest.mark.parametrize("name", list(_SHARED))
def test_a_parameter_reached_from_two_points_of_the_input_path_is_counted_once(name) -> None:
    """W must not follow a frontier node's input edges down to a parameter that another
    frontier node's W already accounts for."""
    torch.manual_seed(0)
    w, m = torch.randn(10, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = _SHARED[name](x, w, m)
    g = torch.randn(out.shape)
    torch.autograd.backward([out], [g])
    want = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in (x, w, m)]
    for t in (x, w, m):
        t.grad = None
    split = SplitBackward([_SHARED[name](x, w, m)], [g], [x], [w, m])
    torch.testing.assert_close(x.grad, want[0])
    assert w.grad is None and m.grad is None
    split.weights()
    for t, expect in zip((w, m), want[1:]):
        torch.testing.assert_close(t.grad if t.grad is not None else torch.zeros_like(t), expect)


@pytest.mark.parametrize("sent", ["the weight", "its transpose"])
def test_a_stage_sending_on_a_weight_finishes_its_gradient_once(sent) -> None:
    """A root under a frontier node's parameter edges (a stage that sends on ``w`` or ``w.t()``)
    is a second way in: ``W`` must not accumulate ``w`` twice, since each accumulation fires
    the gradient hooks (the bucketed sum starts on the first, on half a gradient)."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    g_y, g_w = torch.randn(2, 4), torch.randn(4, 4)

    def stage():
        wt = w if sent == "the weight" else w.t()
        return [x @ wt, wt]

    torch.autograd.backward(stage(), [g_y, g_w])
    want = w.grad.clone()
    x.grad = w.grad = None
    seen = []
    handle = w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    try:
        split = SplitBackward(stage(), [g_y, g_w], [x], [w])
        split.weights()
    finally:
        handle.remove()
    assert len(seen) == 1, f"w's gradient was accumulated {len(seen)} times"
    torch.testing.assert_close(seen[0], want)


def test_w_adds_into_a_bucket_view_without_recording_a_graph() -> None:
    """``.grad`` as a view of a flat bucket: W adds into it in place, and the node it runs by
    hand (a weight on and off the input path) records nothing on the buffer."""
    torch.manual_seed(0)
    m = torch.randn(4, 4, requires_grad=True)
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    torch.autograd.backward([_SHARED["one matrix, two matmuls"](x, None, m)], [g])
    want = m.grad.clone()
    flat = torch.zeros(16)
    m.grad = flat.view(4, 4)
    split = SplitBackward([_SHARED["one matrix, two matmuls"](x, None, m)], [g], [x], [m])
    split.weights()
    assert m.grad.data_ptr() == flat.data_ptr() and not flat.requires_grad
    torch.testing.assert_close(flat.view(4, 4), want)


class _Held:
    """A saved tensor, counted while autograd holds it."""

    live: set[str] = set()

    def __init__(self, t: torch.Tensor, tag: str) -> None:
        self.t, self.tag = t, tag
        _Held.live.add(tag)

    def __del__(self) -> None:
        _Held.live.discard(self.tag)


def test_what_only_i_reads_above_the_first_weight_is_freed_by_i() -> None:
    """A last stage: h = x @ w, loss = log_softmax(h)[t].mean(). W reads the matmul's saved
    input; the loss's saved logits and log-probabilities only I reads, so they go with I,
    not when the deferred W ends (a micro-batch's logits held for every deferred W)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    t = torch.randint(0, 16, (4,))
    tag = {"now": ""}

    def pack(v: torch.Tensor):
        return v if v.is_leaf and v.requires_grad else _Held(v, tag["now"])

    def forward():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t if isinstance(h, _Held) else h):
            tag["now"] = "matmul"
            h = torch.relu(x) @ w
            tag["now"] = "loss"
            return -F.log_softmax(h, -1).gather(1, t[:, None]).mean()

    loss = forward()
    loss.backward()
    want_x, want_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    _Held.live.clear()
    loss = forward()
    assert "loss" in _Held.live and "matmul" in _Held.live
    split = SplitBackward([loss], [torch.ones(())], [x], [w])
    assert "loss" not in _Held.live, "the loss's saved tensors outlive I"
    assert "matmul" in _Held.live, "W reads the matmul's saved input"
    torch.testing.assert_close(x.grad, want_x)
    assert w.grad is None
    split.weights()
    torch.testing.assert_close(w.grad, want_w)

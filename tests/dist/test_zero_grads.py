"""ZeRO-1/2 hold a step's full gradients once: each piece's gradient moves into the sum's
flat input as backward makes it (``ZeroOptimizer.pending_grads``), not kept as every
piece's ``.grad`` and copied again into the sum's input, on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import built
from torchweave.runtime.launch import LaunchConfig, spawn
from torchweave.runtime.zero import _Units


def _pending(ctx, model, batch, plan):
    import torchweave

    pm = torchweave.parallelize(copy.deepcopy(model), batch, plan=plan, groups=ctx.groups)
    ref = torchweave.parallelize(copy.deepcopy(model), batch, plan="dp", groups=ctx.groups)
    zero = pm.zero_opt
    with pm.no_sync(), ref.no_sync():  # this rank's own gradients, not yet summed
        pm(*batch).backward()
        ref(*batch).backward()
    owned = [p for p in pm.params.values() if zero.owns(p)]
    pieces = zero.layout.pieces(0, zero.pending_grads)
    by_id = {id(p): k for k, p in enumerate(zero.owned)}
    paths = {id(p): path for path, p in pm.params.items()}
    diff = max(float((pieces[by_id[id(p)]] - ref.params[paths[id(p)]].grad).abs().max())
               for p in owned)
    held = pm.memory()
    out = {"owned": len(owned), "grads_left": sum(p.grad is not None for p in owned),
           "pending": zero.pending_grads.numel(), "rows": zero.size * zero.layout.total,
           "diff": diff}
    pm(*batch).backward()  # outside no_sync: both backward passes summed, then the step
    ref(*batch).backward()
    out["pending_after"] = zero.pending_grads is None
    out["held_drop"] = held - pm.memory()
    step_pm = torchweave.optimizer(pm, torch.optim.SGD, lr=0.1)
    step_ref = torchweave.optimizer(ref, torch.optim.SGD, lr=0.1)
    step_pm.step()
    step_ref.step()
    out["param_diff"] = max(float((pm.params[k] - v).abs().max())  # whole pieces, both plans
                            for k, v in ref.params.items())
    loss = pm.train_step(*batch)
    out["train_step"] = (zero.pending_grads is None and all(p.grad is None for p in owned)
                         and zero.master.grad is None and loss == loss)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("plan", ["zero1", "zero2"])
def test_the_full_gradients_are_held_once_and_summed_as_before(plan) -> None:
    model, inputs = built("gpt-tiny")[:2]
    for r in spawn(_pending, LaunchConfig(world_size=2), model, inputs, plan):
        assert r["owned"] > 0 and r["grads_left"] == 0, r
        assert r["pending"] == r["rows"], r
        assert r["diff"] == 0.0, r  # the moved gradients are the pieces' own, bit for bit
        assert r["pending_after"] and r["held_drop"] > 0, r  # released once summed
        assert r["param_diff"] < 1e-6, r
        assert r["train_step"], r


def test_one_units_rows_hold_its_pieces_then_its_padding() -> None:
    pieces = [torch.arange(6.0).view(2, 3), torch.arange(5.0) + 10]
    layout = _Units(pieces, ["", ""], 3, budget=float("inf"))
    rows = layout.to_rows(pieces)
    assert rows.shape == (3, 4)
    flat = torch.cat([pieces[0].reshape(-1), pieces[1], torch.zeros(1)])
    assert torch.equal(rows.reshape(-1), flat)
    assert all(torch.equal(a, b) for a, b in zip(layout.from_rows(rows), pieces))


def _poisoned(ctx, model, batch, plan):
    """The flat gradient buffer is made uninitialised: poison it with NaN, so that padding or a
    piece left unzeroed shows in the norm, the clip and the parameters."""
    import torchweave

    pm = torchweave.parallelize(copy.deepcopy(model), batch, plan=plan, groups=ctx.groups)
    ref = torchweave.parallelize(copy.deepcopy(model), batch, plan="dp", groups=ctx.groups)
    zero = pm.zero_opt
    real = zero._empty_grads
    zero._empty_grads = lambda *a: real(*a).fill_(float("nan"))
    padding = zero.size * zero.layout.total - sum(zero.layout.numels)
    pm(*batch).backward()  # a step dropped before its update (as the trainer skips one)
    pm.zero_grads()
    for m in (pm, ref):
        m(*batch).backward()
    norms = [float(pm.clip(0.5)), float(ref.clip(0.5))]
    for m in (pm, ref):
        torchweave.optimizer(m, torch.optim.SGD, lr=0.1).step()
    diff = max(float((pm.params[k] - v).abs().max()) for k, v in ref.params.items())
    return {"padding": padding, "norms": norms, "diff": diff}


@pytest.mark.dist
@pytest.mark.parametrize("plan", ["zero1", "zero2"])
def test_padding_and_a_dropped_step_leave_nothing_in_the_sum(plan) -> None:
    model, inputs = built("gpt-tiny")[:2]  # 118,528 elements: 3 ranks pad 2
    batch = tuple(torch.cat([x, x, x]) for x in inputs)  # rows for 3 ranks
    for r in spawn(_poisoned, LaunchConfig(world_size=3), model, batch, plan):
        assert r["padding"] > 0, r
        a, b = r["norms"]
        assert a == a and abs(a - b) <= 1e-5 * b, r
        assert r["diff"] < 1e-6, r


def _dropped(ctx, model, batch):
    import gc
    import weakref

    import torchweave

    pm = torchweave.parallelize(copy.deepcopy(model), batch, plan="zero2", groups=ctx.groups)
    pm.train_step(*batch)
    gc.collect()
    gc.disable()  # freed by reference counts alone: the pieces' hooks hold no cycle
    try:
        held = weakref.ref(pm.zero_opt)
        del pm
        return held() is None
    finally:
        gc.enable()


@pytest.mark.dist
def test_a_dropped_module_frees_its_sharded_state_without_the_collector() -> None:
    model, inputs = built("gpt-tiny")[:2]
    assert all(spawn(_dropped, LaunchConfig(world_size=2), model, inputs))

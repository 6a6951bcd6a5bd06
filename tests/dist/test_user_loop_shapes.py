"""The user's own loop on batches of other shapes (a new program per shape, from the model
held weakly) and the loss read without a host sync, against one device on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import built
from tests.dist.test_user_loop import _loop, _reference, _schedule
from torchweave.runtime.launch import LaunchConfig, spawn


LENGTHS = (16, 8, 12)
"""Sequence lengths of successive batches: the example's, then two others."""


def _lengths(ctx, model, batches, plans):
    import torchweave

    out = []
    for plan in plans:
        mine = copy.deepcopy(model)  # held: a batch of new shapes is compiled from it
        pm = torchweave.parallelize(mine, batches[0], plan=plan, groups=ctx.groups)
        opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        losses = _loop(pm, opt, sched, batches + batches[:1], accum=1, clip=None,
                       no_sync=lambda m: m.no_sync())
        error = ""
        try:
            pm(*(x[:, :5] for x in batches[0]))  # 5 tokens: sp's split over ranks does not divide
        except Exception as e:  # noqa: BLE001 - the message is checked below
            error = str(e)
        out.append((losses, pm.state_dict(full=True), error))
    return out


def _released(ctx, model, batches):
    import gc
    import weakref

    import torchweave

    mine = copy.deepcopy(model)
    seen = weakref.ref(mine)
    pm = torchweave.parallelize(mine, batches[0], plan="dp", groups=ctx.groups)
    del mine
    gc.collect()
    freed = seen() is None
    same = float(pm(*batches[0]))  # the example's shapes need no model
    try:
        pm(*batches[1])
        error = ""
    except torchweave.TorchweaveError as e:
        error = f"{type(e).__name__}: {e}"
    return freed, same, error


@pytest.mark.dist
def test_one_module_trains_on_three_sequence_lengths_like_one_device() -> None:
    """A batch of another length runs the same plan, compiled again for its shape once."""
    model, inputs = built("gpt-tiny")[:2]
    model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(2)
    batches = [tuple(torch.randint(0, 256, (8, n), generator=g) for _ in inputs) for n in LENGTHS]
    plans = ["dp", "tp", "zero3", "sp"]
    results = spawn(_lengths, LaunchConfig(world_size=2), model, batches, plans)
    want_losses, want_state = _reference(model, batches + batches[:1], 1, None)
    for k, plan in enumerate(plans):
        for rank in range(2):
            losses, state, error = results[rank][k]
            assert losses == pytest.approx(want_losses, rel=1e-9), (plan, rank)
            for name, want in want_state.items():
                torch.testing.assert_close(state[name], want, rtol=1e-7, atol=1e-9,
                                           msg=lambda m: f"{plan} rank {rank} {name}: {m}")
            if plan == "sp":
                assert "5" in error and "divid" in error, error


@pytest.mark.dist
def test_a_released_model_is_freed_and_a_new_shape_then_says_to_keep_it() -> None:
    """parallelize holds the model weakly: a rank keeps its own pieces, and the model's whole
    parameters go when the caller drops it. A batch of the example's shapes still runs; one
    of other shapes (compiled from the model) names the rule and the fix."""
    model, inputs = built("gpt-tiny")[:2]
    g = torch.Generator().manual_seed(3)
    batches = [tuple(torch.randint(0, 256, (8, n), generator=g) for _ in inputs) for n in (16, 8)]
    for freed, same, error in spawn(_released, LaunchConfig(world_size=2), model, batches):
        assert freed
        assert same == same  # a number, not NaN
        assert error.startswith("ModelReleased: "), error  # raised as itself, not re-wrapped
        assert "has been released" in error and "keep a reference to the model" in error, error
        assert "splits divide" not in error, error


def _host_reads(ctx, model, batch, plans):
    from torch.utils._python_dispatch import TorchDispatchMode

    import torchweave

    class Reads(TorchDispatchMode):  # reads of a value to the host: on a GPU, each a sync
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    out = {}
    for plan in plans:
        pm = torchweave.parallelize(copy.deepcopy(model), batch, plan=plan, groups=ctx.groups)
        pm(*batch).backward()  # the first call compiles
        with Reads() as reads:
            loss = pm(*batch)
        loss.backward()
        out[plan] = (reads.count, loss.item())
    return out


@pytest.mark.dist
def test_the_loss_is_summed_over_ranks_without_reading_it_to_the_host() -> None:
    """``pm(*batch)`` returns the global loss from one asynchronous sum, reading no value to the
    host (on a GPU that read stalls the host until the forward ends); it is one device's loss."""
    model, inputs = built("gpt-tiny")[:2]
    plans = ["dp", "zero3", "tp"]
    results = spawn(_host_reads, LaunchConfig(world_size=2), model, inputs, plans)
    want = float(model(*inputs))
    for rank in range(2):
        for plan in plans:
            reads, loss = results[rank][plan]
            assert reads == 0, (plan, rank)
            assert loss == pytest.approx(want, rel=1e-5), (plan, rank)

"""The user's own loop (``pm(*batch)``, ``loss.backward()``, any torch.optim, LR schedulers)
against the same loop on one device, on real gloo ranks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.conftest import built
from torchweave.runtime.launch import LaunchConfig, spawn

STEPS = 3


def _schedule(step: int) -> float:  # warm-up then cosine
    return min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def _batches(inputs, n, rows=8):
    """``n`` random batches of ``rows`` rows (micro-batches of 4 split over 4 ranks too)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        out.append(tuple(torch.randint(0, int(x.max()) + 1, (rows, *x.shape[1:]), generator=g)
                         for x in inputs))
    return out


def _loop(pm, opt, sched, batches, *, accum: int, clip: float | None, no_sync) -> list[float]:
    losses = []
    for batch in batches:
        total = 0.0
        for i in range(accum):
            part = tuple(x.chunk(accum)[i] for x in batch) if accum > 1 else batch
            ctx = no_sync(pm) if i < accum - 1 else _null()
            with ctx:
                loss = pm(*part)
                (loss / accum).backward()
            total += loss.item() / accum
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _reference(model, batches, accum, clip):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)

    class One:
        def __call__(self, *b):
            return model(*b)

    def clip_(max_norm):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    opt.clip_grad_norm_ = clip_
    losses = _loop(One(), opt, sched, batches, accum=accum, clip=clip,
                   no_sync=lambda pm: _null())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(ctx, model, batches, cases):
    import torchweave

    out = []
    for plan, accum, clip in cases:
        pm = torchweave.parallelize(copy.deepcopy(model), batches[0] if accum == 1 else
                                    tuple(x.chunk(accum)[0] for x in batches[0]),
                                    plan=plan, groups=ctx.groups)
        opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
        losses = _loop(pm, opt, sched, batches, accum=accum, clip=clip,
                       no_sync=lambda m: m.no_sync())
        out.append((losses, pm.state_dict(full=True)))
    return out


CASES = [("dp", 1, 1.0), ("zero1", 1, None), ("zero2", 2, None), ("zero3", 1, 0.5),
         ("tp", 1, None), ("sp", 2, 1.0)]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_a_plain_loop_with_adamw_and_a_cosine_schedule_matches_one_device(world) -> None:
    model, inputs = built("gpt-tiny")[:2]
    # float64: AdamW divides by the root of each gradient's square, which turns float32 rounding
    # in near-zero gradients (a key bias's, for one) into visible parameter differences
    model = copy.deepcopy(model).double()  # built() is cached: never change it in place
    batches = _batches(inputs, STEPS)
    results = spawn(_ranks, LaunchConfig(world_size=world), model, batches, CASES)
    for k, (plan, accum, clip) in enumerate(CASES):
        want_losses, want_state = _reference(model, batches, accum, clip)
        for rank in range(world):
            losses, state = results[rank][k]
            assert losses == pytest.approx(want_losses, rel=1e-9), (plan, rank)
            assert state.keys() == want_state.keys()
            for name, want in want_state.items():
                torch.testing.assert_close(state[name], want, rtol=1e-7, atol=1e-9,
                                           msg=lambda m: f"{plan} rank {rank} {name}: {m}")


def _state_and_errors(ctx, model, batches, directory):
    import torch.distributed.checkpoint as dcp

    import torchweave
    from torchweave.errors import TorchweaveError

    out = {}
    pm = torchweave.parallelize(copy.deepcopy(model), batches[0], plan="tp", groups=ctx.groups)
    opt = torchweave.optimizer(pm, torch.optim.SGD, lr=0.1)
    pm(*batches[0]).backward()
    opt.step()
    out["full"] = pm.state_dict(full=True)
    dcp.save(pm.state_dict(), checkpoint_id=directory)  # each piece once, under the model's names
    # a second module (other weights, other plan) loads the sharded checkpoint back
    torch.manual_seed(123)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    pm2 = torchweave.parallelize(other, batches[0], plan="zero3", groups=ctx.groups)
    state = pm2.state_dict()
    dcp.load(state, checkpoint_id=directory)
    pm2.load_state_dict(state)
    out["reloaded"] = pm2.state_dict(full=True)
    pm2.eval()
    with torch.no_grad():
        out["eval"] = pm2(*batches[1]).item()
    model3 = copy.deepcopy(model)  # held: a new shape (the bad one below) is compiled from it
    pm3 = torchweave.parallelize(model3, batches[0], plan="dp", groups=ctx.groups)
    pm3.load_state_dict(out["full"])  # whole tensors, as torch.save'd
    with torch.no_grad():
        out["eval_dp"] = pm3(*batches[1]).item()
    # bad input: each a clear error
    errors = {}
    try:
        pm3(*(x[:1] for x in batches[0]))  # 1 row: dp over 2 ranks does not divide it
    except TorchweaveError as e:
        errors["shape"] = str(e)
    opt2 = torchweave.optimizer(pm2, torch.optim.AdamW, lr=1e-3)
    pm2.train()
    loss = pm2(*batches[0])
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except TorchweaveError as e:
        errors["twice"] = str(e)
    opt2.step()
    opt2.zero_grad()
    pm2.eval()  # evaluation without no_grad: nothing pending, no gradients touched
    out["eval_grad_enabled"] = pm2(*batches[1]).item()
    with torch.no_grad():
        out["eval_no_grad"] = pm2(*batches[1]).item()
    pm2.train()
    first = pm2(*batches[0])
    try:
        pm2(*batches[1])  # a second forward before the first one's backward
    except TorchweaveError as e:
        errors["pending"] = str(e)
    first.backward()
    opt2.zero_grad()
    with pm3.no_sync():
        pm3(*batches[0]).backward()
    opt3 = torchweave.optimizer(pm3, torch.optim.SGD, lr=1e-3)
    with pm3.no_sync():
        pm3(*batches[0]).backward()
    try:
        opt3.step()  # only no_sync backwards: each rank holds its own part
    except TorchweaveError as e:
        errors["unsynced"] = str(e)
    torchweave.optimizer(pm2, torch.optim.SGD, lr=1e-3)
    try:
        opt2.step()
    except TorchweaveError as e:
        errors["stale"] = str(e)
    out["errors"] = errors
    return out


@pytest.mark.dist
def test_state_dicts_under_the_models_names_through_dcp_eval_and_clear_errors(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    model, inputs = built("gpt-tiny")[:2]
    model = copy.deepcopy(model).double()  # built() is cached: never change it in place
    batches = _batches(inputs, 2)
    a, b = spawn(_state_and_errors, LaunchConfig(world_size=2), model, batches, str(tmp_path / "ck"))
    # one step of SGD on one device
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(*batches[0]).backward()
    opt.step()
    want = ref.state_dict()
    for r in (a, b):
        for name, t in want.items():
            torch.testing.assert_close(r["full"][name], t, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(r["reloaded"][name], a["full"][name], rtol=0, atol=0)
    # the sharded checkpoint loads into a plain model's whole state_dict, in one process
    plain = copy.deepcopy(model).state_dict()
    dcp.load(plain, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for name in want:
        torch.testing.assert_close(plain[name], a["full"][name], rtol=0, atol=0)
    with torch.no_grad():
        ref_eval = ref(*batches[1]).item()
    assert a["eval"] == pytest.approx(ref_eval, rel=1e-9) and b["eval_dp"] == pytest.approx(ref_eval, rel=1e-9)
    errors = a["errors"]
    assert "input shapes ((1, " in errors["shape"] and "(8, " in errors["shape"]
    assert "divid" in errors["shape"] and "released" not in errors["shape"], errors["shape"]
    assert "second time" in errors["twice"]
    assert "newer torchweave.optimizer" in errors["stale"]
    assert "before the first one's backward" in errors["pending"]
    assert "no_sync" in errors["unsynced"]
    assert a["eval_grad_enabled"] == a["eval_no_grad"]


def _pipelined(ctx, model, batches, plan, directory):
    import torch.distributed.checkpoint as dcp

    import torchweave
    from torchweave.errors import TorchweaveError

    pm = torchweave.parallelize(copy.deepcopy(model), batches[0], plan=plan, groups=ctx.groups)
    opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    try:
        pm(*batches[0])
        refused = ""
    except TorchweaveError as e:
        refused = str(e)
    losses = []
    for batch in batches:
        losses.append(pm.step(*batch))
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    dcp.save(pm.state_dict(), checkpoint_id=directory)  # stages hold disjoint parameters
    return losses, pm.state_dict(full=True), refused


@pytest.mark.dist
def test_a_pipelined_plan_trains_in_the_users_loop_with_step(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    model, inputs = built("gpt-tiny")[:2]
    model = copy.deepcopy(model).double()  # built() is cached: never change it in place
    batches = _batches(inputs, STEPS)
    results = spawn(_pipelined, LaunchConfig(world_size=2), model, batches, "1f1b:micro=2",
                    str(tmp_path / "ck"))
    want_losses, want_state = _reference(model, batches, 1, 1.0)
    plain = copy.deepcopy(model).state_dict()
    dcp.load(plain, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for name, t in results[0][1].items():
        torch.testing.assert_close(plain[name], t, rtol=0, atol=0)
    for losses, state, refused in results:
        assert losses == pytest.approx(want_losses, rel=1e-9)
        for name, want in want_state.items():
            torch.testing.assert_close(state[name], want, rtol=1e-7, atol=1e-9)
        assert "pm.step(*batch)" in refused


def test_the_optimizer_refuses_a_module_it_does_not_belong_to() -> None:
    import torchweave
    from torchweave.errors import TorchweaveError

    with pytest.raises(TorchweaveError, match="parallelize"):
        torchweave.optimizer(torch.nn.Linear(2, 2), torch.optim.AdamW, lr=1e-3)


def _bf16(ctx, model, batches):
    import torchweave
    from torchweave.runtime.executor import StepConfig

    bf16 = StepConfig(precision="bf16")
    stepped = torchweave.parallelize(
        copy.deepcopy(model), batches[0], plan="zero2", groups=ctx.groups, config=bf16,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    losses_a = [stepped.train_step(*b) for b in batches]
    pm = torchweave.parallelize(copy.deepcopy(model), batches[0], plan="zero2", groups=ctx.groups,
                                config=bf16)
    opt = torchweave.optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    losses_b = []
    for b in batches:
        loss = pm(*b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses_b.append(loss.item())
    return losses_a, losses_b, stepped.state_dict(full=True), pm.state_dict(full=True)


@pytest.mark.dist
def test_mixed_precision_in_the_users_loop_is_train_steps_recipe() -> None:
    """bf16 compute from fp32 masters: the user's loop runs exactly what train_step runs (which
    tests/dist/test_runtime.py checks against the one-device bf16 recipe)."""
    model, inputs = built("gpt-tiny")[:2]
    batches = _batches(inputs, STEPS)
    for losses_a, losses_b, a, b in spawn(_bf16, LaunchConfig(world_size=2), model, batches):
        assert losses_a == losses_b
        assert all(b[k].dtype == torch.float32 for k in b), {k: b[k].dtype for k in b}  # fp32 masters
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)
        assert losses_a[-1] != pytest.approx(losses_a[0], rel=1e-3)  # it trained

"""Collectives on real gloo process groups, checked against one-process autograd.

Each primitive runs on a group; its forward output and its input's gradient
are compared with the same "logical" computation done on the full tensor in
one process. Downstream of each collective sits ``_head`` (tanh, then a
weighted sum), so gradients are not trivial. Loss weights are either the
same on every member (a replicated loss: R-grad) or one per member (the
logical loss is their sum: partial grads). All checks of one world size run
inside one spawned job, to pay process start-up once.
"""

from __future__ import annotations

import atexit
import os
import re
import time
import zlib
from pathlib import Path

import pytest
import torch

from torchweave.errors import TorchweaveError
from torchweave.runtime import collectives
from torchweave.runtime.counter import CommKind, Direction
from torchweave.runtime.launch import LaunchConfig, LaunchError, RankFailedError, spawn
from torchweave.runtime.regather import REGATHER, forward_hooks

pytestmark = pytest.mark.dist

AR, AG, RS, A2A, P2P = (CommKind.ALL_REDUCE, CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER,
                        CommKind.ALL_TO_ALL, CommKind.P2P)
FWD, BWD = Direction.FORWARD, Direction.BACKWARD


def _rand(name: str, group: tuple[int, ...], *shape: int, dtype=torch.float64) -> torch.Tensor:
    """The same tensor on every rank that asks with the same name and group."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}{group}".encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _head(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (y.tanh() * w).sum()


def _leaf(t: torch.Tensor, contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, input): the input is the leaf itself or a non-contiguous view of it."""
    if contiguous:
        leaf = t.clone().requires_grad_()
        return leaf, leaf
    leaf = t.transpose(0, 1).contiguous().requires_grad_()
    return leaf, leaf.transpose(0, 1)


def _grad(leaf: torch.Tensor, contiguous: bool) -> torch.Tensor:
    return leaf.grad if contiguous else leaf.grad.transpose(0, 1)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _counts(c, want: dict, what: str) -> None:
    assert c.counts() == want, f"{what}: counted {c}, want {want}"


def _check_all_reduce(group_cache, G, i, done):
    n = len(G)
    for bwd in ("identity", "all_reduce"):
        for dtype, contiguous in ((torch.float64, True), (torch.float32, False)):
            X = _rand("ar.x", G, n, 4, 6, dtype=dtype)
            W = _rand("ar.w", G, n, 4, 6, dtype=dtype)
            ref = X.clone().requires_grad_()
            Y = ref.sum(0)
            (_head(Y, W[0]) if bwd == "identity" else sum(_head(Y, w) for w in W)).backward()

            leaf, x = _leaf(X[i], contiguous)
            with group_cache.counter.window() as c:
                y = collectives.all_reduce(group_cache, x, G, bwd=bwd)
                _head(y, W[0] if bwd == "identity" else W[i]).backward()
            what = f"all_reduce(bwd={bwd}, {dtype}) on {G}"
            _close(y, Y, what + " forward")
            _close(_grad(leaf, contiguous), ref.grad[i], what + " grad")
            _counts(c, {(AR, FWD): 1} | ({(AR, BWD): 1} if bwd == "all_reduce" else {}), what)
            assert c.count(AR, FWD, group=G) == 1
            done.append(what)


def _check_all_gather(group_cache, G, i, done):
    n = len(G)
    for axis, bwd, contiguous in ((0, "slice", True), (1, "slice", False), (-1, "slice", True),
                                  (0, "reduce_scatter", False), (2, "reduce_scatter", True)):
        X = _rand("ag.x", G, 2 * n, 2 * n, n)
        W = _rand("ag.w", G, n, 2 * n, 2 * n, n)
        ref = X.clone().requires_grad_()
        (_head(ref, W[0]) if bwd == "slice" else sum(_head(ref, w) for w in W)).backward()

        leaf, x = _leaf(X.chunk(n, axis)[i], contiguous)
        with group_cache.counter.window() as c:
            y = collectives.all_gather(group_cache, x, G, axis, bwd=bwd)
            _head(y, W[0] if bwd == "slice" else W[i]).backward()
        what = f"all_gather(axis={axis}, bwd={bwd}) on {G}"
        _close(y, X, what + " forward")
        _close(_grad(leaf, contiguous), ref.grad.chunk(n, axis)[i], what + " grad")
        _counts(c, {(AG, FWD): 1} | ({(RS, BWD): 1} if bwd == "reduce_scatter" else {}), what)
        done.append(what)


def _check_regather(group_cache, G, i, done):
    """``all_gather(..., regather=True)`` in a forward under ``forward_hooks``: what autograd
    saves of the result is kept as the shard and gathered again in backward, once for all
    of an output's saved reads, the next output prefetched; values and gradients as
    without. Outside such a forward the flag does nothing."""
    n = len(G)
    X1, X2 = _rand("rg.x1", G, 2 * n, 3, 4), _rand("rg.x2", G, 2 * n, 3, 4)
    W1, V, W2 = _rand("rg.w1", G, 4, 5), _rand("rg.v", G, 2 * n, 3, 4), _rand("rg.w2", G, 4, 2)
    H = [(_rand(f"rg.a{j}", G, 2 * n, 3, 5), _rand(f"rg.b{j}", G, 2 * n, 3, 4),
          _rand(f"rg.c{j}", G, 2 * n, 3, 2)) for j in range(n)]

    def loss(y1, y2, w1, v, w2, j):  # member j's term; the logical loss is their sum
        a, b, c = H[j]
        return _head(y1 @ w1, a) + _head(y1 * v, b) + _head(y2 @ w2, c)

    ref = [t.clone().requires_grad_() for t in (X1, X2, W1, V, W2)]
    sum(loss(*ref, j) for j in range(n)).backward()
    mine = [t.clone().requires_grad_() for t in (W1, V, W2)]
    want_w = torch.autograd.grad(loss(X1, X2, *mine, i), mine)

    for hooks in (True, False):
        x1, x2 = (X.chunk(n, 0)[i].clone().requires_grad_() for X in (X1, X2))
        w = [t.clone().requires_grad_() for t in (W1, V, W2)]
        saved = REGATHER.saved
        with group_cache.counter.window() as c:
            with forward_hooks(hooks) as call:
                y1 = collectives.all_gather(group_cache, x1, G, 0, bwd="reduce_scatter", regather=True)
                y2 = collectives.all_gather(group_cache, x2, G, 0, bwd="reduce_scatter", regather=True)
                out = loss(y1, y2, *w, i)
            call.at_backward(out)  # y2 is gathered from the start of backward, y1 after y2's read
            saved = REGATHER.saved - saved
            del y1, y2
            out.backward()
        what = f"all_gather(regather=True{'' if hooks else ', outside a forward'}) on {G}"
        _close(x1.grad, ref[0].grad.chunk(n, 0)[i], what + " grad x1")
        _close(x2.grad, ref[1].grad.chunk(n, 0)[i], what + " grad x2")
        for got, want, name in zip(w, want_w, ("w1", "v", "w2")):
            _close(got.grad, want, f"{what} grad {name}")
        again = {(AG, BWD): 2} if hooks else {}
        _counts(c, {(AG, FWD): 2, (RS, BWD): 2} | again, what)
        assert (saved >= 3) if hooks else (saved == 0), f"{what}: {saved} tensors saved as a shard"
        done.append(what)


def _check_reduce_scatter_and_split(group_cache, G, i, done):
    n = len(G)
    for axis in (0, 1, -1):
        X = _rand("rs.x", G, n, 2 * n, n, 3 * n)  # n partial pieces
        W = _rand("rs.w", G, 2 * n, n, 3 * n)
        ref = X.clone().requires_grad_()
        Y = ref.sum(0)
        _head(Y, W).backward()
        leaf, x = _leaf(X[i], axis != 1)
        with group_cache.counter.window() as c:
            y = collectives.reduce_scatter(group_cache, x, G, axis)
            _head(y, W.chunk(n, axis)[i]).backward()
        what = f"reduce_scatter(axis={axis}) on {G}"
        _close(y, Y.chunk(n, axis)[i], what + " forward")
        _close(_grad(leaf, axis != 1), ref.grad[i], what + " grad")
        _counts(c, {(RS, FWD): 1, (AG, BWD): 1}, what)
        done.append(what)

        X = X[0]  # replicated input for split
        ref = X.clone().requires_grad_()
        _head(ref, W).backward()
        leaf, x = _leaf(X, True)
        with group_cache.counter.window() as c:
            y = collectives.split(group_cache, x, G, axis)
            _head(y, W.chunk(n, axis)[i]).backward()
        what = f"split(axis={axis}) on {G}"
        _close(y, X.chunk(n, axis)[i], what + " forward")
        _close(leaf.grad, ref.grad, what + " grad")
        _counts(c, {(AG, BWD): 1}, what)
        done.append(what)


def _check_all_to_all(group_cache, G, i, done):
    n = len(G)
    for a, b in ((0, 1), (1, 0), (1, 1), (2, 0), (-1, 1)):
        X = _rand("a2a.x", G, 2 * n, n * n, 3 * n)
        ref = X.clone().requires_grad_()
        # By definition: member j sends chunk i (along b) of its piece (chunk j along a) to i.
        outs = [torch.cat([p.chunk(n, b)[k] for p in ref.chunk(n, a)], dim=a) for k in range(n)]
        W = _rand("a2a.w", G, n, *outs[0].shape)
        sum(_head(o, w) for o, w in zip(outs, W)).backward()
        if a % 3 != b % 3:
            _close(outs[i], X.chunk(n, b)[i], "all_to_all reference")  # S(a) -> S(b)

        leaf, x = _leaf(X.chunk(n, a)[i], a != 0)
        with group_cache.counter.window() as c:
            y = collectives.all_to_all(group_cache, x, G, split_axis=b, cat_axis=a)
            _head(y, W[i]).backward()
        what = f"all_to_all(split_axis={b}, cat_axis={a}) on {G}"
        _close(y, outs[i].detach(), what + " forward")
        _close(_grad(leaf, a != 0), ref.grad.chunk(n, a)[i], what + " grad")
        _counts(c, {(A2A, FWD): 1, (A2A, BWD): 1}, what)
        done.append(what)


def _check_grad_ops(group_cache, G, i, done):
    n = len(G)
    X = _rand("f.x", G, 3, 5)
    W = _rand("f.w", G, n, 3, 5)
    ref = X.clone().requires_grad_()
    sum(_head(ref, w) for w in W).backward()
    x = X.clone().requires_grad_()
    with group_cache.counter.window() as c:
        y = collectives.grad_all_reduce(group_cache, x, G)
        _head(y, W[i]).backward()
    what = f"grad_all_reduce on {G}"
    _close(y, X, what + " forward")
    _close(x.grad, ref.grad, what + " grad")
    _counts(c, {(AR, BWD): 1}, what)
    done.append(what)

    x = X.clone().requires_grad_()
    y = collectives.grad_scale(x, 0.25)
    _head(y, W[0]).backward()
    ref = X.clone().requires_grad_()
    _head(ref, W[0]).backward()
    _close(y, X, "grad_scale forward")
    _close(x.grad, 0.25 * ref.grad, "grad_scale grad")
    done.append(f"grad_scale on {G}")


def _check_exchange(group_cache, done):
    r, w = group_cache.rank, group_cache.world_size
    nxt, prv = (r + 1) % w, (r - 1) % w
    sends = [(nxt, torch.full((r + 1, 2), float(r))), (nxt, torch.arange(r + 2))]
    specs = [(prv, (prv + 1, 2), torch.float32), (prv, (prv + 2,), torch.int64)]
    if w >= 3:
        sends.append(((r + 2) % w, torch.full((1, r + 1), -float(r), dtype=torch.float64)))
        src = (r - 2) % w
        specs.append((src, (1, src + 1), torch.float64))
    with group_cache.counter.window() as c:
        got = collectives.exchange(group_cache, sends, specs)
    assert torch.equal(got[0], torch.full((prv + 1, 2), float(prv))), got[0]
    assert torch.equal(got[1], torch.arange(prv + 2)), got[1]
    if w >= 3:
        assert torch.equal(got[2], torch.full((1, src + 1), -float(src), dtype=torch.float64))
    _counts(c, {(P2P, FWD): 1}, "exchange")
    done.append("exchange")


def _check_errors(group_cache, done):
    """Misuse fails on the calling rank with a message naming the group."""
    other = tuple(r for r in group_cache.world if r != group_cache.rank)
    if len(other) >= 2:
        msg = f"group {other}: called on rank {group_cache.rank}"
        with pytest.raises(collectives.CommError, match=re.escape(msg)):
            collectives.all_reduce(group_cache, torch.ones(2), other)
    with pytest.raises(TorchweaveError, match=r"\(%d,\): not created" % group_cache.rank):
        group_cache.get((group_cache.rank,))
    with pytest.raises(TorchweaveError, match=r"ranks \[9\]"):
        group_cache.get((0, 9))
    with pytest.raises(collectives.CommError, match="divide evenly"):
        collectives.reduce_scatter(group_cache, torch.ones(group_cache.world_size + 1), group_cache.world, 0)
    with pytest.raises(collectives.CommError, match="axis"):
        collectives.all_gather(group_cache, torch.ones(2, 2), group_cache.world, 2)
    with pytest.raises(collectives.CommError, match="peers"):
        collectives.exchange(group_cache, [(group_cache.rank, torch.ones(1))], [])
    done.append("errors")


def _comm_job(ctx, partitions, abort_marker):
    group_cache = ctx.groups
    group_cache.create_all([g for part in partitions for g in part])
    done: list[str] = []
    for part in partitions:
        (G,) = [g for g in part if ctx.rank in g]
        i = G.index(ctx.rank)
        with group_cache.counter.window() as outer:
            _check_all_reduce(group_cache, G, i, done)
            _check_all_gather(group_cache, G, i, done)
            _check_regather(group_cache, G, i, done)
            _check_reduce_scatter_and_split(group_cache, G, i, done)
            _check_all_to_all(group_cache, G, i, done)
            _check_grad_ops(group_cache, G, i, done)
        # all_reduce 2+4, all_gather 3+2*2, regather 6+4, reduce_scatter+split 3*3,
        # all_to_all 5*2, f 1
        assert outer.count() == outer.count(group=G) == 6 + 7 + 10 + 9 + 10 + 1, outer
    _check_exchange(group_cache, done)
    before = group_cache.counter.count()
    _check_errors(group_cache, done)
    assert group_cache.counter.count() == before
    if abort_marker and ctx.rank == ctx.world_size - 1:
        atexit.register(_die_at_exit, abort_marker)  # the teardown crash of PLATFORM.md
    return done


def _die_at_exit(marker: str) -> None:
    Path(marker).write_text("died")
    os._exit(134)


@pytest.mark.parametrize("world_size, partitions", [
    (2, [[(0, 1)]]),
    (4, [[(0, 1, 2, 3)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]]),
], ids=["w2", "w4"])
def test_collectives_match_one_process(world_size, partitions, tmp_path):
    marker = tmp_path / "died"
    config = LaunchConfig(world_size=world_size, timeout_s=30, threads_per_rank=1)
    results = spawn(_comm_job, config, partitions, str(marker))
    assert len(results) == world_size
    per_group = 2 * 2 + 5 + 2 + 3 * 2 + 5 + 2
    assert all(len(done) == per_group * len(partitions) + 2 for done in results), results[0]
    assert marker.read_text() == "died"  # a rank crashed at exit, after its result


def _fail_job(ctx, how, pid_dir):
    Path(pid_dir, str(ctx.rank)).write_text(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(0.5)  # let rank 0 block in the collective first
        if how == "raise":
            raise ValueError("boom on purpose")
        os._exit(3)
    try:
        collectives.all_reduce(ctx.groups, torch.ones(2), ctx.groups.world)
    finally:
        time.sleep(600)  # a rank that never returns: spawn must kill it


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failing_rank_stops_all(how, tmp_path):
    with pytest.raises(RankFailedError) as info:
        spawn(_fail_job, LaunchConfig(world_size=2, timeout_s=5, threads_per_rank=1),
              how, str(tmp_path))
    # From rank 1's failure (0.5 s after it wrote its pid) to spawn raising,
    # with rank 0 stuck for 600 s: not start-up, which varies with load.
    latency = time.time() - (tmp_path / "1").stat().st_mtime - 0.5
    err = info.value
    assert err.rank == 1
    assert "rank 1" in str(err)
    if how == "raise":
        assert "ValueError: boom on purpose" in str(err) and "_fail_job" in err.traceback
    else:
        assert "exited with code 3" in str(err)
    assert latency < 5, f"spawn took {latency:.1f}s to give up after the failure"
    for pid_file in tmp_path.iterdir():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_launch_config_validation():
    with pytest.raises(LaunchError) as info:
        LaunchConfig(world_size=0, backend="mpi", timeout_s=-1, threads_per_rank=0)
    msg = str(info.value)
    assert "4 problems" in msg
    for field in ("world_size: 0", "backend: 'mpi'", "timeout_s: -1", "threads_per_rank: 0"):
        assert f"LaunchConfig.{field}" in msg, msg
    with pytest.raises(LaunchError, match="timeout_s: inf"):
        LaunchConfig(world_size=2, timeout_s=float("inf"))
    with pytest.raises(LaunchError, match="world_size: True"):
        LaunchConfig(world_size=True)
    cfg = LaunchConfig(world_size=64, backend="gloo")
    assert cfg.resolved_backend() == "gloo" and cfg.resolved_threads() >= 1
    assert LaunchConfig(world_size=2, threads_per_rank=3).resolved_threads() == 3

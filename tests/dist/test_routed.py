"""The routed exchange (``runtime/routed.py``: route, dispatch, combine) on real gloo
ranks, against the sum of every member's terms computed in one process: forward and the
gradients of the rows, the weights and the experts, with spread routing and with routing
that leaves members with nothing to receive."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.dist.test_comm import A2A, BWD, FWD, _close, _counts, _head, _rand
from torchweave.runtime import collectives
from torchweave.runtime.launch import LaunchConfig, spawn

pytestmark = pytest.mark.dist


def _terms(x, index, w, experts, lo):
    """Σ_j w[r, j] · x[r] @ experts[index[r, j] - lo] over the pairs whose expert is held."""
    out = x.new_zeros(x.shape)
    for j in range(index.shape[1]):
        e = index[:, j] - lo
        held = (e >= 0) & (e < len(experts))
        term = torch.einsum("rd,rdf->rf", x, experts[e.clamp(0, len(experts) - 1)])
        out = out + torch.where(held.unsqueeze(1), term * w[:, j:j + 1], 0.0)
    return out


def _check_routed(group_cache, G, i, done):
    """route, dispatch and combine against the sum of every member's terms on every row:
    spread routing, and routing that sends every row to member 0 (the others receive none)."""
    n, rows, k, d, per = len(G), 5, 2, 3, 2
    owners = tuple((m * per, (m + 1) * per) for m in range(n))
    for case in ("spread", "all to member 0"):
        X = _rand(f"r.x{case}", G, n * rows, d)
        Wt = _rand(f"r.w{case}", G, n * rows, k)
        E = _rand(f"r.e{case}", G, n * per, d, d)
        Wout = _rand(f"r.o{case}", G, n * rows, d)
        g = torch.Generator().manual_seed(zlib.crc32(f"r.i{case}{G}".encode()))
        high = n * per if case == "spread" else per
        index = torch.stack([torch.randperm(high, generator=g)[:k] for _ in range(n * rows)])
        rx, rw, re = (t.clone().requires_grad_() for t in (X, Wt, E))
        _head(_terms(rx, index, rw, re, 0), Wout).backward()
        mine = slice(i * rows, (i + 1) * rows)
        x, w = X[mine].clone().requires_grad_(), Wt[mine].clone().requires_grad_()
        experts = E[owners[i][0]:owners[i][1]].clone().requires_grad_()
        with group_cache.counter.window() as c:
            idx = collectives.route(group_cache, index[mine], G, owners=owners)
            xr = collectives.dispatch(group_cache, x, G, route=idx)
            wr = collectives.dispatch(group_cache, w, G, route=idx)
            y = collectives.combine(group_cache, _terms(xr, idx, wr, experts, owners[i][0]), G,
                                    route=idx)
            _head(y, Wout[mine]).backward()
        what = f"routed exchange ({case}) on {G}"
        _close(y, _terms(X, index, Wt, E, 0)[mine], what + " forward")
        _close(x.grad, rx.grad[mine], what + " grad of the rows")
        _close(w.grad, rw.grad[mine], what + " grad of the weights")
        _close(experts.grad, re.grad[owners[i][0]:owners[i][1]], what + " grad of the experts")
        # route: its counts and the index; dispatch twice; combine; each float one back
        _counts(c, {(A2A, FWD): 5, (A2A, BWD): 3}, what)
        done.append(what)


def _job(ctx, partitions):
    ctx.groups.create_all([g for part in partitions for g in part])
    done: list[str] = []
    for part in partitions:
        (G,) = [g for g in part if ctx.rank in g]
        _check_routed(ctx.groups, G, G.index(ctx.rank), done)
    return done


@pytest.mark.parametrize("world_size, partitions", [
    (2, [[(0, 1)]]),
    (4, [[(0, 1, 2, 3)], [(0, 2), (1, 3)]]),
], ids=["w2", "w4"])
def test_the_routed_exchange_matches_one_process(world_size, partitions):
    config = LaunchConfig(world_size=world_size, timeout_s=30, threads_per_rank=1)
    results = spawn(_job, config, partitions)
    assert all(len(done) == 2 * len(partitions) for done in results), results[0]

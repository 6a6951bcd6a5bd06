"""Op zoos: small modules whose captured graphs call every registered ATen op
that the bundled tiny models do not.

Each zoo is an ordinary ``nn.Module`` written with public torch functions (the
last one excepted, see :class:`InternalOps`); it is captured with
:func:`torchweave.capture.export.capture` and replayed by
:func:`~torchweave.ops.selfcheck.graph_cases`, so every call is one that
torch.export really produces, on the tensors it really sees. Split dims are
multiples of 4; values are realistic (logs of positive numbers, indices in
range, masks as bools).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchweave.capture.export import capture
from torchweave.ops.selfcheck import Case, graph_cases

B, T, D = 4, 8, 16


class Elementwise(nn.Module):
    """Unary and binary maths, comparisons, boolean logic, masking, with broadcasting."""

    def forward(self, x, y, keep, ids):
        # x [B T D], y [T D] (broadcast), keep [B 1 D] bool, ids [B T] int
        p = x.abs() + 0.5
        a = p.sqrt() + p.log() + p.exp().reciprocal() + x.erf() + x.square()
        a = a + x.sigmoid() + x.relu() + torch.pow(p, y.sigmoid())
        a = a.clamp(-3.0, 3.0)
        a = torch.maximum(a, y) - torch.minimum(x, y)
        a = 1.0 - a                                           # rsub.Scalar
        wide = (x >= 0.5) | (x <= -0.5)                       # ge/le.Scalar, __or__
        picked = torch.bitwise_and(x > y, keep)               # gt.Tensor, bitwise_and
        either = torch.bitwise_or(x < y, ~(x != y))           # lt/ne.Tensor, bitwise_not
        both = torch.logical_and(wide, torch.logical_not(picked))
        gate = torch.logical_or(both, x >= y) & (ids == 3).unsqueeze(-1)  # ge.Tensor, eq.Scalar
        a = torch.where(gate, a, x)
        a = a.masked_fill(either, 0.0)                        # masked_fill.Scalar
        a = a.masked_fill(~keep, y.mean())                    # masked_fill.Tensor, mean.default
        return a


class Reductions(nn.Module):
    """Reductions over one axis, all axes, with and without keepdim."""

    def forward(self, x):
        # x [B T D]
        top = x.amax(-1, keepdim=True) - x.amin(1, keepdim=True)          # [B T D]
        idx = x.argmax(-1) + x.argmin(1).sum(-1, keepdim=True)            # [B T]
        vmax, imax = x.max(dim=1)
        vmin, imin = x.min(dim=-1, keepdim=True)
        pos = x > 0
        flags = pos.all(-1) | pos.any(1).all(-1, keepdim=True) | pos.all()  # all.dim, all.default
        spread = x.var(-1, correction=0, keepdim=True) + x.std(dim=1, correction=1).unsqueeze(1)
        scale = x.abs().mean() + x.var(correction=0)
        spread = spread + x.var(1, False, keepdim=True) + x.std(-1, True, True)  # var.dim, std.dim
        spread = spread + torch.where(x > 0, x, 0.5) + torch.where(x < 1, 2.0, x)  # where.Scalar*
        run = (x.sigmoid() + 0.5).cumprod(1)
        logp = F.log_softmax(x, dim=-1)
        out = top + vmin + spread + run + logp + vmax.unsqueeze(1) * scale
        return out, idx + imax.sum(-1, keepdim=True) + imin.squeeze(-1), flags


class Shapes(nn.Module):
    """Slicing, stacking, splitting, padding, gathering and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(T, D))

    def forward(self, x, index):
        # x [B T D]; index [B T 4] int64 in [0, D)
        n = x.narrow(1, 2, 4)                                # [B 4 D]
        s = x[:, :1].squeeze(1)                              # squeeze.dim
        s2 = x[:, 3:4].squeeze()                             # squeeze.default
        st = torch.stack([s, s2 * 2.0], dim=1)               # [B 2 D]
        parts = x.unbind(1)                                  # T tensors [B D]
        head, tail = x.split([4, 12], dim=-1)                # split_with_sizes
        halves = x.split(4, dim=1)                           # split.Tensor (not on a projection)
        proj = x @ self.w.t()                                # t, matmul [B T T]
        tri = proj.tril() - proj.triu(1)
        rep = st.repeat(1, 2, 1)                             # [B 4 D]
        pad = torch.constant_pad_nd(head, (2, 2), 0.5)      # [B T 8]
        g = x.gather(-1, index)                              # [B T 4]
        sc = torch.zeros_like(x).scatter(-1, index, 1.0)     # scatter.value
        sc = sc.scatter(-1, index[..., :2], g[..., :2])      # scatter.src
        sa = torch.zeros_like(x).scatter_add(-1, index, g)   # scatter_add
        c = x.clone()
        d = x.detach()
        const = torch.tensor([1.0, -1.0, 0.5, 2.0])          # lift_fresh_copy
        out = n + rep + parts[0].unsqueeze(1) + parts[-1].unsqueeze(1) + halves[0] * halves[1]
        return (out, tri, pad + tail[..., :8], g * const, sc + sa + c - d)


class Contractions(nn.Module):
    """Matrix products, addmm with scaling, convolutions, RMS norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel_size=3, padding=1)
        self.grouped = nn.Conv1d(D, D, kernel_size=3, padding=1, groups=2, bias=False)
        self.kernel = nn.Parameter(torch.randn(D, D, 1) * 0.2)
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
        self.b = nn.Parameter(torch.randn(D))
        self.b2 = nn.Parameter(torch.randn(B * T, D))
        self.v = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        # x [B T D], y [B D T]
        h = self.norm(x)                                          # rms_norm
        flat = h.reshape(B * T, D)
        m = torch.addmm(self.b, flat, self.w, beta=0.5, alpha=2.0)  # addmm (kept by capture)
        m = torch.addmm(self.b2, m, self.w, beta=2.0)             # addmm, 2-D bias
        att = torch.bmm(h, h.transpose(1, 2))                     # [B T T]
        mix = torch.matmul(att.unsqueeze(1), h.view(B, 1, T, D))  # broadcast batch dims
        vec = torch.matmul(h, self.v)                             # matrix @ vector
        row = torch.matmul(self.v, y)                             # vector @ batched matrix
        conv = self.conv(y) + self.grouped(y) + F.conv1d(y, self.kernel)  # conv1d
        return (m.view(B, T, D) + mix.squeeze(1) + vec.unsqueeze(-1),
                conv + row.unsqueeze(1), F.rms_norm(conv.transpose(1, 2), (D,)))


class Factories(nn.Module):
    """Tensors made from shapes and fill values, and random tensors like an input."""

    def forward(self, x):
        # x [B T D]
        e = torch.empty(B, T, D).fill_(0.25)
        ne = x.new_empty(T, D).fill_(-1.0)
        f = torch.full((T, D), 2.0) + x.new_full((B, T, D), 0.5)
        z = torch.zeros(B, T, D) + torch.ones(D) + torch.zeros_like(x) - torch.ones_like(x)
        fl = torch.full_like(x, 3.0) * torch.scalar_tensor(0.5)
        noise = torch.rand_like(x) + torch.randn_like(x)
        return x + e + ne + f + z + fl + 1e-3 * noise


class InternalOps(nn.Module):
    """ATen overloads that public torch functions never export to, called by name.

    ``x + 2`` exports as ``add.Tensor``, ``softmax`` as ``softmax.int``, ``.to``
    as ``to.dtype`` and ``view`` as ``view``: these are reached only through
    ``torch.ops.aten`` in a model's forward.
    """

    def forward(self, x):
        # x [B T D]
        aten = torch.ops.aten
        p = aten._softmax.default(x, -1, False) + aten._log_softmax.default(x, 1, False)
        q = aten._to_copy.default(p, dtype=torch.float64)
        v = aten._unsafe_view.default(x, [B * T, D])
        s = aten.add.Scalar(x, 2.0) - aten.sub.Scalar(x, 1.0)
        s = aten.mul.Scalar(s, 3.0) + aten.div.Scalar(x, 4.0)
        return q, v, s


class Routing(nn.Module):
    """Maths, sorting, histograms and scatters of mixture-of-experts routing and of
    functionalized in-place code (``aten_data``)."""

    def forward(self, x, y, ids):
        # x [B T D], y [T D], ids [B T] int in [0, 5)
        aten = torch.ops.aten
        p = x.abs() + 0.5
        a = torch.min(x, y) + torch.max(x, y) + torch.fmod(x, 0.7) + torch.fmod(x, p)
        a = a + torch.remainder(x, 0.3) + torch.remainder(x, p) + x.floor() + x.ceil()
        a = a + x.round() + x.trunc() + x.sign() + p.log1p() + x.expm1() + p.log2()
        a = a + x.clamp_min(-0.5) + x.clamp_max(0.5) + torch.atan2(x, p)
        a = a + F.leaky_relu(x) + F.hardtanh(x) + F.elu(x) + F.softplus(x)
        a = a + F.hardsigmoid(x) + F.hardswish(x) + F.mish(x)
        bad = torch.logical_xor(x.isnan(), x.isinf() | (x > 1))
        q = torch.floor_divide(ids, 2)
        vals, order = x.sort(-1, descending=True)
        stable = torch.sort(x, dim=1, stable=True)[0] + torch.argsort(x, dim=-1).float() + torch.argsort(x, dim=1, stable=True).float()
        hist = torch.histc(ids.float(), bins=5, min=0, max=4) + torch.histc(x, bins=5)
        sel = x.index_select(1, ids[0, :3])
        aten = torch.ops.aten
        c = aten.copy.default(x, y) + aten.fill.Tensor(x, y[0, 0]) + aten.fill.Scalar(x, 0.5)
        sc = aten.slice_scatter.default(x, y[:3].expand(B, 3, D), 1, 2, 5)
        sc = sc + aten.select_scatter.default(x, y[:B, :], 1, 3)
        out = a + vals + stable + c + sc + order.float()
        return out.masked_fill(bad, 0.0), q, hist, sel


class Losses(nn.Module):
    """Cross-entropy forms that capture keeps as one op (per-token, or with a
    spatial axis); the mean and sum over ``[n, classes]`` are rewritten."""

    def forward(self, x, t):
        # x [B T D] as (batch, classes, positions); t [B D]
        each = torch.nn.functional.cross_entropy(x, t, reduction="none")
        flat = torch.nn.functional.cross_entropy(x[:, :, 0], t[:, 0], reduction="none")
        return each, flat


def zoo_cases() -> list[Case]:
    """Every op call of every zoo, on the tensors the captured graphs see."""
    with torch.random.fork_rng(devices=[]):  # seeded here, the global RNG left as it was
        torch.manual_seed(0)
        return _cases()


def _cases() -> list[Case]:
    x = torch.randn(B, T, D)
    zoos: list[tuple[nn.Module, tuple[torch.Tensor, ...]]] = [
        (Elementwise(), (x, torch.randn(T, D), torch.rand(B, 1, D) > 0.3,
                         torch.randint(0, 5, (B, T)))),
        (Reductions(), (x,)),
        (Shapes(), (x, torch.randint(0, D, (B, T, 4)))),
        (Contractions(), (x, torch.randn(B, D, T))),
        (Factories(), (x,)),
        (InternalOps(), (x,)),
        (Losses(), (x, torch.randint(0, T, (B, D)))),
        (Routing(), (x, torch.randn(T, D), torch.randint(0, 5, (B, T)))),
    ]
    cases: list[Case] = []
    for model, inputs in zoos:
        graph = capture(model, inputs, name=type(model).__name__)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        cases.extend(graph_cases(graph, state, inputs, f"zoo.{type(model).__name__}"))
    return cases

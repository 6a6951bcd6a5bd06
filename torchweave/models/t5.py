"""A small T5-style encoder-decoder (v1.1 flavour).

Shared input embedding, RMS-style T5 LayerNorm (no mean subtraction, no
bias), bucketed relative position bias (one table per stack, shared by its
layers, bucket indices precomputed as a buffer), gated-GELU feed-forward and
an untied LM head. As in T5, attention logits are not scaled by
1/sqrt(head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchweave.models.upcast import upcast


@dataclass(frozen=True, kw_only=True)
class T5Config:
    """Hyper-parameters of :class:`T5`."""

    vocab_size: int = 32128
    """Size of the shared vocabulary."""
    block_size: int
    """Maximum encoder/decoder length (size of the precomputed bucket tables)."""
    d_model: int
    """Width of the residual stream."""
    d_kv: int
    """Width of each attention head."""
    n_head: int
    """Number of attention heads."""
    d_ff: int
    """Hidden width of the gated-GELU feed-forward."""
    n_enc_layer: int
    """Number of encoder blocks."""
    n_dec_layer: int
    """Number of decoder blocks."""
    num_buckets: int = 32
    """Number of relative-position buckets."""
    max_distance: int = 128
    """Distance at which the logarithmic buckets saturate."""
    norm_eps: float = 1e-6
    """Epsilon of the T5 LayerNorm."""


class T5LayerNorm(nn.Module):
    """Scale-only RMS normalization, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def relative_position_buckets(
    length: int, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    """[length, length] bucket ids for relative position (key - query).

    Small distances get their own bucket, larger ones share logarithmically
    wider buckets up to ``max_distance``. Bidirectional tables spend half the
    buckets on each direction; causal tables only distinguish past positions.
    """
    pos = torch.arange(length)
    rel = pos[None, :] - pos[:, None]  # key - query
    offset = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        offset = (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(dist.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return offset + torch.where(dist < exact, dist, far)


class RelativeBias(nn.Module):
    """Learned per-head bias indexed by precomputed relative-position buckets."""

    def __init__(self, cfg: T5Config, bidirectional: bool) -> None:
        super().__init__()
        self.cfg, self.bidirectional = cfg, bidirectional
        self.embed = nn.Embedding(cfg.num_buckets, cfg.n_head)
        self.register_buffer("buckets", torch.empty(0, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the bucket table, e.g. after materializing from meta."""
        c = self.cfg
        b = relative_position_buckets(c.block_size, c.num_buckets, c.max_distance, self.bidirectional)
        self.buckets = b.to(self.embed.weight.device)

    def forward(self, T: int) -> torch.Tensor:
        """Bias of shape [1, n_head, T, T]."""
        return self.embed(self.buckets[:T, :T]).permute(2, 0, 1)[None]


class Attention(nn.Module):
    """Multi-head attention without bias terms; used for self- and cross-attention."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        inner = cfg.n_head * cfg.d_kv
        self.d_kv = cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        S = kv.shape[1]
        q = self.q(x).view(B, T, -1, self.d_kv).transpose(1, 2)
        k = self.k(kv).view(B, S, -1, self.d_kv).transpose(1, 2)
        v = self.v(kv).view(B, S, -1, self.d_kv).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class GatedGELU(nn.Module):
    """Feed-forward: wo(gelu(wi_0 x) * wi_1 x)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attn_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ff_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.ff = GatedGELU(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, bias)
        return x + self.ff(self.ff_norm(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.self_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.cross_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.cross_attn = Attention(cfg)
        self.ff_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.ff = GatedGELU(cfg)

    def forward(self, x: torch.Tensor, enc: torch.Tensor, self_mask: torch.Tensor) -> torch.Tensor:
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, self_mask)
        x = x + self.cross_attn(self.cross_norm(x), enc, None)
        return x + self.ff(self.ff_norm(x))


class T5(nn.Module):
    """Encoder-decoder language model with a shared embedding and untied LM head."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.enc_bias = RelativeBias(cfg, bidirectional=True)
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_enc_layer))
        self.enc_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.dec_bias = RelativeBias(cfg, bidirectional=False)
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_dec_layer))
        self.dec_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.register_buffer("causal_mask", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute every non-persistent buffer, e.g. after materializing from meta."""
        n = self.cfg.block_size
        mask = torch.full((n, n), float("-inf")).triu(1)
        self.causal_mask = mask.to(self.shared.weight.device)
        self.enc_bias.init_buffers()
        self.dec_bias.init_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, S] and [B, T]. Returns the mean loss if ``labels`` is given, else logits."""
        S, T = input_ids.shape[1], decoder_input_ids.shape[1]
        x = self.shared(input_ids)
        enc_bias = self.enc_bias(S).to(x.dtype)
        for block in self.encoder:
            x = block(x, enc_bias)
        enc = self.enc_norm(x)

        y = self.shared(decoder_input_ids)
        dec_mask = (self.dec_bias(T) + self.causal_mask[:T, :T]).to(y.dtype)
        for block in self.decoder:
            y = block(y, enc, dec_mask)
        logits = self.lm_head(self.dec_norm(y))
        if labels is None:
            return logits
        return F.cross_entropy(upcast(logits.flatten(0, 1)), labels.flatten())

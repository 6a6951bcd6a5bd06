"""A small Swin-style hierarchical vision transformer.

Blocks alternate between regular and shifted (``torch.roll``) window
attention. Each window attention adds a learned relative-position bias
gathered with a precomputed index buffer; shifted blocks also add a
precomputed mask that stops tokens from attending across the wrapped-around
image borders. All shapes are fixed by the config: no data-dependent control
flow, so the model traces with ``torch.export``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchweave.models.upcast import upcast


@dataclass(frozen=True, kw_only=True)
class SwinConfig:
    """Hyper-parameters of :class:`Swin`."""

    image_size: int
    """Height and width of the (square) input images."""
    patch_size: int
    """Patch size of the embedding convolution."""
    in_channels: int = 3
    """Channels of the input images."""
    num_classes: int
    """Number of output classes."""
    embed_dim: int
    """Channels of the first stage; each later stage doubles it."""
    depths: tuple[int, ...]
    """Number of blocks per stage."""
    num_heads: tuple[int, ...]
    """Attention heads per stage."""
    window_size: int
    """Side of the square attention windows."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of the stage width."""

    def __post_init__(self) -> None:
        if len(self.depths) != len(self.num_heads):
            raise ValueError("depths and num_heads must have the same length")
        res = self.image_size // self.patch_size
        for i in range(len(self.depths)):
            if res % min(self.window_size, res) != 0:
                raise ValueError(f"stage {i}: resolution {res} not divisible by window {self.window_size}")
            if i + 1 < len(self.depths):
                if res % 2 != 0:
                    raise ValueError(f"stage {i}: odd resolution {res} cannot be merged")
                res //= 2


def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * num_windows, w * w, C], windows in row-major order per image."""
    B, H, W, C = x.shape
    x = x.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B * (H // w) * (W // w), w * w, C)


def window_reverse(windows: torch.Tensor, w: int, B: int, H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: [B * num_windows, w * w, C] -> [B, H, W, C]."""
    C = windows.shape[-1]
    x = windows.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def relative_position_index(w: int) -> torch.Tensor:
    """[w*w, w*w] index into a [(2w-1)^2, heads] bias table."""
    coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)
    rel = coords[:, :, None] - coords[:, None, :] + (w - 1)  # [2, N, N], each in [0, 2w-2]
    return rel[0] * (2 * w - 1) + rel[1]


def shifted_window_mask(resolution: int, w: int, shift: int) -> torch.Tensor:
    """Additive mask [num_windows, w*w, w*w] for windows of an image rolled by ``-shift``."""
    region = torch.zeros(resolution, resolution)
    bounds = (slice(0, -w), slice(-w, -shift), slice(-shift, None))
    label = 0
    for hs in bounds:
        for ws in bounds:
            region[hs, ws] = label
            label += 1
    ids = window_partition(region[None, :, :, None], w).squeeze(-1)  # [nW, N]
    mask = torch.zeros(ids.shape[0], w * w, w * w)
    return mask.masked_fill(ids[:, :, None] != ids[:, None, :], float("-inf"))


class WindowAttention(nn.Module):
    """Multi-head self-attention inside (optionally shifted) windows."""

    def __init__(self, dim: int, n_head: int, window: int, shift: int, resolution: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.window, self.shift, self.resolution = window, shift, resolution
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.rel_pos_bias = nn.Parameter(torch.empty((2 * window - 1) ** 2, n_head))
        nn.init.normal_(self.rel_pos_bias, std=0.02)
        self.register_buffer("rel_pos_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("attn_mask", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the index and mask buffers, e.g. after materializing from meta."""
        device = self.rel_pos_bias.device
        self.rel_pos_index = relative_position_index(self.window).to(device)
        if self.shift > 0:
            self.attn_mask = shifted_window_mask(self.resolution, self.window, self.shift).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [B, H, W, C] -> [B, H, W, C]."""
        B, H, W, C = x.shape
        w, N = self.window, self.window * self.window
        if self.shift > 0:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(x, w)  # [B*nW, N, C]
        q = self.q_proj(win).view(-1, N, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(win).view(-1, N, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(win).view(-1, N, self.n_head, self.head_dim).transpose(1, 2)
        bias = self.rel_pos_bias[self.rel_pos_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        if self.shift > 0:
            nW = self.attn_mask.shape[0]
            mask = bias[None] + self.attn_mask[:, None]  # [nW, heads, N, N]
            mask = mask[None].expand(B, -1, -1, -1, -1).reshape(B * nW, -1, N, N)
        else:
            mask = bias[None]  # [1, heads, N, N], broadcast over windows
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        y = self.o_proj(y.transpose(1, 2).reshape(-1, N, C))
        x = window_reverse(y, w, B, H, W)
        if self.shift > 0:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        return x


class SwinBlock(nn.Module):
    """Pre-LN block: (shifted) window attention followed by an MLP."""

    def __init__(
        self, dim: int, n_head: int, window: int, shift: int, resolution: int, mlp_ratio: int
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, n_head, window, shift, resolution)
        self.norm2 = nn.LayerNorm(dim)
        self.fc_in = nn.Linear(dim, mlp_ratio * dim)
        self.fc_out = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.norm2(x))))


class PatchMerging(nn.Module):
    """Concatenate each 2x2 neighbourhood (4C), normalize, project to 2C; halves H and W."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x))


class Swin(nn.Module):
    """Swin-style classifier: patch embedding, window-attention stages, mean-pool, head."""

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.embed_dim, cfg.patch_size, cfg.patch_size)
        self.embed_norm = nn.LayerNorm(cfg.embed_dim)
        self.stages = nn.ModuleList()
        self.merges = nn.ModuleList()
        dim, res = cfg.embed_dim, cfg.image_size // cfg.patch_size
        for i, (depth, heads) in enumerate(zip(cfg.depths, cfg.num_heads)):
            # As in Swin, a stage no larger than one window uses one unshifted window.
            window = min(cfg.window_size, res)
            shift = window // 2 if res > window else 0
            self.stages.append(nn.Sequential(*(
                SwinBlock(dim, heads, window, shift if j % 2 == 1 else 0, res, cfg.mlp_ratio)
                for j in range(depth)
            )))
            if i + 1 < len(cfg.depths):
                self.merges.append(PatchMerging(dim))
                dim, res = 2 * dim, res // 2
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.num_classes)

    def init_buffers(self) -> None:
        """Recompute every non-persistent buffer (see :meth:`WindowAttention.init_buffers`)."""
        for m in self.modules():
            if isinstance(m, WindowAttention):
                m.init_buffers()

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``images``: [B, C, H, W]. Returns the mean loss if ``labels`` is given, else logits."""
        x = self.embed_norm(self.patch_embed(images).permute(0, 2, 3, 1))  # [B, H, W, C]
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i < len(self.merges):
                x = self.merges[i](x)
        logits = self.head(self.norm(x).mean(dim=(1, 2)))
        if labels is None:
            return logits
        return F.cross_entropy(upcast(logits), labels)

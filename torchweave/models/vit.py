"""A small Vision Transformer (ViT): Conv2d patch embedding, class token, pre-LN encoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchweave.models.upcast import upcast


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """Hyper-parameters of :class:`ViT`."""

    image_size: int
    """Height and width of the (square) input images."""
    patch_size: int
    """Height and width of a patch; must divide ``image_size``."""
    in_channels: int = 3
    """Channels of the input images."""
    num_classes: int
    """Number of output classes."""
    n_layer: int
    """Number of encoder blocks."""
    n_head: int
    """Number of attention heads; must divide ``d_model``."""
    d_model: int
    """Width of the token embeddings."""
    mlp_hidden: int
    """Hidden width of the MLP."""
    dropout: float = 0.0
    """Dropout probability on attention and residual branches."""

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size != 0:
            raise ValueError("patch_size must divide image_size")
        if self.d_model % self.n_head != 0:
            raise ValueError("n_head must divide d_model")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Attention(nn.Module):
    """Bidirectional multi-head self-attention."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, N, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.mlp_hidden)
        self.fc_out = nn.Linear(cfg.mlp_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LayerNorm encoder block."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return x


class ViT(nn.Module):
    """Image classifier; the head reads the class token."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.d_model, kernel_size=p, stride=p)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.num_patches + 1, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``images``: [B, C, H, W]. Returns the mean loss if ``labels`` is given, else logits."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, num_patches, d]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x[:, 0]))
        if labels is None:
            return logits
        return F.cross_entropy(upcast(logits), labels)

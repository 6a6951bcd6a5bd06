"""A small GPT-2 style decoder-only transformer (nanoGPT-like).

The model is written to be friendly to ``torch.export``: all shapes derive
from the input shape and there is no Python control flow on tensor values.
Attention uses separate q/k/v projections so that each can be sharded on its
own output dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchweave.models.upcast import upcast


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`."""

    vocab_size: int
    """Number of token ids (rows of the token embedding and LM head)."""
    block_size: int
    """Maximum sequence length (rows of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of attention heads; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    tie_weights: bool = True
    """Share the LM head weight with the token embedding."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, T, C] -> [B, n_head, T, head_dim]; -1 keeps this valid when the
        # projections are sharded and each rank holds a subset of the heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear(d, 4d) -> GELU -> Linear(4d, d)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT language model: token + learned position embeddings, pre-LN blocks, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        # nn.Embedding's default N(0, 1) makes a tied head's initial logits huge
        # (loss ~40 instead of ~ln(vocab)); use GPT-2's std of 0.02 instead.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: [B, T] token ids. Returns the mean loss if ``targets`` is given, else logits."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


def num_params(cfg: GPTConfig, *, include_position_embedding: bool = True) -> int:
    """Number of parameters of ``GPT(cfg)``, counting tied weights once (closed form)."""
    d, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    b = 1 if cfg.bias else 0
    ln = d + b * d
    attn = 4 * (d * d + b * d)
    mlp = 2 * 4 * d * d + b * (4 * d + d)
    n = V * d + L * (2 * ln + attn + mlp) + ln
    if not cfg.tie_weights:
        n += V * d
    if include_position_embedding:
        n += cfg.block_size * d
    return n


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    Uses the standard estimate from PaLM (Chowdhery et al., 2022), appendix B:
    ``6 * N + 12 * n_layer * d_model * seq_len``, where ``N`` is the number of
    parameters (tied weights counted once) excluding the position embedding,
    which is a lookup rather than a matmul. The second term counts the
    attention score and value matmuls.
    """
    n = num_params(cfg, include_position_embedding=False)
    return float(6 * n + 12 * cfg.n_layer * cfg.d_model * seq_len)

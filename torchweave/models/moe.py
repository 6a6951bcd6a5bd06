"""A small GPT-like transformer whose MLPs are top-k mixture-of-experts layers.

Routing follows GShard / Switch Transformer with a fixed expert capacity:
every token picks its top-k experts, takes a slot in each expert's buffer in
token order, and is dropped from an expert whose buffer is full. Dropless
routing (``capacity_factor=None``) gives every expert one slot per token, so no
token is ever dropped, at the price of buffers ``E / top_k`` times a balanced
load's (dense dispatch, every shape still static; a grouped matmul over
data-dependent groups would not be). Tokens are routed as one group (the whole
batch), or, with ``group_size``, in groups of that many tokens, each with its own
capacity, as GShard routes: the dispatch tensors then grow with the batch, not
with its square. Dispatch and
combine are dense [tokens, experts, capacity] tensors applied with einsum, so
all shapes depend only on the input shape and the model traces with
``torch.export`` (no data-dependent shapes or branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchweave.models.upcast import upcast


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Hyper-parameters of :class:`MoEGPT`."""

    vocab_size: int
    """Number of token ids."""
    block_size: int
    """Maximum sequence length (rows of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of attention heads; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    ffn_hidden: int
    """Hidden width of each expert."""
    n_expert: int
    """Number of experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    capacity_factor: float | None = 1.25
    """Expert buffer size relative to a perfectly balanced load; ``None``: dropless (one
    slot per token in every expert, so no token is dropped)."""
    group_size: int | None = None
    """Tokens routed together (GShard's groups), each group with its own expert capacity;
    ``None``: the whole batch is one group. Must divide the batch's tokens."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the LM loss."""
    dropout: float = 0.0
    """Dropout probability in attention (kept for compatibility with the GPT blocks)."""
    bias: bool = True
    """Whether attention Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_expert={self.n_expert}]")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0, or None "
                             "for dropless routing")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1, or None to route "
                             "the whole batch as one group")


def expert_capacity(n_tokens: int, n_expert: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ceil(top_k * tokens * capacity_factor / experts); dropless (``None``):
    one per token, since a token takes at most one slot in each expert."""
    if capacity_factor is None:
        return n_tokens
    return max(1, math.ceil(top_k * n_tokens * capacity_factor / n_expert))


class MoELayer(nn.Module):
    """Top-k routed expert MLPs with fixed-capacity dispatch.

    Expert weights are stacked: ``w_in`` is [E, d, f] and ``w_out`` is [E, f, d],
    so expert parallelism can shard them on dim 0.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_expert, self.top_k, self.capacity_factor = cfg.n_expert, cfg.top_k, cfg.capacity_factor
        self.group_size = cfg.group_size
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.w_in = nn.Parameter(torch.empty(cfg.n_expert, cfg.d_model, cfg.ffn_hidden))
        self.w_out = nn.Parameter(torch.empty(cfg.n_expert, cfg.ffn_hidden, cfg.d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Same distribution as nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        nn.init.uniform_(self.w_in, -1 / math.sqrt(self.w_in.shape[1]), 1 / math.sqrt(self.w_in.shape[1]))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(self.w_out.shape[1]), 1 / math.sqrt(self.w_out.shape[1]))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: [S, d] (one group) or [G, S, d] (``G`` groups routed apart) -> combine
        [..., S, E, C], dispatch [..., S, E, C] and the load-balancing loss."""
        S, E = x.shape[-2], self.n_expert
        C = expert_capacity(S, E, self.top_k, self.capacity_factor)
        probs = F.softmax(upcast(self.router(x)), dim=-1)  # [..., S, E]
        gate_vals, gate_idx = torch.topk(probs, self.top_k, dim=-1)  # [..., S, k]
        gate_vals = gate_vals / gate_vals.sum(-1, keepdim=True)

        combine = probs.new_zeros(*x.shape[:-1], E, C)
        tok = x.dim() - 2  # the tokens' axis
        # slots already taken by earlier choices, per group
        filled = probs.new_zeros(*x.shape[:-2], 1, E) if tok else probs.new_zeros(E)
        for j in range(self.top_k):  # static loop over the k choices
            mask = F.one_hot(gate_idx[..., j], E).to(probs.dtype)  # [..., S, E]
            pos = torch.cumsum(mask, dim=tok) - 1 + filled  # slot each token would take
            mask = mask * (pos < C).to(probs.dtype)  # drop tokens over capacity
            filled = filled + mask.sum(tok, keepdim=bool(tok))
            slot = (pos * mask).sum(-1).long()  # [..., S]; 0 for dropped tokens, masked below
            slot_1h = F.one_hot(slot, C).to(probs.dtype)  # [..., S, C]
            combine = combine + (gate_vals[..., j, None] * mask)[..., None] * slot_1h[..., None, :]

        # Switch-style load balancing: E * sum_e(fraction routed to e) * (mean prob of e),
        # over every token, using the first choice of each.
        first = F.one_hot(gate_idx[..., 0], E).to(probs.dtype)
        if tok:
            first, probs = first.reshape(-1, E), probs.reshape(-1, E)
        aux = E * (first.mean(0) * probs.mean(0)).sum()
        dispatch = (combine > 0).to(x.dtype)
        return combine.to(x.dtype), dispatch, aux

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: [B, T, d] -> (output [B, T, d], load-balancing loss)."""
        B, T, d = x.shape
        if self.group_size is None:
            tokens = x.reshape(B * T, d)
            combine, dispatch, aux = self.route(tokens)
            expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)  # [E, C, d]
            h = F.gelu(torch.einsum("ecd,edf->ecf", expert_in, self.w_in))
            expert_out = torch.einsum("ecf,efd->ecd", h, self.w_out)  # [E, C, d]
            return torch.einsum("tec,ecd->td", combine, expert_out).view(B, T, d), aux
        if (B * T) % self.group_size:
            raise ValueError(f"MoE group_size={self.group_size} does not divide the batch's "
                             f"{B * T} tokens ({B} x {T}); choose a divisor, e.g. {T}")
        tokens = x.reshape(B * T // self.group_size, self.group_size, d)  # [G, S, d]
        combine, dispatch, aux = self.route(tokens)
        expert_in = torch.einsum("gtec,gtd->egcd", dispatch, tokens)  # [E, G, C, d]
        h = F.gelu(torch.einsum("egcd,edf->egcf", expert_in, self.w_in))
        expert_out = torch.einsum("egcf,efd->egcd", h, self.w_out)
        return torch.einsum("gtec,egcd->gtd", combine, expert_out).reshape(B, T, d), aux


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (same layout as the GPT model's)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MoEBlock(nn.Module):
    """Pre-LN block with causal self-attention and an MoE feed-forward."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor, aux_total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, load-balancing loss so far) -> both after this block (the sum
        kept in the block, so that every block is the same ops reading the one before)."""
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux_total + aux


class MoEGPT(nn.Module):
    """GPT-like language model with MoE feed-forwards and a tied LM head."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        # Small embedding init as in GPT-2 (see torchweave/models/gpt.py).
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: [B, T]. Returns LM loss + aux_loss_coef * mean load-balancing loss, else logits."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        aux_total = upcast(x.new_zeros(()))  # float32 at least, as the routers compute
        for block in self.blocks:
            x, aux_total = block(x, aux_total)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())
        return loss + self.cfg.aux_loss_coef * aux_total / len(self.blocks)

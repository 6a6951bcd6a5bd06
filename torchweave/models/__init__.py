"""Bundled example models and a registry of factories.

Every factory takes no arguments and returns ``(model, example_inputs)``;
``model(*example_inputs)`` returns the scalar training loss. Example inputs
come from a seeded ``torch.Generator`` and are deterministic; parameters use
torch's default init under the caller's global seed. The tiny models keep
every dimension divisible by 2 and 4 so they can be split 2 or 4 ways;
their example batch is 4 (images: 4) and sequences are 16 tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from torchweave.models.gpt import GPT, GPTConfig, flops_per_token
from torchweave.models.hf_zoo import ZOO
from torchweave.models.llama import Llama, LlamaConfig
from torchweave.models.moe import MoEConfig, MoEGPT
from torchweave.models.recycler import Recycler, RecyclerConfig
from torchweave.models.recycler import example as _recycler_example
from torchweave.models.swin import Swin, SwinConfig
from torchweave.models.t5 import T5, T5Config
from torchweave.models.vit import ViT, ViTConfig

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]

_SEED = 1234


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(_SEED)


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, next-token targets) of shape [batch, seq]."""
    data = torch.randint(0, vocab, (batch, seq + 1), generator=_gen())
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _images(batch: int, size: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen()
    images = torch.randn(batch, 3, size, size, generator=g)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    return images, labels


def _gpt(cfg: GPTConfig, batch: int, seq: int) -> Example:
    return GPT(cfg), _tokens(cfg.vocab_size, batch, seq)


def gpt_tiny() -> Example:
    return _gpt(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64), 4, 16)


def gpt_small() -> Example:
    """About 10M parameters."""
    return _gpt(GPTConfig(vocab_size=8192, block_size=128, n_layer=10, n_head=8, d_model=256), 8, 128)


def gpt_medium() -> Example:
    """GPT-2 medium shape (~350M parameters); example batch 1 x 256."""
    return _gpt(GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, d_model=1024), 1, 256)


def gpt_175b() -> Example:
    """GPT-3 175B shape, built on the meta device (no memory is allocated)."""
    cfg = GPTConfig(vocab_size=50304, block_size=2048, n_layer=96, n_head=96, d_model=12288)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.empty(1, 2048, dtype=torch.long)
        targets = torch.empty(1, 2048, dtype=torch.long)
    return model, (idx, targets)


def llama_tiny() -> Example:
    cfg = LlamaConfig(
        vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_hidden=128
    )
    return Llama(cfg), _tokens(cfg.vocab_size, 4, 16)


def llama_small() -> Example:
    """About 10M parameters."""
    cfg = LlamaConfig(
        vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_kv_head=4, d_model=256, ffn_hidden=704
    )
    return Llama(cfg), _tokens(cfg.vocab_size, 8, 128)


def vit_tiny() -> Example:
    """32x32 images, 8x8 patches (16 patches + class token = 17 tokens)."""
    cfg = ViTConfig(
        image_size=32, patch_size=8, num_classes=16, n_layer=2, n_head=4, d_model=64, mlp_hidden=256
    )
    return ViT(cfg), _images(4, cfg.image_size, cfg.num_classes)


def swin_tiny() -> Example:
    """32x32 images, 2x2 patches, 4x4 windows; stages at 16x16 (C=32) and 8x8 (C=64)."""
    cfg = SwinConfig(
        image_size=32, patch_size=2, num_classes=16, embed_dim=32,
        depths=(2, 2), num_heads=(4, 8), window_size=4,
    )
    return Swin(cfg), _images(4, cfg.image_size, cfg.num_classes)


def t5_tiny() -> Example:
    """Large (32128) vocabulary with a narrow model."""
    cfg = T5Config(
        vocab_size=32128, block_size=32, d_model=64, d_kv=16, n_head=4, d_ff=128,
        n_enc_layer=2, n_dec_layer=2,
    )
    g = _gen()
    input_ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    # Teacher forcing: decoder inputs are the labels shifted right, starting from id 0.
    decoder_input_ids = torch.cat([torch.zeros(4, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return T5(cfg), (input_ids, decoder_input_ids, labels)


def moe_tiny() -> Example:
    """4 experts, top-2 routing, capacity factor 1.25 (64 tokens -> 40 slots per expert)."""
    cfg = MoEConfig(
        vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64, ffn_hidden=128,
        n_expert=4, top_k=2,
    )
    return MoEGPT(cfg), _tokens(cfg.vocab_size, 4, 16)


def moe_dropless_tiny() -> Example:
    """``moe-tiny`` with dropless routing: every expert has a slot for each of the 64 tokens."""
    cfg = MoEConfig(
        vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64, ffn_hidden=128,
        n_expert=4, top_k=2, capacity_factor=None,
    )
    return MoEGPT(cfg), _tokens(cfg.vocab_size, 4, 16)


def moe_grouped_tiny() -> Example:
    """``moe-tiny`` routed per sequence (GShard's groups, ``group_size=16``): each of the 4
    sequences fills its own 10 slots per expert."""
    cfg = MoEConfig(
        vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64, ffn_hidden=128,
        n_expert=4, top_k=2, group_size=16,
    )
    return MoEGPT(cfg), _tokens(cfg.vocab_size, 4, 16)


def recycler_tiny() -> Example:
    """An AlphaFold-style recycling model (:mod:`torchweave.models.recycler`); batch 8."""
    return _recycler_example(RecyclerConfig(), 8)


def _hf_tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face shifts labels internally, so labels are the input ids themselves."""
    input_ids = torch.randint(0, vocab, (batch, seq), generator=_gen())
    return input_ids, input_ids.clone()


def hf_gpt2_tiny() -> Example:
    """Needs ``transformers``."""
    from torchweave.models.hf import hf_gpt2

    return hf_gpt2(), _hf_tokens(256, 4, 16)


def hf_llama_tiny() -> Example:
    """Needs ``transformers``."""
    from torchweave.models.hf import hf_llama

    return hf_llama(), _hf_tokens(256, 4, 16)


FACTORIES: dict[str, Callable[[], Example]] = {
    "gpt-tiny": gpt_tiny,
    "gpt-small": gpt_small,
    "gpt-medium": gpt_medium,
    "gpt-175b": gpt_175b,
    "llama-tiny": llama_tiny,
    "llama-small": llama_small,
    "vit-tiny": vit_tiny,
    "swin-tiny": swin_tiny,
    "t5-tiny": t5_tiny,
    "moe-tiny": moe_tiny,
    "moe-dropless-tiny": moe_dropless_tiny,
    "moe-grouped-tiny": moe_grouped_tiny,
    "recycler-tiny": recycler_tiny,
    "hf-gpt2-tiny": hf_gpt2_tiny,
    "hf-llama-tiny": hf_llama_tiny,
    **ZOO,  # eleven more transformers families (hf_zoo.py)
}


def get_factory(name: str) -> Callable[[], Example]:
    """Look up a bundled factory by name."""
    try:
        return FACTORIES[name]
    except KeyError:
        known = ", ".join(sorted(FACTORIES))
        raise KeyError(
            f"unknown model {name!r}; known models: {known}. "
            "To use your own model, pass an nn.Module and example inputs instead of a name."
        ) from None


def build(name: str) -> Example:
    """Build the bundled model ``name``: returns ``(model, example_inputs)``."""
    return get_factory(name)()


__all__ = [
    "FACTORIES", "build", "get_factory", "flops_per_token",
    "GPT", "GPTConfig", "Llama", "LlamaConfig", "MoEGPT", "MoEConfig", "Recycler", "RecyclerConfig",
    "Swin", "SwinConfig", "T5", "T5Config", "ViT", "ViTConfig",
]

"""Tiny ``transformers`` models of many families, built from small configs (nothing is
downloaded): the architectures users bring, as the test suite verifies them.

Each factory returns ``(model, inputs)`` where ``model(*inputs)`` is the loss the
model's own head computes (:class:`HFTask` passes the inputs by keyword). The
families, and what each adds:

- ``hf-mistral-tiny``: grouped-query attention with a sliding window (8 of 16 tokens);
- ``hf-gemma-tiny``: RMS norms that scale by ``1 + weight`` with the weight at zero,
  one key/value head (multi-query);
- ``hf-qwen2-tiny``: biases on the query, key and value projections;
- ``hf-phi3-tiny``: fused ``qkv_proj`` and ``gate_up_proj`` with grouped-query heads;
- ``hf-neox-tiny``: fused ``query_key_value`` and rotary embedding on half the head;
- ``hf-bert-tiny``: an encoder with a masked-LM head (labels -100 where unmasked);
- ``hf-t5-tiny``: encoder-decoder with relative position buckets;
- ``hf-vit-tiny``: patch embedding by convolution, classification;
- ``hf-convnext-tiny``: a convolutional network (depthwise convolutions, layer norms);
- ``hf-mixtral-tiny``: mixture of experts, top-2 of 4, through transformers' grouped
  matmul (captured as one ``torchweave.moe_experts`` op each, which ``ep`` splits);
- ``hf-qwen2moe-tiny``: experts plus a gated shared expert.

``transformers`` is imported inside the factories only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from torchweave.models.hf import _transformers

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]
_SEED = 1234
_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=32, vocab_size=256, use_cache=False)


class HFTask(nn.Module):
    """A transformers model whose forward takes ``keys`` positionally and returns its loss."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, inputs))).loss


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(_SEED)


def _tokens(batch: int = 4, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=_gen())


def _causal(cls: str, config: str, **fields: Any) -> Example:
    tf = _transformers()
    model = getattr(tf, cls)(getattr(tf, config)(**{**_DECODER, **fields}))
    ids = _tokens()
    return HFTask(model, ("input_ids", "labels")), (ids, ids.clone())  # the model shifts labels


def _images(model: nn.Module, size: int) -> Example:
    g = _gen()
    pixels, labels = torch.randn(4, 3, size, size, generator=g), torch.randint(0, 10, (4,), generator=g)
    return HFTask(model, ("pixel_values", "labels")), (pixels, labels)


def hf_mistral_tiny() -> Example:
    """Mistral: grouped-query attention, sliding window of 8 (needs transformers)."""
    return _causal("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=8)


def hf_gemma_tiny() -> Example:
    """Gemma: zero-initialized (1 + w) RMS norms, multi-query attention (needs transformers)."""
    return _causal("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=16)


def hf_qwen2_tiny() -> Example:
    """Qwen2: biased q/k/v projections, grouped-query attention (needs transformers)."""
    return _causal("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2)


def hf_phi3_tiny() -> Example:
    """Phi-3: fused qkv_proj and gate_up_proj (needs transformers)."""
    return _causal("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)


def hf_neox_tiny() -> Example:
    """GPT-NeoX: fused query_key_value, rotary on half of each head (needs transformers)."""
    return _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", rotary_pct=0.5)


def hf_mixtral_tiny() -> Example:
    """Mixtral: 4 experts, top-2 routing (needs transformers)."""
    return _causal("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2)


def hf_qwen2moe_tiny() -> Example:
    """Qwen2-MoE: 4 experts, top-2, and a gated shared expert (needs transformers)."""
    return _causal("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_key_value_heads=2, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=64)


def hf_bert_tiny() -> Example:
    """BERT: encoder with a masked-LM head, every third token a target (needs transformers)."""
    tf = _transformers()
    cfg = tf.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    ids = _tokens()
    labels = torch.where(torch.arange(16) % 3 == 0, ids, torch.full_like(ids, -100))
    return HFTask(tf.BertForMaskedLM(cfg), ("input_ids", "labels")), (ids, labels)


def hf_t5_tiny() -> Example:
    """T5: encoder-decoder, 16 source and 8 target tokens (needs transformers)."""
    tf = _transformers()
    cfg = tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    src = _tokens()
    tgt = torch.randint(1, 256, (4, 8), generator=torch.Generator().manual_seed(_SEED + 1))
    return HFTask(tf.T5ForConditionalGeneration(cfg), ("input_ids", "labels")), (src, tgt)


def hf_vit_tiny() -> Example:
    """ViT: 16×16 images in 4×4 patches, 10 classes (needs transformers)."""
    tf = _transformers()
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _images(tf.ViTForImageClassification(cfg), 16)


def hf_convnext_tiny() -> Example:
    """ConvNeXt: two stages of depthwise convolutions, 32×32 images (needs transformers)."""
    tf = _transformers()
    cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                            image_size=32, num_labels=10, drop_path_rate=0.0)
    return _images(tf.ConvNextForImageClassification(cfg), 32)


ZOO: dict[str, Callable[[], Example]] = {
    "hf-mistral-tiny": hf_mistral_tiny,
    "hf-gemma-tiny": hf_gemma_tiny,
    "hf-qwen2-tiny": hf_qwen2_tiny,
    "hf-phi3-tiny": hf_phi3_tiny,
    "hf-neox-tiny": hf_neox_tiny,
    "hf-bert-tiny": hf_bert_tiny,
    "hf-t5-tiny": hf_t5_tiny,
    "hf-vit-tiny": hf_vit_tiny,
    "hf-convnext-tiny": hf_convnext_tiny,
    "hf-mixtral-tiny": hf_mixtral_tiny,
    "hf-qwen2moe-tiny": hf_qwen2moe_tiny,
}
"""The families above, by the names the CLI knows them by."""

MOE = ("hf-mixtral-tiny", "hf-qwen2moe-tiny")

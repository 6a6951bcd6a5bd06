"""Tiny Hugging Face causal LMs (GPT-2 and Llama) built from configs, no download.

``transformers`` is an optional dependency: it is imported inside the
factories only. Each model is wrapped in :class:`HFCausalLM` whose forward
returns the loss, so parameter paths read ``model.<HF path>`` (for example
``model.transformer.h.0.attn.c_attn.weight``). Note that GPT-2 uses HF's
``Conv1D`` whose weight is stored [in_features, out_features], the transpose
of ``nn.Linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "the hf-* models need Hugging Face transformers: pip install transformers"
        ) from e
    return transformers


class HFCausalLM(nn.Module):
    """Wraps a Hugging Face causal LM; forward(input_ids, labels) returns the mean loss.

    As in Hugging Face, ``labels`` are aligned with ``input_ids`` (usually equal
    to them): the model shifts them by one position internally.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def hf_gpt2(
    *, vocab_size: int = 256, n_positions: int = 32, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
    attn_implementation: str = "sdpa",
) -> HFCausalLM:
    """A tiny ``GPT2LMHeadModel`` (tied LM head) with dropout off and no KV cache."""
    tf = _transformers()
    cfg = tf.GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, attn_implementation=attn_implementation,
    )
    model = tf.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # the class name does not say so; avoids a warning
    return HFCausalLM(model)


def hf_llama(
    *, vocab_size: int = 256, max_position_embeddings: int = 32, num_hidden_layers: int = 2,
    hidden_size: int = 64, num_attention_heads: int = 4, num_key_value_heads: int = 2,
    intermediate_size: int = 128, attn_implementation: str = "sdpa",
) -> HFCausalLM:
    """A tiny ``LlamaForCausalLM`` (untied LM head, grouped-query attention) with no KV cache."""
    tf = _transformers()
    cfg = tf.LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, use_cache=False, tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    return HFCausalLM(tf.LlamaForCausalLM(cfg))

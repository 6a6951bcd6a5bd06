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


class HFNextToken(HFCausalLM):
    """Wraps a Hugging Face causal LM for next-token targets (a train config's data:
    ``targets[t]`` is the token after ``input_ids[t]``); forward returns the mean
    cross-entropy of the model's logits against them."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hf_causal_lm(name: str, config: dict[str, Any]) -> HFNextToken:
    """A ``transformers`` causal LM by class name (``LlamaForCausalLM``), built from
    ``config`` (the fields of its config class) with fresh weights: nothing is
    downloaded, and only a class ``transformers`` exports whose name ends in
    ``ForCausalLM`` or ``LMHeadModel`` is looked up (a config names a model, it never
    runs code). The KV cache is off, since training does not use it."""
    from torchweave.errors import Problem, TorchweaveError

    tf = _transformers()
    causal = name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
    cls = getattr(tf, name, None) if name.isidentifier() and causal else None
    if not (isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel)):
        known = sorted(n for n in dir(tf) if n.endswith("ForCausalLM"))[:8]
        raise TorchweaveError(Problem(
            obj="model.hf", value=repr(name),
            rule="a causal LM class of transformers (its name ends in ForCausalLM or LMHeadModel)",
            fix=f"e.g. {', '.join(known)}"))
    try:
        cfg = cls.config_class(**{**config, "use_cache": False})
    except (TypeError, ValueError) as e:
        raise TorchweaveError(Problem(obj="model.config", value=repr(config),
                                      rule=f"fields of {cls.config_class.__name__} ({e})")) from None
    return HFNextToken(cls(cfg))


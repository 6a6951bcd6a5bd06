"""Text from a trained character-level model: what ``torchweave demo`` shows after training."""

from __future__ import annotations

import torch

from torchweave.train.build import build_model
from torchweave.train.config import TrainConfig
from torchweave.train.data import build_dataset


@torch.no_grad()
def sample_text(cfg: TrainConfig, weights: str, *, prompt_chars: int = 24, chars: int = 200,
                temperature: float = 0.8, seed: int = 0) -> tuple[str, str] | None:
    """(prompt, continuation) sampled from the merged ``weights`` on one process; ``None``
    when the data has no text to decode or the model's forward gives no logits."""
    from safetensors.torch import load_file

    dataset = build_dataset(cfg.data, cfg.seed)
    if not hasattr(dataset, "decode") or not hasattr(dataset, "tokens"):
        return None
    model = build_model(cfg.model, vocab_size=dataset.vocab_size, seq_len=cfg.data.seq_len)
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    idx = dataset.tokens[:prompt_chars].unsqueeze(0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(chars):
        logits = model(idx[:, -cfg.data.seq_len:])
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            return None
        probs = torch.softmax(logits[0, -1].float() / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g).view(1, 1)], dim=1)
    ids = idx[0].tolist()
    return dataset.decode(ids[:prompt_chars]), dataset.decode(ids[prompt_chars:])

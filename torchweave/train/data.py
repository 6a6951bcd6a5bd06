"""Training data: the bundled datasets and a resumable, seeded global-batch sampler.

Every rank draws the same *global* batch; the plan decides which rank computes
which part of it (a data-parallel plan slices dim 0, a tensor-parallel one
reads it whole). The sampler's whole state is one number, the count of samples
consumed, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import importlib
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from torchweave.errors import Problem
from torchweave.train.config import ConfigError, DataConfig


class Dataset(Protocol):
    """A map-style dataset whose items are tuples of tensors of equal shapes."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]: ...


class SyntheticTokens:
    """Seeded random token sequences: ``(inputs, next-token targets)``."""

    def __init__(self, *, seq_len: int, vocab_size: int, size: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (size, seq_len + 1), generator=g)
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


class CharText:
    """A text tokenized by characters, cut into overlapping windows of ``seq_len + 1``."""

    def __init__(self, text: str, *, seq_len: int, stride: int | None = None) -> None:
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len
        self.stride = stride or max(1, seq_len // 2)
        n = (len(self.tokens) - seq_len - 1) // self.stride + 1
        if n < 1:
            raise ConfigError(Problem(
                obj="data.seq_len", value=str(seq_len),
                rule=f"shorter than the text ({len(self.tokens)} characters)",
                fix="use a shorter seq_len or a longer text"))
        self.size = n

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = index * self.stride
        window = self.tokens[a:a + self.seq_len + 1]
        return window[:-1], window[1:]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def bundled_text() -> str:
    """The small English corpus shipped with torchweave (original prose, ~20 KB)."""
    return resources.files("torchweave.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def _import(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(Problem(obj=what, value=repr(spec),
                                  rule=f"an importable 'package.module:name' ({e})",
                                  fix="check the module is on PYTHONPATH and the name exists"))
    return obj


def build_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """The dataset a config names."""
    if cfg.kind == "synthetic":
        return SyntheticTokens(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, seed=seed)
    if cfg.kind == "text":
        if cfg.path is None:
            text = bundled_text()
        else:
            try:
                text = Path(cfg.path).read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(Problem(obj="data.path", value=cfg.path,
                                          rule=f"a readable UTF-8 text file ({e.strerror})"))
        return CharText(text, seq_len=cfg.seq_len, **cfg.kwargs)
    dataset = _import(cfg.kind, "data.kind")(**cfg.kwargs)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(Problem(obj="data.kind", value=repr(cfg.kind),
                                  rule="returns a map-style dataset (__len__ and __getitem__)"))
    return dataset


class Sampler:
    """Global batches in a seeded random order, epoch after epoch; resumable by one number."""

    def __init__(self, dataset: Dataset, global_batch: int, seed: int) -> None:
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.n = len(dataset)
        if self.n < 1:
            raise ConfigError(Problem(obj="dataset", value="empty", rule="at least one sample"))
        self.consumed = 0
        """Samples handed out so far (the data position saved in checkpoints)."""
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """The next global batch: each item field stacked along a new dim 0."""
        items = []
        for _ in range(self.global_batch):
            epoch, pos = divmod(self.consumed, self.n)
            items.append(self.dataset[int(self._order(epoch)[pos])])
            self.consumed += 1
        if not isinstance(items[0], (tuple, list)):
            items = [(x,) for x in items]
        return tuple(torch.stack([it[k] for it in items]) for k in range(len(items[0])))


__all__ = ["CharText", "Dataset", "Sampler", "SyntheticTokens", "build_dataset", "bundled_text"]

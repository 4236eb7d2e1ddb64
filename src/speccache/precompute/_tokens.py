"""The token samples a run feeds its engine: tensors of each sample, and right-padded batches of them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from speccache.data import TokenizedSamples
from speccache.format import SAMPLE_TURN_KEY
from speccache.precompute.append import AppendedDataset, AppendPlan

__all__ = ["TokenizedDataset", "batch_pad_id", "pad_tokens", "token_loader"]


class TokenizedDataset(Dataset):
    """The tokenized samples as tensors."""

    def __init__(self, samples: TokenizedSamples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples.arrays(index)
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.bool_)),
            "sample_index": torch.tensor(index, dtype=torch.int64),  # names the sample in a non-finite error
            "source_row": torch.tensor(int(self.samples.source_rows[index]), dtype=torch.int64),
            SAMPLE_TURN_KEY: torch.tensor(int(self.samples.turns[index]), dtype=torch.int64),
        }


def batch_pad_id(tokenizer: Any) -> int:
    """The token id batches are right-padded with: the tokenizer's pad token, else 0."""
    return tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0


def pad_tokens(items: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad token samples into a batch with ``attention_mask``."""
    longest = max(t["input_ids"].numel() for t in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.bool)
    attn = torch.zeros((len(items), longest), dtype=torch.int64)
    for i, t in enumerate(items):
        n = t["input_ids"].numel()
        ids[i, :n], mask[i, :n], attn[i, :n] = t["input_ids"], t["loss_mask"], 1
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
    for key in ("sample_index", "source_row", SAMPLE_TURN_KEY):
        # an append's batch may mix stored samples (the keys their schema has) with new ones
        if all(key in t for t in items):
            batch[key] = torch.stack([t[key] for t in items])
    return batch


def token_loader(samples: TokenizedSamples, extension: AppendPlan | None, batch_size: int, pad_id: int) -> DataLoader:
    """Batches of ``batch_size`` samples padded with ``pad_id``: of ``samples``, after an append's stored ones."""
    dataset: Dataset = TokenizedDataset(samples)
    return DataLoader(
        dataset if extension is None else AppendedDataset(extension, dataset),
        batch_size=batch_size,
        collate_fn=lambda b: pad_tokens(b, pad_id),
    )

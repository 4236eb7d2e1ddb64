"""The token samples a run feeds its engine: tensors of each sample, and right-padded batches of them.

A vision-language target's samples also carry what its forward takes for their images (:class:`ImageInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from speccache.data import MODALITY_KEYS, TokenizedSamples, processor_inputs, sample_images
from speccache.format import SAMPLE_TURN_KEY
from speccache.methods.decoder import IMAGE_INPUTS
from speccache.precompute.append import AppendedDataset, AppendPlan

__all__ = ["ImageInputs", "TokenizedDataset", "batch_pad_id", "pad_tokens", "sample_length", "token_loader"]


@dataclass(frozen=True)
class ImageInputs:
    """What a vision-language target's forward takes for a sample besides its ids, made by the run's processor.

    Attributes:
        processor: the target's processor (as the run rendered the rows with).
        data: the data file the samples were read from (a sample's in-row images are reread from its row).
        split: its split.
        image_root: where relative image paths resolve.
    """

    processor: Any
    data: str
    split: str | None
    image_root: str

    def __call__(self, ids: np.ndarray, sources: tuple[str, ...], source_row: int) -> dict[str, torch.Tensor]:
        """The processor's image outputs for a sample's images (none for a text sample) and its per-token
        modality ids, the processor's own for ``ids``.

        Raises:
            DataError: an image is gone, or the processor now expands the images into another number of tokens
                than the sample's ids hold.
        """
        images = sample_images(sources, source_row, self.data, self.split, self.image_root) if sources else []
        return processor_inputs(self.processor, ids.tolist(), images, f"{self.data}:{source_row + 1}")


class TokenizedDataset(Dataset):
    """The tokenized samples as tensors (with a vision-language target's :class:`ImageInputs`)."""

    def __init__(self, samples: TokenizedSamples, images: ImageInputs | None = None) -> None:
        self.samples = samples
        self.images = images

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples.arrays(index)
        source_row = int(self.samples.source_rows[index])
        extra = {} if self.images is None else self.images(ids, self.samples.images.get(index, ()), source_row)
        return {
            **extra,
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.bool_)),
            "sample_index": torch.tensor(index, dtype=torch.int64),  # names the sample in a non-finite error
            "source_row": torch.tensor(source_row, dtype=torch.int64),
            SAMPLE_TURN_KEY: torch.tensor(int(self.samples.turns[index]), dtype=torch.int64),
        }


def sample_length(dataset: Dataset, index: int) -> int:
    """The tokens of sample ``index`` of a token loader's dataset, without building its image inputs."""
    if isinstance(dataset, TokenizedDataset):
        offsets = dataset.samples.offsets
        return int(offsets[index + 1] - offsets[index])
    return int(dataset[index]["input_ids"].numel())


def batch_pad_id(tokenizer: Any) -> int:
    """The token id batches are right-padded with: the tokenizer's pad token, else 0."""
    return tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0


def pad_tokens(items: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad token samples into a batch with ``attention_mask``; a vision-language target's per-token
    modality ids are padded with 0 (text), its images' inputs concatenated in sample order."""
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
    for key in MODALITY_KEYS:
        if key in items[0]:
            batch[key] = torch.zeros((len(items), longest), dtype=torch.int64)
            for i, t in enumerate(items):
                batch[key][i, : t[key].numel()] = t[key]
    for key in IMAGE_INPUTS:
        parts = [t[key] for t in items if key in t and key not in MODALITY_KEYS]
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def token_loader(
    samples: TokenizedSamples,
    extension: AppendPlan | None,
    batch_size: int,
    pad_id: int,
    images: ImageInputs | None = None,
) -> DataLoader:
    """Batches of ``batch_size`` samples padded with ``pad_id``: of ``samples``, after an append's stored ones
    (with a vision-language target's ``images`` inputs)."""
    dataset: Dataset = TokenizedDataset(samples, images)
    return DataLoader(
        dataset if extension is None else AppendedDataset(extension, dataset),
        batch_size=batch_size,
        collate_fn=lambda b: pad_tokens(b, pad_id),
    )

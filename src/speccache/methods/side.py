"""Side files: the tensors a method stores once per cache beside its shards (safetensors, named in the manifest),
and how a tied target's head is stored once and read back.

Readers and producers both use it: :func:`read_side_file` is the one reader of every method's side file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speccache.errors import CacheFormatError
from speccache.format import ShardFile

__all__ = ["TIED_KEY", "read_side_file", "stores_head", "tied_metadata", "ties_embeddings"]


TIED_KEY = "tie_word_embeddings"
"""The side-file metadata entry of a tied target whose file leaves ``lm_head`` out (absent before tied targets
were stored once)."""


def ties_embeddings(model_config: Any) -> bool:
    """Whether the target's config ties its LM head to its input embedding (transformers' ``tie_word_embeddings``)."""
    return bool(getattr(model_config, TIED_KEY, False))


def tied_metadata(tied: bool) -> dict[str, str]:
    """A side file's metadata entries for a target that does (``tied``) or does not tie its head."""
    return {TIED_KEY: "true"} if tied else {}


def stores_head(embed_tokens: torch.Tensor, lm_head: torch.Tensor, tied: bool) -> bool:
    """Whether a side file stores ``lm_head`` besides ``embed_tokens``: not when it is the embedding, as
    transformers ties them (the config says so and the checkpoint's head, if it has one, is equal)."""
    return not (tied and torch.equal(lm_head, embed_tokens))


def read_side_file(path: str, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (default: all) of a side file, as copies. A tied target's file that stores the
    matrix once gives ``lm_head`` as the tensor an untied file stores (the draft rows of ``embed_tokens`` where
    the file holds ``selected_token_ids``, else the whole embedding), so every reader sees the same tensors.

    Raises:
        CacheFormatError: a named tensor the file does not hold.
    """
    side = ShardFile(path)
    try:
        tied = side.metadata.get(TIED_KEY) == "true" and "lm_head" not in side.keys()
        stored = list(side.keys()) + (["lm_head"] if tied else [])
        missing = sorted(set(names or ()) - set(stored))
        if missing:
            raise CacheFormatError(
                f"{path}: the side file lacks {missing} (it holds {sorted(stored)}), which this reader needs; "
                "use a cache written by speccache precompute"
            )
        out = {name: side.tensor(name).clone() for name in side.keys() if names is None or name in names}
        if tied and (names is None or "lm_head" in names):
            embed = side.tensor("embed_tokens")
            rows = side.tensor("selected_token_ids") if "selected_token_ids" in side.keys() else None
            out["lm_head"] = embed.clone() if rows is None else embed[rows]
        return out
    finally:
        side.close()

"""Loading the target: whole on each rank (``replicate``) or FSDP2-sharded over all ranks (``fsdp``).

``fsdp`` builds the model on the meta device, wraps every decoder layer, the
decoder and the output head with ``torch.distributed.fsdp.fully_shard``, and
fills each rank's local shards straight from the safetensors checkpoint,
reading only the rows the rank owns (``safe_open(...).get_slice``): no rank
ever holds the whole model.

The side file (embeddings, LM-head rows) of a sharded target is read from the
checkpoint by the rank that writes it, so it needs no collective and no other
rank ever materialises those tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speccache.methods.decoder import decoder_layers
from speccache.write.dist import fully_shard_units, local_rows

__all__ = ["SHARD_MODES", "LoadedTarget", "load_target", "target_device", "check_shard_target"]

SHARD_MODES = ("replicate", "fsdp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedTarget:
    """A target ready for inference and the way to read its full embedding matrices.

    Attributes:
        model: the causal LM (plain, FSDP2-wrapped or tensor-parallel).
        input_embeddings: the full input embedding matrix, on the CPU (called only by the writing rank).
        output_embeddings: the full LM-head matrix, on the CPU (called only by the writing rank).
    """

    model: nn.Module
    input_embeddings: Callable[[], torch.Tensor]
    output_embeddings: Callable[[], torch.Tensor]


def target_device(device: str | None) -> torch.device:
    """The target's device: ``device``, else CUDA (``cuda:LOCAL_RANK`` under torchrun) if available, else CPU."""
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_shard_target(mode: str) -> None:
    """Check ``--shard-target`` without the model.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"--shard-target {mode!r} is unknown; choose one of {', '.join(SHARD_MODES)}")


def load_target(model_path: str, model_dtype: str, device: torch.device, mode: str = "replicate") -> LoadedTarget:
    """Load the target for inference.

    Args:
        model_path: the Hugging Face model directory (a hub id works for ``replicate``).
        model_dtype: ``auto`` (the checkpoint's) or a key of :data:`DTYPES`.
        device: the device to compute on.
        mode: one of :data:`SHARD_MODES`.

    Raises:
        ValueError: the checkpoint cannot be sharded this way (the message names the fix).
    """
    dtype: Any = "auto" if model_dtype == "auto" else DTYPES[model_dtype]
    if mode == "fsdp":
        return _load_fsdp(model_path, dtype, device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval().requires_grad_(False)
    return LoadedTarget(
        model,
        lambda: model.get_input_embeddings().weight.detach().cpu(),
        lambda: model.get_output_embeddings().weight.detach().cpu(),
    )


# ---------------------------------------------------------------------------
# reading the safetensors checkpoint


class Checkpoint:
    """The safetensors files of a model directory, tensor by tensor.

    Raises:
        ValueError: the directory has no safetensors weights.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.files: dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ValueError(
                f"--model {model_dir}: --shard-target fsdp reads the weights from safetensors files "
                "(model.safetensors or model.safetensors.index.json) in a local directory, and found none. "
                "Convert the checkpoint with save_pretrained(safe_serialization=True), or use --shard-target replicate."
            )

    def key_for(self, name: str, prefix: str) -> str:
        """The checkpoint key of the model's parameter ``name`` (with or without the base-model prefix)."""
        for key in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if key in self.files:
                return key
        raise ValueError(
            f"--model {self.model_dir}: the checkpoint has no tensor for parameter {name!r} (transformers renames "
            "some checkpoints' tensors while loading, which --shard-target fsdp does not): use --shard-target "
            "replicate for this model."
        )

    @contextmanager
    def _open(self, key: str) -> Iterator[Any]:
        from safetensors import safe_open

        with safe_open(os.path.join(self.model_dir, self.files[key]), framework="pt") as f:
            yield f

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``key``, or only its rows ``rows`` (read from disk alone)."""
        with self._open(key) as f:
            if rows is None:
                return f.get_tensor(key)
            return f.get_slice(key)[rows]

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (what ``dtype="auto"`` loads without a config dtype)."""
        for key in self.files:
            with self._open(key) as f:
                t = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(t.get_dtype())
            if dtype is not None:
                return dtype
        return torch.float32


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


# ---------------------------------------------------------------------------
# fsdp


def _meta_model(model_path: str, dtype: Any, checkpoint: Checkpoint) -> nn.Module:
    """The model with every parameter on the meta device and its buffers (rotary tables) real, on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or checkpoint.dtype()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out = model.get_output_embeddings()
    if out is not None and out.weight is model.get_input_embeddings().weight:
        # Tied: give the head its own copy (filled from the same checkpoint tensor), so that it is a separate FSDP
        # unit that the decoder's forward never has to gather.
        out.weight = nn.Parameter(torch.empty_like(out.weight, device="meta"), requires_grad=False)
    return model.eval().requires_grad_(False)


def _load_fsdp(model_path: str, dtype: Any, device: torch.device) -> LoadedTarget:
    checkpoint = Checkpoint(model_path)
    model = _meta_model(model_path, dtype, checkpoint)
    prefix = getattr(model, "base_model_prefix", "model")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names = _parameter_keys(model, checkpoint, prefix, tied)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    head = model.get_output_embeddings()
    # The embedding is a unit of its own: gathered only around its lookup, not for the whole decoder forward.
    units = [*decoder_layers(model), model.get_input_embeddings(), model.get_decoder()]
    fully_shard_units([*units, *([head] if head is not None else []), model], device)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, offset = local_rows(param)
            if local.numel() == 0:
                continue  # more ranks than rows: this rank holds none of it
            rows = slice(offset, offset + local.shape[0]) if local.dim() else None
            local.copy_(checkpoint.read(names[name], rows))
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)

    def full(module: nn.Module) -> torch.Tensor:
        param_name = next(n for n, p in model.named_parameters() if p is module.weight)
        return checkpoint.read(names[param_name]).to(module.weight.dtype)

    return LoadedTarget(model, lambda: full(model.get_input_embeddings()), lambda: full(model.get_output_embeddings()))


def _parameter_keys(model: nn.Module, checkpoint: Checkpoint, prefix: str, tied: bool) -> dict[str, str]:
    keys: dict[str, str] = {}
    head = model.get_output_embeddings()
    head_name = next((n for n, p in model.named_parameters() if head is not None and p is head.weight), None)
    embed_name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    for name, _ in model.named_parameters():
        if tied and name == head_name:
            keys[name] = keys.get(embed_name) or checkpoint.key_for(embed_name, prefix)
        else:
            keys[name] = checkpoint.key_for(name, prefix)
    return keys

"""How the ``hf`` engine reads a safetensors checkpoint and loads a target sharded over ranks (``fsdp``, ``tp``).

See :mod:`speccache.engines.hf` for what each mode does; this module is its plumbing: the checkpoint read tensor
by tensor (a rank's rows only), the meta-device model, transformers' weight conversions, and the two loaders.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from speccache.errors import UsageError
from speccache.methods.base import LoadedTarget
from speccache.methods.decoder import decoder_layers, is_vision_language
from speccache.write.dist import (
    DataParallelGroups,
    TorchComm,
    data_parallel_groups,
    fully_shard_units,
    group_mesh,
    local_rows,
    require_group,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Checkpoint", "check_tp_plan", "from_checkpoint", "load_fsdp", "load_tp", "meta_model", "parameter_readers"]

log = logging.getLogger("speccache.engines.hf")


def check_tp_plan(model_config: Any, tp_size: int) -> None:
    """Check, before loading, that transformers can split ``model_config``'s architecture over ``tp_size`` ranks.

    Raises:
        ValueError: the architecture has no tensor-parallel plan (or one that splits no decoder layer), or its heads
            do not split into ``tp_size`` parts.
    """
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError:
        import transformers

        raise UsageError(
            f"--shard-target tp needs transformers' native tensor parallelism (transformers.distributed."
            f"DistributedConfig), which transformers {transformers.__version__} lacks: upgrade transformers, "
            "or use --shard-target fsdp"
        ) from None
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        raise UsageError(
            f"--shard-target tp: transformers has no tensor-parallel plan for the {model_config.model_type!r} "
            "architecture; shard it with --shard-target fsdp instead"
        )
    if not any(module.startswith("layers.") for module in plan):
        # Qwen3-VL's plan splits the embedding alone: every rank would hold, and compute, every decoder layer whole
        raise UsageError(
            f"--shard-target tp: transformers' tensor-parallel plan for the {model_config.model_type!r} architecture "
            "splits none of its decoder layers; shard it with --shard-target fsdp instead"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if isinstance(heads, int) and heads % tp_size:
            raise UsageError(
                f"--tp-size {tp_size} must divide the model's {name} ({heads}): each rank takes whole heads. "
                "Choose a divisor, or --shard-target fsdp"
            )


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
            raise UsageError(
                f"--model {model_dir}: a sharded target reads the weights from safetensors files "
                "(model.safetensors or model.safetensors.index.json) in a local directory, and found none. "
                "Convert the checkpoint with save_pretrained(safe_serialization=True), or use --shard-target replicate."
            )

    def find(self, name: str, prefix: str) -> str | None:
        """The checkpoint key of the model's parameter ``name`` (with or without the base-model prefix), if any."""
        for key in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if key in self.files:
                return key
        return None

    def key_for(self, name: str, prefix: str) -> str:
        """Like :meth:`find`, for a tensor that must be there.

        Raises:
            ValueError: the checkpoint has no such tensor.
        """
        key = self.find(name, prefix)
        if key is None:
            raise self.missing(name)
        return key

    def missing(self, name: str) -> UsageError:
        """The error for parameter ``name``, which the checkpoint cannot provide."""
        return UsageError(
            f"--model {self.model_dir}: the checkpoint has no tensor for parameter {name!r}, and transformers "
            "has no conversion that builds it from the checkpoint's tensors: use --shard-target replicate "
            "for this model."
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


def meta_model(model_path: str, dtype: Any, checkpoint: Checkpoint) -> PreTrainedModel:
    """The model with every parameter on the meta device and its buffers (rotary tables) real, on the CPU (a
    vision-language target: its ``ForConditionalGeneration``, vision tower included)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or checkpoint.dtype()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(config, dtype=dtype)
    out = model.get_output_embeddings()
    if out is not None and out.weight is model.get_input_embeddings().weight:
        # Tied: give the head its own copy (filled from the same checkpoint tensor), so that it is a separate FSDP
        # unit that the decoder's forward never has to gather.
        out.weight = nn.Parameter(torch.empty_like(out.weight, device="meta"), requires_grad=False)
    return model.eval().requires_grad_(False)


def _return_freed_blocks() -> None:
    """Have glibc give every freed block of 64 KiB or more back to the system at once.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB) and serves later
    blocks below it from a heap that it seldom trims, so the units FSDP2 gathers and frees layer after layer
    stayed with the process: a rank's anonymous memory grew past twice its share over a run. A threshold set
    with ``mallopt`` is fixed; at 64 KiB even a small layer's projections are returned. A threshold the user
    set (``MALLOC_MMAP_THRESHOLD_``) is kept; other C libraries are left alone.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}):
        return
    import ctypes

    m_mmap_threshold = -3  # glibc's malloc.h
    ctypes.CDLL(None).mallopt(m_mmap_threshold, 1 << 16)


def load_fsdp(model_path: str, dtype: Any, device: torch.device) -> LoadedTarget:
    _return_freed_blocks()
    checkpoint = Checkpoint(model_path)
    model = meta_model(model_path, dtype, checkpoint)
    readers = parameter_readers(model, checkpoint)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    head = model.get_output_embeddings()
    # The embedding is a unit of its own: gathered only around its lookup, not for the whole decoder forward.
    units = [*decoder_layers(model), model.get_input_embeddings(), model.get_decoder()]
    replicated: set[nn.Parameter] = set()
    if is_vision_language(model.config):
        # The vision tower and projector stay whole on every rank (each encodes its own batch's images, with no
        # collective); the vision-language model is a unit so that its forward, which calls the embedding before
        # the decoder, is FSDP's root of both.
        units.append(model.model)
        inside = {id(p) for unit in (model.get_decoder(), head) if unit is not None for p in unit.parameters()}
        replicated = {p for p in model.parameters() if id(p) not in inside}
    fully_shard_units([*units, *([head] if head is not None else []), model], device, ignored=replicated)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, offset = local_rows(param)
            if local.numel() == 0:
                continue  # more ranks than rows: this rank holds none of it
            rows = slice(offset, offset + local.shape[0]) if local.dim() else None
            local.copy_(readers[name](rows))
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)

    return from_checkpoint(model, readers)


Reader = Callable[[slice | None], torch.Tensor]
"""Reads a parameter from the checkpoint: its rows ``rows`` along dim 0, or all of it for ``None``."""


def from_checkpoint(model: PreTrainedModel, readers: dict[str, Reader]) -> LoadedTarget:
    """``model`` with embedding readers that read the full matrices from the checkpoint."""

    def full(module: nn.Module) -> torch.Tensor:
        param_name, param = next((n, p) for n, p in model.named_parameters() if p is module.weight)
        return readers[param_name](None).to(param.dtype)

    return LoadedTarget(model, lambda: full(model.get_input_embeddings()), lambda: full(model.get_output_embeddings()))


def parameter_readers(
    model: PreTrainedModel, checkpoint: Checkpoint, only: Iterable[str] | None = None
) -> dict[str, Reader]:
    """A reader for each of ``model``'s parameters (``only``: for these alone), found before anything is read.

    A parameter is a checkpoint tensor of the same name (or of the name transformers' key renamings give it), the
    embedding's for a tied head, or built by one of transformers' weight conversions (the fused experts of an MoE
    layer from one tensor per expert).

    Raises:
        ValueError: a parameter is none of these (the message names it).
    """
    prefix = getattr(model, "base_model_prefix", "model")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    head_name = next((n for n, p in model.named_parameters() if head is not None and p is head.weight), None)
    embed_name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    converters = _weight_converters(model)
    renamed = _renamed_keys(model, checkpoint)
    wanted = set(only) if only is not None else None
    readers: dict[str, Reader] = {}
    for name, param in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        source = embed_name if tied and name == head_name else name
        key = renamed.get(source) or checkpoint.find(source, prefix)
        if key is not None:
            readers[name] = functools.partial(checkpoint.read, key)
            continue
        converter = next((c for c in converters if name.endswith("." + c.target_patterns[0])), None)
        if converter is None:
            raise checkpoint.missing(name)
        readers[name] = _ConvertedReader(checkpoint, converter, name, prefix, int(param.shape[0]), model.config)
    return readers


def _renamed_keys(model: PreTrainedModel, checkpoint: Checkpoint) -> dict[str, str]:
    """The checkpoint key of each parameter whose checkpoint tensor transformers renames on loading.

    Vision-language checkpoints keep the layout of older transformers (Qwen2.5-VL's ``model.layers.*`` is the
    model's ``model.language_model.layers.*``, LLaVA's ``language_model.model.*`` too), which ``from_pretrained``
    renames with the model's key mapping; a sharded load reads the same tensors by the same mapping.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers that loads checkpoints as they are
        return {}
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    if not renamings:
        return {}
    params = dict(model.named_parameters())
    prefix = getattr(model, "base_model_prefix", "model")
    renamed = {rename_source_key(key, renamings, [], prefix, params)[0]: key for key in checkpoint.files}
    return {name: key for name, key in renamed.items() if name != key}


def _weight_converters(model: PreTrainedModel) -> list[Any]:
    """transformers' conversions of checkpoint tensors into ``model``'s parameters (one target each)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers that loads checkpoints as they are
        return []
    return [
        c
        for c in get_model_conversion_mapping(model)
        if isinstance(c, WeightConverter) and len(c.target_patterns) == 1 and c.scope_prefix is None
    ]


class _ConvertedReader:
    """Builds a parameter with transformers' conversion ``converter`` from the checkpoint's source tensors.

    A conversion whose first step stacks one tensor per expert along dim 0 (``MergeModulelist(dim=0)``, how
    transformers fuses MoE experts) reads only the experts in ``rows``: FSDP2 shards the fused parameter along
    the experts, so a rank reads its own experts alone. Any other conversion reads its sources whole, then slices.
    """

    def __init__(self, checkpoint: Checkpoint, converter: Any, name: str, prefix: str, length: int, config: Any):
        from transformers.core_model_loading import MergeModulelist

        self.checkpoint, self.converter, self.name, self.config = checkpoint, converter, name, config
        self.layer = name[: -len(converter.target_patterns[0])]
        first = converter.operations[0]
        self.per_expert = isinstance(first, MergeModulelist) and first.dim == 0
        if not self.per_expert and any("*" in source for source in converter.source_patterns):
            raise checkpoint.missing(name)  # a list of tensors that is not one per row: not followed
        # every source key, found now: a checkpoint that lacks one fails before any weight is read
        self.keys = {
            source: [
                checkpoint.key_for(self.layer + source.replace("*", str(e)), prefix)
                for e in range(length if self.per_expert else 1)
            ]
            for source in converter.source_patterns
        }

    def __call__(self, rows: slice | None) -> torch.Tensor:
        pick = rows if self.per_expert and rows is not None else slice(None)
        tensors: dict[str, Any] = {
            source: [self.checkpoint.read(key) for key in keys[pick]] for source, keys in self.keys.items()
        }
        for op in self.converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=list(self.converter.source_patterns),
                target_patterns=list(self.converter.target_patterns),
                full_layer_name=self.name,
                config=self.config,
            )
        out = tensors[self.converter.target_patterns[0]]
        return out if self.per_expert or rows is None else out[rows]


# ---------------------------------------------------------------------------
# tp


def load_tp(model_path: str, dtype: Any, device: torch.device, groups: DataParallelGroups | None) -> LoadedTarget:
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    checkpoint = Checkpoint(model_path)  # before loading: a directory without safetensors fails at once
    if groups is None:  # one group of every rank
        require_group("tp")
        world = TorchComm(device)
        groups = data_parallel_groups(world, world.world_size)
    tp_size = groups.size
    # transformers lays its mesh over the whole world; data-parallel groups of tp_size ranks need it over this
    # rank's group only, so the model class is handed the group's slice of a (group, ...) mesh.
    dense = group_mesh(device, groups.count, {"pp": 1, "dp_replicate": 1, "fsdp": 1, "tp": tp_size})
    expert = group_mesh(device, groups.count, {"pp": 1, "dp_replicate": 1, "efsdp": tp_size, "ep": 1})
    meshes = TransformersDeviceMesh(dense, expert)
    config = AutoConfig.from_pretrained(model_path)
    check_tp_plan(config, tp_size)
    # a vision-language target: its ForConditionalGeneration, whose tp plan splits the language model alone (the
    # vision tower, outside it, loads whole on every rank)
    classes = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if is_vision_language(config) else MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in classes:
        raise UsageError(
            f"--model {model_path}: --shard-target tp loads transformers' own causal-LM classes, and the "
            f"{config.model_type!r} architecture has none; use --shard-target fsdp"
        )
    # transformers annotates every lazy auto mapping's values as the tokenizers' (slow, fast) class pair; this
    # one maps a config class to its model class
    cls = cast("type[PreTrainedModel]", classes[type(config)])

    def prepare(_: type, config: Any, device_map: Any = None) -> tuple[Any, torch.device, Any]:
        return config, device, meshes

    # in transformers' module, so that transformers keeps treating it as its own class, not custom code: it applies
    # its key renamings (a vision-language checkpoint's older layout) only to its own classes
    body = {"prepare_distribute_model": classmethod(prepare), "__module__": cls.__module__}
    grouped: type[PreTrainedModel] = type(cls.__name__, (cls,), body)
    model = grouped.from_pretrained(model_path, dtype=dtype, distributed_config=DistributedConfig(tp_size=tp_size))
    model = model.eval().requires_grad_(False)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    params = [n for n, p in model.named_parameters() if p is embedding or (head is not None and p is head.weight)]
    return from_checkpoint(model, parameter_readers(model, checkpoint, params))

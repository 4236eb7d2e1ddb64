"""The ``hf`` engine: the target run by transformers, loaded whole on each rank (``replicate``), FSDP2-sharded
over all ranks (``fsdp``), or tensor-parallel over groups of ranks (``tp``).

``fsdp`` builds the model on the meta device, wraps every decoder layer, the
decoder and the output head with ``torch.distributed.fsdp.fully_shard``, and
fills each rank's local shards straight from the safetensors checkpoint,
reading only the rows the rank owns (``safe_open(...).get_slice``): no rank
ever holds the whole model. A parameter that transformers builds from several
checkpoint tensors (an MoE layer's fused experts) is built with transformers'
own conversion, from the rank's experts alone.

``tp`` is transformers' own tensor-parallel loading (``DistributedConfig(tp_size=T)``,
PyTorch DTensor), each rank reading its slices of the checkpoint, over this
rank's group of ``T`` ranks: the ``world_size / T`` groups each hold a copy of
the model, and a forward talks only within its group.

The side file (embeddings, LM-head rows) of a sharded target is read from the
checkpoint by the rank that writes it, so it needs no collective and no other
rank ever materialises those tensors.

The forward is :func:`speccache.methods.decoder.forward_capturing` over the loaded model (:class:`HfEngine`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from speccache.devices import DTYPES, target_device
from speccache.engines.base import EngineSettings
from speccache.errors import UsageError
from speccache.methods.base import CaptureRequest, LoadedTarget
from speccache.methods.decoder import decoder_calls, decoder_layers, forward_capturing
from speccache.write import Comm
from speccache.write.dist import (
    DataParallelGroups,
    TorchComm,
    data_parallel_groups,
    fully_shard_units,
    group_mesh,
    local_rows,
    not_under_torchrun,
    require_group,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "SHARD_MODES",
    "HfEngine",
    "cpu_thread_advice",
    "load_target",
    "load_outer_modules",
    "check_shard_target",
    "check_tp_plan",
]

SHARD_MODES = ("replicate", "fsdp", "tp")
log = logging.getLogger("speccache.engines.hf")


def check_shard_target(mode: str, tp_size: int | None = None, world_size: int | None = None) -> None:
    """Check ``--shard-target`` and ``--tp-size`` without the model (and the world size once it is known).

    Raises:
        ValueError: an unknown mode, a ``--tp-size`` without ``tp`` or below 2, or a sharded mode outside torchrun.
    """
    if mode not in SHARD_MODES:
        raise UsageError(f"--shard-target {mode!r} is unknown; choose one of {', '.join(SHARD_MODES)}")
    if tp_size is not None and mode != "tp":
        raise UsageError(f"--tp-size is for --shard-target tp (this run has --shard-target {mode})")
    if tp_size is not None and tp_size < 2:
        raise UsageError(f"--tp-size must be >= 2, got {tp_size}; a target on one rank is --shard-target replicate")
    if world_size == 1 and mode != "replicate":
        raise not_under_torchrun(mode)


def check_tp_plan(model_config: Any, tp_size: int) -> None:
    """Check, before loading, that transformers can split ``model_config``'s architecture over ``tp_size`` ranks.

    Raises:
        ValueError: the architecture has no tensor-parallel plan, or its heads do not split into ``tp_size`` parts.
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
    if not getattr(text, "base_model_tp_plan", None):
        raise UsageError(
            f"--shard-target tp: transformers has no tensor-parallel plan for the {model_config.model_type!r} "
            "architecture; shard it with --shard-target fsdp instead"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if isinstance(heads, int) and heads % tp_size:
            raise UsageError(
                f"--tp-size {tp_size} must divide the model's {name} ({heads}): each rank takes whole heads. "
                "Choose a divisor, or --shard-target fsdp"
            )


class HfEngine:
    """The ``hf`` engine (:class:`speccache.engines.base.Engine`): the target loaded as ``--shard-target`` says,
    its decoder run by :func:`speccache.methods.decoder.forward_capturing` over right-padded batches.

    Raises:
        ValueError: a sharded mode in a plain process.
    """

    name = "hf"
    pads = True

    @classmethod
    def check_flags(cls, cfg: EngineSettings) -> None:
        """Check ``--shard-target``, ``--tp-size`` and ``--threads``; refuse vLLM's ``--tensor-parallel-size`` and
        ``--enable-expert-parallel``."""
        check_shard_target(cfg.shard_target, cfg.tp_size)
        if cfg.tensor_parallel_size != 1:
            raise UsageError("--tensor-parallel-size is vLLM's: use it with --engine vllm (or --shard-target tp)")
        if cfg.enable_expert_parallel:
            raise UsageError(
                "--enable-expert-parallel is vLLM's: use it with --engine vllm (the hf engine spreads a mixture of "
                "experts over torchrun's ranks with --shard-target fsdp or tp)"
            )
        if cfg.threads is not None and cfg.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {cfg.threads}")

    @classmethod
    def check_model(cls, cfg: EngineSettings, model_config: Any, world_size: int) -> None:
        """Under ``--shard-target tp``: whether transformers can split the architecture over ``--tp-size`` ranks."""
        if cfg.shard_target == "tp":
            check_tp_plan(model_config, cfg.tp_size or world_size)

    def __init__(self, cfg: EngineSettings, comm: Comm) -> None:
        check_shard_target(cfg.shard_target, cfg.tp_size, comm.world_size)
        self.cfg, self.comm = cfg, comm
        self.group_size = (cfg.tp_size or comm.world_size) if cfg.shard_target == "tp" else 1
        self.model: nn.Module | None = None

    def open(self, request: CaptureRequest, groups: DataParallelGroups, max_tokens: int) -> LoadedTarget:
        """Load the whole target (every layer may be captured: ``request`` and ``max_tokens`` change nothing);
        ``--threads`` sets torch's threads, and a CPU target warns of threads that would contend."""
        cfg = self.cfg
        device = target_device(cfg.device)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        advice = cpu_thread_advice(torch.get_num_threads()) if device.type == "cpu" else None
        if advice is not None:
            log.warning("%s", advice)
        loaded = load_target(cfg.model, cfg.model_dtype, device, cfg.shard_target, groups)
        self.model = loaded.model
        return loaded

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
        """:func:`speccache.methods.decoder.forward_capturing` over the opened model, in ``--prefill-chunk`` chunks.

        Under ``fsdp`` every decoder forward is a collective of all ranks (each layer's all-gather), and a batch's
        chunk count follows its length: so the ranks first agree on the most chunks any of them has this step, and
        a rank with fewer joins the others' remaining forwards with one-token forwards whose outputs it discards
        (as the lockstep loop joins a rank with fewer batches). ``tp`` needs none: a group computes one batch.
        """
        assert self.model is not None, "HfEngine.capture before open"
        chunk = self.cfg.prefill_chunk
        calls = decoder_calls(input_ids.shape[1], chunk)
        joined = self.comm.max_int(calls) if chunk is not None and self.cfg.shard_target == "fsdp" else calls
        result = forward_capturing(self.model, input_ids, attention_mask, outputs, input_of_first, chunk=chunk)
        if joined > calls:
            decoder = self.model.get_decoder()
            with torch.no_grad():
                for _ in range(joined - calls):
                    decoder(input_ids=input_ids[:, :1], attention_mask=attention_mask[:, :1], use_cache=False)
        return result

    def close(self) -> None:
        """Nothing to release: the model goes with the engine."""

    def record(self) -> dict[str, Any]:
        """``parallel`` for a sharded target (informational: a resume may change the mode and the world size)."""
        if self.cfg.shard_target == "replicate":
            return {}
        parallel = {"shard_target": self.cfg.shard_target, "world_size": self.comm.world_size}
        return {"parallel": {**parallel, **({"tp_size": self.group_size} if self.cfg.shard_target == "tp" else {})}}


def cpu_thread_advice(threads: int) -> str | None:
    """Why ``threads`` torch threads would run a CPU target slowly, or None: more threads than the CPUs this
    process may use (its affinity), or a machine whose other processes already keep those CPUs busy."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads > cpus:
        return (
            f"torch runs {threads} threads but this process may use only {cpus} CPUs (its affinity), so they "
            f"contend: pass --threads {cpus} (or set OMP_NUM_THREADS={cpus})"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads > 1 and load >= cpus:
        return (
            f"the machine is busy (load {load:.1f} on {cpus} CPUs): torch's {threads} threads contend with the "
            "other processes, which ran a CPU target 8-37x slower than one thread on a busy 2-core machine; "
            "pass --threads 1 (or set OMP_NUM_THREADS=1)"
        )
    return None


def load_target(
    model_path: str,
    model_dtype: str,
    device: torch.device,
    mode: str = "replicate",
    groups: DataParallelGroups | None = None,
) -> LoadedTarget:
    """Load the target for inference.

    Args:
        model_path: the Hugging Face model directory (a hub id works for ``replicate``).
        model_dtype: ``auto`` (the checkpoint's) or a key of :data:`DTYPES`.
        device: the device to compute on.
        mode: one of :data:`SHARD_MODES`.
        groups: for ``tp``: the tensor-parallel groups the ranks form (default: one group of all ranks).

    Raises:
        ValueError: the checkpoint cannot be sharded this way (the message names the fix).
    """
    dtype: Any = "auto" if model_dtype == "auto" else DTYPES[model_dtype]
    if mode == "fsdp":
        return _load_fsdp(model_path, dtype, device)
    if mode == "tp":
        return _load_tp(model_path, dtype, device, groups)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval().requires_grad_(False)
    return LoadedTarget(
        model,
        lambda: model.get_input_embeddings().weight.detach().cpu(),
        lambda: model.get_output_embeddings().weight.detach().cpu(),
    )


def load_outer_modules(model_path: str, model_dtype: str) -> LoadedTarget:
    """The target with only what lies outside its decoder layers (embeddings, final norm, LM head) read, on the CPU.

    For an engine that runs the decoder layers itself: the methods still apply the model's own final norm and
    LM head (transformers' modules, so e.g. Gemma's norm is Gemma's), and the side file reads the embeddings.
    The decoder layers stay on the meta device, so a 70B target costs the main process only these few tensors.

    Raises:
        ValueError: the directory has no safetensors weights, or lacks one of these tensors.
    """
    dtype: Any = "auto" if model_dtype == "auto" else DTYPES[model_dtype]
    checkpoint = Checkpoint(model_path)
    model = _meta_model(model_path, dtype, checkpoint)
    in_layers = {id(p) for p in decoder_layers(model).parameters()}
    names = [n for n, p in model.named_parameters() if id(p) not in in_layers]
    readers = _parameter_readers(model, checkpoint, only=names)
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        value = readers[name](None).to(getattr(module, attr).dtype)
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    return _from_checkpoint(model, readers)


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


def _meta_model(model_path: str, dtype: Any, checkpoint: Checkpoint) -> PreTrainedModel:
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


def _load_fsdp(model_path: str, dtype: Any, device: torch.device) -> LoadedTarget:
    _return_freed_blocks()
    checkpoint = Checkpoint(model_path)
    model = _meta_model(model_path, dtype, checkpoint)
    readers = _parameter_readers(model, checkpoint)
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
            local.copy_(readers[name](rows))
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)

    return _from_checkpoint(model, readers)


Reader = Callable[[slice | None], torch.Tensor]
"""Reads a parameter from the checkpoint: its rows ``rows`` along dim 0, or all of it for ``None``."""


def _from_checkpoint(model: PreTrainedModel, readers: dict[str, Reader]) -> LoadedTarget:
    """``model`` with embedding readers that read the full matrices from the checkpoint."""

    def full(module: nn.Module) -> torch.Tensor:
        param_name = next(n for n, p in model.named_parameters() if p is module.weight)
        return readers[param_name](None).to(module.weight.dtype)

    return LoadedTarget(model, lambda: full(model.get_input_embeddings()), lambda: full(model.get_output_embeddings()))


def _parameter_readers(
    model: PreTrainedModel, checkpoint: Checkpoint, only: Iterable[str] | None = None
) -> dict[str, Reader]:
    """A reader for each of ``model``'s parameters (``only``: for these alone), found before anything is read.

    A parameter is a checkpoint tensor of the same name, the embedding's for a tied head, or built by one of
    transformers' weight conversions (the fused experts of an MoE layer from one tensor per expert).

    Raises:
        ValueError: a parameter is none of these (the message names it).
    """
    prefix = getattr(model, "base_model_prefix", "model")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    head_name = next((n for n, p in model.named_parameters() if head is not None and p is head.weight), None)
    embed_name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    converters = _weight_converters(model)
    wanted = set(only) if only is not None else None
    readers: dict[str, Reader] = {}
    for name, param in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        key = checkpoint.find(embed_name if tied and name == head_name else name, prefix)
        if key is not None:
            readers[name] = functools.partial(checkpoint.read, key)
            continue
        converter = next((c for c in converters if name.endswith("." + c.target_patterns[0])), None)
        if converter is None:
            raise checkpoint.missing(name)
        readers[name] = _ConvertedReader(checkpoint, converter, name, prefix, int(param.shape[0]), model.config)
    return readers


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


def _load_tp(model_path: str, dtype: Any, device: torch.device, groups: DataParallelGroups | None) -> LoadedTarget:
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(
            f"--model {model_path}: --shard-target tp loads transformers' own causal-LM classes, and the "
            f"{config.model_type!r} architecture has none; use --shard-target fsdp"
        )
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

    def prepare(_: type, config: Any, device_map: Any = None) -> tuple[Any, torch.device, Any]:
        return config, device, meshes

    grouped = type(cls.__name__, (cls,), {"prepare_distribute_model": classmethod(prepare)})
    model = grouped.from_pretrained(model_path, dtype=dtype, distributed_config=DistributedConfig(tp_size=tp_size))
    model = model.eval().requires_grad_(False)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    params = [n for n, p in model.named_parameters() if p is embedding or (head is not None and p is head.weight)]
    return _from_checkpoint(model, _parameter_readers(model, checkpoint, params))

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

A vision-language target shards its language model alone: its vision tower and projector load whole on every
rank (docs/vision.md, "Sharded targets").

The side file (embeddings, LM-head rows) of a sharded target is read from the
checkpoint by the rank that writes it, so it needs no collective and no other
rank ever materialises those tensors.

The forward is :func:`speccache.methods.decoder.forward_capturing` over the loaded model (:class:`HfEngine`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from speccache.devices import DTYPES, target_device
from speccache.engines._hf_load import (
    Checkpoint,
    check_tp_plan,
    from_checkpoint,
    load_fsdp,
    load_tp,
    meta_model,
    parameter_readers,
)
from speccache.engines.base import EngineSettings, check_gpu_memory_utilization
from speccache.errors import UsageError
from speccache.methods.base import CaptureRequest, LoadedTarget
from speccache.methods.decoder import (
    decoder_calls,
    decoder_layers,
    forward_capturing,
    is_mrope,
    is_vision_language,
)
from speccache.write import Comm
from speccache.write.dist import (
    DataParallelGroups,
    not_under_torchrun,
)

if TYPE_CHECKING:
    pass

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


class HfEngine:
    """The ``hf`` engine (:class:`speccache.engines.base.Engine`): the target loaded as ``--shard-target`` says,
    its decoder run by :func:`speccache.methods.decoder.forward_capturing` over right-padded batches.

    Raises:
        ValueError: a sharded mode in a plain process.
    """

    name = "hf"
    pads = True

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        """``--threads``, ``--shard-target`` and ``--tp-size``."""
        p.add_argument(
            "--threads",
            type=int,
            help="torch CPU threads (default: torch's own, which follows OMP_NUM_THREADS and the CPU affinity); "
            "warns when the CPUs are oversubscribed",
        )
        p.add_argument(
            "--shard-target",
            help="under torchrun: replicate (a whole target per rank, default), fsdp (FSDP2 over all ranks) "
            "or tp (tensor parallel over groups of --tp-size ranks)",
        )
        p.add_argument(
            "--tp-size",
            type=int,
            help="--shard-target tp: ranks per tensor-parallel group (default: all); "
            "world_size / T groups split the data",
        )

    @classmethod
    def check_flags(cls, cfg: EngineSettings) -> None:
        """Check ``--shard-target``, ``--tp-size`` and ``--threads``; refuse vLLM's ``--tensor-parallel-size``,
        ``--enable-expert-parallel`` and ``--gpu-memory-utilization``."""
        check_gpu_memory_utilization(cfg.gpu_memory_utilization, cls.name)
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
        """Under ``--shard-target tp``: whether transformers can split the architecture over ``--tp-size`` ranks;
        a vision-language target runs in ``--prefill-chunk`` chunks only if it is an M-RoPE one, in one process or
        replicated."""
        if is_vision_language(model_config) and cfg.prefill_chunk is not None:
            kind = f"--model {cfg.model} is a vision-language target ({type(model_config).__name__})"
            if not is_mrope(model_config):
                raise UsageError(
                    f"{kind}: its rows run whole, never chunked (a chunk that cuts an image is exact only for the "
                    "M-RoPE targets, Qwen2.5-VL and Qwen3-VL: Gemma 3's image tokens attend to each other both "
                    "ways); leave out --prefill-chunk"
                )
            if cfg.shard_target != "replicate":
                raise UsageError(
                    f"{kind}: --prefill-chunk runs its rows in chunks with --shard-target replicate only; leave out "
                    f"--prefill-chunk with --shard-target {cfg.shard_target}"
                )
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
        image_inputs: Mapping[str, torch.Tensor] | None = None,
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
        result = forward_capturing(
            self.model, input_ids, attention_mask, outputs, input_of_first, image_inputs, chunk=chunk
        )
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
        return load_fsdp(model_path, dtype, device)
    if mode == "tp":
        return load_tp(model_path, dtype, device, groups)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    # a vision-language target loads whole, vision tower included (its ForConditionalGeneration)
    vision = is_vision_language(AutoConfig.from_pretrained(model_path))
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(model_path, dtype=dtype)
    # PreTrainedModel.to is declared through functools.wraps(nn.Module.to), whose stub loses the bound self
    cast(nn.Module, model).to(device).eval().requires_grad_(False)
    return LoadedTarget(
        model,
        lambda: model.get_input_embeddings().get_parameter("weight").detach().cpu(),
        lambda: model.get_output_embeddings().get_parameter("weight").detach().cpu(),
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
    model = meta_model(model_path, dtype, checkpoint)
    in_layers = {id(p) for p in decoder_layers(model).parameters()}
    names = [n for n, p in model.named_parameters() if id(p) not in in_layers]
    readers = parameter_readers(model, checkpoint, only=names)
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        value = readers[name](None).to(getattr(module, attr).dtype)
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    return from_checkpoint(model, readers)

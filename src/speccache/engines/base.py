"""The engine protocol: what runs the target's decoder for ``speccache precompute`` (``--engine``).

An engine loads the target (or only what a method needs of it outside the decoder layers), then computes the
hidden states a method asks for (its :class:`speccache.methods.base.CaptureRequest`) for each padded batch of
token ids, as a :data:`speccache.methods.decoder.Capture`. The method turns them into cache rows; the engine
never sees the schema or the writer. An engine is a class: its class methods check the flags and the model
config before anything is loaded, an instance is one run's engine. :mod:`.registry` maps ``--engine`` to it.
"""

from __future__ import annotations

import argparse
from collections.abc import Hashable, Mapping
from typing import Any, Protocol

import torch

from speccache.errors import UsageError
from speccache.methods.base import CaptureRequest, LoadedTarget
from speccache.write import Comm, DataParallelGroups

__all__ = ["Engine"]


def check_gpu_memory_utilization(value: float | None, engine: str) -> None:
    """``--gpu-memory-utilization``: the share of each GPU's memory (of the host's, on vLLM's CPU build) that a vLLM
    engine takes for its weights and KV cache, in (0, 1]; another engine refuses it.

    Raises:
        ValueError: out of range, or given to an engine other than ``vllm``.
    """
    if value is None:
        return
    if engine != "vllm":
        raise UsageError(
            f"--gpu-memory-utilization is vLLM's: use it with --engine vllm, or drop it (--engine {engine})"
        )
    if not 0 < value <= 1:
        raise UsageError(f"--gpu-memory-utilization must lie in (0, 1] (a share of the memory), got {value}")


def add_gpu_memory_utilization_argument(p: argparse.ArgumentParser) -> None:
    """``--gpu-memory-utilization``, of the commands that run vLLM (:func:`check_gpu_memory_utilization`)."""
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="--engine vllm: the share of each GPU's memory (on a CPU build, of the host's) each engine takes "
        "(default: vLLM's, or under torchrun 0.9 / the ranks of a node on a CPU)",
    )


class EngineSettings(Protocol):
    """The settings an engine reads from a run's :class:`speccache.precompute.config.PrecomputeConfig` (the flags of
    ``speccache precompute`` of the same names)."""

    model: str
    model_dtype: str
    device: str | None
    prefill_chunk: int | None
    shard_target: str
    tp_size: int | None
    tensor_parallel_size: int
    enable_expert_parallel: bool
    gpu_memory_utilization: float | None
    threads: int | None


class Engine(Protocol):
    """One run's engine. ``cfg`` holds the run's :class:`EngineSettings`.

    An engine with flags of its own may define a class method ``add_arguments(parser)`` adding them to
    ``speccache precompute`` (their defaults are the config's, set after); its :meth:`check_flags` checks them.

    Attributes:
        name: what ``--engine`` calls it (recorded as the manifest's ``config.engine``).
        group_size: how many ranks compute each batch together (a tensor-parallel group); their first rank writes.
        pads: whether the target computes the padding of a batch (the manifest's ``stats.computed_tokens`` counts
            it), or only each sequence's own tokens (an engine that batches without padding).
    """

    name: str
    group_size: int
    pads: bool

    @classmethod
    def check_flags(cls, cfg: EngineSettings) -> None:
        """Refuse the flags this engine does not take, before anything is read (``UsageError``: the CLI exits 2)."""

    @classmethod
    def check_model(cls, cfg: EngineSettings, model_config: Any, world_size: int) -> None:
        """Refuse a target this engine cannot run, from its config alone, before the data is read."""

    def __init__(self, cfg: EngineSettings, comm: Comm) -> None:
        """Refuse a world this engine cannot run in (it starts nothing)."""

    def open(self, request: CaptureRequest, groups: DataParallelGroups, max_tokens: int) -> LoadedTarget:
        """Load the target for a method that reads ``request``, for sequences of at most ``max_tokens`` tokens."""

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
        image_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
        """The :data:`speccache.methods.decoder.Capture` of the opened target (for the layers ``open`` was given)."""

    def close(self) -> None:
        """Release what :meth:`open` started (called whether the run succeeded or not)."""

    def record(self) -> dict[str, Any]:
        """Entries for the manifest's ``stats`` (informational: a resume may change them), e.g. ``engine``."""

"""Where this process stands in its ``torch.distributed`` world: the one rank lookup of readers and producers.

Below ``read/`` and ``write/``, which both ask it: a sampler or a following reader for the share of the data
its rank reads (:func:`distributed_position`, :func:`group_position`), a producer for whether ``torchrun``
started it (:func:`launched_distributed`). The groups and collectives themselves are the producer's
(:mod:`speccache.write.dist`).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["distributed_position", "group_position", "launched_distributed"]


def group_position(group: Any = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` in ``group`` (default: the default group), or ``None`` without an initialised group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return None


def distributed_position() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, for a sampler that splits data across ranks.

    Raises:
        RuntimeError: no process group is initialised: under torchrun every rank would otherwise read the
            whole dataset in the same order. Call ``torch.distributed.init_process_group`` first, or pass
            ``rank`` and ``world_size`` yourself.
    """
    position = group_position()
    if position is not None:
        return position
    launched = os.environ.get("WORLD_SIZE")
    raise RuntimeError(
        "distributed=True needs an initialised torch.distributed process group"
        + (f" (WORLD_SIZE={launched} is set: this process was started by torchrun)" if launched else "")
        + ": call torch.distributed.init_process_group() before building the loader, or pass rank= and world_size=."
    )


def launched_distributed() -> bool:
    """Whether this process was started by ``torchrun`` (or a launcher that sets the same variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1

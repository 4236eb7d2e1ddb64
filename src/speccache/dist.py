"""The few collectives a producer needs, for one process or a ``torch.distributed`` group.

Producers talk to a :class:`Comm` so that the same code runs alone and under
``torchrun``; only :func:`init_from_env` knows about process groups.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Comm(Protocol):
    """What a producer needs from its process group."""

    rank: int
    world_size: int

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""

    def max_int(self, value: int) -> int:
        """The largest ``value`` over all ranks."""

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over all ranks (int64 CPU tensor)."""

    def barrier(self) -> None:
        """Wait for every rank."""


class LocalComm:
    """The group of one process."""

    rank = 0
    world_size = 1

    def all_gather(self, obj: T) -> list[T]:
        return [obj]

    def max_int(self, value: int) -> int:
        return value

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None


class TorchComm:
    """A ``torch.distributed`` process group (already initialised)."""

    def __init__(self, device: torch.device | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # NCCL reduces only CUDA tensors; Gloo only CPU ones.
        self._device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_gather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return int(t.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.to(self._device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)
        return t.cpu()

    def barrier(self) -> None:
        self._dist.barrier()


def launched_distributed() -> bool:
    """Whether this process was started by ``torchrun`` (or a launcher that sets the same variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_from_env(device: torch.device, timeout_s: float) -> Comm:
    """Join the ``torchrun`` process group (NCCL on CUDA, Gloo on CPU), or return :class:`LocalComm`.

    Args:
        device: the device the producer computes on.
        timeout_s: how long a collective waits for the other ranks before failing.
    """
    if not launched_distributed():
        return LocalComm()
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return TorchComm(device)

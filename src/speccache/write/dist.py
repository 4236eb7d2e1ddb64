"""The few collectives a producer needs, for one process or a ``torch.distributed`` group.

Producers talk to a :class:`Comm` so that the same code runs alone and under
``torchrun``; this is the only module that makes groups and collectives of ``torch.distributed``
(where a process stands in its world, which readers ask too, is :mod:`speccache.dist`'s): :func:`init_from_env`
joins the group, :func:`shutdown` leaves it.

A collective that fails (another rank died, so its sockets closed; or it did not
reach the same collective within the timeout) raises
:class:`speccache.errors.DistributedError` on the ranks still alive, naming the
rank, the timeout and the ``--resume`` way out, instead of a backend traceback.
With Gloo (CPU) a dead peer is noticed at once and a hung one after the timeout;
with NCCL the backend's watchdog aborts the process after the timeout.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch

from speccache.dist import launched_distributed
from speccache.errors import DistributedError, UsageError

T = TypeVar("T")

__all__ = [
    "Comm",
    "LocalComm",
    "TorchComm",
    "DataParallelGroups",
    "agree",
    "data_parallel_groups",
    "group_mesh",
    "not_under_torchrun",
    "require_group",
    "init_from_env",
    "shutdown",
    "exit_after_group",
    "fully_shard_units",
    "local_rows",
]


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


def _describe_timeout(timeout_s: float | None) -> str:
    return f"the --timeout of {timeout_s:g} s" if timeout_s is not None else "the process group's timeout"


def collective_failure_message(rank: int, world_size: int, op: str, timeout_s: float | None, exc: BaseException) -> str:
    """What a rank says when collective ``op`` failed with the backend error ``exc``."""
    detail = " ".join(str(exc).split())
    if len(detail) > 400:
        detail = detail[:400] + "..."
    if "timed out" in detail.lower() or "timeout" in detail.lower():
        what = (
            f"another rank did not reach the same step within {_describe_timeout(timeout_s)}: "
            "it hangs or is much slower"
        )
    else:
        what = (
            "lost the connection to another rank, which exited or crashed "
            f"(a rank that hangs instead is given up on after {_describe_timeout(timeout_s)})"
        )
    return (
        f"rank {rank} of {world_size}: {op} failed: {what}. The first error is in the log of the rank that stopped. "
        "Every shard already written is kept: re-run the same command with --resume (any number of ranks) to finish "
        f"the cache. [backend: {detail}]"
    )


class TorchComm:
    """A ``torch.distributed`` process group (already initialised).

    Args:
        device: the device the producer computes on (collectives use it under NCCL, the CPU under Gloo).
        timeout_s: the group's collective timeout, quoted in error messages.
        group: the process group (default: the default group).
        owns_group: :func:`shutdown` destroys the default group only when this is true
            (:func:`init_from_env` created it).
    """

    def __init__(
        self,
        device: torch.device | None = None,
        *,
        timeout_s: float | None = None,
        group: Any = None,
        owns_group: bool = False,
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.owns_group = owns_group
        # NCCL reduces only CUDA tensors; Gloo only CPU ones.
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def _run(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:  # DistBackendError, DistNetworkError... all subclass RuntimeError
            raise DistributedError(
                collective_failure_message(self.rank, self.world_size, op, self.timeout_s, exc)
            ) from exc

    def all_gather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather", lambda: self._dist.all_gather_object(out, obj, group=self._group))
        return out

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run("all_reduce(max)", lambda: self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._group))
        return int(t.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.to(self.device)
        if t is tensor:
            t = t.clone()  # all_reduce works in place; leave the caller's tensor alone
        self._run("all_reduce(sum)", lambda: self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self._group))
        return t.cpu()


def agree(comm: Comm, fn: Callable[[], T] | None, *, leader_only: bool = False) -> T:
    """Run ``fn`` on every rank of ``comm`` and fail on all ranks if it failed on any.

    The first failing rank's exception is raised everywhere (the same type for speccache and built-in
    errors, rebuilt by name, which always pickles), so no rank is left waiting in a later collective.

    Args:
        comm: the ranks that agree.
        fn: the work (may be ``None`` on the ranks that do not run it).
        leader_only: run ``fn`` on rank 0 alone and return its result on every rank.

    Returns:
        This rank's result (rank 0's with ``leader_only``).
    """
    error: Exception | None = None
    result: Any = None
    if not leader_only or comm.rank == 0:
        assert fn is not None, "the rank that runs the work was given none"
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    report = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    try:
        gathered = comm.all_gather((report, result if leader_only else None))
    except DistributedError:
        if error is not None:
            raise error from None
        raise
    for rank, (item, _) in enumerate(gathered):
        if item is not None:
            if rank == comm.rank and error is not None:
                raise error
            raise _rebuild_error(rank, *item)
    # rank 0 ran ``fn`` and did not fail (that was raised above), so with leader_only its slot holds fn's T
    return cast(T, gathered[0][1]) if leader_only else result


def _rebuild_error(rank: int, module: str, qualname: str, message: str) -> Exception:
    """Rank ``rank``'s exception, recreated here: the same type for speccache and built-in errors."""
    kind: Any = None
    if module == "builtins" or module == "speccache" or module.startswith("speccache."):
        try:
            kind = importlib.import_module(module)
            for part in qualname.split("."):
                kind = getattr(kind, part)
        except (ImportError, AttributeError):
            kind = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            pass
    return DistributedError(f"rank {rank} failed: {module}.{qualname}: {message}")


@dataclass
class DataParallelGroups:
    """The ranks split into data-parallel groups of ``size`` consecutive ranks that compute one batch stream.

    Every rank of a group computes the same batches (a tensor-parallel target); the group's first rank writes.

    Attributes:
        size: ranks per group.
        count: groups (``world_size / size``).
        writers: the process group of the groups' writing ranks (a data-parallel world of
            ``world_size / size`` ranks), or ``None`` on a rank that computes but does not write.
        group: this rank's group.
    """

    size: int
    count: int
    writers: Comm | None
    group: Comm

    def from_writer(self, fn: Callable[[], T] | None) -> T:
        """``fn()`` run on the group's writing rank (``None`` on the others), its result or error handed to all."""
        return agree(self.group, fn, leader_only=True)


def data_parallel_groups(comm: Comm, size: int) -> DataParallelGroups:
    """Split ``comm`` into groups of ``size`` (``--tp-size``) consecutive ranks (collective: every rank calls it).

    Raises:
        ValueError: ``size`` does not divide the world size.
    """
    if size < 1 or comm.world_size % size:
        raise UsageError(
            f"--tp-size {size} must divide the number of ranks ({comm.world_size}): the ranks form "
            "world_size / --tp-size data-parallel groups"
        )
    if size == 1:
        return DataParallelGroups(1, comm.world_size, comm, LocalComm())
    assert isinstance(comm, TorchComm)  # a LocalComm has world size 1, which only size 1 divides
    import torch.distributed as dist

    # new_group is collective: every rank creates every group, in the same order.
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(comm.world_size // size)]
    first = list(range(0, comm.world_size, size))
    writers_group = dist.new_group(first) if len(first) > 1 else None
    mine = groups[comm.rank // size]
    group = TorchComm(comm.device, timeout_s=comm.timeout_s, group=mine)
    writers: Comm | None = None
    if comm.rank in first:
        writers = (
            LocalComm()
            if writers_group is None
            else TorchComm(comm.device, timeout_s=comm.timeout_s, group=writers_group)
        )
    return DataParallelGroups(size, comm.world_size // size, writers, group)


def group_mesh(device: torch.device, groups: int, dims: dict[str, int]) -> Any:
    """This rank's slice of a ``(group, *dims)`` device mesh over all ranks (collective: every rank calls it).

    Args:
        device: the device the mesh's collectives use.
        groups: the number of groups of consecutive ranks.
        dims: the named dimensions of one group's mesh and their sizes (their product: the group's size).

    Returns:
        A ``DeviceMesh`` over this rank's group with the dimensions ``dims``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (groups, *dims.values()), mesh_dim_names=("group", *dims))
    return mesh[tuple(dims)]


def init_from_env(device: torch.device, timeout_s: float) -> Comm:
    """Join the ``torchrun`` process group (NCCL on CUDA, Gloo on CPU), or return :class:`LocalComm`.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    as ``torchrun`` sets them. A group already initialised by the caller is used as is.

    Args:
        device: the device the producer computes on.
        timeout_s: how long joining the group and each collective wait for the other ranks before failing.

    Raises:
        DistributedError: the group could not be joined within ``timeout_s``.
    """
    if not launched_distributed():
        return LocalComm()
    import torch.distributed as dist

    if dist.is_initialized():
        return TorchComm(device, timeout_s=timeout_s)
    # torch.distributed.nn binds the default group as default arguments when it is first imported (transformers
    # imports it when it loads a config). Imported after init_process_group, it would keep the group alive past
    # shutdown(), and the group's Gloo threads would be torn down with the interpreter, which now and then
    # aborts the process at exit ("terminate called without an active exception").
    import torch.distributed.nn

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:  # DistStoreError/DistNetworkError are RuntimeErrors; bad env: ValueError
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise DistributedError(
            f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}: could not join the {backend} process "
            f"group at {where} within {timeout_s:g} s (--timeout): {str(exc).strip().rstrip('.')}. "
            "Check that every rank was started with the "
            "same rendezvous settings and can reach that address."
        ) from exc
    return TorchComm(device, timeout_s=timeout_s, owns_group=True)


def not_under_torchrun(mode: str) -> UsageError:
    """The error for ``--shard-target mode`` in a process that is not one rank of a torchrun world."""
    return UsageError(
        f"--shard-target {mode} runs under torchrun (it shards the target over the ranks); "
        "launch with torchrun --nproc-per-node N, or use --shard-target replicate"
    )


def require_group(mode: str) -> None:
    """Check that a process group is initialised, as a sharded target needs.

    Raises:
        ValueError: no process group (not launched by ``torchrun``).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise not_under_torchrun(mode)


def fully_shard_units(
    units: list[torch.nn.Module], device: torch.device, ignored: set[torch.nn.Parameter] | None = None
) -> None:
    """Wrap each module of ``units`` with FSDP2 over all ranks, innermost first (the last is the root); the
    parameters in ``ignored`` are left whole on every rank, outside every unit.

    Raises:
        ValueError: no process group is initialised (not launched by ``torchrun``).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    require_group("fsdp")
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    sharded = [fully_shard(unit, mesh=mesh, ignored_params=ignored) for unit in units]
    if device.type == "cpu":
        # FSDP2 keeps a unit's all-gather output until the next unit's parameters are copied out of its own (for
        # streams that overlap the two on a GPU): three units at once in host memory. Gathering with async_op
        # frees each output as soon as its parameters are copied out, which on the CPU costs no overlap.
        sharded[-1]._set_unshard_async_op(True)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of a parameter (its local shard if sharded by FSDP2, else all of it) and its first row."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param, 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), int(offset[0]) if offset else 0


_left_group = False  # this process destroyed a group that init_from_env created: see exit_after_group


def shutdown(comm: Comm) -> None:
    """Leave the process group :func:`init_from_env` joined (no-op for :class:`LocalComm` or a caller's group)."""
    global _left_group
    if isinstance(comm, TorchComm) and comm.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
            _left_group = True
        comm.owns_group = False


def exit_after_group(code: int) -> int:
    """Return ``code``; but in a process that :func:`shutdown` took out of its group, end the process now.

    torch keeps references to process groups past ``destroy_process_group`` (DTensor's sharding caches
    hold the device meshes of a sharded target, and the meshes their groups). Such a
    group's Gloo threads are then torn down with the interpreter, which now and then aborts a process that
    completed its work (SIGABRT, "terminate called without an active exception"). A command that ran under
    ``torchrun`` has flushed and synced everything it wrote by then, so it skips that teardown.
    """
    if _left_group:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

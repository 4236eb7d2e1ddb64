"""``--device``: the names it takes, the default, and the refusal of one this process cannot use (one rule for
``precompute``, ``audit``, ``regenerate``, ``train`` and ``evaluate``); which compute dtype runs fastest there; and
the dtype names every ``--dtype`` and ``--model-dtype`` takes (:data:`DTYPES`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

from speccache.errors import UsageError

__all__ = ["DTYPES", "TORCH_DTYPE_NAMES", "check_device", "dtype_name", "fast_compute_dtype", "target_device"]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtype names of ``--dtype`` (storage) and ``--model-dtype`` (the target's compute, besides ``auto``)."""

TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""torch's names of the :data:`DTYPES`, which every ``--dtype`` and ``--model-dtype`` also takes."""


def dtype_name(name: str, flag: str, choices: Sequence[str] = tuple(DTYPES)) -> str:
    """``name`` given to ``flag`` as a key of :data:`DTYPES` (or another of ``choices``): every command takes the
    short names (``bf16``) and torch's (``bfloat16``), and records the short one.

    Raises:
        ValueError: neither, naming ``flag`` and ``choices``.
    """
    short = TORCH_DTYPE_NAMES.get(name, name)
    if short not in choices:
        raise UsageError(
            f"{flag} {name!r} is unknown; choose one of {', '.join(choices)} (torch's names, as bfloat16, too)"
        )
    return short


def check_device(device: str | None) -> None:
    """Refuse a ``--device`` other than ``cpu``, ``cuda`` or ``cuda:N``, or CUDA where torch sees no GPU.

    Raises:
        ValueError: naming the device and what to give instead.
    """
    if device is None:
        return
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise UsageError(f"--device {device!r} is unknown; choose cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is visible to this process; use --device cpu")


def target_device(device: str | None) -> torch.device:
    """``device`` (checked by :func:`check_device`), else CUDA (``cuda:LOCAL_RANK`` under torchrun) if available,
    else the CPU.

    Raises:
        ValueError: see :func:`check_device`.
    """
    check_device(device)
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# /proc/cpuinfo flags of CPUs that multiply bf16 matrices natively: x86's AVX512-BF16 and AMX, Arm's BF16.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def fast_compute_dtype(device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The ``--model-dtype`` that runs a target fastest on ``device``: ``bf16`` on a GPU and on a CPU with bf16
    instructions, else ``fp32``.

    Without them torch emulates bf16 matrix products: on an AVX2-only CPU a SmolLM2-135M forward ran 5.5x slower
    in bf16 than in fp32, where a CPU with AMX ran it about 4x faster (docs/acceptance.md).
    """
    if device.type != "cpu":
        return "bf16"
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:  # not Linux: nothing tells, and fp32 is never the slow case
        return "fp32"
    return "bf16" if flags & _BF16_FLAGS else "fp32"

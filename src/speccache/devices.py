"""``--device``: the names it takes, the default, and the refusal of one this process cannot use (one rule for
``precompute``, ``audit``, ``regenerate``, ``train`` and ``evaluate``)."""

from __future__ import annotations

import os
import re

import torch

__all__ = ["check_device", "target_device"]


def check_device(device: str | None) -> None:
    """Refuse a ``--device`` other than ``cpu``, ``cuda`` or ``cuda:N``, or CUDA where torch sees no GPU.

    Raises:
        ValueError: naming the device and what to give instead.
    """
    if device is None:
        return
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"--device {device!r} is unknown; choose cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible to this process; use --device cpu")


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

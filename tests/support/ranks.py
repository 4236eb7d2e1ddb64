"""Launching ``speccache`` in a process, or over torchrun's ranks (Gloo on the CPU), as the sharded tests do."""

from __future__ import annotations

import os
import subprocess
import sys


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of a launched run: offline, and one thread per process, so that the reference and every
    rank run the same GEMM kernels and their bytes can match."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECCACHE_FAULT", None)
    return {**env, **extra}


def launch(argv: list[str], nproc: int) -> subprocess.CompletedProcess[str]:
    """``python -m speccache ARGV`` in one process, or under torchrun over ``nproc`` ranks (with a 60 s collective
    timeout, so that a hung rank fails the test rather than the suite's time limit)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        argv = [*argv, "--timeout", "60"]
    cmd = [*launcher, "-m", "speccache", *argv]
    return subprocess.run(cmd, env=rank_env(), timeout=240, capture_output=True, text=True)

"""The KV connector that vLLM's ``extract_hidden_states`` method writes through: it hands each request's hidden
states to the process that started vLLM (:data:`DELIVERED` there) instead of writing a file per request.

Imported by vLLM alone (``kv_connector_module_path``) and by :meth:`speccache.engines.vllm.VllmEngine.start`, so
that importing :mod:`speccache.engines.vllm` needs no vLLM. The stock connector copies asynchronously into
pinned memory on a CUDA stream, which fails on a CPU build (``pin_memory=True requires a CUDA or other
accelerator backend``); this one copies synchronously, on any device.

Where vLLM's tensor-parallel rank 0 worker runs in the starting process (one rank: speccache runs vLLM's
engine core in process), the states go straight into :data:`DELIVERED`. With more ranks vLLM's workers are
processes of their own: rank 0 then sends each request's states over a Unix socket that :func:`listen` serves
in the starting process, and a thread there puts them into :data:`DELIVERED`. So do the engine cores of torchrun's
ranks, each in a process of its own.

In every process but the starting one (an engine core, a worker) the connector asks the kernel to kill the process
when its parent dies: vLLM's processes outlive a rank that was killed (SIGKILL) otherwise, holding its devices.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

DELIVERED: dict[str, torch.Tensor] = {}
"""Request id -> its hidden states ``[T, len(layer_ids), H]`` on the CPU, until the engine takes them."""

_HEADER = struct.Struct("<Q")


def listen(path: str) -> None:
    """Serve the socket ``path``: every message a worker sends lands in :data:`DELIVERED` (a daemon thread)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def receive(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            while header := stream.read(_HEADER.size):
                req_id, states = torch.load(io.BytesIO(stream.read(_HEADER.unpack(header)[0])))
                DELIVERED[req_id] = states

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=receive, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was gone before the request
        os.kill(os.getpid(), signal.SIGKILL)


class _Copied:
    """A finished copy, as the stock connector's CUDA event reports one."""

    def query(self) -> bool:
        return True


class InProcessHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that hands the states to the starting process, synchronously.

    ``kv_connector_extra_config``: ``speccache_pid`` (the starting process), ``speccache_socket`` (its
    :func:`listen` path) and ``speccache_handoff`` (``auto``, or ``socket`` to send even from that process).
    """

    _socket: socket.socket | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if os.getpid() != self._kv_transfer_config.get_from_extra_config("speccache_pid", None):
            _die_with_parent()

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long).reshape(-1, 1)
        slots = (torch.arange(self._block_size, dtype=torch.long).reshape(1, -1) + blocks * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        self._deliver(pending.req_id, states.to("cpu", copy=True))
        self._req_copy_events[pending.req_id] = _Copied()  # type: ignore[assignment]

    def _deliver(self, req_id: str, states: torch.Tensor) -> None:
        extra = self._kv_transfer_config.get_from_extra_config
        if os.getpid() == extra("speccache_pid", None) and extra("speccache_handoff", "auto") != "socket":
            DELIVERED[req_id] = states
            return
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.connect(extra("speccache_socket", None))
        payload = io.BytesIO()
        torch.save((req_id, states), payload)
        self._socket.sendall(_HEADER.pack(payload.tell()) + payload.getvalue())

"""The KV connector that vLLM's ``extract_hidden_states`` method writes through: it keeps each request's hidden
states in this process (:data:`DELIVERED`) instead of writing a file per request.

Imported by vLLM alone (``kv_connector_module_path``), so that importing :mod:`speccache.engines.vllm` needs no vLLM.
The stock connector copies asynchronously into pinned memory on a CUDA stream, which fails on a CPU build
(``pin_memory=True requires a CUDA or other accelerator backend``); this one copies synchronously, on any device.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

DELIVERED: dict[str, torch.Tensor] = {}
"""Request id -> its hidden states ``[T, len(layer_ids), H]`` on the CPU, until the engine takes them."""


class _Copied:
    """A finished copy, as the stock connector's CUDA event reports one."""

    def query(self) -> bool:
        return True


class InProcessHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that hands the states over in process, synchronously."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long).reshape(-1, 1)
        slots = (torch.arange(self._block_size, dtype=torch.long).reshape(1, -1) + blocks * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        DELIVERED[pending.req_id] = states.to("cpu", copy=True)
        self._req_copy_events[pending.req_id] = _Copied()  # type: ignore[assignment]

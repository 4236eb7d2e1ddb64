"""The connector's socket hand-off (how vLLM's rank 0 worker in a process of its own, under
--tensor-parallel-size > 1, delivers), forced on one rank: the states are transformers' layer outputs."""

from __future__ import annotations

import pytest
import torch
from enginelib import require_vllm

from speccache.engines.vllm import VllmEngine
from speccache.methods.decoder import forward_capturing

require_vllm()

pytestmark = pytest.mark.usefixtures("offline_single_thread")


def test_states_sent_over_the_socket_are_the_layer_outputs(vllm_models):
    from transformers import AutoModelForCausalLM

    path = vllm_models("llama")
    engine = VllmEngine(path, [0, 3, 8], dtype="fp32", max_model_len=64, handoff="socket")
    sequences = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    try:
        states = engine.hidden_states(sequences)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for seq, got in zip(sequences, states):
        ids = torch.tensor([seq])
        _, want = forward_capturing(model, ids, torch.ones_like(ids), {3: 2, 8: 7}, 0)
        expected = torch.stack([want[k][0] for k in (0, 3, 8)], dim=1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

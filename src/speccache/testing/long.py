"""A long-sample target and the memory of its chunked forward (tests/test_long_samples.py, benchmarks/long_samples.py).

``python -m speccache.testing.long LENGTH CHUNK TARGET`` runs :func:`forward_capturing` of ``TARGETS[TARGET]``
on one sample of ``LENGTH`` tokens in chunks of ``CHUNK`` (0: unchunked) and prints the peak growth of the
process's resident memory during the forward, in bytes; :func:`forward_peak_bytes` runs it in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speccache.methods.decoder import forward_capturing

__all__ = [
    "LONG_TARGET",
    "TARGETS",
    "WIDE_MLP_TARGET",
    "forward_peak_bytes",
    "long_target",
    "memory_bound",
    "right_padded",
]

LONG_TARGET = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=1 << 18,
)  # fmt: skip
"""A Llama small enough for 131,072 tokens on a CPU: 2 layers, hidden 32, 2 heads of 16, 1 KV head."""

WIDE_MLP_TARGET = dict(LONG_TARGET, hidden_size=64, intermediate_size=4096, num_hidden_layers=1, head_dim=32)
"""As :data:`LONG_TARGET` with a real target's proportion of MLP to attention width (an 8B's MLP is 3.5x its
hidden size, with 32 heads): per token its MLP's activations outweigh one chunk's attention scores."""

TARGETS = {"narrow": LONG_TARGET, "wide-mlp": WIDE_MLP_TARGET}


def long_target(seed: int = 0, config: dict | None = None) -> LlamaForCausalLM:
    """The random fp32 Llama of ``config`` (default :data:`LONG_TARGET`) and ``seed``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(config or LONG_TARGET))).eval()


def right_padded(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and the attention mask of right-padded samples of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids, mask


def memory_bound(length: int, chunk: int) -> int:
    """What the chunked forward of :data:`LONG_TARGET` may hold at once: its outputs and KV cache (linear in
    ``length``), one chunk's attention over the tokens so far (fp32 scores per head and the boolean mask,
    ``chunk x length``), twice over for a forward's temporaries, plus 64 MiB of allocator slack."""
    hidden, heads, layers = (
        LONG_TARGET["hidden_size"],
        LONG_TARGET["num_attention_heads"],
        LONG_TARGET["num_hidden_layers"],
    )
    outputs = 3 * length * hidden * 4  # the last state, one captured layer, the embeddings
    kv = layers * 2 * length * LONG_TARGET["head_dim"] * LONG_TARGET["num_key_value_heads"] * 4
    attention = chunk * length * (heads * 4 + 1)
    return 2 * (outputs + kv + attention) + (64 << 20)


def forward_peak_bytes(length: int, chunk: int | None, target: str = "narrow") -> int:
    """The peak growth of resident memory while ``TARGETS[target]`` computes one ``length``-token sample in
    ``chunk``-token chunks (``None``: at once), measured in a fresh one-thread process."""
    out = subprocess.run(
        [sys.executable, "-m", "speccache.testing.long", str(length), str(chunk or 0), target],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the forward of {length} tokens failed: {out.stderr[-3000:]}")
    return int(out.stdout.split()[-1])


def _measure(length: int, chunk: int | None, target: str) -> int:
    torch.set_num_threads(1)
    model = long_target(config=TARGETS[target])
    ids, mask = right_padded([length], LONG_TARGET["vocab_size"])
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    base = rss()
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        forward_capturing(model, ids, mask, {"layer0": 0}, "embed", chunk=chunk)
    finally:
        done.set()
        thread.join()
    return max(peak[0], rss()) - base


if __name__ == "__main__":
    print(_measure(int(sys.argv[1]), int(sys.argv[2]) or None, sys.argv[3]))

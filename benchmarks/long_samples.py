"""Peak memory of a long sample's forward, unchunked and in ``--prefill-chunk`` chunks, per token.

    python benchmarks/long_samples.py --out docs/benchmarks.md    # replaces the "long samples" section there

Each figure is the peak growth of resident memory while ``forward_capturing`` computes one sample of ``T``
tokens on ``speccache.testing.long.LONG_TARGET`` (a 2-layer Llama, hidden 32, 2 heads of 16; fp32; one captured
layer and the embeddings, as a method reads them), in a fresh one-thread process (``OMP_NUM_THREADS=1``), with
the bound the tests hold the chunked forward to (``memory_bound``). The outputs and the KV cache grow linearly
with ``T``; the attention of one forward holds ``queries x T`` scores per head, ``T x T`` unchunked and
``chunk x T`` chunked. An unchunked run that would exceed ``--max-unchunked-bytes`` is not started.

Usage: python benchmarks/long_samples.py [--lengths T ...] [--chunks N ...] [--max-unchunked-bytes B] [--out FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the measured processes run one thread each

import argparse
import platform

from docsection import replace_section  # benchmarks/, beside this script
from speccache.testing.long import LONG_TARGET, forward_peak_bytes, memory_bound
from speccache.units import human_bytes

BEGIN, END = "<!-- long-samples-benchmark:begin -->", "<!-- long-samples-benchmark:end -->"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--max-unchunked-bytes", type=int, default=8 << 30, help="skip unchunked runs above this")
    p.add_argument("--out", default=None, help="Markdown report to replace the long-samples section of")
    args = p.parse_args()

    heads = LONG_TARGET["num_attention_heads"]
    rows = []
    for length in args.lengths:
        cells = []
        unchunked_scores = length * length * heads * 4
        if unchunked_scores <= args.max_unchunked_bytes:
            peak = forward_peak_bytes(length, None)
            cells.append(f"{human_bytes(peak)} ({peak / length / 1024:.1f} KiB/token)")
        else:
            cells.append(f"not run (its scores alone: {human_bytes(unchunked_scores)})")
        for chunk in args.chunks:
            peak = forward_peak_bytes(length, chunk)
            bound = memory_bound(length, chunk)
            cells.append(
                f"{human_bytes(peak)} ({peak / length / 1024:.1f} KiB/token; bound {human_bytes(bound)})"
                + ("" if peak <= bound else " **over the bound**")
            )
        rows.append(f"| {length:,} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            BEGIN,
            "## Long samples: peak memory of the forward (benchmarks/long_samples.py)",
            "",
            f"`python benchmarks/long_samples.py --out docs/benchmarks.md` (`make bench`), {platform.machine()}, "
            f"{os.cpu_count()} cores, one thread. The peak growth of resident memory while one sample of T tokens "
            "is computed (`forward_capturing`, fp32) on a 2-layer Llama of hidden 32 with 2 heads of 16 "
            "(`speccache.testing.long.LONG_TARGET`), unchunked and with `--prefill-chunk N` (a KV cache carried "
            "across chunks); the bound is the one tests/test_long_samples.py holds the chunked forward to.",
            "",
            "| tokens | unchunked | " + " | ".join(f"chunks of {c}" for c in args.chunks) + " |",
            "|---|---|" + "---|" * len(args.chunks),
            *rows,
            "",
            "Unchunked, the attention of the one forward holds T x T scores per head (on a CPU, and in any "
            "attention that materialises them): memory per token grows with T. In chunks it holds chunk x T: per "
            "token that is `chunk x heads x 4` bytes plus the features and the KV cache, whatever T. A real "
            "target multiplies each term by its width (heads, layers, hidden size); a fused attention kernel "
            "(flash or memory-efficient SDPA on a GPU) does not hold the scores at all, and there the chunk "
            "bounds the MLP's and the projections' activations instead.",
            END,
            "",
        ]
    )
    print(text)
    if args.out:
        replace_section(args.out, text, BEGIN, END)


if __name__ == "__main__":
    main()

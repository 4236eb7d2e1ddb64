"""Peak memory of a long sample's forward, unchunked and in ``--prefill-chunk`` chunks, per token.

    python benchmarks/long_samples.py --out docs/benchmarks.md    # replaces the "long samples" section there

Each figure is the peak growth of resident memory while ``forward_capturing`` computes one unpadded sample of
``T`` tokens on a target of ``speccache.testing.long.TARGETS`` (narrow: attention-heavy; wide-mlp: a real
target's proportion of MLP to attention), fp32, one captured layer and the embeddings, in a fresh one-thread
process (``OMP_NUM_THREADS=1``), beside the bound the tests hold the narrow target's chunked forward to
(``memory_bound``). The report says what each term of the memory is.

Usage: python benchmarks/long_samples.py [--lengths T ...] [--chunks N ...] [--out FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the measured processes run one thread each

import argparse

from harness import machine_summary, replace_section  # benchmarks/, beside this script
from speccache.testing.long import TARGETS, forward_peak_bytes, memory_bound
from speccache.units import human_bytes

BEGIN, END = "<!-- long-samples-benchmark:begin -->", "<!-- long-samples-benchmark:end -->"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--out", default=None, help="Markdown report to replace the long-samples section of")
    args = p.parse_args()

    def cell(peak: int, length: int, bound: int | None = None) -> str:
        text = f"{human_bytes(peak)} ({peak / length / 1024:.1f} KiB/token"
        if bound is not None:
            text += f"; bound {human_bytes(bound)}" + ("" if peak <= bound else ", **over**")
        return text + ")"

    rows = []
    for target in TARGETS:
        for length in args.lengths:
            cells = [cell(forward_peak_bytes(length, None, target), length)]
            for chunk in args.chunks:
                bound = memory_bound(length, chunk) if target == "narrow" else None
                cells.append(cell(forward_peak_bytes(length, chunk, target), length, bound))
            rows.append(f"| {target} | {length:,} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    narrow, wide = TARGETS["narrow"], TARGETS["wide-mlp"]
    text = "\n".join(
        [
            BEGIN,
            "## Long samples: peak memory of the forward (benchmarks/long_samples.py)",
            "",
            f"`python benchmarks/long_samples.py --out docs/benchmarks.md` (`make bench`), {machine_summary()}, "
            f"one thread, torch's SDPA attention. The peak growth of resident memory while "
            "one unpadded sample of T tokens is computed (`forward_capturing`, fp32, one captured layer and the "
            "embeddings), unchunked and with `--prefill-chunk N` (a KV cache carried across chunks), on two "
            "random Llamas of `speccache.testing.long`: narrow (hidden "
            f"{narrow['hidden_size']}, MLP {narrow['intermediate_size']}, {narrow['num_hidden_layers']} layers, "
            f"{narrow['num_attention_heads']} heads) and wide-mlp (hidden {wide['hidden_size']}, MLP "
            f"{wide['intermediate_size']}, {wide['num_hidden_layers']} layer, {wide['num_attention_heads']} heads: "
            "a real target's proportion of MLP to attention). The bound is the one tests/test_long_samples.py "
            "holds the narrow target's chunked forward to.",
            "",
            "| target | tokens | unchunked | " + " | ".join(f"chunks of {c}" for c in args.chunks) + " |",
            "|---|---|---|" + "---|" * len(args.chunks),
            *rows,
            "",
            "What a chunk bounds is the activations of one forward: the MLP's and the projections' grow with the "
            "tokens computed at once (`T` unchunked, `N` chunked), which is what the wide-MLP target shows (and a "
            "real target, whose MLP is 3.5x its hidden size and whose layers hold several such tensors, more so). "
            "The attention is the other term: for one unpadded sample SDPA's fused causal kernel holds no "
            "scores, while a chunk after the first attends with an explicit mask (its queries sit after the "
            "cached tokens), which SDPA on a CPU computes with `N x T` scores per head: on the narrow target, "
            "whose MLP is tiny, that makes chunks cost more than the unchunked forward. On a GPU the masked SDPA "
            "kernels (memory-efficient attention) hold no scores either, so the chunk's memory is its "
            "activations; where the attention holds its scores anyway (eager attention, a padded batch), the "
            "unchunked forward holds `T x T` per head and the chunked one `N x T`. Per token, then: the features "
            "and the KV cache (linear in T) plus the activations of `N` tokens, whatever T.",
            END,
            "",
        ]
    )
    print(text)
    if args.out:
        replace_section(args.out, text, BEGIN, END)


if __name__ == "__main__":
    main()

"""``speccache regenerate`` speed on the real target (SmolLM2-135M-Instruct): rows/s and generated tokens/s.

    OMP_NUM_THREADS=1 python benchmarks/regenerate.py --out docs/benchmarks.md   # replaces the "Regenerate" section

``--prompts`` single-turn prompts (the first user turn of the bundled demo rows, cycled), greedy, answers of at
most ``--max-new-tokens``, at each ``--batch-sizes`` and ``--dtypes``, on the CPU. Each case is one
``regenerate()`` call into a fresh directory, timed whole (the model load included, about a second); a
generated token is one the loss mask covers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from docsection import replace_section  # benchmarks/, beside this script

BEGIN, END = "<!-- regenerate-benchmark:begin -->", "<!-- regenerate-benchmark:end -->"


def prompts_file(path: str, n: int) -> None:
    """``n`` rows holding one user turn each (prompt-only rows: regenerate answers each once)."""
    from speccache.demo import demo_data_path

    with open(demo_data_path("openai")) as f:
        firsts = [next(m for m in json.loads(line)["messages"] if m["role"] == "user") for line in f if line.strip()]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [firsts[i % len(firsts)]]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=None, help="a Markdown file whose regenerate section is replaced")
    args = parser.parse_args()

    import torch

    from speccache.demo.real_target import ensure_real_target
    from speccache.precompute.regenerate import RegenerateConfig, regenerate

    model = ensure_real_target()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        prompts_file(data, args.prompts)
        for dtype in args.dtypes.split(","):
            for batch in map(int, args.batch_sizes.split(",")):
                out = os.path.join(tmp, f"{dtype}-{batch}")
                config = RegenerateConfig(
                    model, data, out, max_new_tokens=args.max_new_tokens, batch_size=batch, model_dtype=dtype
                )
                start = time.perf_counter()
                result = regenerate(config)
                seconds = time.perf_counter() - start
                row = (dtype, batch, result.rows, result.generated_tokens, seconds)
                rows.append(row)
                rate = f"{result.rows / seconds:.2f} rows/s, {result.generated_tokens / seconds:.1f} tokens/s"
                print(
                    f"{dtype:9} batch {batch:3}: {result.generated_tokens} tokens in {seconds:.1f} s = {rate}",
                    flush=True,
                )
    lines = [
        BEGIN,
        "## Regenerate",
        "",
        f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')} python benchmarks/regenerate.py "
        f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}` on the CPU "
        f"({os.cpu_count()} cores, torch {torch.__version__}): SmolLM2-135M-Instruct answering {args.prompts} "
        "single-turn prompts greedily, each case one `regenerate()` call (model load included).",
        "",
        "| dtype | batch | rows | generated tokens | seconds | rows/s | tokens/s |",
        "|---|---|---|---|---|---|---|",
        *(f"| {d} | {b} | {r} | {t} | {s:.1f} | {r / s:.2f} | {t / s:.1f} |" for d, b, r, t, s in rows),
        END,
    ]
    if args.out:
        replace_section(args.out, "\n".join(lines) + "\n", BEGIN, END)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

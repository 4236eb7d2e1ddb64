"""``speccache regenerate`` speed on the real target (SmolLM2-135M-Instruct): rows/s and generated tokens/s.

    OMP_NUM_THREADS=1 python benchmarks/regenerate.py --out docs/benchmarks.md   # replaces the "Regenerate" section

``--prompts`` single-turn prompts (the first user turn of the bundled demo rows, cycled), greedy, answers of at
most ``--max-new-tokens``, at each ``--batch-sizes`` and ``--dtypes``, on the CPU. Each case is one
``regenerate()`` call into a fresh directory, timed whole (the model load included, about a second); a
generated token is one the loss mask covers. The last column counts the rows whose ids equal those the first
batch size gave (batched greedy against one prompt at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from harness import machine_summary, replace_section  # benchmarks/, beside this script

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
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,16", help="the first is what the others are compared with")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=None, help="a Markdown file whose regenerate section is replaced")
    args = parser.parse_args()

    import torch

    from speccache.demo.real_target import ensure_real_target
    from speccache.precompute.regenerate import RegenerateConfig, regenerate

    model = ensure_real_target()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        prompts_file(data, args.prompts)
        for dtype in args.dtypes.split(","):
            first: list = []
            for batch in batch_sizes:
                out = os.path.join(tmp, f"{dtype}-{batch}")
                config = RegenerateConfig(
                    model, data, out, max_new_tokens=args.max_new_tokens, batch_size=batch, model_dtype=dtype
                )
                start, cpu = time.perf_counter(), time.process_time()
                result = regenerate(config)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                with open(os.path.join(out, "part-00000.jsonl")) as f:
                    answers = [json.loads(line)["input_ids"] for line in f]
                first = first if batch != batch_sizes[0] else answers
                same = sum(a == b for a, b in zip(answers, first))
                row = (dtype, batch, result.rows, result.generated_tokens, seconds, cpu, same)
                rows.append(row)
                rate = f"{result.rows / seconds:.2f} rows/s, {result.generated_tokens / seconds:.1f} tokens/s"
                print(
                    f"{dtype:9} batch {batch:3}: {result.generated_tokens} tokens in {seconds:.1f} s = {rate}; "
                    f"{cpu:.1f} CPU s; {same} of {result.rows} rows as at batch {batch_sizes[0]}",
                    flush=True,
                )
    lines = [
        BEGIN,
        "## Regenerate",
        "",
        f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')} python benchmarks/regenerate.py "
        f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}` on the CPU "
        f"({machine_summary()}, torch {torch.__version__}): SmolLM2-135M-Instruct answering {args.prompts} "
        "single-turn prompts greedily, each case one `regenerate()` call (model load included). The rates are per "
        "second of wall time; CPU seconds are the process's own (a shared machine's other load is in the wall time "
        "only).",
        "",
        f"| dtype | batch | rows | generated tokens | seconds | CPU seconds | rows/s | tokens/s | tokens per CPU s "
        f"| rows as at batch {batch_sizes[0]} |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {d} | {b} | {r} | {t} | {s:.1f} | {c:.1f} | {r / s:.2f} | {t / s:.1f} | {t / c:.1f} | {same} |"
            for d, b, r, t, s, c, same in rows
        ),
        END,
    ]
    if args.out:
        replace_section(args.out, "\n".join(lines) + "\n", BEGIN, END)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

"""Image rows against text rows on the same vision-language target: bytes per token of each key, and precompute
tokens/s.

``speccache precompute --method eagle3`` of the tiny Qwen2.5-VL and Qwen3-VL targets of
:mod:`speccache.testing.vlm` (4 decoder layers of width 64, fp32 on the CPU, one torch thread) over ``--rows``
chat rows twice: as image rows (one or two drawn pictures of 56-112 px per row, the question and answer in text)
and as the same rows with the images left out (text rows). Each case runs ``--rounds`` times into a fresh
directory (the model load included, well under a second); the median round is reported. Bytes are the shards'
(``speccache inspect``'s per-key bytes) over the tokens they hold.

The report goes between ``<!-- vision-benchmark:begin -->`` and ``<!-- vision-benchmark:end -->`` of ``--out``.

Usage: OMP_NUM_THREADS=1 python benchmarks/vision.py --out docs/benchmarks.md [--work bench-out] [--rows 48]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from typing import Any

from harness import Report, bench_args, start, write_report  # benchmarks/, beside this script

CASES = {  # the rows and the flags of each case
    "text": [],
    "image rows": [],
    "image rows, --no-vision-inputs": ["--no-vision-inputs"],
}

QUESTIONS = [
    ("What is in the picture?", "A red square on a blue ground, crossed by a dark line."),
    ("Describe the colours.", "The ground is blue, the square red and the line almost black."),
    ("Where is the square?", "In the middle, half as wide and half as high as the picture."),
    ("Compare the pictures.", "Both hold a square; the grounds differ in their shade of blue."),
]


def write_rows(folder: str, rows: int, images: bool) -> str:
    """``rows`` chat rows in ``folder/data.jsonl`` (with images: one or two drawn pictures each, by path)."""
    from speccache.testing.vlm import draw_image

    os.makedirs(folder, exist_ok=True)
    lines = []
    for i in range(rows):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        parts: list[dict[str, Any]] = []
        for j in range((1 + i % 2) if images else 0):
            name = f"img{i}-{j}.png"
            draw_image(os.path.join(folder, name), 56 + 14 * (i % 5), 56 + 14 * ((i + j) % 5), seed=i + j)
            parts.append({"type": "image_url", "image_url": {"url": name}})
        user = {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
        assistant = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
        lines.append(json.dumps({"messages": [user, assistant]}))
    path = os.path.join(folder, "data.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_case(model: str, data: str, out: str, rounds: int, *flags: str) -> tuple[float, dict[str, Any]]:
    """The median wall seconds of ``rounds`` precompute runs, and the last run's ``inspect`` description."""
    from speccache.cli import main
    from speccache.read.verify import inspect_cache

    argv = ["precompute", "--model", model, "--data", data, "--out", out, "--dtype", "bf16", "--model-dtype", "fp32"]
    argv += ["--batch-size", "8", "--device", "cpu", "--quiet", *flags]
    seconds = []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        began = time.perf_counter()
        if main(argv) != 0:
            raise SystemExit(f"precompute of {data} failed")
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds), inspect_cache(out)


def bench_vision(report: Report, work: str, rows: int, rounds: int) -> None:
    from speccache.demo.real_target import ensure_real_target
    from speccache.testing.vlm import ensure_vlm_target

    report.add("## Vision-language targets: image rows against text rows (benchmarks/vision.py)")
    report.add()
    data = {kind: write_rows(os.path.join(work, f"vision-{kind}"), rows, kind == "image") for kind in ("image", "text")}
    keys: list[str] = []
    measured: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
    for family in ("qwen2_5_vl", "qwen3_vl"):
        model = ensure_vlm_target(family, ensure_real_target())
        for number, (case, flags) in enumerate(CASES.items()):
            source = data["text" if case == "text" else "image"]
            out = os.path.join(work, f"vision-{family}-{number}-cache")
            measured[family, case] = run_case(model, source, out, rounds, *flags)
            keys += [k for k in measured[family, case][1]["keys"] if k not in keys and k != "source_row"]
    table = []
    for (family, case), (seconds, info) in measured.items():
        tokens = info["num_tokens"]
        per_key = [f"{info['keys'][k]['bytes'] / tokens:.1f}" if k in info["keys"] else "-" for k in keys]
        rates = [f"{info['num_samples'] / seconds:.1f}", f"{tokens / seconds:.0f}"]
        table.append([family, case, tokens, f"{info['bytes_per_token']:.1f}", *per_key, *rates])
    header = ["target", "rows", "tokens", "bytes/token", *(f"{k} B/token" for k in keys)]
    report.table([*header, "precompute rows/s", "tokens/s"], table)
    for family in ("qwen2_5_vl", "qwen3_vl"):
        (text_s, text), (image_s, image) = measured[family, "text"], measured[family, "image rows"]
        speed = (image["num_tokens"] / image_s) / (text["num_tokens"] / text_s)
        size = image["bytes_per_token"] / text["bytes_per_token"]
        report.target(
            f"{family}: image rows against text rows",
            f"{size:.2f}x the bytes per token, {speed:.2f}x the tokens/s",
            None,
        )


def main(argv: list[str] | None = None) -> None:
    p = bench_args(__doc__, scale=None, rounds=3)
    p.add_argument("--rows", type=int, default=48, help="chat rows per case (default 48)")
    args, run = start(p, __file__, argv)
    report = Report()
    bench_vision(report, args.work, args.rows, args.rounds)
    write_report("vision", report, run, args.out)


if __name__ == "__main__":
    main()

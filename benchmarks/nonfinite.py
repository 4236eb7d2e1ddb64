"""Section 6: the non-finite guard's share of a precompute run (target: <= 3%), and its throughput alone.

``speccache precompute`` of the demo target (tiny Llama, fp32 on the CPU) with the guard
(``speccache.methods.finite.guard_nonfinite``) timed inside the same run, the median of ``--rounds`` runs; then the
guard alone over section 1's bytes of bf16 rows, the best of ``--rounds``.

The report goes between ``<!-- nonfinite-benchmark:begin -->`` and ``<!-- nonfinite-benchmark:end -->`` of
``--out``.

Usage: python benchmarks/nonfinite.py --out docs/benchmarks.md [--work bench-out] [--scale 1.0] [--rounds 3]
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from harness import Report, bench_args, start, timed, write_report  # benchmarks/, beside this script


def bench_nonfinite(report: Report, work: str, scale: float, rounds: int) -> None:
    """The guard's share of a precompute run (target: <= 3%), and its throughput against the section-1 write."""
    from speccache.demo import build_tiny_model_dir, demo_data_path
    from speccache.methods import eagle3
    from speccache.methods.finite import guard_nonfinite
    from speccache.precompute import PrecomputeConfig, run_precompute

    model = build_tiny_model_dir(os.path.join(work, "guard-model"), "llama", seed=0)
    out = os.path.join(work, "guard-cache")
    limit = max(16, int(240 * scale))
    cfg = PrecomputeConfig(
        model=model, data=demo_data_path("sharegpt"), out=out, batch_size=8, shard_size=64, max_length=512,
        limit=limit, model_dtype="fp32", device="cpu",
    )  # fmt: skip
    spent = [0.0]

    def timed_guard(*args: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        try:
            return guard_nonfinite(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    shares: list[tuple[float, float, float]] = []
    eagle3.guard_nonfinite = timed_guard  # the name compute_batch looks up at call time
    try:
        for _ in range(rounds):
            shutil.rmtree(out, ignore_errors=True)
            spent[0] = 0.0
            total = timed(lambda: run_precompute(cfg, progress=False))
            shares.append((spent[0] / total, spent[0], total))
    finally:
        eagle3.guard_nonfinite = guard_nonfinite
    share, guard_s, total_s = sorted(shares)[len(shares) // 2]  # the median round

    rows = max(1, int(8 * 256 * 48 * scale))
    feats = {"__lengths__": torch.full((rows // 256 or 1,), 256), "x": torch.randn(rows, 4096).to(torch.bfloat16)}
    guard_only = min(timed(lambda: guard_nonfinite(feats, "fail", lambda k, c: "")) for _ in range(rounds))
    nbytes = feats["x"].numel() * 2
    report.add("## 6. Non-finite guard")
    report.add()
    report.add(
        f"`speccache precompute` of the demo target (tiny Llama, fp32 on the CPU) over {limit} demo conversations, "
        "batches of 8, bf16 storage, with the guard (`speccache.methods.finite.guard_nonfinite`, called by "
        "`compute_batch` before the copy to the host) timed inside the same run; the median of "
        f"{rounds} runs. The guard costs one `aminmax` per float key and one host sync per batch."
    )
    report.add()
    alone = f"{guard_only:.2f} s ({nbytes / guard_only / 1e6:.0f} MB/s)"
    report.table(
        ["measure", "value"],
        [
            ["precompute wall time", f"{total_s:.2f} s"],
            ["time in the guard", f"{guard_s * 1000:.1f} ms"],
            ["guard share of the run", f"{share * 100:.2f}%"],
            [f"guard alone over {nbytes / 1e6:.0f} MB of bf16 rows", alone],
        ],
    )
    report.add(
        "The last row is the guard over the bytes of section 1, for comparison with the cache write throughput "
        "there: on a GPU the same reduction runs at memory bandwidth (TB/s), before the copy to the host."
    )
    report.add()
    report.target("non-finite guard share of the precompute run <= 3%", f"{share * 100:.2f}%", share <= 0.03)


def main(argv: list[str] | None = None) -> None:
    args, run = start(bench_args(__doc__), __file__, argv)
    report = Report()
    bench_nonfinite(report, args.work, args.scale, args.rounds)
    write_report("nonfinite", report, run, args.out)


if __name__ == "__main__":
    main()

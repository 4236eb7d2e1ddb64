"""``benchmarks/run.py``: its read sections' paired statistics, and its report written in place in a shared file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def run_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    return run


def test_paired_rounds_compare_jobs_within_each_round(run_module):
    # The disk's speed changes between rounds; within a round both jobs see the same disk. The ratio is the
    # median of the rounds' own ratios (0.9, 2.0, 0.8), not the best plain time over the best of the other job.
    calls: list[str] = []
    plain_times = iter([1.0, 2.0, 2.0])
    ours_times = iter([1 / 0.9, 1.0, 2 / 0.8])

    def job(name, times):
        def run():
            calls.append(name)
            return next(times)

        return run

    runs = run_module.paired_rounds(3, {"plain": job("plain", plain_times), "ours": job("ours", ours_times)}, seed=1)
    assert sorted(calls[:2]) == sorted(calls[2:4]) == sorted(calls[4:]) == ["ours", "plain"]  # once per round
    assert runs.ratio("plain", "ours") == pytest.approx(0.9)
    assert runs.spread("plain", "ours") == "0.80-2.00x"
    assert runs["plain"] == 2.0 and runs["ours"] == pytest.approx(1 / 0.9)  # medians


def test_paired_rounds_shuffle_the_order_of_jobs(run_module):
    calls: list[str] = []
    jobs = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abcdef"}
    run_module.paired_rounds(4, jobs, seed=0)
    orders = {tuple(calls[i : i + 6]) for i in range(0, 24, 6)}
    assert len(orders) > 1 and all(sorted(o) == list("abcdef") for o in orders)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_report_replaces_its_own_section_and_keeps_the_rest(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n\n<!-- other:begin -->\nanother script's section\n<!-- other:end -->\n")
    cmd = [sys.executable, str(BENCHMARKS / "run.py"), "--only", "nonfinite", "--rounds", "1", "--scale", "0.05",
           "--work", str(tmp_path / "work"), "--out", str(doc)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n\n<!-- other:begin -->\nanother script's section\n<!-- other:end -->")
    assert text.count("<!-- run-benchmark:begin -->") == text.count("<!-- run-benchmark:end -->") == 1
    assert "## 6. Non-finite guard" in text and text.endswith("<!-- run-benchmark:end -->\n")
    assert "seed module: not needed by these sections" in text  # nothing downloaded for sections that need no seed

"""``benchmarks/harness.py`` and the section scripts: paired statistics, the read targets against their ceilings, and
a script's report written in place in a shared file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import harness

    return harness


def test_paired_rounds_compare_jobs_within_each_round(harness):
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

    runs = harness.paired_rounds(3, {"plain": job("plain", plain_times), "ours": job("ours", ours_times)}, seed=1)
    assert sorted(calls[:2]) == sorted(calls[2:4]) == sorted(calls[4:]) == ["ours", "plain"]  # once per round
    assert runs.ratio("plain", "ours") == pytest.approx(0.9)
    assert runs.spread("plain", "ours") == "0.80-2.00x"
    assert runs["plain"] == 2.0 and runs["ours"] == pytest.approx(1 / 0.9)  # medians


def test_paired_rounds_shuffle_the_order_of_jobs(harness):
    calls: list[str] = []
    jobs = {name: (lambda name=name: calls.append(name) or 1.0) for name in "abcdef"}
    harness.paired_rounds(4, jobs, seed=0)
    orders = {tuple(calls[i : i + 6]) for i in range(0, 24, 6)}
    assert len(orders) > 1 and all(sorted(o) == list("abcdef") for o in orders)


def test_warm_read_targets_are_held_against_the_ceilings_of_the_same_rounds(harness):
    # Issue 44: large warm >= 0.9x the two-buffer plain read, small warm >= 0.8x the bare per-sample copy loop, each
    # the median of per-round ratios; the one-buffer plain read is reported without a target.
    import reads

    times = {
        "plain warm": [1.0, 1.0, 1.0],
        "plain warm, two batch buffers": [2.0, 2.0, 2.0],
        "bare copies warm": [3.0, 3.0, 3.0],
        "plain cold": [4.0, 4.0, 4.0],
        "ours-pack locality warm": [2.0, 2.5, 4.0],
        "ours-pack locality cold": [5.0, 5.0, 5.0],
    }
    runs = harness.Paired(times)
    large = {what: (ratio, target) for what, ratio, target in reads.native_targets(runs, "large")}
    assert large == {
        "large warm shuffled reads (locality sampler) >= 0.9x the plain read into two batch-sized buffers in turn": (
            pytest.approx(0.8), 0.9),
        "large warm shuffled reads (locality sampler) / plain read into one reused buffer (reported)": (
            pytest.approx(0.4), None),
        "large cold shuffled reads (locality sampler) >= 0.9x plain sequential read": (pytest.approx(0.8), 0.9),
    }  # fmt: skip
    small = {what: (ratio, target) for what, ratio, target in reads.native_targets(runs, "small")}
    assert small == {
        "small warm shuffled reads (locality sampler) >= 0.8x the bare per-sample copy loop": (pytest.approx(1.2), 0.8),
        "small warm shuffled reads (locality sampler) / plain read into one reused buffer (reported)": (
            pytest.approx(0.4), None),
    }  # fmt: skip


def test_the_report_states_its_targets_and_verdicts(harness, tmp_path):
    report = harness.Report(echo=False)
    report.add("## 9. A section")
    report.add()
    report.add("body")
    report.target("x >= 1x", "1.50x", True)
    report.target("y >= 1x", "0.50x", False)
    report.target("z (reported)", "2.00x", None)
    doc = tmp_path / "b.md"
    harness.write_report("nine", report, harness.Run("nine.py", str(tmp_path), "--out b.md"), str(doc))
    text = doc.read_text()
    assert text.startswith(
        "\n\n<!-- nine-benchmark:begin -->\n## 9. A section\n\n`python benchmarks/nine.py --out b.md`"
    )
    assert "| x >= 1x | 1.50x | met |\n| y >= 1x | 0.50x | **not met** |\n| z (reported) | 2.00x | n/a |" in text
    assert text.endswith("body\n<!-- nine-benchmark:end -->\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_replaces_its_own_section_and_keeps_the_rest(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n\n<!-- other:begin -->\nanother script's section\n<!-- other:end -->\n")
    cmd = [sys.executable, str(BENCHMARKS / "nonfinite.py"), "--rounds", "1", "--scale", "0.05",
           "--work", str(tmp_path / "work"), "--out", str(doc)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n\n<!-- other:begin -->\nanother script's section\n<!-- other:end -->")
    assert text.count("<!-- nonfinite-benchmark:begin -->") == text.count("<!-- nonfinite-benchmark:end -->") == 1
    assert "## 6. Non-finite guard" in text and text.endswith("<!-- nonfinite-benchmark:end -->\n")
    assert "| non-finite guard share of the precompute run <= 3% |" in text
    assert not (tmp_path / "work" / "upstream").exists()  # nothing downloaded for a section that needs no seed

"""The pictures and the log of ``speccache train`` and ``speccache evaluate``, through the CLI.

* train writes ``train_log.jsonl`` (one line per optimizer step, as it trains) and ``loss.png`` in the draft
  directory;
* evaluate draws ``REPORT.png`` beside ``--json REPORT.json``, and nothing without ``--json``;
* without matplotlib both print one line saying how to get it, and still write their log and report.
"""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.train.trainer import lr_factor

pytestmark = pytest.mark.usefixtures("offline_single_thread")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HINT = "pip install 'speccache[plots]'"


@pytest.fixture(scope="module")
def cache(tiny_models, tmp_path_factory):
    """An fp32 EAGLE-3 cache of 16 demo rows of the tiny llama: two batches of 8 per epoch."""
    out = str(tmp_path_factory.mktemp("plots") / "cache")
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt"), "--out", out,
            "--limit", "16", "--batch-size", "4", "--max-length", "128", "--model-dtype", "fp32", "--dtype", "fp32",
            "--draft-vocab-size", "300", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    return out


def _train(cache: str, out: str) -> None:
    argv = ["train", cache, "--out", out, "--epochs", "3", "--batch-size", "8", "--ttt-steps", "2", "--lr", "2e-3",
            "--warmup", "0.2"]  # fmt: skip
    assert main(argv) == 0


def _matplotlib_png(path) -> tuple[int, int]:
    """The size of a PNG file that matplotlib wrote (its signature, and the Software text chunk it adds)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert b"Software" in data and b"Matplotlib" in data
    return struct.unpack(">II", data[16:24])


def _hide_matplotlib(monkeypatch) -> None:
    """Make every ``import matplotlib...`` fail, as on an install without the plots extra."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_train_writes_a_step_log_and_a_loss_curve(cache, tmp_path, capsys):
    out = tmp_path / "draft"
    _train(cache, str(out))
    printed = capsys.readouterr().out
    assert f"training log: {out / 'train_log.jsonl'}; loss curve: {out / 'loss.png'}" in printed

    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["epoch"] for r in records] == [1, 1, 2, 2, 3, 3]
    for r in records:
        assert set(r) == {"step", "epoch", "loss", "lr", "tokens", "accuracy", "seconds"}
        assert r["lr"] == pytest.approx(2e-3 * lr_factor(r["step"] - 1, 6, 0.2))
        assert len(r["accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in r["accuracy"])
        assert r["tokens"] > 0 and math.isfinite(r["loss"])
    assert [r["seconds"] for r in records] == sorted(r["seconds"] for r in records)
    assert sum(r["tokens"] for r in records[:2]) == sum(r["tokens"] for r in records[2:4])  # each epoch reads all
    training = json.loads((out / "config.json").read_text(encoding="utf-8"))["speccache"]["training"]
    assert training["steps"] == 6 and training["final_loss"] == records[-1]["loss"]

    pytest.importorskip("matplotlib")
    assert _matplotlib_png(out / "loss.png") == (800, 600)


def test_evaluate_draws_the_acceptance_chart_beside_its_report(cache, tiny_models, tmp_path, monkeypatch, capsys):
    draft = str(tmp_path / "draft")
    _train(cache, draft)
    monkeypatch.chdir(tmp_path)
    argv = ["evaluate", draft, "--cache", cache, "--model", tiny_models("llama"), "--prompts", "1",
            "--max-new-tokens", "4"]  # fmt: skip
    assert main([*argv, "--json", "report.png"]) == 2  # refused before evaluating: the chart would replace it
    assert "--json report.png: its chart would be written over it; name the report REPORT.json" in (
        capsys.readouterr().err
    )
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # without --json nothing is written
    capsys.readouterr()

    assert main([*argv, "--json", "report.json"]) == 0
    assert "report: report.json; acceptance chart: report.png" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "report.json").read_text())) >= {"teacher_forced", "speculative"}
    pytest.importorskip("matplotlib")
    assert _matplotlib_png(tmp_path / "report.png") == (1100, 450)
    assert main(["evaluate", draft, "--cache", cache, "--json", "tf-only.json"]) == 0  # no --model: one panel
    assert _matplotlib_png(tmp_path / "tf-only.png") == (700, 450)


def test_without_matplotlib_one_line_says_how_to_get_it(cache, tmp_path, monkeypatch, capsys):
    _hide_matplotlib(monkeypatch)
    with pytest.raises(ImportError):
        import matplotlib  # noqa: F401
    out = tmp_path / "draft"
    _train(cache, str(out))
    printed = capsys.readouterr().out
    assert [line for line in printed.splitlines() if HINT in line] == [
        f"training log: {out / 'train_log.jsonl'}; {out / 'loss.png'} not drawn: matplotlib is not installed ({HINT})"
    ]
    assert len((out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()) == 6
    assert not (out / "loss.png").exists() and (out / "model.safetensors").exists()

    report = tmp_path / "report.json"
    assert main(["evaluate", str(out), "--cache", cache, "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert [line for line in printed.splitlines() if HINT in line] == [
        f"report: {report}; {tmp_path / 'report.png'} not drawn: matplotlib is not installed ({HINT})"
    ]
    assert "teacher_forced" in json.loads(report.read_text()) and not (tmp_path / "report.png").exists()

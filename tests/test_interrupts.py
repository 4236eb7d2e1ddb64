"""Ctrl-C and SIGTERM: one line (what is kept, the command that resumes), exit 130 / 143, no traceback.

The commands run as a user runs them, in a subprocess of ``speccache.cli`` on the tiny demo target; a precompute's
shard writer is slowed (a second after each shard) so that the signal lands mid-run, between shards.
Then ``speccache precompute --out DIR --resume`` alone, the command the line gives, finishes the cache with the
recorded settings, byte for byte the uninterrupted run's.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

import speccache
from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.format import load_manifest_json, manifest_path, shard_path

pytestmark = pytest.mark.usefixtures("offline_single_thread")

SLOW_CLI = """
import sys, time
from speccache.write import writers
real = writers.NativeShardWriter.__call__
def slow(self, *args):
    path = real(self, *args)
    time.sleep(1.0)
    return path
writers.NativeShardWriter.__call__ = slow
from speccache.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """``(precompute argv without --out, an uninterrupted cache of it)``: 4 shards of 16 samples."""
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path(), "--batch-size", "8"]
    argv += ["--shard-size", "16", "--max-length", "512", "--limit", "64", "--dtype", "fp32"]
    whole = str(tmp_path_factory.mktemp("interrupts") / "whole")
    assert main([*argv, "--out", whole, "--quiet"]) == 0
    return argv, whole


def _interrupt(argv: list[str], signum: int, ready) -> subprocess.CompletedProcess:
    """Run ``speccache ARGV`` (its shard writer slowed), send ``signum`` once ``ready()``; its result."""
    src = os.path.dirname(os.path.dirname(speccache.__file__))  # this tree's package, whatever the cwd
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": src}
    # A shell starts background jobs with SIGINT ignored, and the command would inherit that: restore the default.
    restore = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=restore)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _files(cache: str) -> dict[str, bytes]:
    return {n: open(os.path.join(cache, n), "rb").read() for n in sorted(os.listdir(cache)) if n != "manifest.json"}


def _without_producer(cache: str) -> dict:
    body = load_manifest_json(manifest_path(cache))
    del body["producer"]
    return body


def test_ctrl_c_of_precompute_says_how_to_resume_and_resume_alone_finishes_it(run, tmp_path, capsys, monkeypatch):
    argv, whole = run
    monkeypatch.chdir(tmp_path)
    result = _interrupt([*argv, "--out", "c"], signal.SIGINT, lambda: os.path.exists(shard_path("c", 0)))
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("speccache precompute: interrupted; ") and "whole shards are kept in c" in last
    assert last.endswith("resume with: speccache precompute --out c --resume"), last
    manifest = load_manifest_json(manifest_path("c"))
    assert not manifest["complete"] and not os.path.exists("c/.speccache.lock")
    assert manifest["producer"]["argv"] == [*argv, "--out", "c"] and manifest["producer"]["cwd"] == str(tmp_path)
    kept = sum(os.path.exists(shard_path("c", i)) for i in range(4))
    assert 1 <= kept < 4
    capsys.readouterr()

    assert main(["precompute", "--out", "c", "--resume"]) == 0
    said = capsys.readouterr().out
    computing = f"computing {4 - kept} shard{'s' if kept < 3 else ''} ({16 * (4 - kept)} samples)"
    assert f"speccache: resuming c: kept {kept} of 4 shards ({16 * kept} samples), {computing}" in said
    assert main([*argv, "--out", "fresh", "--resume"]) == 0  # --resume on a new directory keeps nothing
    assert "resuming" not in capsys.readouterr().out
    assert _files("c") == _files(whole)
    assert _without_producer("c") == _without_producer(whole)
    assert main(["inspect", "c"]) == 0
    shown = capsys.readouterr().out
    assert f"written by speccache {manifest['producer']['version']}" in shown
    # the command that started the cache stays recorded (a resume of a resume does not grow it)
    assert f"speccache {shlex.join([*argv, '--out', 'c'])} (run in {tmp_path})" in shown


def test_a_resume_alone_still_refuses_flags_that_differ_and_needs_the_recorded_directory(
    run, tmp_path, monkeypatch, capsys
):
    argv, _ = run
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--out", "c", "--quiet"]) == 0
    before = open(manifest_path("c"), "rb").read()
    capsys.readouterr()
    assert main(["precompute", "--out", "c", "--resume", "--max-length", "256"]) == 1
    assert "config.max_length: cache has 512, this run has 256" in capsys.readouterr().err
    assert main(["precompute", "--out", "new", "--resume"]) == 2
    assert "which does not exist (nothing of a cache was written there)" in capsys.readouterr().err
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")
    assert main(["precompute", "--out", "../c", "--resume"]) == 2
    assert f"ran in {tmp_path}, and its paths may be relative to it; resume from there: cd {tmp_path} && " in (
        capsys.readouterr().err
    )
    assert open(manifest_path("../c"), "rb").read() == before


def test_sigterm_of_precompute_exits_143_with_the_line(run, tmp_path, monkeypatch):
    argv, _ = run
    monkeypatch.chdir(tmp_path)
    result = _interrupt([*argv, "--out", "c"], signal.SIGTERM, lambda: os.path.exists(shard_path("c", 0)))
    assert result.returncode == 143, result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("speccache precompute: terminated (SIGTERM); ")
    assert not os.path.exists("c/.speccache.lock")


def test_ctrl_c_of_train_says_nothing_was_saved_and_the_command(run, tmp_path):
    _, whole = run
    argv = ["train", whole, "--out", str(tmp_path / "draft"), "--epochs", "1000", "--batch-size", "4"]
    started = []

    def stepping() -> bool:  # the trainer is in its loop once a few seconds have passed
        started.append(time.monotonic())
        return started[-1] - started[0] > 5

    result = _interrupt(argv, signal.SIGINT, stepping)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"speccache train: interrupted; nothing was saved to {tmp_path / 'draft'}")
    assert line.endswith(
        f"train again with: speccache train {whole} --out {tmp_path / 'draft'} --epochs 1000 --batch-size 4"
    )
    assert not os.path.exists(tmp_path / "draft" / "model.safetensors")


def test_ctrl_c_of_regenerate_keeps_its_parts_and_says_resume(tiny_models, tmp_path):
    out = str(tmp_path / "regen")
    argv = ["regenerate", "--model", tiny_models("llama"), "--data", demo_data_path(), "--out", out]
    argv += ["--limit", "240", "--max-new-tokens", "256", "--part-size", "8", "--device", "cpu"]
    result = _interrupt(argv, signal.SIGINT, lambda: os.path.exists(os.path.join(out, "part-00000.jsonl")))
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line == (f"speccache regenerate: interrupted; the parts written so far in {out} are kept; resume with: "
                    f"speccache {shlex.join(argv)} --resume")  # fmt: skip

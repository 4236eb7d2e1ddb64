"""A user's first hour with their own data: what the commands say, where they look, what they write.

* a ``--model`` that is neither a local directory nor a hub id this machine can load fails before anything
  slow, naming both readings;
* a mistyped cache path is named as a missing directory by every command that reads a cache;
* ``train --out`` refuses a directory holding files it did not write;
* every file and directory written takes the user's umask (not tempfile's or safetensors' 0600/0700);
* the summary lines say what they compare and count in the right number; ``inspect`` of a reclaimed cache says
  it was reclaimed.
"""

from __future__ import annotations

import json
import os
import stat

import huggingface_hub
import pytest

from speccache.cli import main
from speccache.demo import build_tiny_model_dir, demo_data_path
from speccache.format import Manifest
from speccache.format.reclaim import reclaim_shard
from speccache.train.commands import loss_summary

pytestmark = pytest.mark.usefixtures("offline_single_thread")

DATA = demo_data_path("sharegpt")
COMMON = ["--model-dtype", "fp32", "--dtype", "fp32", "--max-length", "128", "--quiet", "--draft-vocab-size", "300"]
COMMON += ["--device", "cpu", "--batch-size", "3", "--skip-bad-rows", "--shard-size", "3"]


@pytest.fixture(scope="module")
def cache(tiny_models, tmp_path_factory):
    """An EAGLE-3 cache of 6 demo rows and one line that is not JSON (skipped), in shards of 3."""
    base = tmp_path_factory.mktemp("first-hour")
    with open(DATA, encoding="utf-8") as f:
        rows = f.readlines()[:6]
    data = base / "data.jsonl"
    data.write_text("".join(rows[:3]) + "not json\n" + "".join(rows[3:]), encoding="utf-8")
    out = str(base / "cache")
    argv = ["precompute", "--model", tiny_models("llama"), "--data", str(data), "--out", out]
    assert main([*argv, *COMMON]) == 0
    return {"model": tiny_models("llama"), "data": str(data), "cache": out, "base": base}


# ---------------------------------------------------------------------------
# --model


def _precompute(model, data, out):
    return ["precompute", "--model", model, "--data", data, "--out", out]


def _regenerate(model, data, out):
    return ["regenerate", "--model", model, "--data", data, "--out", out]


@pytest.mark.parametrize("command", [_precompute, _regenerate], ids=["precompute", "regenerate"])
def test_a_hub_id_not_in_the_local_cache_fails_offline_naming_both_readings(command, tmp_path, capsys, monkeypatch):
    # the hub is never asked offline: a network call here would fail the test rather than wait
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("asked the hub offline"))
    out = str(tmp_path / "out")
    assert main(command("someorg/no-such-model", DATA, out)) == 1
    err = capsys.readouterr().err
    assert "--model someorg/no-such-model: no such model directory" in err
    assert "not in the local Hugging Face cache" in err and "HF_HUB_OFFLINE is set" in err
    assert "hf download someorg/no-such-model" in err
    assert not os.path.exists(out)


def test_an_unreachable_hub_fails_at_once_naming_both_readings(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    asked = []

    def unreachable(model, timeout=None):
        asked.append((model, timeout))
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert main(_precompute("someorg/no-such-model", DATA, str(tmp_path / "out"))) == 1
    err = capsys.readouterr().err
    assert "no such model directory, and as a hub id it is not in the local Hugging Face cache" in err
    assert "the hub cannot be reached (Name or service not known)" in err
    assert asked == [("someorg/no-such-model", 10)], "one probe, with a timeout of seconds"
    argv = ["import", str(tmp_path), str(tmp_path / "imported"), "--from", "specforge", "--model", "someorg/x"]
    assert main(argv) == 1
    assert "--model someorg/x: no such model directory" in capsys.readouterr().err
    # evaluate checks its --model before it loads the draft
    assert main(["evaluate", "missing-draft", "--cache", cache["cache"], "--model", "someorg/no-such-model"]) == 1
    assert "the hub cannot be reached" in capsys.readouterr().err


def test_a_hub_id_in_the_local_cache_and_a_missing_path_are_told_apart(tmp_path, capsys, monkeypatch):
    from speccache.data import check_model_source

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/hub/{repo}/{name}")
    check_model_source("someorg/cached-model")  # passes: transformers loads it from the local cache
    assert main(_precompute(str(tmp_path / "models" / "mine"), DATA, str(tmp_path / "out"))) == 1
    err = capsys.readouterr().err
    assert f"--model {tmp_path}/models/mine: no such model directory; fix the path" in err
    assert "Hugging Face" not in err


# ---------------------------------------------------------------------------
# cache paths and --out


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["verify", "{missing}"],
        ["train", "{missing}", "--out", "{tmp}/draft"],
        ["export", "{missing}", "{tmp}/exported", "--to", "nemo-eagle3"],
        ["merge", "{missing}", "--out", "{tmp}/view"],
    ],
    ids=lambda a: a[0],
)
def test_a_mistyped_cache_path_is_named_as_a_missing_directory(argv, tmp_path, capsys):
    missing = str(tmp_path / "cahce")
    assert main([a.format(missing=missing, tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err
    assert f"no such directory: {missing} (no cache there); check the path" in err
    assert "fully written" not in err


def test_a_mistyped_draft_path_is_named_as_a_missing_directory(cache, tmp_path, capsys):
    missing = str(tmp_path / "drfat")
    assert main(["evaluate", missing, "--cache", cache["cache"]]) == 1
    assert f"no such directory: {missing} (no draft there); check the path" in capsys.readouterr().err


def test_train_out_refuses_a_directory_holding_other_files(cache, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["train", cache["cache"], "--out", str(out), "--max-steps", "1", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"{out} holds files speccache train did not write ['notes.txt']" in err
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    # a draft it wrote is still refused as a draft (never overwritten), and an empty directory is used
    (out / "notes.txt").unlink()
    assert main(["train", cache["cache"], "--out", str(out), "--max-steps", "1", "--device", "cpu"]) == 0
    assert main(["train", cache["cache"], "--out", str(out), "--max-steps", "1", "--device", "cpu"]) == 1
    assert "already holds a draft" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# file modes


def _modes(root: str) -> dict[str, int]:
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return found


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_take_the_users_umask(cache, tmp_path, umask):
    before = os.umask(umask)
    try:
        model = build_tiny_model_dir(str(tmp_path / "model"), "llama", seed=0)
        out = str(tmp_path / "cache")
        assert main([*_precompute(model, cache["data"], out), *COMMON]) == 0
        draft = str(tmp_path / "draft")
        assert main(["train", out, "--out", draft, "--max-steps", "1", "--device", "cpu"]) == 0
        exported = str(tmp_path / "exported")
        assert main(["export", out, exported, "--to", "nemo-eagle3"]) == 0
    finally:
        os.umask(before)
    for root in (model, out, draft, exported):
        modes = _modes(root)
        wrong = {
            name: oct(mode)
            for name, mode in modes.items()
            if mode != (0o777 if os.path.isdir(os.path.join(root, name)) else 0o666) & ~umask
        }
        assert not wrong, f"{root}: {wrong}"
        assert "model.safetensors" in modes or any(n.endswith(".safetensors") for n in modes)


# ---------------------------------------------------------------------------
# words


def test_the_summary_says_what_it_compares_and_where_the_skipped_row_is(cache, tmp_path, capsys):
    out = str(tmp_path / "c")
    argv = [a for a in COMMON if a != "--quiet"]
    assert main([*_precompute(cache["model"], cache["data"], out), *argv]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("speccache: 6 samples (1 row skipped, listed in ")
    assert f"listed in {os.path.join(out, 'skipped_rows.jsonl')})" in line
    assert "(the target computed " in line and "x as many with padding)" in line
    assert "; this cache is " in line and ("x smaller than that" in line or "x larger than that" in line)
    assert main(["inspect", out]) == 0
    printed = capsys.readouterr().out
    assert f"skipped    1 row: malformed 1 (listed in {os.path.join(out, 'skipped_rows.jsonl')})" in printed
    assert "samples    6 in 2 shards of 3; tokens " in printed


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([], "no step taken"),
        ([2.0], "loss 2.0000 (one step)"),
        ([4.0, 2.0, 1.0], "loss 4.0000 (mean of the first step) -> 1.0000 (of the last step)"),
        ([4.0] * 3 + [9.0] + [1.0] * 3, "loss 4.0000 (mean of the first 3 steps) -> 1.0000 (of the last 3 steps)"),
        (
            [4.0] * 10 + [9.0] * 5 + [1.0] * 10,
            "loss 4.0000 (mean of the first 10 steps) -> 1.0000 (of the last 10 steps)",
        ),
    ],
)
def test_the_train_summary_compares_steps_that_do_not_overlap(losses, expected):
    assert loss_summary(losses) == expected


def test_a_short_train_run_summarises_its_own_steps(cache, tmp_path, capsys):
    out = str(tmp_path / "draft")
    assert main(["train", cache["cache"], "--out", out, "--max-steps", "1", "--device", "cpu"]) == 0
    assert f"{out}: EAGLE-3 draft trained 1 step in " in capsys.readouterr().out


def test_inspect_of_a_reclaimed_cache_says_it_was_reclaimed(cache, tmp_path, capsys):
    import shutil

    out = str(tmp_path / "c")
    shutil.copytree(cache["cache"], out)
    schema = Manifest.read(out).schema
    reclaim_shard(out, 0, schema, None)
    assert main(["inspect", out]) == 0
    printed = capsys.readouterr().out
    assert "samples    6 in 2 shards of 3: 1 reclaimed after use, 1 here holding " in printed
    reclaim_shard(out, 1, schema, None)
    assert main(["inspect", out]) == 0
    printed = capsys.readouterr().out
    assert "samples    6 in 2 shards of 3, all reclaimed (deleted after a following trainer read them)" in printed
    assert "tokens 0" not in printed and "in 0 shards" not in printed


# ---------------------------------------------------------------------------
# progress and --quiet


def _bars(err: str) -> str:
    return err.replace("\r", "\n")


def test_regenerate_shows_rows_and_tokens_on_stderr_unless_quiet(cache, tmp_path, capsys):
    argv = ["regenerate", "--model", cache["model"], "--data", demo_data_path("openai"), "--limit", "4"]
    argv += ["--max-new-tokens", "6", "--part-size", "2", "--batch-size", "2", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "shown")]) == 0
    captured = capsys.readouterr()
    generated = json.loads((tmp_path / "shown" / "regenerate.json").read_text())["counts"]["generated_tokens"]
    last = [line for line in _bars(captured.err).splitlines() if line.startswith("regenerate:")][-1]
    assert "100%" in last and "4/4" in last and "row/s" in last, last
    assert f"{generated} tokens, " in last and " tok/s" in last, last
    assert "Loading weights" in captured.err, "transformers' bar shows without --quiet (so the check below can fail)"
    assert "4 rows" in captured.out
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "regenerate:" not in captured.err and "Loading weights" not in captured.err and not captured.out


def test_evaluate_shows_its_decoding_on_stderr_unless_quiet(cache, tmp_path, capsys):
    draft = str(tmp_path / "draft")
    assert main(["train", cache["cache"], "--out", draft, "--max-steps", "1", "--device", "cpu"]) == 0
    argv = ["evaluate", draft, "--cache", cache["cache"], "--model", cache["model"], "--prompts", "2"]
    argv += ["--max-new-tokens", "4", "--device", "cpu"]
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    last = [line for line in _bars(captured.err).splitlines() if line.startswith("evaluate:")][-1]
    # greedy, the draft, prompt lookup and the n-gram table each decode the 2 prompts
    assert "100%" in last and "8/8" in last and "prompt/s" in last and " tok/s" in last, last
    assert "Loading weights" in captured.err
    assert main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "evaluate:" not in captured.err and "Loading weights" not in captured.err
    assert "speculative greedy decoding, 2 prompts" in captured.out, "--quiet keeps the report"


def test_precompute_quiet_silences_transformers_and_its_rates_count_this_runs_work(cache, tmp_path, capsys):
    from speccache.format.manifest import ShardRecord
    from speccache.precompute.report import _Progress

    assert main([*_precompute(cache["model"], cache["data"], str(tmp_path / "c")), *COMMON]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    # a resumed run's bar: the terabyte of shards it kept was not written by it, so it counts in no rate
    records = {0: ShardRecord(0, 3, 300, 10**12, "0" * 32)}
    bar = _Progress(6, True, records)
    records[1] = ShardRecord(1, 3, 300, 1000, "0" * 32)
    bar.update(3, 300)
    bar.close()
    last = _bars(capsys.readouterr().err).strip().splitlines()[-1]
    rate = float(last.split(" MB/s written")[0].rsplit(" ", 1)[-1])
    assert "3/6" in last and rate < 1e6, last  # counting the kept terabyte: over 1e6 MB/s within 1000 s

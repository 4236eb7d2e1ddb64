"""Output directories: a user's files are never touched, OS refusals are clean errors, views through symlinks.

* ``--out`` of ``merge``, ``subset``, ``precompute`` and ``import`` on a directory of the user's own files
  (``thesis.tmp``, ``backup.tmp-2024-01-01``...) is refused and every file survives byte for byte (the real CLI in
  a subprocess); a resume sweeps only the exact temporary names speccache's writers give.
* an ``--out`` the operating system refuses (read-only filesystem, no permission: simulated with the real errno,
  since root passes mode bits; a name too long: a real over-long name) is ``speccache CMD: error: ...`` naming
  the path and the fix, for ``precompute`` before the model loads; a full disk during ``merge`` or ``export``
  too, and nothing half-written is left under a final name.
* a view written or opened through a symlinked directory opens.
* ``merge --weights`` a sampler could not expand (``inf``, ``1e400``, ``1e9``...) is refused at merge time, and
  a hand-edited ``view.json`` at open.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import speccache.compat.offline_cache as oc
import speccache.engines.hf as hf_engine
import speccache.format.manifest as manifest_module
import speccache.format.view as view_module
import speccache.precompute.run as precompute
from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.errors import CacheFormatError, OutputError
from speccache.format import shard_path
from speccache.format.view import MAX_EPOCH_SAMPLES, VIEW_NAME
from speccache.read import CacheDataset
from speccache.read.view import ViewDataset, make_merge_view, verify_view
from speccache.testing.synthetic import write_synthetic_cache
from speccache.write import SideFile
from test_full_disk import _Disk
from test_views import make_samples, write_samples

SYN = dict(num_samples=10, shard_size=4, hidden=8, max_len=8)
DATA = demo_data_path("sharegpt")
PRECOMPUTE_FLAGS = ["--limit", "4", "--max-length", "64", "--batch-size", "2", "--shard-size", "2", "--quiet"]
USER_FILES = {
    "thesis.tmp": b"chapter 1\n",
    "backup.tmp-2024-01-01": b"old backup",
    "manifest.json.tmp-mine": b"my notes on manifests",
    "notes.txt": b"notes",
    os.path.join("drafts", "draft.tmp"): b"a draft",
}

pytestmark = pytest.mark.usefixtures("offline_single_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A sealed cache of 10 samples with per-sample statistics (for subset)."""
    path = str(tmp_path_factory.mktemp("src") / "cache")
    write_samples(path, make_samples(10, 0), {"model": "m", "data": "a.jsonl"})
    return path


@pytest.fixture(scope="module")
def dspark(precompute_runs) -> str:
    """A small layers cache, the source of an export."""
    table = {"dspark": ("llama", ["--method", "dspark", "--batch-size", "2", "--shard-size", "2"])}
    return precompute_runs(table, DATA, 4, 64)("dspark")


def _user_dir(path: Path) -> dict[str, bytes]:
    for name, data in USER_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return _tree(path)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _nemo_eagle3_manifest(path: Path) -> str:
    """The manifest of a NeMo EAGLE-3 cache (an import reads it before anything else)."""
    fields = {"num_samples": 2, "shard_size": 2, "draft_vocab_size": 4, "target_probs_topk": 0, "dtype": "bf16"}
    fields |= {"target_vocab_size": 4, "aux_hidden_dim": 12, "aux_layer_ids": [1, 2, 3], "seq_length": 8}
    oc.write_manifest(str(path), {**fields, "target_model": "m", "selected_token_ids": [0, 1, 2, 3]}, 2)
    return str(path)


@pytest.mark.parametrize("command", ["merge", "subset", "precompute", "import"])
def test_a_directory_of_user_files_is_refused_and_every_file_survives(command, cache, tiny_models, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    before = _user_dir(out)
    argv = {
        "merge": ["merge", cache, "--out", str(out)],
        "subset": ["subset", cache, "--out", str(out), "--where", "supervised_tokens >= 0"],
        "precompute": ["precompute", "--model", tiny_models("llama"), "--data", DATA, "--out", str(out),
                       *PRECOMPUTE_FLAGS],
        "import": ["import", "--from", "nemo-eagle3", _nemo_eagle3_manifest(tmp_path / "nemo"), str(out)],
    }[command]  # fmt: skip
    src = str(Path(precompute.__file__).parents[2])  # these sources, whatever the installed speccache
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "speccache", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"speccache {command}: error: {out} holds files speccache did not write")
    assert "choose a new or empty directory" in done.stderr and "Traceback" not in done.stderr
    assert _tree(out) == before


def test_a_writer_sweeps_only_its_own_temporary_names(tmp_path):
    out = tmp_path / "cache"
    write_synthetic_cache(str(out), **SYN)
    sealed = _tree(out)
    user = _user_dir(out)
    stale = [
        "shard-000001.safetensors.tmp-otherhost.example.org-123-0badf00d",
        "manifest.json.tmp-host-1-deadbeef",
        "shard-000002.safetensors.tmp",  # the seed layout's writers
        ".speccache.lock.tmp-recover",
    ]
    for name in stale:
        (out / name).write_bytes(b"partial")
    write_synthetic_cache(str(out), resume=True, **SYN)
    assert _tree(out) == {**sealed, **user}


def test_a_view_directory_holding_only_a_killed_writers_temp_file_is_reused(cache, tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / f"{VIEW_NAME}.tmp-host-7-0123abcd").write_text("{")
    assert main(["merge", cache, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == [VIEW_NAME]


def test_a_run_that_fails_before_its_first_manifest_leaves_no_side_file_to_block_a_rerun(tmp_path, monkeypatch):
    out = tmp_path / "cache"
    samples = make_samples(4, 0)
    side = SideFile("notes.bin", content=lambda: b"side bytes")  # written by durable.py, which the disk spares
    disk = _Disk(0)
    monkeypatch.setattr(manifest_module, "open", disk.open, raising=False)
    with pytest.raises(OutputError, match=f"cannot write output directory {out}: No space left on device") as info:
        write_samples(str(out), samples, {"model": "m"}, side_files=(side,))
    assert info.value.errno == errno.ENOSPC and disk.failures == 1
    assert os.listdir(out) == []
    monkeypatch.undo()
    write_samples(str(out), samples, {"model": "m"}, side_files=(side,))
    assert (out / "notes.bin").read_bytes() == b"side bytes" and len(CacheDataset(str(out))) == 4


# ---------------------------------------------------------------------------
# the operating system refuses the output


def _refuse_writes(monkeypatch, root: Path, code: int) -> None:
    """Creating anything under ``root`` fails with ``code``, as a read-only or forbidden directory does."""
    root_text = str(root)

    def under(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(root_text)

    def refuse(path):
        raise OSError(code, os.strerror(code), os.fspath(path))

    real_mkdir, real_os_open, real_open = os.mkdir, os.open, builtins.open

    def mkdir(path, *args, **kwargs):
        return refuse(path) if under(path) else real_mkdir(path, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        return refuse(path) if writing and under(path) else real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        writing = any(c in mode for c in "wax+")
        return refuse(file) if writing and under(file) else real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)


def _argv(command: str, out: str, cache: str, dspark: str | None, model: str | None) -> list[str]:
    return {
        "merge": lambda: ["merge", cache, "--out", out],
        "subset": lambda: ["subset", cache, "--out", out, "--where", "supervised_tokens >= 0"],
        "export": lambda: ["export", "--to", "nemo-dspark", dspark, out],
        "precompute": lambda: ["precompute", "--model", model, "--data", DATA, "--out", out, *PRECOMPUTE_FLAGS],
    }[command]()


COMMANDS = ["merge", "subset", "export", "precompute"]


@pytest.fixture
def sources(request, cache, tiny_models):
    """``(cache, dspark cache, model dir)``, building the slow ones only for the commands that read them."""
    command = request.node.callspec.params["command"]
    dspark = request.getfixturevalue("dspark") if command == "export" else None
    model = tiny_models("llama") if command == "precompute" else None
    return cache, dspark, model


@pytest.fixture
def no_model_load(monkeypatch):
    """A precompute that loads the target fails the test: the output must be refused first."""

    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the output directory was checked")

    monkeypatch.setattr(hf_engine, "load_target", load_target)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "code,fix",
    [(errno.EROFS, "writable one"), (errno.EACCES, "permissions")],
    ids=["read-only", "no-permission"],
)
@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing-empty"])
def test_an_out_the_os_refuses_is_a_clean_error(
    command, code, fix, exists, sources, no_model_load, tmp_path, monkeypatch, capsys
):
    parent = tmp_path / "locked"
    parent.mkdir()
    out = parent / "out"
    if exists:
        out.mkdir()
    _refuse_writes(monkeypatch, parent, code)
    assert main(_argv(command, str(out), *sources)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"speccache {command}: error: cannot write output directory {out}: {os.strerror(code)}")
    assert fix in err
    monkeypatch.undo()
    assert sorted(os.listdir(parent)) == (["out"] if exists else []) and not (exists and os.listdir(out))


@pytest.mark.parametrize("command", COMMANDS)
def test_an_over_long_out_is_a_clean_error(command, sources, no_model_load, tmp_path, capsys):
    out = tmp_path / ("x" * 300)  # a real ENAMETOOLONG: one name over NAME_MAX
    assert main(_argv(command, str(out), *sources)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"speccache {command}: error: cannot write output directory {out}: File name too long")
    assert "choose a shorter path" in err


@pytest.mark.parametrize("where", ["out", "parent"])
def test_an_export_out_that_is_a_file_is_a_clean_error(where, dspark, tmp_path, capsys):
    (tmp_path / "file").write_bytes(b"mine")
    out = tmp_path / "file" if where == "out" else tmp_path / "file" / "out"
    assert main(["export", "--to", "nemo-dspark", dspark, str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"speccache export: error: cannot write output directory {out}: ")
    assert "is a file; choose a directory" in err and (tmp_path / "file").read_bytes() == b"mine", err


def test_a_full_disk_during_merge_is_a_clean_error_and_leaves_no_view(cache, tmp_path, monkeypatch, capsys):
    disk = _Disk(10)
    monkeypatch.setattr(view_module, "open", disk.open, raising=False)
    out = tmp_path / "v"
    assert main(["merge", cache, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert disk.failures == 1
    assert err.startswith(f"speccache merge: error: cannot write output directory {out}: No space left on device")
    assert "free space" in err
    assert os.listdir(out) == []  # neither view.json nor its temporary file
    monkeypatch.undo()
    assert main(["merge", cache, "--out", str(out)]) == 0 and ViewDataset(str(out))


def test_a_full_disk_during_export_is_a_clean_error_and_leaves_only_whole_files(dspark, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    reference = tmp_path / "reference"
    assert main(["export", "--to", "nemo-dspark", dspark, str(reference)]) == 0
    real = oc.load_safetensors

    def load_safetensors(cache_name):
        save_file, safe_open = real(cache_name)

        def full_at_the_second_shard(tensors, path, metadata=None):
            if os.path.basename(path).startswith(os.path.basename(shard_path("", 1))):
                with open(path, "wb") as f:  # what fits, then the refusal, as save_file reports it
                    f.write(b"\0" * 100)
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return save_file(tensors, path, metadata=metadata)

        return full_at_the_second_shard, safe_open

    monkeypatch.setattr(oc, "load_safetensors", load_safetensors)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", "--to", "nemo-dspark", dspark, str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"speccache export: error: cannot write output directory {out}: Error while serializing")
    assert "No space left on device" in err and "Traceback" not in err
    left, whole = _tree(out), _tree(reference)
    assert shard_path("", 1) not in left and all(".tmp" not in name for name in left)
    assert json.loads(left["manifest.json"])["complete"] is False
    for name, data in left.items():
        if name != "manifest.json":
            assert data == whole[name], f"{name} under its final name is not whole"


# ---------------------------------------------------------------------------
# views through symlinks


def test_a_view_written_and_opened_through_symlinked_directories_opens(cache, tmp_path, capsys):
    deep = tmp_path / "deep" / "real"
    deep.mkdir(parents=True)
    (tmp_path / "views").symlink_to(deep)  # views/v is deep/real/v: ".." differs by the path taken
    (tmp_path / "cache-link").symlink_to(cache)
    written = tmp_path / "views" / "v"
    assert main(["merge", str(tmp_path / "cache-link"), "--out", str(written)]) == 0
    assert main(["subset", str(tmp_path / "cache-link"), "--out", str(tmp_path / "views" / "s"), "--where",
                 "supervised_tokens >= 0"]) == 0  # fmt: skip
    (tmp_path / "elsewhere").symlink_to(deep)
    for path in (written, deep / "v", tmp_path / "elsewhere" / "v", deep / "s"):
        assert len(ViewDataset(str(path))) == 10, path
        assert verify_view(str(path)) == []
        assert main(["inspect", str(path)]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------------------
# weights


@pytest.mark.parametrize("weights", ["inf,1", "1e400,1", "nan,1", "1e9,1", "0,1", "-1,2", "0,0"])
def test_merge_refuses_weights_a_sampler_cannot_expand(weights, cache, tmp_path, capsys):
    out = tmp_path / "v"
    assert main(["merge", cache, cache, "--out", str(out), f"--weights={weights}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"speccache merge: error: view {out}: weights ")
    assert "(--weights of speccache merge) must be finite and > 0" in err and str(MAX_EPOCH_SAMPLES) in err
    assert not os.path.exists(out / VIEW_NAME)


@pytest.mark.parametrize("weight", [float("inf"), 1e12, 0.0])
def test_an_edited_view_with_weights_a_sampler_cannot_expand_is_refused_at_open(weight, cache, tmp_path):
    out = str(tmp_path / "v")
    make_merge_view([cache], out, [2.0])
    path = os.path.join(out, VIEW_NAME)
    with open(path) as f:
        body = json.load(f)
    body["sources"][0]["weight"] = weight
    with open(path, "w") as f:
        json.dump(body, f)
    with pytest.raises(
        CacheFormatError, match=f"must be finite and > 0 and expand one epoch to at most {MAX_EPOCH_SAMPLES}"
    ):
        ViewDataset(out)

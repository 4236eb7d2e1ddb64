"""Seed parity of ``speccache.offline_cache``, the drop-in for NeMo AutoModel's offline-cache module.

The seed is ``nemo_automodel/components/datasets/llm/offline_cache.py``. Its names and
signatures are pinned below; when a copy of the seed is available (``SPECCACHE_SEED``
or the default path) the pins are checked against it, and caches are exchanged with
the seed module itself in both directions.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

import speccache
import speccache.offline_cache as oc
from speccache.format import tensor_checksum
from speccache.format.shard import SHARD_META_CHECKSUMS

SEED_PATH = Path(os.environ.get("SPECCACHE_SEED", "/tmp/nemo/nemo_automodel/components/datasets/llm/offline_cache.py"))
needs_seed = pytest.mark.skipif(not SEED_PATH.is_file(), reason=f"no copy of the seed module at {SEED_PATH}")
LOG = logging.getLogger("test_offline_cache")

REQUIRED = object()
# Every top-level def/class/constant of the seed, with its parameters in the seed's order
# (keyword-only ones included) and their defaults. Checked against the seed when present.
SEED_SIGNATURES: dict[str, list[tuple[str, object]] | None] = {
    "MANIFEST_NAME": None,
    "SHARD_RE": None,
    "load_safetensors": [("cache_name", REQUIRED)],
    "atomic_write": [("path", REQUIRED), ("write_fn", REQUIRED)],
    "shard_path": [("cache_dir", REQUIRED), ("shard_index", REQUIRED)],
    "manifest_path": [("cache_dir", REQUIRED)],
    "existing_shard_indices": [("cache_dir", REQUIRED)],
    "write_manifest": [("cache_dir", REQUIRED), ("manifest", REQUIRED), ("format_version", REQUIRED)],
    "read_manifest": [
        ("cache_dir", REQUIRED), ("cache_name", REQUIRED), ("format_version", REQUIRED),
        ("producer_name", None), ("defaults", None),
    ],
    "ensure_supervision_options_match": [
        ("manifest", REQUIRED), ("expected", REQUIRED), ("cache_name", REQUIRED), ("cache_dir", REQUIRED),
        ("producer_name", REQUIRED),
    ],
    "validate_contiguous_shards": [
        ("cache_dir", REQUIRED), ("cache_name", REQUIRED), ("num_samples", REQUIRED), ("shard_size", REQUIRED),
    ],
    "write_tensor_shard": [
        ("cache_dir", REQUIRED), ("shard_index", REQUIRED), ("samples", REQUIRED), ("keys", REQUIRED),
        ("cache_name", REQUIRED),
    ],
    "CachedTensorDataset": [
        ("cache_dir", REQUIRED), ("cache_name", REQUIRED), ("format_version", REQUIRED), ("disk_keys", REQUIRED),
    ],
    "collate_cached": [("features", REQUIRED), ("keys", REQUIRED)],
    "build_cached_dataloader": [
        ("dataset", REQUIRED), ("batch_size", REQUIRED), ("shuffle", REQUIRED), ("collate_fn", REQUIRED),
        ("num_workers", 0), ("distributed", False),
    ],
    "resume_start_sample": [("existing_shards", REQUIRED), ("shard_size", REQUIRED)],
    "_sequential_subset_loader": [("dataloader", REQUIRED), ("start", REQUIRED), ("end", REQUIRED)],
    "dataloader_from_sample": [("dataloader", REQUIRED), ("start_sample", REQUIRED)],
    "_ShardAccumulator": [
        ("output_dir", REQUIRED), ("shard_size", REQUIRED), ("start_shard_index", REQUIRED),
        ("write_shard_fn", REQUIRED), ("logger", REQUIRED),
    ],
    "write_cache_shards": [
        ("dataloader", REQUIRED), ("output_dir", REQUIRED), ("shard_size", REQUIRED), ("start_shard_index", REQUIRED),
        ("compute_batch", REQUIRED), ("write_shard_fn", REQUIRED), ("logger", REQUIRED),
    ],
    "partition_cache_shards": [
        ("num_samples", REQUIRED), ("shard_size", REQUIRED), ("world_size", REQUIRED), ("rank", REQUIRED),
    ],
    "write_cache_shards_distributed": [
        ("dataloader", REQUIRED), ("output_dir", REQUIRED), ("shard_size", REQUIRED), ("world_size", REQUIRED),
        ("rank", REQUIRED), ("compute_batch", REQUIRED), ("write_shard_fn", REQUIRED), ("logger", REQUIRED),
        ("sync_max_steps", None),
    ],
}  # fmt: skip
SEED_FUNCTIONS = [name for name, params in SEED_SIGNATURES.items() if params is not None]


# ---------------------------------------------------------------------------
# helpers


def _seed_ast_namespace() -> dict[str, list[tuple[str, object]] | None]:
    """Top-level defs/classes (with parameters) and constants of the seed file."""
    tree = ast.parse(SEED_PATH.read_text())
    out: dict[str, list[tuple[str, object]] | None] = {}

    def params(fn: ast.FunctionDef, skip_self: bool) -> list[tuple[str, object]]:
        a = fn.args
        positional = a.posonlyargs + a.args
        pos_defaults = [REQUIRED] * (len(positional) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
        kw_defaults = [REQUIRED if d is None else ast.literal_eval(d) for d in a.kw_defaults]
        items = list(zip([p.arg for p in positional], pos_defaults)) + list(
            zip([p.arg for p in a.kwonlyargs], kw_defaults)
        )
        return items[1:] if skip_self else items

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node, skip_self=False)
        elif isinstance(node, ast.ClassDef):
            init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
            out[node.name] = params(init, skip_self=True)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = None
    return out


def _load_seed(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Import the seed file with ``nemo_automodel.shared.import_utils.safe_import_from`` stubbed."""

    def safe_import_from(module: str, name: str, *args, **kwargs):
        try:
            return True, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False, None

    for name in ("nemo_automodel", "nemo_automodel.shared"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils = types.ModuleType("nemo_automodel.shared.import_utils")
    utils.safe_import_from = safe_import_from  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nemo_automodel.shared.import_utils", utils)
    spec = importlib.util.spec_from_file_location("_seed_offline_cache", SEED_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def seed(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    if not SEED_PATH.is_file():
        pytest.skip(f"no copy of the seed module at {SEED_PATH}")
    return _load_seed(monkeypatch)


def snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def fixed_samples(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (n, 5), generator=g),
        "hidden": torch.randn(n, 5, 3, generator=g).to(torch.bfloat16),
        "loss_mask": torch.rand(n, 5, generator=g) > 0.5,
    }


KEYS = ("input_ids", "hidden", "loss_mask")
VERSION = 3


def write_seed_layout_cache(
    module, cache_dir: str, samples: dict[str, torch.Tensor], shard_size: int, name: str = "EAGLE-3"
) -> None:
    """A cache written only with the seed's public functions (of ``module``)."""
    n = samples["input_ids"].shape[0]
    for index, start in enumerate(range(0, n, shard_size)):
        part = {k: v[start : start + shard_size] for k, v in samples.items()}
        module.write_tensor_shard(cache_dir=cache_dir, shard_index=index, samples=part, keys=KEYS, cache_name=name)
    module.write_manifest(
        cache_dir, {"num_samples": n, "shard_size": shard_size, "mask_generation_prompt": True}, VERSION
    )


def assert_samples_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


class RecordingDataset(Dataset):
    """Sample ``i`` is ``{"input_ids": [i]*4, "x": i + [0, 1, 2]}``; records every index read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.accessed: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.accessed.append(int(index))
        return {"input_ids": torch.full((4,), int(index), dtype=torch.int64), "x": torch.arange(3.0) + int(index)}


def compute(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "hidden": batch["x"] * 2}


class Recorder:
    """A ``write_shard_fn`` that keeps copies of what it was asked to write."""

    def __init__(self) -> None:
        self.shards: dict[int, dict[str, torch.Tensor]] = {}
        self.order: list[int] = []

    def __call__(self, output_dir: str, shard_index: int, samples: dict[str, torch.Tensor]) -> str:
        self.shards[shard_index] = {k: v.clone() for k, v in samples.items()}
        self.order.append(shard_index)
        return f"{output_dir}/shard-{shard_index:06d}.safetensors"


# ---------------------------------------------------------------------------
# namespace and signatures


@needs_seed
def test_pinned_seed_namespace_matches_the_seed_file():
    parsed = _seed_ast_namespace()
    assert set(parsed) == set(SEED_SIGNATURES)
    for name, params in parsed.items():
        assert params == SEED_SIGNATURES[name], name


def test_every_seed_name_exists_in_offline_cache():
    missing = [name for name in SEED_SIGNATURES if not hasattr(oc, name)]
    assert missing == []


def test_seed_import_names_exist_in_offline_cache():
    # The seed's imports are part of its namespace; code doing `from ...offline_cache import DataLoader` keeps working.
    for name in (
        "json",
        "logging",
        "os",
        "re",
        "torch",
        "DataLoader",
        "Dataset",
        "Subset",
        "DistributedSampler",
        "Any",
        "Callable",
    ):
        assert hasattr(oc, name), name


def test_seed_names_live_in_offline_cache_not_in_the_native_api():
    """``speccache`` exports the native API only; the compatibility names are ``speccache.offline_cache``'s."""
    assert "CachedTensorDataset" not in speccache.__all__ and not hasattr(speccache, "write_cache_shards")
    assert oc is sys.modules["speccache.compat.offline_cache"]
    for name in SEED_SIGNATURES:
        assert hasattr(oc, name), name


def test_offline_cache_all_lists_every_seed_name():
    assert set(SEED_SIGNATURES) <= set(oc.__all__)


@pytest.mark.parametrize("name", SEED_FUNCTIONS)
def test_every_seed_function_accepts_keywords_and_the_seed_positional_order(name):
    sig = inspect.signature(getattr(oc, name))
    seed_params = SEED_SIGNATURES[name]
    assert seed_params is not None
    names = [p for p, _ in seed_params]
    values = [object() for _ in names]
    by_position = sig.bind(*values)
    assert [by_position.arguments[p] for p in names] == values
    by_keyword = sig.bind(**dict(zip(names, values)))
    assert [by_keyword.arguments[p] for p in names] == values
    # Seed calls that omit optional arguments still bind, with the seed's defaults.
    for pname, default in seed_params:
        param = sig.parameters[pname]
        if default is REQUIRED:
            assert param.default is inspect.Parameter.empty, pname
        else:
            assert param.default == default, pname
    # Anything speccache adds is optional, so no seed call breaks.
    extra = [
        p for p in sig.parameters.values() if p.name not in names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    assert all(p.default is not inspect.Parameter.empty for p in extra), extra


# ---------------------------------------------------------------------------
# names and paths


def test_manifest_name_is_manifest_json():
    assert oc.MANIFEST_NAME == "manifest.json"


@pytest.mark.parametrize(
    "name,index",
    [("shard-000000.safetensors", 0), ("shard-000042.safetensors", 42), ("shard-999999.safetensors", 999999)],
)
def test_shard_re_matches_six_digits_and_captures_the_index(name, index):
    match = oc.SHARD_RE.match(name)
    assert match is not None and int(match.group(1)) == index and len(match.group(1)) == 6


@pytest.mark.parametrize(
    "name",
    [
        "shard-00001.safetensors",  # five digits
        "shard-0000001.safetensors",  # seven digits
        "shard-00000a.safetensors",
        "shard-000001.safetensors.tmp",
        "shard-000001.safetensors.tmp-host-1-abcd",
        "xshard-000001.safetensors",
        "shard-000001.safetensor",
        "shard-000001.safetensors\n",  # `$` would accept a trailing newline
        "shard-\u0661\u0662\u0663\u0664\u0665\u0666.safetensors",  # non-ASCII digits
        "manifest.json",
    ],
)
def test_shard_re_rejects_other_names(name):
    assert oc.SHARD_RE.match(name) is None


def test_shard_path_and_manifest_path_name_files_inside_the_cache(tmp_path):
    assert oc.shard_path(str(tmp_path), 7) == os.path.join(str(tmp_path), "shard-000007.safetensors")
    assert oc.shard_path(cache_dir="c", shard_index=123456) == os.path.join("c", "shard-123456.safetensors")
    assert oc.manifest_path(str(tmp_path)) == os.path.join(str(tmp_path), "manifest.json")
    assert oc.manifest_path(cache_dir="c") == os.path.join("c", "manifest.json")


def test_existing_shard_indices_of_a_missing_directory_is_empty(tmp_path):
    assert oc.existing_shard_indices(str(tmp_path / "nope")) == set()


def test_existing_shard_indices_ignores_temp_files_and_other_names(tmp_path):
    for name in (
        "shard-000000.safetensors",
        "shard-000003.safetensors",
        "shard-000001.safetensors.tmp-host-99-0123abcd",
        "shard-000002.safetensors.tmp",
        "shard-0000004.safetensors",
        "manifest.json",
        "notes.txt",
        ".speccache.lock",
    ):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "shard-000005.safetensors").write_bytes(b"")
    assert oc.existing_shard_indices(str(tmp_path)) == {0, 3}
    assert oc.existing_shard_indices(cache_dir=str(tmp_path)) == {0, 3}


# ---------------------------------------------------------------------------
# atomic_write


def test_atomic_write_creates_parents_and_returns_the_path(tmp_path):
    target = str(tmp_path / "a" / "b" / "file.bin")
    assert oc.atomic_write(target, lambda tmp: Path(tmp).write_bytes(b"data")) == target
    assert Path(target).read_bytes() == b"data"
    assert os.listdir(tmp_path / "a" / "b") == ["file.bin"]


def test_atomic_write_uses_unique_sibling_temp_names(tmp_path):
    target = str(tmp_path / "f.json")
    seen: list[str] = []

    def write(tmp: str) -> None:
        seen.append(tmp)
        Path(tmp).write_text("x")

    oc.atomic_write(target, write)
    oc.atomic_write(path=target, write_fn=write)
    assert len(set(seen)) == 2
    for tmp in seen:
        assert os.path.dirname(tmp) == str(tmp_path)
        assert os.path.basename(tmp).startswith("f.json.") and tmp != target
        assert oc.SHARD_RE.match(os.path.basename(tmp)) is None
    assert sorted(os.listdir(tmp_path)) == ["f.json"]


def test_atomic_write_temp_name_is_never_a_shard_name(tmp_path):
    target = oc.shard_path(str(tmp_path), 1)
    seen = []
    oc.atomic_write(target, lambda tmp: (seen.append(tmp), Path(tmp).write_bytes(b"")))
    assert oc.SHARD_RE.match(os.path.basename(seen[0])) is None


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_write_failing_write_fn_leaves_no_temp_file_and_the_target_unchanged(tmp_path, exc):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"partial new")
        raise exc

    with pytest.raises(type(exc)):
        oc.atomic_write(str(target), write)
    assert os.listdir(tmp_path) == ["f.bin"]
    assert target.read_bytes() == b"old"


def test_atomic_write_replaces_the_target_atomically(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    during = []

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"new contents")
        during.append(target.read_bytes())  # readers see the whole old file until the rename

    oc.atomic_write(str(target), write)
    assert during == [b"old"]
    assert target.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["f.bin"]


# ---------------------------------------------------------------------------
# manifests


def test_write_manifest_format_version_argument_wins_over_the_manifest_key(tmp_path):
    path = oc.write_manifest(str(tmp_path), {"format_version": 99, "num_samples": 3}, 2)
    assert path == oc.manifest_path(str(tmp_path))
    assert json.loads(Path(path).read_text()) == {"format_version": 2, "num_samples": 3}
    oc.write_manifest(cache_dir=str(tmp_path), manifest={"a": 1}, format_version=5)
    assert json.loads(Path(path).read_text()) == {"format_version": 5, "a": 1}
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_read_manifest_round_trips_a_written_manifest(tmp_path):
    oc.write_manifest(str(tmp_path), {"num_samples": 3, "shard_size": 2, "nested": {"a": [1, 2]}}, 4)
    assert oc.read_manifest(str(tmp_path), cache_name="EAGLE-3", format_version=4) == {
        "format_version": 4, "num_samples": 3, "shard_size": 2, "nested": {"a": [1, 2]},
    }  # fmt: skip
    assert oc.read_manifest(str(tmp_path), "EAGLE-3", 4)["num_samples"] == 3


def test_read_manifest_missing_raises_file_not_found_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        oc.read_manifest(str(tmp_path), cache_name="EAGLE-3", format_version=1)
    assert oc.manifest_path(str(tmp_path)) in str(info.value)


def test_read_manifest_other_version_names_found_expected_and_the_default_producer(tmp_path):
    oc.write_manifest(str(tmp_path), {}, 1)
    with pytest.raises(ValueError) as info:
        oc.read_manifest(str(tmp_path), cache_name="EAGLE-3", format_version=2)
    message = str(info.value)
    assert "format_version=1" in message and "expected 2" in message
    assert "precompute_eagle3" in message  # the seed's name: lower-cased, '-' removed
    assert str(tmp_path) in message


def test_read_manifest_other_version_names_an_explicit_producer(tmp_path):
    oc.write_manifest(str(tmp_path), {}, 1)
    with pytest.raises(ValueError, match="my_tool"):
        oc.read_manifest(str(tmp_path), "EAGLE-3", 2, "my_tool")


def test_read_manifest_without_a_version_reports_none(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="format_version=None"):
        oc.read_manifest(str(tmp_path), cache_name="x", format_version=1)


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe"])
def test_read_manifest_invalid_json_raises_value_error_naming_the_file(tmp_path, text):
    (tmp_path / "manifest.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as info:
        oc.read_manifest(str(tmp_path), cache_name="EAGLE-3", format_version=1)
    assert not isinstance(info.value, json.JSONDecodeError)
    assert oc.manifest_path(str(tmp_path)) in str(info.value)


def test_read_manifest_defaults_fill_missing_fields_and_the_manifest_wins(tmp_path):
    oc.write_manifest(str(tmp_path), {"present": 1}, 1)
    got = oc.read_manifest(str(tmp_path), cache_name="x", format_version=1, defaults={"present": 0, "absent": True})
    assert got == {"format_version": 1, "present": 1, "absent": True}


def test_ensure_supervision_options_match_accepts_equal_and_names_mismatches():
    oc.ensure_supervision_options_match({"a": True}, {"a": 1}, cache_name="c", cache_dir="d", producer_name="p")
    with pytest.raises(ValueError, match="a=True.*a=False"):
        oc.ensure_supervision_options_match({"a": True}, {"a": False}, cache_name="c", cache_dir="d", producer_name="p")
    with pytest.raises(ValueError, match="does not record b.*Rebuild the cache with the current p"):
        oc.ensure_supervision_options_match({"a": True}, {"b": True}, cache_name="c", cache_dir="d", producer_name="p")


# ---------------------------------------------------------------------------
# shard set


def test_validate_contiguous_shards_returns_the_indices(tmp_path):
    for i in range(3):
        (tmp_path / f"shard-{i:06d}.safetensors").write_bytes(b"")
    assert oc.validate_contiguous_shards(str(tmp_path), "EAGLE-3", 5, 2) == [0, 1, 2]
    assert oc.validate_contiguous_shards(cache_dir=str(tmp_path), cache_name="x", num_samples=6, shard_size=2) == [
        0,
        1,
        2,
    ]


def test_validate_contiguous_shards_of_an_empty_cache_is_empty(tmp_path):
    assert oc.validate_contiguous_shards(str(tmp_path), "x", 0, 4) == []


@pytest.mark.parametrize(
    "present,samples,mentions",
    [([0, 2], 6, "missing [1]"), ([0, 1, 2, 3], 6, "unexpected [3]"), ([0], 6, "missing [1, 2]")],
)
def test_validate_contiguous_shards_names_missing_and_extra_shards(tmp_path, present, samples, mentions):
    for i in present:
        (tmp_path / f"shard-{i:06d}.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        oc.validate_contiguous_shards(str(tmp_path), "EAGLE-3", samples, 2)
    message = str(info.value)
    assert mentions in message and str(tmp_path) in message and "EAGLE-3" in message and "--resume" in message


# ---------------------------------------------------------------------------
# write_tensor_shard and load_safetensors


def test_load_safetensors_returns_save_file_and_safe_open():
    got_save, got_open = oc.load_safetensors("EAGLE-3")
    assert got_save is save_file and got_open is safe_open


def test_write_tensor_shard_writes_exactly_the_keys_contiguously(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    samples = {
        "a": base.t(),
        "b": torch.tensor([[True], [False], [True], [True], [False], [False]]),
        "extra": torch.zeros(6),
    }
    assert not samples["a"].is_contiguous()
    path = oc.write_tensor_shard(str(tmp_path), 2, samples, ("a", "b"), "EAGLE-3")
    assert path == oc.shard_path(str(tmp_path), 2)
    loaded = load_file(path)
    assert set(loaded) == {"a", "b"}
    assert torch.equal(loaded["a"], base.t()) and loaded["a"].dtype == torch.float32
    assert torch.equal(loaded["b"], samples["b"])
    assert os.listdir(tmp_path) == ["shard-000002.safetensors"]


def test_write_tensor_shard_accepts_the_seed_keywords(tmp_path):
    samples = fixed_samples(3)
    path = oc.write_tensor_shard(cache_dir=str(tmp_path), shard_index=0, samples=samples, keys=KEYS, cache_name="x")
    assert set(load_file(path)) == set(KEYS)


def test_write_tensor_shard_records_tensor_checksums_in_its_metadata(tmp_path):
    samples = fixed_samples(3)
    path = oc.write_tensor_shard(str(tmp_path), 0, samples, KEYS, "x")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    recorded = json.loads(meta[SHARD_META_CHECKSUMS])
    assert recorded == {k: tensor_checksum(samples[k].contiguous()) for k in KEYS}


def test_write_tensor_shard_missing_keys_raise_value_error_listing_them(tmp_path):
    with pytest.raises(ValueError) as info:
        oc.write_tensor_shard(str(tmp_path), 0, {"a": torch.zeros(2)}, ("a", "b", "c"), "EAGLE-3")
    assert "['b', 'c']" in str(info.value) and "EAGLE-3" in str(info.value)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# CachedTensorDataset


@pytest.fixture
def seed_layout_cache(tmp_path):
    samples = fixed_samples(7)
    write_seed_layout_cache(oc, str(tmp_path), samples, shard_size=3)
    return str(tmp_path), samples


def test_cached_tensor_dataset_reads_a_cache_written_with_the_seed_functions(seed_layout_cache):
    cache_dir, samples = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    assert len(ds) == 7
    assert ds.num_samples == 7 and ds.shard_size == 3
    assert ds.manifest["mask_generation_prompt"] is True and ds.manifest["format_version"] == VERSION
    for i in range(7):
        assert_samples_equal(ds[i], {k: samples[k][i] for k in KEYS})


def test_cached_tensor_dataset_takes_the_seed_positional_order(seed_layout_cache):
    cache_dir, samples = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir, "EAGLE-3", VERSION, ("hidden",))
    assert list(ds[4]) == ["hidden"]
    assert torch.equal(ds[4]["hidden"], samples["hidden"][4])


def test_cached_tensor_dataset_negative_indices_and_index_error(seed_layout_cache):
    cache_dir, samples = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    assert torch.equal(ds[-1]["input_ids"], samples["input_ids"][6])
    assert torch.equal(ds[-7]["input_ids"], samples["input_ids"][0])
    for bad in (7, 100, -8):
        with pytest.raises(IndexError):
            ds[bad]
    assert list(ds)[6]["input_ids"].tolist() == samples["input_ids"][6].tolist()  # iteration stops at IndexError


def test_cached_tensor_dataset_reads_lazily(seed_layout_cache, monkeypatch):
    opened: list[str] = []
    save_file, safe_open = oc.load_safetensors("EAGLE-3")

    def counting_safe_open(path, framework):
        opened.append(os.path.basename(path))
        return safe_open(path, framework=framework)

    # the dataset opens shards through the module's own load_safetensors, so patching it reaches the reads
    monkeypatch.setattr(oc, "load_safetensors", lambda name: (save_file, counting_safe_open))
    cache_dir, _ = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    assert opened == []
    ds[4]
    ds[5]
    assert opened == ["shard-000001.safetensors"]


def test_cached_tensor_dataset_samples_are_copies(seed_layout_cache):
    cache_dir, samples = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    ds[0]["input_ids"].fill_(-1)
    assert torch.equal(ds[0]["input_ids"], samples["input_ids"][0])


def test_batched_loader_batches_are_the_stacked_samples_and_the_callers_own(seed_layout_cache):
    cache_dir, samples = seed_layout_cache
    ds = oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    order = [5, 0, 3, 6, 1, 4, 2]
    loader = DataLoader(ds, batch_size=3, sampler=order, collate_fn=lambda f: oc.collate_cached(f, KEYS))
    batches = list(loader)
    for batch, start in zip(batches, range(0, 7, 3)):
        assert_samples_equal(batch, {k: samples[k][order[start : start + 3]] for k in KEYS})
    for batch in batches:  # editing a batch changes neither a later batch nor a later sample
        for value in batch.values():
            value.zero_()
    assert_samples_equal(next(iter(loader)), {k: samples[k][order[:3]] for k in KEYS})
    assert_samples_equal(ds[5], {k: samples[k][5] for k in KEYS})


def test_a_shard_truncated_under_the_dataset_raises_instead_of_sigbus(tmp_path):
    cache_dir = str(tmp_path)
    write_seed_layout_cache(oc, cache_dir, fixed_samples(6), shard_size=3)
    code = f"""
import os
import speccache.offline_cache as oc
from speccache.errors import CacheCorruptError
keys = {KEYS!r}
ds = oc.CachedTensorDataset({cache_dir!r}, "EAGLE-3", {VERSION}, keys)
views = ds.__getitems__([0, 1, 2])  # what a batched DataLoader hands the collate_fn
os.truncate({oc.shard_path(cache_dir, 0)!r}, 100)  # what copying a backup over the file does, mid-way
attempts = (
    lambda: oc.collate_cached(views, keys),
    lambda: ds[1],
    lambda: ds._handle(0).get_slice("hidden")[0],
    lambda: ds._handle(0).get_tensor("hidden"),
)
for attempt in attempts:
    try:
        attempt()
    except CacheCorruptError as exc:
        print("refused:", exc)
    else:
        print("read")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7 would be SIGBUS
    assert out.stdout.count("refused:") == 4 and "shrank" in out.stdout, out.stdout


def test_cached_tensor_dataset_refuses_another_version(seed_layout_cache):
    cache_dir, _ = seed_layout_cache
    with pytest.raises(ValueError, match=f"format_version={VERSION}, expected {VERSION + 1}.*precompute_eagle3"):
        oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION + 1, disk_keys=KEYS)


def test_cached_tensor_dataset_reads_a_native_speccache_cache(tmp_path):
    from speccache.testing.synthetic import write_synthetic_cache

    write_synthetic_cache(str(tmp_path / "c"), num_samples=5, shard_size=2, hidden=4, overlap=False)
    ds = oc.CachedTensorDataset(str(tmp_path / "c"), "synthetic", speccache.FORMAT_VERSION, ("sample_id", "hidden"))
    assert len(ds) == 5
    assert [int(ds[i]["sample_id"]) for i in range(5)] == list(range(5))
    assert ds[3]["hidden"].shape[1] == 4


@needs_seed
def test_speccache_reads_a_cache_written_by_the_seed_module_exactly_as_the_seed(seed, tmp_path):
    samples = fixed_samples(8, seed=1)
    write_seed_layout_cache(seed, str(tmp_path), samples, shard_size=3)
    ours = oc.CachedTensorDataset(cache_dir=str(tmp_path), cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    theirs = seed.CachedTensorDataset(
        cache_dir=str(tmp_path), cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS
    )
    assert len(ours) == len(theirs) == 8
    assert ours.manifest == theirs.manifest
    for i in range(-8, 8):
        assert_samples_equal(ours[i], theirs[i])
    assert_samples_equal(
        oc.collate_cached([ours[i] for i in range(4)], KEYS), seed.collate_cached([theirs[i] for i in range(4)], KEYS)
    )


@needs_seed
def test_the_seed_reads_a_seed_layout_cache_written_by_speccache(seed, tmp_path):
    samples = fixed_samples(8, seed=2)
    write_seed_layout_cache(oc, str(tmp_path), samples, shard_size=3)
    theirs = seed.CachedTensorDataset(
        cache_dir=str(tmp_path), cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS
    )
    assert len(theirs) == 8
    for i in range(8):
        assert_samples_equal(theirs[i], {k: samples[k][i] for k in KEYS})


@needs_seed
def test_the_seed_and_speccache_write_the_same_tensors_and_manifest(seed, tmp_path):
    samples = fixed_samples(5, seed=3)
    write_seed_layout_cache(seed, str(tmp_path / "seed"), samples, shard_size=2)
    write_seed_layout_cache(oc, str(tmp_path / "ours"), samples, shard_size=2)
    assert sorted(os.listdir(tmp_path / "seed")) == sorted(os.listdir(tmp_path / "ours"))
    assert json.loads((tmp_path / "seed" / "manifest.json").read_text()) == json.loads(
        (tmp_path / "ours" / "manifest.json").read_text()
    )
    for i in range(3):
        assert_samples_equal(
            load_file(oc.shard_path(str(tmp_path / "seed"), i)), load_file(oc.shard_path(str(tmp_path / "ours"), i))
        )


# ---------------------------------------------------------------------------
# collation and loaders


def test_collate_cached_stacks_the_requested_keys():
    feats = [{"a": torch.tensor([i, i]), "b": torch.tensor(float(i)), "c": torch.zeros(1)} for i in range(3)]
    out = oc.collate_cached(feats, ("a", "b"))
    assert list(out) == ["a", "b"]
    assert out["a"].tolist() == [[0, 0], [1, 1], [2, 2]] and out["b"].tolist() == [0.0, 1.0, 2.0]
    assert oc.collate_cached(features=feats, keys=("c",))["c"].shape == (3, 1)


def test_build_cached_dataloader_without_distribution():
    ds = RecordingDataset(5)

    def collate(items):
        return oc.collate_cached(items, ("input_ids",))

    loader = oc.build_cached_dataloader(ds, 2, False, collate)
    assert isinstance(loader.sampler, SequentialSampler)
    assert loader.batch_size == 2 and loader.drop_last is False and loader.num_workers == 0
    assert loader.collate_fn is collate and loader.pin_memory == torch.cuda.is_available()
    assert [b["input_ids"][:, 0].tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    shuffled = oc.build_cached_dataloader(dataset=ds, batch_size=2, shuffle=True, collate_fn=collate, num_workers=0)
    assert isinstance(shuffled.sampler, RandomSampler)


@pytest.mark.parametrize("shuffle", [False, True])
def test_build_cached_dataloader_uses_a_distributed_sampler_when_distributed(monkeypatch, shuffle):
    class TwoRanks(DistributedSampler):
        def __init__(self, dataset, shuffle=True):
            super().__init__(dataset, num_replicas=2, rank=1, shuffle=shuffle)

    monkeypatch.setattr(oc, "DistributedSampler", TwoRanks)
    ds = RecordingDataset(7)
    loader = oc.build_cached_dataloader(
        dataset=ds,
        batch_size=3,
        shuffle=shuffle,
        collate_fn=lambda items: oc.collate_cached(items, ("input_ids",)),
        distributed=True,
    )
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.shuffle is shuffle and loader.drop_last is False
    batches = [b["input_ids"][:, 0].tolist() for b in loader]
    assert [len(b) for b in batches] == [3, 1]  # 4 samples on rank 1 of 2; the last batch is kept
    if not shuffle:
        assert batches == [[1, 3, 5], [0]]  # rank 1's share, padded by wrapping round


# ---------------------------------------------------------------------------
# resume helpers


def test_resume_start_sample_is_the_prefix_length_times_shard_size():
    assert oc.resume_start_sample(set(), 4) == 0
    assert oc.resume_start_sample({0, 1, 2}, 4) == 12
    assert oc.resume_start_sample(existing_shards={0}, shard_size=7) == 7


def test_resume_start_sample_refuses_a_non_contiguous_prefix():
    with pytest.raises(ValueError, match=r"contiguous prefix \[0, 1\].*found \[0, 2\]"):
        oc.resume_start_sample({0, 2}, 4)


def test_dataloader_from_sample_returns_the_same_loader_at_or_before_zero():
    loader = DataLoader(RecordingDataset(4), batch_size=2)
    assert oc.dataloader_from_sample(loader, 0) is loader
    assert oc.dataloader_from_sample(dataloader=loader, start_sample=-3) is loader


@pytest.mark.parametrize("start", [5, 6, 100])
def test_dataloader_from_sample_past_the_end_is_empty(start):
    ds = RecordingDataset(5)
    assert list(oc.dataloader_from_sample(DataLoader(ds, batch_size=2), start)) == []
    assert ds.accessed == []


def test_dataloader_from_sample_past_the_end_starts_no_worker_processes():
    # As the seed: an empty loader needs no workers (starting them would cost a process per worker for nothing).
    ds = RecordingDataset(5)
    collate = lambda items: items  # noqa: E731
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn", collate_fn=collate)
    resumed = oc.dataloader_from_sample(loader, 5)
    assert resumed.num_workers == 0 and resumed.batch_size == 2 and resumed.collate_fn is collate
    assert list(resumed) == [] and ds.accessed == []


def test_dataloader_from_sample_reads_only_from_start_in_order_with_the_same_batching():
    ds = RecordingDataset(10)

    def collate(items):
        return [int(item["input_ids"][0]) for item in items]

    loader = DataLoader(ds, batch_size=3, shuffle=True, collate_fn=collate)
    resumed = oc.dataloader_from_sample(loader, 4)
    assert list(resumed) == [[4, 5, 6], [7, 8, 9]]
    assert sorted(ds.accessed) == list(range(4, 10))


def test_dataloader_from_sample_keeps_the_worker_and_batching_settings():
    ds = RecordingDataset(10)

    def collate(items):
        return items

    loader = DataLoader(
        ds,
        batch_size=3,
        collate_fn=collate,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="spawn",
        pin_memory=True,
    )
    resumed = oc.dataloader_from_sample(loader, 4)
    assert resumed.batch_size == 3 and resumed.collate_fn is collate
    assert resumed.num_workers == 2 and resumed.persistent_workers is True
    assert resumed.multiprocessing_context is loader.multiprocessing_context
    assert resumed.pin_memory is True and resumed.drop_last is False
    assert isinstance(resumed.sampler, SequentialSampler)
    assert list(resumed.dataset.indices) == list(range(4, 10))
    assert ds.accessed == []  # nothing iterated, so no worker was started


# ---------------------------------------------------------------------------
# the accumulator and the loops


@pytest.mark.parametrize("batch_sizes", [[10], [1] * 10, [3, 3, 3, 1], [4, 0, 5, 1], [7, 3]])
def test_shard_accumulator_writes_exact_shard_sizes_numbered_from_the_start_index(batch_sizes):
    data = torch.arange(10)
    rec = Recorder()
    acc = oc._ShardAccumulator(output_dir="out", shard_size=4, start_shard_index=5, write_shard_fn=rec, logger=LOG)
    start = 0
    for size in batch_sizes:
        acc.add({"input_ids": data[start : start + size], "other": data[start : start + size] * 10})
        start += size
    assert rec.order == [5, 6]
    acc.finalize()
    assert rec.order == [5, 6, 7]
    assert [rec.shards[i]["input_ids"].tolist() for i in (5, 6, 7)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert rec.shards[7]["other"].tolist() == [80, 90]
    acc.finalize()
    assert rec.order == [5, 6, 7]  # nothing left to write


def test_shard_accumulator_takes_the_seed_positional_order_and_writes_no_empty_shard():
    rec = Recorder()
    acc = oc._ShardAccumulator("out", 3, 0, rec, LOG)
    acc.add({"input_ids": torch.arange(6)})
    acc.finalize()
    assert rec.order == [0, 1]


def test_write_cache_shards_writes_readable_sequential_shards(tmp_path):
    ds = RecordingDataset(7)
    keys = ("input_ids", "hidden")

    def write(output_dir, shard_index, samples):
        return oc.write_tensor_shard(output_dir, shard_index, samples, keys, "EAGLE-3")

    oc.write_cache_shards(
        dataloader=DataLoader(ds, batch_size=2), output_dir=str(tmp_path), shard_size=3, start_shard_index=0,
        compute_batch=compute, write_shard_fn=write, logger=LOG,
    )  # fmt: skip
    oc.write_manifest(str(tmp_path), {"num_samples": 7, "shard_size": 3}, 1)
    assert oc.existing_shard_indices(str(tmp_path)) == {0, 1, 2}
    cached = oc.CachedTensorDataset(str(tmp_path), "EAGLE-3", 1, keys)
    for i in range(7):
        assert cached[i]["input_ids"].tolist() == [i] * 4
        assert cached[i]["hidden"].tolist() == [2.0 * i, 2.0 * i + 2, 2.0 * i + 4]


def test_write_cache_shards_resumes_from_a_start_index(tmp_path):
    rec = Recorder()
    loader = oc.dataloader_from_sample(
        DataLoader(RecordingDataset(10), batch_size=4), oc.resume_start_sample({0, 1}, 3)
    )
    oc.write_cache_shards(loader, str(tmp_path), 3, 2, compute, rec, LOG)
    assert rec.order == [2, 3]
    assert [rec.shards[i]["input_ids"][:, 0].tolist() for i in (2, 3)] == [[6, 7, 8], [9]]


def test_partition_cache_shards_example():
    assert [oc.partition_cache_shards(10, 2, 3, r) for r in range(3)] == [(0, 0, 4), (2, 4, 4), (4, 8, 2)]
    assert oc.partition_cache_shards(num_samples=10, shard_size=2, world_size=3, rank=1) == (2, 4, 4)


def test_partition_cache_shards_gives_ranks_beyond_the_shard_count_nothing():
    assert [oc.partition_cache_shards(3, 2, 4, r)[2] for r in range(4)] == [2, 1, 0, 0]
    assert oc.partition_cache_shards(0, 2, 2, 1)[2] == 0


def test_partition_cache_shards_accepts_numpy_integers_like_the_seed():
    got = oc.partition_cache_shards(np.int64(10), np.int64(2), np.int64(3), np.int64(2))
    assert tuple(map(int, got)) == (4, 8, 2)


@pytest.mark.parametrize(
    "args,names",
    [((10, 2, 0, 0), "world_size"), ((10, 2, -1, 0), "world_size"), ((10, 2, 3, 3), "rank"), ((10, 2, 3, -1), "rank"),
     ((10, 0, 3, 0), "shard_size"), ((10, -2, 1, 0), "shard_size")],
)  # fmt: skip
def test_partition_cache_shards_errors_name_the_bad_argument(args, names):
    with pytest.raises(ValueError, match=names):
        oc.partition_cache_shards(*args)


def _run_distributed(ds, world, rank, sync, batch_size=2, shard_size=3):
    rec = Recorder()
    calls = []

    def counting(batch):
        calls.append(batch)
        return compute(batch)

    oc.write_cache_shards_distributed(
        dataloader=DataLoader(ds, batch_size=batch_size), output_dir="out", shard_size=shard_size, world_size=world,
        rank=rank, compute_batch=counting, write_shard_fn=rec, logger=LOG, sync_max_steps=sync,
    )  # fmt: skip
    return rec, calls


def test_write_cache_shards_distributed_calls_compute_batch_sync_max_steps_times():
    # 10 samples, shards of 3 -> 4 shards; world 3 -> rank 2 owns shard 3 (1 sample, 1 step); others 2 shards (3 steps).
    seen_local = []

    def sync(local):
        seen_local.append(local)
        return 5

    ds = RecordingDataset(10)
    rec, calls = _run_distributed(ds, 3, 2, sync)
    assert seen_local == [1]
    assert len(calls) == 5
    assert rec.order == [3] and rec.shards[3]["input_ids"][:, 0].tolist() == [9]
    # the padding batches are one-sample dummies made of sample 0, their outputs discarded
    assert [c["input_ids"][:, 0].tolist() for c in calls[1:]] == [[0]] * 4


def test_write_cache_shards_distributed_reads_the_dummy_batch_only_when_padding():
    ds = RecordingDataset(10)
    rec, calls = _run_distributed(ds, 3, 1, sync=lambda local: local)
    assert len(calls) == 2  # samples 6..8 in batches of 2
    assert sorted(ds.accessed) == [6, 7, 8]  # no dummy read: sample 0 is not this rank's
    assert rec.order == [2] and rec.shards[2]["input_ids"][:, 0].tolist() == [6, 7, 8]
    ds = RecordingDataset(10)
    rec, calls = _run_distributed(ds, 3, 1, sync=lambda local: local + 1)
    assert len(calls) == 3 and sorted(ds.accessed) == [0, 6, 7, 8]


def test_write_cache_shards_distributed_on_an_empty_dataset_reads_and_writes_nothing():
    ds = RecordingDataset(0)
    rec, calls = _run_distributed(ds, 2, 1, sync=lambda local: local)
    assert calls == [] and ds.accessed == [] and rec.order == []
    rec, calls = _run_distributed(ds, 1, 0, sync=None)
    assert calls == [] and ds.accessed == [] and rec.order == []


@pytest.mark.parametrize("n,batch_size,shard_size", [(10, 2, 3), (7, 3, 2), (6, 4, 6), (1, 1, 5)])
def test_write_cache_shards_distributed_with_world_one_equals_write_cache_shards(n, batch_size, shard_size):
    single = Recorder()
    oc.write_cache_shards(
        DataLoader(RecordingDataset(n), batch_size=batch_size), "out", shard_size, 0, compute, single, LOG
    )
    rec, calls = _run_distributed(RecordingDataset(n), 1, 0, None, batch_size, shard_size)
    assert rec.order == single.order
    for i in rec.order:
        assert_samples_equal(rec.shards[i], single.shards[i])
    assert len(calls) == -(-n // batch_size)


def test_write_cache_shards_distributed_ranks_together_write_what_one_process_writes():
    single = Recorder()
    oc.write_cache_shards(DataLoader(RecordingDataset(11), batch_size=2), "out", 3, 0, compute, single, LOG)
    combined: dict[int, dict[str, torch.Tensor]] = {}
    steps = []
    for rank in range(3):
        rec, calls = _run_distributed(RecordingDataset(11), 3, rank, sync=lambda local: _max_steps(11, 3, 2, 3))
        assert not set(rec.shards) & set(combined)
        combined.update(rec.shards)
        steps.append(len(calls))
    assert steps == [3, 3, 3]
    assert sorted(combined) == single.order
    for i in single.order:
        assert_samples_equal(combined[i], single.shards[i])


def _max_steps(n: int, shard_size: int, batch_size: int, world: int) -> int:
    return max(-(-oc.partition_cache_shards(n, shard_size, world, r)[2] // batch_size) for r in range(world))


@needs_seed
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_write_cache_shards_distributed_matches_the_seed(seed, world):
    n, shard_size, batch_size = 11, 3, 2
    steps = _max_steps(n, shard_size, batch_size, world)
    for rank in range(world):
        ours, our_calls = _run_distributed(
            RecordingDataset(n), world, rank, lambda local: steps, batch_size, shard_size
        )
        theirs = Recorder()
        seed_calls = []
        seed.write_cache_shards_distributed(
            dataloader=DataLoader(RecordingDataset(n), batch_size=batch_size), output_dir="out", shard_size=shard_size,
            world_size=world, rank=rank, compute_batch=lambda b, calls=seed_calls: (calls.append(b), compute(b))[1],
            write_shard_fn=theirs, logger=LOG, sync_max_steps=lambda local: steps,
        )  # fmt: skip
        assert len(our_calls) == len(seed_calls)
        assert ours.order == theirs.order
        for i in ours.order:
            assert_samples_equal(ours.shards[i], theirs.shards[i])


# ---------------------------------------------------------------------------
# subclasses written against the seed's dataset (as the seed's own EAGLE-3 reader is)


class TopKDataset(oc.CachedTensorDataset):
    """A subclass in the seed's style: its own ``__getitem__`` built on ``_handle``/``_disk_keys``."""

    def __init__(self, cache_dir: str) -> None:
        self.width = 6  # set before super().__init__, as seed subclasses do
        super().__init__(
            cache_dir=cache_dir,
            cache_name="EAGLE-3",
            format_version=VERSION,
            disk_keys=("input_ids", "values", "indices"),
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        handle = self._handle(index // self.shard_size)
        sample = {key: handle.get_slice(key)[index % self.shard_size] for key in self._disk_keys}
        full = torch.zeros(self.width)
        sample["probs"] = full.scatter_(0, sample.pop("indices").long(), sample.pop("values"))
        return sample


@pytest.fixture
def topk_cache(tmp_path):
    n = 5
    samples = {
        "input_ids": torch.arange(n * 2).reshape(n, 2),
        "values": torch.tensor([[0.75, 0.25]] * n),
        "indices": torch.tensor([[i % 6, (i + 1) % 6] for i in range(n)], dtype=torch.int32),
    }
    for index, start in enumerate(range(0, n, 2)):
        oc.write_tensor_shard(
            str(tmp_path), index, {k: v[start : start + 2] for k, v in samples.items()}, tuple(samples), "EAGLE-3"
        )
    oc.write_manifest(str(tmp_path), {"num_samples": n, "shard_size": 2}, VERSION)
    return str(tmp_path)


def _expected_probs(i: int) -> list[float]:
    full = [0.0] * 6
    full[i % 6] = 0.75
    full[(i + 1) % 6] = 0.25
    return full


def test_a_seed_style_subclass_reads_through_handle_and_disk_keys(topk_cache):
    ds = TopKDataset(topk_cache)
    assert ds._disk_keys == ("input_ids", "values", "indices")
    for i in range(5):
        sample = ds[i]
        assert set(sample) == {"input_ids", "probs"}
        assert sample["input_ids"].tolist() == [2 * i, 2 * i + 1]
        assert sample["probs"].tolist() == _expected_probs(i)
    handle = ds._handle(1)
    assert set(handle.keys()) == {"input_ids", "values", "indices"}
    assert handle.get_tensor("input_ids").tolist() == [[4, 5], [6, 7]]
    assert handle.get_slice("values").get_shape() == [2, 2]
    ds._handle(0).get_slice("input_ids")[0].fill_(-1)  # what a handle returns is the caller's to change
    assert ds[0]["input_ids"].tolist() == [0, 1]


def test_a_seed_style_subclass_overriding_getitem_is_used_by_batched_dataloaders(topk_cache):
    ds = TopKDataset(topk_cache)
    keys = ("input_ids", "probs")
    loader = oc.build_cached_dataloader(ds, 2, False, lambda items: oc.collate_cached(items, keys))
    batches = list(loader)
    assert [b["probs"].tolist() for b in batches] == [
        [_expected_probs(0), _expected_probs(1)],
        [_expected_probs(2), _expected_probs(3)],
        [_expected_probs(4)],
    ]
    assert ds.__getitems__([4, 0])[0]["probs"].tolist() == _expected_probs(4)


WHEEL = SEED_PATH.parents[4] / "nemo_automodel-0.7.0-py3-none-any.whl" if len(SEED_PATH.parents) > 4 else None


@pytest.mark.skipif(WHEEL is None or not WHEEL.is_file(), reason="no NeMo AutoModel wheel next to the seed")
@pytest.mark.parametrize("topk", [None, 2])
def test_the_seed_eagle3_reader_runs_unchanged_on_speccache(monkeypatch, tmp_path, topk):
    """NeMo's own ``eagle3_cache`` module, its offline_cache import switched to speccache, writes and reads a cache."""
    import zipfile

    source = zipfile.ZipFile(WHEEL).read("nemo_automodel/components/datasets/llm/eagle3_cache.py").decode()
    monkeypatch.setitem(sys.modules, "nemo_automodel.components.datasets.llm.offline_cache", oc)
    module = types.ModuleType("_seed_eagle3_cache")
    exec(compile(source, "eagle3_cache.py", "exec"), module.__dict__)

    n, seq, vocab = 5, 3, 7
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(n, seq, vocab, generator=g), -1)
    common = {
        "input_ids": torch.randint(0, 100, (n, seq), generator=g),
        "attention_mask": torch.ones(n, seq, dtype=torch.int64),
        "loss_mask": torch.ones(n, seq, dtype=torch.int64),
        "aux_hidden_states": torch.randn(n, seq, 12, generator=g).to(torch.bfloat16),
        "position_mask": torch.ones(n, seq, 1, dtype=torch.bool),
    }
    if topk:
        values, indices = module.compress_target_probs(probs, topk)
        stored = {**common, "target_probs_values": values, "target_probs_indices": indices}
        expected_probs = module.reconstruct_target_probs(values, indices, vocab)
    else:
        stored = {**common, "target_probs": probs}
        expected_probs = probs
    cache = str(tmp_path)
    for index, start in enumerate(range(0, n, 2)):
        module.write_shard(cache, index, {k: v[start : start + 2] for k, v in stored.items()})
    module.write_manifest(
        cache, {"num_samples": n, "shard_size": 2, "draft_vocab_size": vocab, "target_probs_topk": topk}
    )
    module.write_target_embeddings(cache, torch.randn(4, 3))

    ds = module.CachedEagle3Dataset(cache)
    assert ds.manifest["draft_vocab_size"] == vocab
    for i in (0, 3, -1):
        sample = ds[i]
        assert set(sample) == set(module.CACHE_KEYS)
        assert torch.equal(sample["target_probs"], expected_probs[i])
        assert torch.equal(sample["aux_hidden_states"], common["aux_hidden_states"][i])
    loader = module.build_cached_eagle3_dataloader(cache_dir=cache, batch_size=2, shuffle=False)
    got = torch.cat([b["target_probs"] for b in loader])
    assert torch.equal(got, expected_probs)
    assert module.read_target_embeddings(cache).shape == (4, 3)


def test_subclasses_overriding_getitem_or_getitems_compose_without_recursion(topk_cache):
    class Plus(oc.CachedTensorDataset):  # __getitem__ on top of the parent's: batched reads go through it
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            sample["input_ids"] = sample["input_ids"] + 1000
            return sample

    class Finish(oc.CachedTensorDataset):  # __getitems__ on top of the parent's: what batched loaders get
        def __getitems__(self, indices):
            return [{**s, "input_ids": s["input_ids"] + 2000} for s in super().__getitems__(indices)]

    class Both(Finish):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            sample["extra"] = torch.tensor(index)
            return sample

    args = (topk_cache, "EAGLE-3", VERSION, ("input_ids",))
    plus, finish, both = Plus(*args), Finish(*args), Both(*args)
    assert plus[1]["input_ids"].tolist() == [1002, 1003]
    assert [s["input_ids"].tolist() for s in plus.__getitems__([1, 0])] == [[1002, 1003], [1000, 1001]]
    assert finish[1]["input_ids"].tolist() == [2, 3]  # ds[i] is __getitem__, as in the original
    assert [s["input_ids"].tolist() for s in finish.__getitems__([2])] == [[2004, 2005]]
    assert both[3]["input_ids"].tolist() == [6, 7] and int(both[3]["extra"]) == 3
    assert [(s["input_ids"].tolist(), int(s["extra"])) for s in both.__getitems__([3])] == [([2006, 2007], 3)]


# ---------------------------------------------------------------------------
# patching the module's globals reaches the code, as with the original module


def test_patched_safe_import_from_reaches_load_safetensors(monkeypatch):
    monkeypatch.setattr(oc, "safe_import_from", lambda module, name, *a, **k: (False, None))
    with pytest.raises(ImportError, match="requires the 'safetensors' package"):
        oc.load_safetensors("EAGLE-3")
    with pytest.raises(ImportError):
        oc.write_tensor_shard("/nonexistent", 0, {"a": torch.zeros(1)}, ("a",), "EAGLE-3")


def test_patched_atomic_write_reaches_the_writers(monkeypatch, tmp_path):
    calls: list[str] = []
    real = oc.atomic_write

    def recording(path, write_fn):
        calls.append(os.path.basename(path))
        return real(path, write_fn)

    monkeypatch.setattr(oc, "atomic_write", recording)
    oc.write_tensor_shard(str(tmp_path), 0, {"a": torch.zeros(2, 3)}, ("a",), "EAGLE-3")
    oc.write_manifest(str(tmp_path), {"num_samples": 2, "shard_size": 2}, VERSION)
    assert calls == ["shard-000000.safetensors", "manifest.json"]


def test_patched_read_manifest_and_validate_reach_the_dataset(monkeypatch, seed_layout_cache):
    cache_dir, _ = seed_layout_cache
    seen: list[str] = []
    real_read, real_validate = oc.read_manifest, oc.validate_contiguous_shards
    monkeypatch.setattr(oc, "read_manifest", lambda *a, **k: (seen.append("read"), real_read(*a, **k))[1])
    monkeypatch.setattr(
        oc, "validate_contiguous_shards", lambda *a, **k: (seen.append("validate"), real_validate(*a, **k))[1]
    )
    oc.CachedTensorDataset(cache_dir=cache_dir, cache_name="EAGLE-3", format_version=VERSION, disk_keys=KEYS)
    assert seen == ["read", "validate"]


def test_patched_dataloader_and_subset_reach_the_loaders(monkeypatch):
    made: list[str] = []

    class RecordingLoader(DataLoader):
        def __init__(self, *args, **kwargs):
            made.append("loader")
            super().__init__(*args, **kwargs)

    class RecordingSubset(torch.utils.data.Subset):
        def __init__(self, *args, **kwargs):
            made.append("subset")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(oc, "DataLoader", RecordingLoader)
    monkeypatch.setattr(oc, "Subset", RecordingSubset)
    data = [{"input_ids": torch.tensor([i])} for i in range(6)]
    assert isinstance(oc.build_cached_dataloader(data, 2, False, lambda b: b), RecordingLoader)
    loader = oc._sequential_subset_loader(DataLoader(data, batch_size=2), 1, 4)
    assert isinstance(loader, RecordingLoader) and isinstance(loader.dataset, RecordingSubset)
    assert isinstance(oc.dataloader_from_sample(DataLoader(data, batch_size=2), 2), RecordingLoader)
    assert made == ["loader", "subset", "loader", "subset", "loader"]


def test_patched_shard_accumulator_and_partition_reach_the_loops(monkeypatch, tmp_path):
    built: list[int] = []
    real_acc, real_partition = oc._ShardAccumulator, oc.partition_cache_shards

    class Recording(real_acc):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(oc, "_ShardAccumulator", Recording)
    monkeypatch.setattr(oc, "partition_cache_shards", lambda *a: (built.append(2), real_partition(*a))[1])
    data = [{"input_ids": torch.tensor([i])} for i in range(4)]
    loader = DataLoader(data, batch_size=2, collate_fn=lambda b: {"input_ids": torch.cat([x["input_ids"] for x in b])})
    write = lambda d, i, s: oc.write_tensor_shard(d, i, s, ("input_ids",), "EAGLE-3")  # noqa: E731
    oc.write_cache_shards(loader, str(tmp_path / "a"), 2, 0, lambda b: b, write, LOG)
    oc.write_cache_shards_distributed(loader, str(tmp_path / "b"), 2, 1, 0, lambda b: b, write, LOG)
    assert built == [1, 2, 1]


def test_patched_distributed_sampler_reaches_build_cached_dataloader(monkeypatch):
    made: list[bool] = []

    class OneRank(torch.utils.data.distributed.DistributedSampler):
        def __init__(self, dataset, shuffle=True):
            made.append(shuffle)
            super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle)

    monkeypatch.setattr(oc, "DistributedSampler", OneRank)
    loader = oc.build_cached_dataloader([1, 2, 3], 2, True, lambda b: b, distributed=True)
    assert isinstance(loader.sampler, OneRank) and made == [True]

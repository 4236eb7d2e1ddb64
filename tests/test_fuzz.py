"""Hostile input (hypothesis): fuzzed manifests, safetensors headers and chat-data rows.

Whatever the bytes, only documented exceptions come out, each with a message:
speccache errors (:class:`SpeccacheError` subclasses) and ``FileNotFoundError``
for the cache; :class:`DataError` for data rows. Reading and verifying never
change a file; a writer asked to resume a hostile cache either refuses without
changing anything or completes the cache correctly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from speccache import cli
from speccache.errors import DataError, SpeccacheError
from speccache.format import MANIFEST_NAME, ShardFile, shard_path
from speccache.read import CacheDataset
from speccache.read.verify import inspect_cache, verify_cache
from speccache.testing.synthetic import write_synthetic_cache
from support import SOAK
from support.cachecmp import all_samples, file_tree, same_samples

# `make soak` runs it with SPECCACHE_SOAK=1, which multiplies its examples
pytestmark = pytest.mark.soak_suite

ARGS = dict(num_samples=10, shard_size=4, hidden=8, max_len=8)
DOCUMENTED = (SpeccacheError, FileNotFoundError)
EXAMPLES = 400 if SOAK else 40
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


class Pristine:
    def __init__(self, base: str) -> None:
        self.path = os.path.join(base, "pristine")
        write_synthetic_cache(self.path, overlap=False, **ARGS)
        self.tree = file_tree(self.path)
        self.samples = all_samples(self.path)
        self.manifest = json.loads(self.tree[MANIFEST_NAME])
        self.work = os.path.join(base, "work")

    def fresh(self) -> str:
        """A writable copy of the cache (rebuilt for each example)."""
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(self.path, self.work)
        return self.work


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return Pristine(str(tmp_path_factory.mktemp("fuzz")))


def _documented(fn) -> object:
    """Run ``fn``; a documented error is returned (it must have a message), anything else fails the test."""
    try:
        return fn()
    except DOCUMENTED as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc


def exercise(path: str, reference) -> None:
    """Every read-only entry point on ``path``: documented errors only, no file changed, never wrong verified data."""
    before = file_tree(path)
    got = _documented(lambda: all_samples(path, verify=True))
    if not isinstance(got, Exception):
        assert same_samples(got, reference), "verify=True returned data that differs from what was written"
    _documented(lambda: all_samples(path))
    _documented(lambda: all_samples(path, allow_incomplete=True))
    _documented(lambda: CacheDataset(path).sample_lengths())
    _documented(lambda: verify_cache(path))
    _documented(lambda: inspect_cache(path))
    for command in ("verify", "inspect"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            rc = cli.main([command, path])
        assert rc in (0, 1), f"speccache {command} exited {rc}: {err.getvalue()}"
    assert file_tree(path) == before, "reading or verifying changed a file"


def _write_manifest_text(path: str, text: str | bytes) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)


# ---------------------------------------------------------------------------
# manifests

MANIFEST_PATHS = [
    ("format_version",), ("cache_name",), ("keys",), ("keys", "hidden"), ("keys", "hidden", "dtype"),
    ("keys", "hidden", "shape"), ("keys", "hidden", "ragged"), ("keys", "hidden", "encoding"),
    ("keys", "sample_id", "shape"), ("shard_size",),
    ("num_samples",), ("complete",), ("shards",), ("shards", 0), ("shards", 0, "index"), ("shards", 1, "xxh3_128"),
    ("shards", 2, "samples"), ("num_tokens",), ("total_bytes",), ("config",), ("side_files",), ("stats",),
]  # fmt: skip


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(MANIFEST_PATHS), st.booleans(), json_values), min_size=1, max_size=3))
@example(edits=[(("shard_size",), False, float("inf"))])
@example(edits=[(("num_samples",), False, float("nan"))])
@example(edits=[(("shards", 0, "index"), False, [1])])
@example(edits=[(("shards",), False, 3)])
@example(edits=[(("shards",), False, [1, "x", None])])
@example(edits=[(("keys", "hidden", "shape"), False, [float("inf")])])
@example(edits=[(("side_files",), False, {"x": 1})])
@example(edits=[(("side_files",), False, [1])])
@example(edits=[(("num_samples",), False, 10**30)])
@example(edits=[(("shard_size",), False, 10**30)])
def test_fuzzed_manifest_fields(pristine, edits):
    manifest = json.loads(pristine.tree[MANIFEST_NAME])
    for path, delete, value in edits:
        target = manifest
        for key in path[:-1]:
            if (
                isinstance(target, dict)
                and key in target
                or isinstance(target, list)
                and isinstance(key, int)
                and key < len(target)
            ):
                target = target[key]
            else:
                target = None
                break
        if (
            isinstance(target, dict)
            or isinstance(target, list)
            and isinstance(path[-1], int)
            and path[-1] < len(target)
        ):
            if delete and isinstance(target, dict):
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
    work = pristine.fresh()
    _write_manifest_text(work, json.dumps(manifest))
    exercise(work, pristine.samples)


@FUZZ
@given(value=json_values)
def test_fuzzed_manifest_documents(pristine, value):
    work = pristine.fresh()
    _write_manifest_text(work, json.dumps(value))
    exercise(work, pristine.samples)


@FUZZ
@given(data=st.binary(max_size=300))
@example(data=b"[" * 100_000)
@example(data=b'{"a":' * 100_000)
@example(data=b"\xef\xbb\xbf{}")
@example(data=b"\x00\x00\x00{")
def test_fuzzed_manifest_bytes(pristine, data):
    work = pristine.fresh()
    _write_manifest_text(work, data)
    exercise(work, pristine.samples)


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.sampled_from(MANIFEST_PATHS[:13]), st.booleans(), json_values), min_size=1, max_size=2)
)
@example(edits=[(("config",), False, {"seed": 1})])
@example(edits=[(("complete",), False, "yes")])
def test_resuming_a_fuzzed_manifest_refuses_without_changes_or_completes_correctly(pristine, edits):
    manifest = json.loads(pristine.tree[MANIFEST_NAME])
    for path, delete, value in edits:
        target = manifest
        for key in path[:-1]:
            target = target.get(key) if isinstance(target, dict) else None
        if isinstance(target, dict):
            if delete:
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
    work = pristine.fresh()
    _write_manifest_text(work, json.dumps(manifest))
    before = file_tree(work)
    try:
        write_synthetic_cache(work, overlap=False, resume=True, **ARGS)
    except SpeccacheError as exc:
        assert str(exc)
        assert file_tree(work) == before, "a refused resume changed the cache"
    else:
        assert file_tree(work) == pristine.tree


# ---------------------------------------------------------------------------
# safetensors headers


def _shard_parts(pristine, index: int = 1) -> tuple[dict, bytes]:
    data = pristine.tree[os.path.basename(shard_path(pristine.path, index))]
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _put_shard(path: str, header: bytes, body: bytes, index: int = 1, length: int | None = None) -> None:
    with open(shard_path(path, index), "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + body)


HEADER_FIELDS = ["dtype", "shape", "data_offsets"]


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 50), st.sampled_from(HEADER_FIELDS + ["__rename__", "__delete__"]), json_values),
        min_size=1, max_size=3,
    ),
    meta_edits=st.lists(st.tuples(
        st.sampled_from(["speccache_format", "shard_index", "num_samples", "num_rows", "xxh3_128", "other"]),
        json_values,
    ), max_size=2),
)  # fmt: skip
@example(edits=[(0, "shape", [float("inf")])], meta_edits=[])
@example(edits=[(0, "shape", [-1, -4])], meta_edits=[])
@example(edits=[(0, "data_offsets", [0, 2**70])], meta_edits=[])
@example(edits=[(0, "dtype", "F8_E5M2")], meta_edits=[])
@example(edits=[(1, "shape", [])], meta_edits=[])
@example(edits=[(0, "shape", [0])], meta_edits=[("num_samples", "x")])
@example(edits=[(0, "shape", [1])], meta_edits=[("xxh3_128", "{}")])
@example(edits=[(0, "shape", [1])], meta_edits=[("xxh3_128", "[1]")])
def test_fuzzed_safetensors_header_fields(pristine, edits, meta_edits):
    header, body = _shard_parts(pristine)
    names = sorted(k for k in header if k != "__metadata__")
    for pick, field, value in edits:
        name = names[pick % len(names)]
        if name not in header:
            continue
        if field == "__delete__":
            del header[name]
        elif field == "__rename__":
            header[str(value)] = header.pop(name)
        else:
            header[name][field] = value
    meta = header.setdefault("__metadata__", {})
    for key, value in meta_edits:
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    text = json.dumps(header).encode()
    work = pristine.fresh()
    _put_shard(work, text + b" " * (-len(text) % 8), body)
    exercise(work, pristine.samples)


@FUZZ
@given(header=st.dictionaries(st.text(max_size=10), json_values, max_size=6), pad=st.integers(0, 9))
def test_fuzzed_safetensors_header_documents(pristine, header, pad):
    _, body = _shard_parts(pristine)
    work = pristine.fresh()
    _put_shard(work, json.dumps(header).encode() + b" " * pad, body)
    exercise(work, pristine.samples)


@FUZZ
@given(raw=st.binary(max_size=200), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)), keep_body=st.booleans())
@example(raw=b"[" * 50_000, length=None, keep_body=True)
@example(raw=b"{}", length=2**63, keep_body=True)
def test_fuzzed_safetensors_header_bytes(pristine, raw, length, keep_body):
    _, body = _shard_parts(pristine)
    work = pristine.fresh()
    _put_shard(work, raw, body if keep_body else b"", length=length)
    exercise(work, pristine.samples)
    try:
        ShardFile(shard_path(work, 1))
    except SpeccacheError as exc:
        assert "shard-000001" in str(exc)


# ---------------------------------------------------------------------------
# chat-data rows (speccache.data)


@pytest.fixture(scope="module")
def tokenizer():
    from speccache.demo import build_demo_tokenizer

    return build_demo_tokenizer()


message = st.fixed_dictionaries(
    {},
    optional={"role": json_values | st.sampled_from(["user", "assistant", "system", "tool"]),
              "content": json_values | st.text(max_size=20),
              "from": json_values | st.sampled_from(["human", "gpt", "system"]),
              "value": json_values | st.text(max_size=20)},
)  # fmt: skip
rows = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={"messages": json_values | st.lists(message, max_size=4),
                                        "conversations": json_values | st.lists(message, max_size=4),
                                        "input_ids": json_values | st.lists(st.integers(-5, 2**40), max_size=6),
                                        "loss_mask": json_values | st.lists(st.integers(-1, 2), max_size=6)}),
)  # fmt: skip


@FUZZ
@given(row=rows, max_length=st.integers(1, 64))
@example(row={"input_ids": [1, 2], "loss_mask": [1, 1.5]}, max_length=8)
@example(row={"input_ids": [True, 2], "loss_mask": [1, 1]}, max_length=8)
@example(row={"input_ids": [10**30], "loss_mask": [1]}, max_length=8)
@example(row={"messages": [{"role": "assistant", "content": "x"}]}, max_length=8)
@example(row={"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, max_length=8)
def test_fuzzed_chat_rows_raise_only_data_errors(tokenizer, row, max_length):
    from speccache.data import tokenize_row

    try:
        sample = tokenize_row(row, tokenizer, max_length, where="fuzz.jsonl:1")
    except DataError as exc:
        assert str(exc).startswith("fuzz.jsonl:1") or "chat template" in str(exc), str(exc)
        return
    if sample is not None:
        assert 0 < len(sample.input_ids) == len(sample.loss_mask) <= max_length
        assert all(isinstance(i, int) for i in sample.input_ids) and set(sample.loss_mask) <= {0, 1}


@settings(
    max_examples=EXAMPLES // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(lines=st.lists(st.one_of(rows.map(json.dumps), st.binary(max_size=40).map(lambda b: b.decode("latin-1"))),
                     max_size=5),
       suffix=st.sampled_from([".jsonl", ".json"]), skip=st.booleans())  # fmt: skip
def test_fuzzed_data_files_raise_only_data_errors(tokenizer, tmp_path, lines, suffix, skip):
    from speccache.data import load_samples

    path = tmp_path / f"data{suffix}"
    text = "\n".join(lines) if suffix == ".jsonl" else "[" + ",".join(lines) + "]"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        samples, stats = load_samples(str(path), tokenizer, 32, skip_bad_rows=skip)
    except DataError as exc:
        assert str(exc)
        return
    assert stats.rows_read >= len(samples)
    assume(True)

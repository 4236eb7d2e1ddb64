"""docs/errors.md is true: each listed message is real, and every speccache error is listed.

Each table row of docs/errors.md gives a fragment of a message and the exception
class (or ``verify`` for a ``speccache verify`` finding). This test

* checks every fragment is in the source (src/speccache);
* triggers most rows for real and checks the exception class and that the
  fragment is in the message (or in a verify finding's reason);
* scans the source for every speccache error constructed with a literal message
  and fails if no row's fragment covers it, so a new error needs a row.
"""

from __future__ import annotations

import ast
import gzip
import importlib.metadata
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import zstandard
from transformers import GPT2Config, LlamaConfig, Qwen3VLConfig

import speccache.errors as errors_module
from speccache.compat._base import refuse_vision
from speccache.data import chat_format
from speccache.data.regenerated import REGENERATE_FORMAT, REGENERATE_NAME, read_progress
from speccache.demo.real_target import build_real_model_dir, real_target_gguf
from speccache.devices import dtype_name
from speccache.engines.hf import Checkpoint, check_shard_target, check_tp_plan
from speccache.engines.vllm import rank_environment
from speccache.format import MANIFEST_NAME, KeySpec, Manifest, ShardFile, shard_path, write_safetensors
from speccache.format.encoding import get_encoding
from speccache.format.lock import LOCK_NAME
from speccache.format.names import check_shard_size
from speccache.format.shard import verify_tensor_checksums
from speccache.format.view import View, source_record
from speccache.methods.base import stores_vision_inputs
from speccache.methods.eagle3 import read_side_file
from speccache.methods.finite import check_nonfinite_mode, guard_nonfinite
from speccache.methods.layers_producer import LayerSelection, preset_selection
from speccache.offline_cache import (
    CachedTensorDataset,
    ensure_supervision_options_match,
    resume_start_sample,
    write_manifest,
    write_tensor_shard,
)
from speccache.precompute.append import plan_append
from speccache.precompute.audit import audit_cache
from speccache.precompute.config import check_out_outside_data
from speccache.precompute.regenerate import RegenerateConfig, regenerate
from speccache.read import CacheDataset
from speccache.read.follow import Follow
from speccache.read.ranges import sequence_parallel_rows
from speccache.read.sampler import LocalityShuffleSampler
from speccache.read.source import open_source
from speccache.read.verify import VerifyReport, inspect_cache, verify_cache
from speccache.read.view import make_merge_view, parse_where
from speccache.testing.synthetic import write_synthetic_cache
from speccache.train.inputs import check_draft_inputs
from speccache.units import parse_bytes
from speccache.write import LocalComm, NativeShardWriter, OverlappedShardWriter, data_parallel_groups

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
SRC = ROOT / "src" / "speccache"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(`?)([A-Za-z]+)\2\s*\|")
ARGS = dict(num_samples=10, shard_size=4, hidden=8, max_len=8)


def doc_rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            section = line
        m = ROW.match(line)
        if m and section.startswith("## "):
            fragment, kind = m.group(1), m.group(3)
            assert fragment not in rows, f"fragment {fragment!r} is listed twice"
            rows[fragment] = kind
    return rows


ROWS = doc_rows()
SOURCE_FILES = sorted(SRC.rglob("*.py"))
SOURCE = "\n".join(p.read_text() for p in SOURCE_FILES)


def test_the_doc_lists_rows_of_known_exception_classes():
    assert len(ROWS) > 80
    known = (
        set(errors_module.__all__)
        | {"verify"}
        | {n for n in dir(__builtins__ if isinstance(__builtins__, dict) else __builtins__)}
    )
    assert {kind for kind in ROWS.values()} <= known | {
        "ValueError",
        "FileNotFoundError",
        "NotADirectoryError",
        "ImportError",
        "ModuleNotFoundError",
        "FileExistsError",
        "IndexError",
        "RuntimeError",
    }


@pytest.mark.parametrize("fragment", sorted(ROWS))
def test_every_documented_fragment_is_in_the_source(fragment):
    assert fragment in SOURCE, f"docs/errors.md lists {fragment!r}, which no source file contains"


def _literal_text(call: ast.Call) -> str:
    parts: list[str] = []
    for node in ast.walk(call):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts.append(node.value)
    return "\x00".join(parts)


def test_every_speccache_error_with_a_literal_message_is_documented():
    classes = set(errors_module.__all__) | {"_RowError"}
    missing = []
    for path in SOURCE_FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes:
                text = _literal_text(node)
                if len(re.sub(r"[^A-Za-z]", "", text)) < 6:  # a wrapper re-raising another message
                    continue
                if not any(fragment in text for fragment in ROWS):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}({text[:100]!r}...)")
    assert not missing, "errors missing from docs/errors.md:\n" + "\n".join(missing)


# ---------------------------------------------------------------------------
# triggering the rows


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("doc")
    raw = str(base / "raw")
    write_synthetic_cache(raw, overlap=False, **ARGS)
    zbf16 = str(base / "zbf16")
    write_synthetic_cache(zbf16, overlap=False, encoding="zbf16", **ARGS)
    return {"raw": raw, "zbf16": zbf16}


class Env:
    """A scratch directory with a fresh copy of the cache for each trigger."""

    def __init__(self, tmp: Path, pristine: dict[str, str]) -> None:
        self.tmp = tmp
        self.pristine = pristine

    def cache(self, kind: str = "raw") -> str:
        path = str(self.tmp / f"cache-{kind}")
        shutil.copytree(self.pristine[kind], path)
        return path

    @staticmethod
    def edit_manifest(path: str, edit: Callable[[dict], Any]) -> str:
        mpath = os.path.join(path, MANIFEST_NAME)
        manifest = json.loads(Path(mpath).read_text())
        edit(manifest)
        Path(mpath).write_text(json.dumps(manifest))
        return path

    @staticmethod
    def edit_header(path: str, index: int, edit: Callable[[dict], Any]) -> str:
        full = shard_path(path, index)
        data = Path(full).read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        edit(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        Path(full).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
        return full

    def file(self, header: bytes, body: bytes = b"", length: int | None = None) -> str:
        path = str(self.tmp / "f.safetensors")
        Path(path).write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + body)
        return path

    def seed_cache(self, num_samples: int) -> str:
        path = str(self.tmp / "seed")
        write_tensor_shard(path, 0, {"a": torch.zeros(2, 3)}, ("a",), "x")
        write_manifest(path, {"num_samples": num_samples, "shard_size": num_samples}, 1)
        return path


def _read(path: str, **kwargs) -> None:
    ds = CacheDataset(path, **kwargs)
    for sample in ds.__getitems__(range(len(ds))):
        for value in sample.values():
            value.clone()


def _flip_data_byte(path: str, index: int = 1) -> None:
    full = shard_path(path, index)
    shard = ShardFile(full)
    pos = shard.data_start + shard.entries["hidden"][2] + 3
    del shard
    data = bytearray(Path(full).read_bytes())
    data[pos] ^= 0x10
    Path(full).write_bytes(bytes(data))


def _tokenizer():
    from speccache.demo import build_demo_tokenizer

    return build_demo_tokenizer()


def _row(row: Any) -> None:
    from speccache.data import tokenize_row

    tokenize_row(row, _tokenizer(), 64, where="rows.jsonl:1")


def _data_file(env: Env, name: str, content: bytes) -> None:
    from speccache.data import load_samples

    path = env.tmp / name
    path.write_bytes(content)
    load_samples(str(path), _tokenizer(), 64)


def _write_lock(path: str) -> None:
    Path(path, LOCK_NAME).write_text(json.dumps({"host": "node-9", "pid": 7, "since": 0}))


def _without_real_target_wheel() -> None:
    with mock.patch("importlib.metadata.distribution", side_effect=importlib.metadata.PackageNotFoundError):
        real_target_gguf()


def _failing_overlapped_writer() -> None:
    writer = OverlappedShardWriter(lambda *args: None)
    try:
        with writer:
            raise RuntimeError("the producer failed")
    except RuntimeError:
        pass
    writer("unused", 0, {})


def _no_checksums(env: Env) -> None:
    verify_tensor_checksums(
        ShardFile(write_safetensors(str(env.tmp / "plain.safetensors"), {"a": torch.zeros(2)}).path)
    )


def _shard_table_edit(m: dict) -> None:
    m["shards"][1]["bytes"] += 1


def _offsets_decreasing(env: Env) -> str:
    path = env.cache()
    full = shard_path(path, 0)
    shard = ShardFile(full)
    pos = shard.data_start + shard.entries["__offsets__"][2] + 8
    del shard
    data = bytearray(Path(full).read_bytes())
    data[pos : pos + 8] = struct.pack("<q", 10**6)
    Path(full).write_bytes(bytes(data))
    return path


def _undecodable(env: Env) -> str:
    """Move the end of sample 0's high-byte chunk: it no longer has the raw length, and is no zstd frame."""
    path = env.cache("zbf16")
    full = shard_path(path, 0)
    shard = ShardFile(full)
    pos = shard.data_start + shard.entries["hidden.hi_offsets"][2] + 8
    del shard
    data = bytearray(Path(full).read_bytes())
    (end,) = struct.unpack("<q", data[pos : pos + 8])
    data[pos : pos + 8] = struct.pack("<q", end + 1)
    Path(full).write_bytes(bytes(data))
    return path


def _shard_batch() -> tuple[dict, dict]:
    from speccache.testing.synthetic import SyntheticSamples, collate_samples, make_compute, synthetic_schema

    samples = SyntheticSamples(4, 1, 8, 0)
    batch = make_compute(8, torch.bfloat16, 0)(collate_samples([samples[i] for i in range(4)]))
    return synthetic_schema(8), batch


def _unwritable_shard(env: Env) -> None:
    schema, batch = _shard_batch()
    NativeShardWriter(schema)(str(_touch(env.tmp / "f")) + "/sub", 0, batch)


def _side_file(env: Env, content: bytes | None, mkdir: bool = False) -> VerifyReport:
    path = env.cache()
    env.edit_manifest(path, lambda m: m.update(side_files={"side.bin": {"bytes": 3, "xxh3_128": "0" * 32}}))
    if mkdir:
        os.mkdir(os.path.join(path, "side.bin"))
    elif content is not None:
        Path(path, "side.bin").write_bytes(content)
    return verify_cache(path)


def _view_of_two_side_files(e: Env) -> str:
    """A view (written directly: merge refuses it) of two caches whose manifests record different side files."""
    sources = []
    for name, digit in (("one", "1"), ("two", "2")):
        path = str(shutil.copytree(e.pristine["raw"], e.tmp / name))
        e.edit_manifest(path, lambda m, d=digit: m.update(side_files={"side.bin": {"bytes": 3, "xxh3_128": d * 32}}))
        sources.append((path, Manifest.read(path)))
    out = str(e.tmp / "v")
    records = [source_record(out, path, m, range(m.num_shards), 1.0) for path, m in sources]
    View(sources[0][1].cache_name, sources[0][1].schema, records, [(0, 0, 10), (1, 0, 10)]).write(out)
    return open_source(out).side_file("side.bin")


def _rewritten_under_a_reader(e: Env) -> Any:
    ds = CacheDataset(p := e.cache(), max_open_shards=1)
    e.edit_manifest(p, lambda m: m["config"].update(seed=99))  # another run's manifest, written in place
    return ds[8]


def _appended_under_a_reader(e: Env) -> Any:
    ds = CacheDataset(p := e.cache(), max_open_shards=1)
    e.edit_manifest(p, lambda m: m.update(complete=False, num_samples=12, config={**m["config"], "appended": [{}]}))
    return ds[8]


def _torn_seed_shard(path: str) -> str:
    os.truncate(shard_path(path, 0), os.path.getsize(shard_path(path, 0)) - 4)
    return path


def _manifest_a_directory(e: Env) -> Any:
    os.unlink(os.path.join(p := e.cache(), MANIFEST_NAME))
    os.mkdir(os.path.join(p, MANIFEST_NAME))
    return CacheDataset(p)


def _train_into_a_draft(e: Env) -> Any:
    from speccache.train.trainer import train

    (e.tmp / "draft").mkdir()
    _touch(e.tmp / "draft" / "config.json")
    return train(e.cache(), str(e.tmp / "draft"))


def _foreign_draft(e: Env) -> Any:
    from speccache.train.draft import draft_record

    (e.tmp / "draft").mkdir()
    _touch(e.tmp / "draft" / "config.json", b'{"architectures": ["LlamaForCausalLMEagle3"]}')
    return draft_record(str(e.tmp / "draft"))


def _train(**kwargs: Any) -> Callable[[Env], Any]:
    def run(e: Env) -> Any:
        from speccache.train.trainer import train

        return train(e.cache(), str(e.tmp / "draft"), **kwargs)

    return run


def _side_without_head(env: Env) -> str:
    """An EAGLE-3 side file without LM-head rows, as an import from NeMo's layout writes it."""
    path = str(env.tmp / "eagle3_side.safetensors")
    write_safetensors(path, {"embed_tokens": torch.zeros(4, 2), "selected_token_ids": torch.arange(4)})
    return path


def _engine_flags(**flags: Any) -> None:
    from speccache.demo import demo_data_path
    from speccache.precompute import PrecomputeConfig

    PrecomputeConfig(model=str(ROOT), data=demo_data_path("sharegpt"), out="", **flags).check()


def _follow_an_empty_directory(env: Env) -> None:
    from speccache.read.follow import Follow

    CacheDataset(str(env.tmp / "nothing-yet"), follow=Follow(timeout=0.05, poll=0.01))


def _reclaimed(env: Env) -> str:
    from speccache.format.reclaim import reclaim_shard

    path = env.cache()
    manifest = Manifest.read(path, "synthetic")
    reclaim_shard(path, 1, manifest.schema, manifest.shard_samples(1))
    return path


def _damaged_reclaim_record(env: Env) -> None:
    from speccache.format.names import reclaim_path
    from speccache.format.reclaim import read_reclaims

    path = _reclaimed(env)
    Path(reclaim_path(path, 1)).write_text("{")
    read_reclaims(path)


def _load_processor_of_text_target() -> None:
    from speccache.data import load_processor
    from speccache.demo import ensure_demo_target

    load_processor(ensure_demo_target(), max_pixels=1000)


def _recorded_processor_of_text_target() -> None:
    from speccache.data import recorded_processor
    from speccache.demo import ensure_demo_target

    recorded_processor(ensure_demo_target(), {"processor": "Qwen2_5_VLProcessor"}, "/cache")


def _regenerated_image_column(env: Env) -> None:
    """regenerate of a row whose image is a decoded column value (no JSON form to write back)."""
    from PIL import Image

    from speccache.precompute._regenerate_images import ImageTurns

    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
    row = {"messages": [user, {"role": "assistant", "content": "ok"}], "image": Image.new("RGB", (4, 4))}
    ImageTurns(row, "rows.jsonl:1", None, str(env.tmp))


def _images(env: Env, *parts: dict, **fields: Any) -> None:
    """An image row of a user message with ``parts`` (an assistant message after it), read for a vision target."""
    from PIL import Image

    from speccache.data._images import image_messages

    (env.tmp / "junk.png").write_bytes(b"not an image")
    Image.new("RGB", (4, 4)).save(env.tmp / "ok.png")
    row = {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "ok"}], **fields}
    image_messages(row, "rows.jsonl:1", str(env.tmp))


def _image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


T = Callable[[Env], Any]
TRIGGERS: dict[str, T] = {
    # image rows (a vision-language target's)
    "cannot be read": lambda e: _images(e, _image_url("missing.png")),
    "not a readable image": lambda e: _images(e, _image_url("junk.png")),
    "download the images and give their paths": lambda e: _images(e, _image_url("https://example.com/a.png")),
    "not valid base64": lambda e: _images(e, _image_url("data:image/png;base64,@@")),
    "only data:image/...;base64, URIs are read": lambda e: _images(e, _image_url("data:text/plain,hi")),
    "expected a path, URL or image": lambda e: _images(e, {"type": "image", "image": 5}),
    "is a video; only images are read": lambda e: _images(e, {"type": "video", "path": "v.mp4"}),
    "has both 'image' and 'images'": lambda e: _images(e, {"type": "image"}, image="a.png", images=["b.png"]),
    "but the row has only": lambda e: _images(e, {"type": "image"}, {"type": "image"}, image="ok.png"),
    "but places only": lambda e: _images(e, {"type": "text", "text": "hi"}, image="junk.png"),
    "images are read in user messages only": lambda e: _images(
        e, {"type": "text", "text": "hi"}, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [_image_url("ok.png")]},
        ]
    ),
    "the row has images, but the target has no image processor": lambda e: _row(
        {"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "ok"}], "image": "a.png"}
    ),
    "has no image processor (a text-only target)": lambda e: _load_processor_of_text_target(),
    "has no image processor, but": lambda e: _recorded_processor_of_text_target(),
    "held as decoded pixels or bytes": lambda e: _regenerated_image_column(e),
    # following a cache while it is written
    "producer has started on this directory": _follow_an_empty_directory,
    "were reclaimed (deleted or moved": lambda e: CacheDataset(_reclaimed(e)),
    "a damaged reclaim record": _damaged_reclaim_record,
    # the reference draft
    "already holds a draft": _train_into_a_draft,
    "must be at least 1": _train(ttt_steps=0),
    "must be a positive learning rate": _train(lr=0.0),
    "must be a positive weight ratio": _train(step_decay=0.0),
    "is unknown; choose one of generated, all": _train(supervise="prompts"),
    "unknown --draft-inputs": _train(draft_inputs="pixels"),
    "must be a share of the steps": _train(warmup=1.0),
    "is not a draft that speccache train wrote": _foreign_draft,
    "is unknown; choose cpu or cuda": _train(device="tpu"),
    # --engine
    "--engine": lambda e: _engine_flags(engine="sglang"),
    "--engine vllm parallelises the target": lambda e: _engine_flags(engine="vllm", shard_target="fsdp"),
    "--tensor-parallel-size is vLLM's": lambda e: _engine_flags(tensor_parallel_size=2),
    "--tensor-parallel-size must be >= 1": lambda e: _engine_flags(engine="vllm", tensor_parallel_size=0),
    "--threads must be >= 1": lambda e: _engine_flags(threads=0),
    "--threads is the hf engine's": lambda e: _engine_flags(engine="vllm", threads=1),
    "--enable-expert-parallel is vLLM's": lambda e: _engine_flags(enable_expert_parallel=True),
    "--enable-expert-parallel spreads a mixture of experts' experts": lambda e: _engine_flags(engine="vllm", enable_expert_parallel=True),
    "--gpu-memory-utilization is vLLM's": lambda e: _engine_flags(gpu_memory_utilization=0.5),
    "--gpu-memory-utilization must lie in (0, 1]": lambda e: _engine_flags(engine="vllm", gpu_memory_utilization=1.5),
    "GPUs (rank r takes GPUs": lambda e: rank_environment(0, 2, 8, {}, gpus=8, cpus=[0]),
    "CPUs (a core per vLLM worker)": lambda e: rank_environment(0, 2, 2, {}, gpus=0, cpus=[0, 1]),
    # --shard-target / --tp-size
    "--shard-target": lambda e: check_shard_target("zero"),
    "runs under torchrun (it shards the target over the ranks)": lambda e: check_shard_target("tp", None, 1),
    "--tp-size is for --shard-target tp": lambda e: check_shard_target("fsdp", 2),
    "--tp-size must be >= 2": lambda e: check_shard_target("tp", 1),
    "must divide the number of ranks": lambda e: data_parallel_groups(LocalComm(), 3),
    "must divide the model's": lambda e: check_tp_plan(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), 4),
    "has no tensor-parallel plan for the": lambda e: check_tp_plan(GPT2Config(), 2),
    "splits none of its decoder layers": lambda e: check_tp_plan(Qwen3VLConfig(), 2),
    "reads the weights from safetensors files": lambda e: Checkpoint(str(e.tmp)),
    # writing and resuming
    "already holds a cache": lambda e: write_synthetic_cache(e.cache(), **ARGS),
    "holds shards but no": lambda e: (os.unlink(os.path.join(p := e.cache(), MANIFEST_NAME)), write_synthetic_cache(p, resume=True, **ARGS)),
    "is a file; choose a directory": lambda e: write_synthetic_cache(str(_touch(e.tmp / "file")), **ARGS),
    "did not write": lambda e: (_touch(e.tmp / "thesis.tmp"), write_synthetic_cache(str(e.tmp), **ARGS)),
    "cannot write output directory": lambda e: write_synthetic_cache(str(e.tmp / ("x" * 300)), **ARGS),  # ENAMETOOLONG
    "was written with a different configuration": lambda e: write_synthetic_cache(e.cache(), resume=True, **{**ARGS, "seed": 1}),
    "is locked by": lambda e: (_write_lock(p := e.cache()), write_synthetic_cache(p, resume=True, **ARGS)),
    "No partial shard is left under that name": _unwritable_shard,
    "writing shard ": _unwritable_shard,
    "writing stopped after an error in the producer": lambda e: _failing_overlapped_writer(),
    "cannot be stored; use one of": lambda e: KeySpec("x", torch.complex64),
    "encoding 'fp8' stores only": lambda e: KeySpec("x", torch.int32, encoding="fp8"),
    "encoding 'zbf16' stores only": lambda e: KeySpec("x", torch.float32, encoding="zbf16"),
    "cannot store non-finite values": lambda e: get_encoding("fp8").encode(torch.tensor([[float("nan")]]), torch.tensor([0, 1])),
    "unknown encoding": lambda e: get_encoding("lz4"),
    # contents: the non-finite guard and audit
    "is not finite (NaN or Inf) at token": lambda e: guard_nonfinite(
        {"__lengths__": torch.tensor([1]), "x": torch.tensor([[float("nan")]])}, "fail", lambda k, c: "layer"
    ),
    "--nonfinite": lambda e: check_nonfinite_mode("drop"),
    "--samples must be >= 1": lambda e: audit_cache(e.cache(), samples=0),
    "the audit does not know how to recompute": lambda e: audit_cache(e.cache()),
    # the real demo target
    "the real demo target needs the": lambda e: _without_real_target_wheel(),
    "does not hold a speccache build of SmolLM2-135M-Instruct": lambda e: build_real_model_dir(str(_touch(e.tmp / "x").parent)),
    # views
    "must look like NAME OP NUMBER": lambda e: parse_where("a => 1"),
    "must give one weight per cache": lambda e: make_merge_view([e.cache()], str(e.tmp / "v"), [1, 2]),
    "is not a size; give bytes": lambda e: parse_bytes("12Q", "--max-cache-bytes"),
    "must be at least one byte": lambda e: parse_bytes("0.1", "--max-cache-bytes"),
    "torch's names, as bfloat16, too": lambda e: dtype_name("int8", "--dtype"),
    "must be sorted or ordered": lambda e: _engine_flags(batching="shuffled"),
    "with --batching sorted (the default)": lambda e: _engine_flags(batching="ordered", max_batch_tokens=64),
    "shard_size must be an integer >= 1": lambda e: check_shard_size(0),
    "replay must be an integer >= 1": lambda e: Follow(replay=0),
    "timeout and poll must be positive seconds": lambda e: Follow(timeout=0),
    "reclaim_to moves reclaimed shards: it needs reclaim=True": lambda e: Follow(reclaim_to=str(e.tmp)),
    "pass both rank and world_size, or neither": lambda e: Follow(rank=0),
    "is outside [0, world_size=": lambda e: sequence_parallel_rows(4, 2, 2),
    "(--weights of speccache merge) must be finite and > 0": lambda e: make_merge_view([e.cache()], str(e.tmp / "v"), [float("inf")]),
    "one finite weight >= 0 per sample": lambda e: LocalityShuffleSampler(2, 1, weights=[1.0]),
    "not a readable view": lambda e: View.read(str(e.tmp)),
    "selects samples of": lambda e: open_source(make_merge_view([e.cache()], str(e.tmp / "v")).path, "eagle3"),
    "hold different side files": _view_of_two_side_files,
    "a view needs sealed caches":
        lambda e: make_merge_view([e.edit_manifest(e.cache(), lambda m: m.update(complete=False))], str(e.tmp / "v")),
    # vision-language targets
    "has no path for image rows": lambda e: refuse_vision(str(e.tmp), {"vision": {}}, "specforge", "none"),
    "is a text-only target, whose cache has no vision inputs": lambda e: stores_vision_inputs(
        SimpleNamespace(no_vision_inputs=True, model=str(e.tmp)), SimpleNamespace(), {}
    ),
    "holds no image_embeds (and the image token id) to merge": lambda e: check_draft_inputs(
        "merged", open_source(e.edit_manifest(e.cache(), lambda m: m["config"].update(vision={})))
    ),
    # layer methods
    "must be distinct increasing layer ids in": lambda e: LayerSelection((3, 1), 8),
    "stores nothing: give --layers": lambda e: LayerSelection((), 8),
    "--method layers needs --layers": lambda e: preset_selection("layers", 8, None, False, False),
    "stores the last hidden state only": lambda e: preset_selection("mtp", 8, [1], False, False),
    "is not a layer preset": lambda e: preset_selection("medusa", 8, None, False, False),
    # reading
    "cache manifest not found at": lambda e: CacheDataset(str(e.tmp)),
    "the cache records no side file": lambda e: open_source(e.cache()).side_file("eagle3_side.safetensors"),
    "the side file lacks": lambda e: read_side_file(_side_without_head(e), ("lm_head",)),
    "cannot be read (": _manifest_a_directory,
    "'cache_name' must be a string": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(cache_name=3))),
    "the manifest's shard table records": lambda e: CacheDataset(
        e.edit_manifest(e.cache(), lambda m: m["shards"][2].update(bytes=m["shards"][2]["bytes"] + 8))
    )[8],
    "changed since this reader opened the cache": _rewritten_under_a_reader,
    "the cache was appended to": _appended_under_a_reader,
    "is not one JSON object per line": lambda e: plan_append(
        str(_touch(Path(e.cache(), "skipped_rows.jsonl"), b"{\n").parent), {"data_hash": "new"}, 1, 4
    ),
    "an append to it is still running or was interrupted": lambda e: CacheDataset(
        e.edit_manifest(e.cache(), lambda m: m.update(complete=False, config={**m["config"], "appended": [{}]}))
    ),
    "is not complete: it is still being written or its writer was interrupted":
        lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(complete=False))),
    "is not valid JSON": lambda e: (Path(p := e.cache(), MANIFEST_NAME).write_text("{"), CacheDataset(p)),
    "must hold a JSON object": lambda e: (Path(p := e.cache(), MANIFEST_NAME).write_text("[]"), CacheDataset(p)),
    "has format_version=": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(format_version=2))),
    "Point the reader at a": lambda e: CacheDataset(e.cache(), cache_name="eagle3"),
    "needs integer 'shard_size' and 'num_samples'": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(shard_size="x"))),
    "shard_size must be >= 1 and num_samples >= 0": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(shard_size=0))),
    "samples in shards of": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(shard_size=1, num_samples=10**7))),
    "'shards' must be a list": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(shards=3))),
    "the shard table lists index":
        lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m["shards"].append(m["shards"][0]))),
    "'keys' must be a non-empty object": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.update(keys={}))),
    "malformed key schema entry": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m["keys"]["hidden"].pop("shape"))),
    "unknown dtype": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m["keys"]["hidden"].update(dtype="int128"))),
    "are not in the cache; it holds": lambda e: CacheDataset(e.cache(), keys=["nope"]),
    "with no speccache key schema": lambda e: CacheDataset(e.edit_manifest(e.cache(), lambda m: m.pop("keys"))),
    "but found shard indices": lambda e: (os.unlink(shard_path(p := e.cache(), 1)), CacheDataset(p)),
    "has no tensor": lambda e: CachedTensorDataset(e.seed_cache(2), "x", 1, ("b",))[0],
    "samples, expected": lambda e: CachedTensorDataset(e.seed_cache(3), "x", 1, ("a",))[0],
    "not a readable safetensors file": lambda e: CachedTensorDataset(_torn_seed_shard(e.seed_cache(2)), "x", 1, ("a",))[0],
    "does not match its checksum": lambda e: (_flip_data_byte(p := e.cache()), _read(p)),
    "shard metadata has no readable tensor checksums": _no_checksums,
    "too short for a safetensors header": lambda e: ShardFile(str(_touch(e.tmp / "short", b"1234"))),
    "exceeds the file size": lambda e: ShardFile(e.file(b"{}", length=999)),
    "safetensors header is not valid JSON": lambda e: ShardFile(e.file(b"{x      ")),
    "safetensors header is not a JSON object": lambda e: ShardFile(e.file(b"[]      ")),
    "__metadata__ must map strings to strings": lambda e: ShardFile(e.file(b'{"__metadata__":{"a":1}}')),
    "malformed header entry for tensor": lambda e: ShardFile(e.file(b'{"t":{"dtype":"F32"}}')),
    "which no tensor can have": lambda e: ShardFile(e.file(b'{"t":{"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]}}')),
    "but spans bytes": lambda e: ShardFile(e.file(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"1234")),
    "tensor data is not contiguous": lambda e: ShardFile(e.file(b'{"t":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', b"1234")),
    "header covers": lambda e: ShardFile(e.file(b'{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}', b"12345678")),
    "the shard is not from this cache or from another speccache version":
        lambda e: (e.edit_header(p := e.cache(), 1, lambda h: h["__metadata__"].update(speccache_format="9")), _read(p)),
    "records shard index": lambda e: (shutil.copy(shard_path(p := e.cache(), 0), shard_path(p, 1)), _read(p)),
    "the schema needs": lambda e: _read(e.edit_manifest(e.cache(), lambda m: m["keys"].update(mask=m["keys"].pop("loss_mask")))),
    "the manifest expects": lambda e: _read(e.edit_manifest(e.cache(), lambda m: m.update(num_samples=11))),
    "is not a count (damaged header)": lambda e: (e.edit_header(p := e.cache(), 1, lambda h: h["__metadata__"].update(num_samples="x")), _read(p)),
    "must be int64": lambda e: (e.edit_header(p := e.cache(), 1, lambda h: h["__offsets__"].update(dtype="F64")), _read(p)),
    "are not non-decreasing from 0": lambda e: _read(_offsets_decreasing(e), verify=False),
    "the manifest says": lambda e: _read(e.edit_manifest(e.cache(), lambda m: m["keys"]["hidden"].update(shape=[9]))),
    ", but key": lambda e: _read(e.edit_manifest(e.cache("zbf16"), lambda m: m["keys"]["hidden"].update(shape=[9]))),
    "cannot be decoded": lambda e: _read(_undecodable(e), verify=False),
    "shard metadata num_rows=": lambda e: (e.edit_header(p := e.cache(), 1, lambda h: h["__metadata__"].update(num_rows="x")), inspect_cache(p)),
    "does not record": lambda e: ensure_supervision_options_match({}, {"opt": True}, "EAGLE-3", "/c", "precompute"),
    "was built with": lambda e: ensure_supervision_options_match({"opt": False}, {"opt": True}, "EAGLE-3", "/c", "precompute"),
    "expects existing shards to be a contiguous prefix": lambda e: resume_start_sample({0, 2}, 4),
    "write_shard is missing required": lambda e: write_tensor_shard(str(e.tmp / "w"), 0, {}, ("a",), "x"),
    "out of range for a cache of": lambda e: CacheDataset(e.cache())[10**6],
    # input data
    "data file not found": lambda e: _load(e.tmp / "missing.jsonl"),
    "data path is not a file": lambda e: (os.mkfifo(e.tmp / "fifo.jsonl"), _load(e.tmp / "fifo.jsonl")),
    "data path is a directory but not a saved Hugging Face dataset": lambda e: _load(e.tmp),
    "cannot locate the assistant turns": lambda e: _row_with_template("{{ messages[-1].content * 2 }}"),
    "the chat template rejected the conversation": lambda e: _row_with_template("{{ raise_exception('no') }}"),
    "the chat template drops": lambda e: _dropping_row(e.tmp),
    "--on-dropped": lambda e: __import__("speccache.data").data.check_dropped_mode("loud"),
    "cannot read the template": lambda e: __import__("speccache.data").data.load_template_file(str(e.tmp)),
    "unsupported data file extension": lambda e: _data_file(e, "rows.csv", b"a,b"),
    "not valid UTF-8": lambda e: _data_file(e, "rows.json", b'["\xff"]'),
    "invalid JSON": lambda e: _data_file(e, "rows.jsonl", b"{"),
    "a .json data file must hold a JSON list": lambda e: _data_file(e, "rows.json", b"{}"),
    "expected a JSON object per row": lambda e: _data_file(e, "rows.jsonl", b"[1]"),
    "the zstd file is truncated": lambda e: _data_file(e, "rows.jsonl.zst", zstandard.ZstdCompressor().compress(b"\n")[:-1]),
    "the gzip file is truncated": lambda e: _data_file(e, "rows.jsonl.gz", gzip.compress(b"\n")[:-4]),
    "it is damaged or in another format": lambda e: _data_file(e, "rows.jsonl.gz", b"{}\n"),
    "not a readable Parquet file": lambda e: _data_file(e, "rows.parquet", b"PAR1"),
    "not a valid dataset_dict.json": lambda e: (_touch(e.tmp / "dataset_dict.json", b"{"), _load(e.tmp)),
    "has no splits": lambda e: _load(_touch(e.tmp / "rows.jsonl"), split="train"),
    "lies inside --data": lambda e: check_out_outside_data(str(e.tmp / "cache"), str(e.tmp)),
    "not a valid Jinja template": lambda e: chat_format(_tokenizer(), str(_touch(e.tmp / "t.jinja", b"{{ x }"))),
    "a row needs exactly one of": lambda e: _row({"text": "hi"}),
    "must be a non-empty list of messages": lambda e: _row({"messages": []}),
    "must be an object with": lambda e: _row({"messages": ["hi"]}),
    "must be one of": lambda e: _row({"messages": [{"role": "robot", "content": "hi"}]}),
    "must be a string, got": lambda e: _row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": 1}]}),
    "must be a string or a list of text parts": lambda e: _row({"messages": [{"role": "user", "content": 1}]}),
    "part; only text parts": lambda e: _row({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
    "is a text part without a string 'text'": lambda e: _row({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    "must be a tool call": lambda e: _row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{}]}]}),
    "the arguments string is not JSON": lambda e: _row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}),
    "the arguments must be an object": lambda e: _row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}]}),
    "a function_call must be a JSON object": lambda e: _row({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{"}]}),
    "is a string but not JSON": lambda e: _row({"messages": [{"role": "user", "content": "q"}], "tools": "{"}),
    "must be a list of tool schema objects": lambda e: _row({"messages": [{"role": "user", "content": "q"}], "tools": {}}),
    "mistral-common rejected the conversation": lambda e: _mistral_common_row({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r", "tool_call_id": "x"}, {"role": "assistant", "content": "a"}]}),
    "cannot read the file": lambda e: __import__("speccache.data").data.load_tools_file(str(e.tmp / "missing.json")),
    "starts with an assistant message": lambda e: _row({"messages": [{"role": "assistant", "content": "hi"}]}),
    "must be a non-empty list of integer ids": lambda e: _row({"input_ids": [], "loss_mask": []}),
    "a pre-tokenized row needs 'loss_mask'": lambda e: _row({"input_ids": [1, 2]}),
    "entries but 'input_ids' has": lambda e: _row({"input_ids": [1, 2], "loss_mask": [1]}),
    "chat rows need a tokenizer with a chat template": lambda e: _row_without_template(),
    # regenerate
    "already holds a regenerate run; pass --resume": lambda e: (_touch(e.tmp / REGENERATE_NAME), regenerate(RegenerateConfig(str(e.tmp), str(e.tmp), str(e.tmp)))),
    "is a file; choose a new directory to regenerate into": lambda e: regenerate(RegenerateConfig("m", "d", str(_touch(e.tmp / "f")))),
    "not a readable regenerate record": lambda e: read_progress(str(_touch(e.tmp / REGENERATE_NAME, b"{").parent)),
    "not a speccache regenerate record": lambda e: read_progress(str(_touch(e.tmp / REGENERATE_NAME, b"{}").parent)),
    "an unfinished speccache regenerate run": lambda e: _load(_touch(e.tmp / REGENERATE_NAME, json.dumps({"format": REGENERATE_FORMAT, "parts": [], "complete": False}).encode()).parent),
    "is the hf engine's: vLLM runs the target on its own platform": lambda e: RegenerateConfig("m", "d", str(e.tmp), engine="vllm", device="cpu").check(),
    "a part of the regenerate record, cannot be read": lambda e: _load(_touch(e.tmp / REGENERATE_NAME, json.dumps({"format": REGENERATE_FORMAT, "parts": [{"name": "part-00000.jsonl"}], "complete": True}).encode()).parent),
    # verify findings
    "missing shard": lambda e: (os.unlink(shard_path(p := e.cache(), 1)), verify_cache(p))[1],
    "unexpected shard: not part of this cache": lambda e: (shutil.copy(shard_path(p := e.cache(), 0), shard_path(p, 9)), verify_cache(p))[1],
    "is not complete (still being written or interrupted)": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m.update(complete=False))),
    "shard table lists": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m["shards"].pop())),
    "but the manifest's shard table says": lambda e: verify_cache(e.edit_manifest(e.cache(), _shard_table_edit)),
    "num_tokens says": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m.update(num_tokens=m["num_tokens"] + 1))),
    "malformed manifest": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m.update(num_samples="x"))),
    "a seed-layout cache, not a native speccache cache": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m.pop("keys"))),
    "Regenerate the cache with this speccache": lambda e: verify_cache(e.edit_manifest(e.cache(), lambda m: m.update(format_version=2))),
    "missing side file": lambda e: _side_file(e, None),
    "side file does not match its checksum": lambda e: _side_file(e, b"abc"),
    "cannot read side file": lambda e: _side_file(e, None, mkdir=True),
}  # fmt: skip


def _touch(path: Path, content: bytes = b"x") -> Path:
    path.write_bytes(content)
    return path


def _load(path: Path, split: str | None = None) -> None:
    from speccache.data import load_samples

    load_samples(str(path), _tokenizer(), 64, split=split)


def _dropping_row(tmp: Path) -> None:
    from speccache.data import load_samples

    path = tmp / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "thinking": "hm"}]}
    path.write_text(json.dumps(row) + "\n")
    load_samples(str(path), _tokenizer(), 64, on_dropped="fail")


def _mistral_common_row(row: Any) -> None:
    import mistral_common
    from transformers.tokenization_mistral_common import MistralCommonBackend

    from speccache.data import tokenize_row

    model = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    tokenize_row(row, MistralCommonBackend(str(model)), 64, where="rows.jsonl:1")


def _row_with_template(template: str) -> None:
    from speccache.data import tokenize_row

    tokenizer = _tokenizer()
    tokenizer.chat_template = template
    tokenize_row(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        tokenizer,
        64,
        where="rows.jsonl:1",
    )


def _row_without_template() -> None:
    from speccache.data import tokenize_row

    tokenizer = _tokenizer()
    tokenizer.chat_template = None
    tokenize_row(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        tokenizer,
        64,
        where="r:1",
    )


def test_triggers_name_documented_rows():
    assert set(TRIGGERS) <= set(ROWS), sorted(set(TRIGGERS) - set(ROWS))
    assert len(TRIGGERS) >= 0.6 * len(ROWS), f"only {len(TRIGGERS)} of {len(ROWS)} rows are triggered"


@pytest.mark.parametrize("fragment", sorted(TRIGGERS))
def test_triggered_message_contains_the_documented_fragment(fragment, pristine, tmp_path):
    kind = ROWS[fragment]
    env = Env(tmp_path, pristine)
    try:
        result = TRIGGERS[fragment](env)
    except Exception as exc:
        assert kind != "verify", f"expected a verify finding, got {type(exc).__name__}: {exc}"
        names = [c.__name__ for c in type(exc).__mro__]
        assert kind in names, f"expected {kind}, got {type(exc).__name__}: {exc}"
        assert fragment in str(exc), f"{fragment!r} is not in the message: {exc}"
        return
    assert kind == "verify", f"expected {kind}, nothing was raised"
    assert isinstance(result, VerifyReport)
    reasons = [p.reason for p in result.problems]
    assert any(fragment in r for r in reasons), f"{fragment!r} is not in any finding: {reasons}"

"""SpecForge's and speculators' offline layouts, written from a speccache cache and read back into one.

Both peers store one file per sample and read them with their own trainers:

* ``specforge`` (SpecForge 0.2.0, ``specforge/runtime/data_plane/offline_reader.py`` and
  ``feature_store.load_feature_file``): a tree of ``*.ckpt`` files read in sorted path order, each a
  ``torch.save`` dict of one sample: ``input_ids`` int64 ``[S]``, ``loss_mask`` int64 ``[S]``,
  ``aux_hidden_state`` ``[1, S, 3H]`` (the aux decoder layers before the final norm) and ``hidden_state``
  ``[1, S, H]`` (the final-norm output, the LM-head input); ``vocab_mapping.pt`` (``d2t``/``t2d``) beside them
  when the draft vocabulary is smaller than the target's. Its DFlash and DSpark trainers
  (``specforge/algorithms/common/dflash_family_data.py``) read the same files with ``hidden_states``
  ``[1, S, K*H]`` (the method's layers concatenated) and, for DSpark, ``target_last_hidden_states`` ``[1, S, H]``:
  ``specforge-dflash`` and ``specforge-dspark``, from a layers cache.
* ``speculators`` (speculators 0.9.0, ``speculators/train/data.py`` ``ArrowDataset``): an Arrow
  ``save_to_disk`` directory (``input_ids``, ``loss_mask``, ``seq_len``; torch format), ``token_freq.pt`` (the
  supervised tokens' counts) and ``hidden_states/hs_{row}.safetensors`` holding ``hidden_states``
  ``[T, K + 1, H]`` (the K aux layers, then the last decoder layer before the final norm) and ``token_ids``
  int64 ``[T]``.

Export streams one speccache shard at a time, prints the size first, writes every file atomically and
refuses a non-empty output directory. docs/interop.md has the tables and the measured sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError

from speccache.compat.export import check_export_dir
from speccache.devices import DTYPES
from speccache.errors import CacheFormatError, UsageError
from speccache.format import Manifest, atomic_write, write_safetensors
from speccache.format.durable import ensure_writable_dir, writes_to
from speccache.methods import eagle3, layers
from speccache.methods.eagle3_producer import eagle3_schema, vocab_mapping
from speccache.methods.layers_producer import LayerSelection, layers_schema, side_tensors
from speccache.read import CacheDataset
from speccache.read.source import CacheSource, open_source
from speccache.units import human_bytes

__all__ = [
    "IMPORTS",
    "LAYOUTS",
    "SKIPPED_FILES",
    "BadFile",
    "export_peer",
    "import_peer",
    "specforge_path",
    "speculators_hs_path",
]

SPECFORGE = "specforge"
SPECFORGE_DFLASH = "specforge-dflash"
SPECFORGE_DSPARK = "specforge-dspark"
SPECULATORS = "speculators"
LAYOUTS = (SPECFORGE, SPECFORGE_DFLASH, SPECFORGE_DSPARK, SPECULATORS)
IMPORTS = (SPECFORGE, SPECULATORS)
FILES_PER_DIR = 5000
"""SpecForge's hidden-state preparation groups its files in folders of this many rows."""
VOCAB_MAPPING = "vocab_mapping.pt"
TOKEN_FREQ = "token_freq.pt"
HS_DIR = "hidden_states"


def specforge_path(out: str, index: int) -> str:
    """Sample ``index``'s file: zero-padded names, so SpecForge's sorted path order is the cache's sample order."""
    first = index - index % FILES_PER_DIR
    return os.path.join(out, f"rows_{first:08d}-{first + FILES_PER_DIR:08d}", f"data_{index:08d}.ckpt")


def speculators_hs_path(out: str, index: int) -> str:
    """Row ``index``'s hidden-state file, named as speculators' ``FileTransfer`` looks it up."""
    return os.path.join(out, HS_DIR, f"hs_{index}.safetensors")


@dataclass
class _Export:
    """What an export reads (``dataset``), turns each sample into (``sample_files``: path -> tensors, written by
    ``write``) and writes once at the end (``finish``)."""

    dataset: CacheDataset
    sample_files: Callable[[str, int, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]
    write: Callable[[str, dict[str, torch.Tensor]], Any]
    finish: Callable[[str, list[torch.Tensor], list[torch.Tensor]], None]  # out, every sample's ids and mask


def _torch_save(path: str, obj: Any) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes a tensor's whole storage: a sample that views a larger buffer would carry it along.
    return t.contiguous().clone()


def _specforge(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> _Export:
    vocab: dict[str, torch.Tensor] | None = None
    if source.cache_name == eagle3.CACHE_NAME:
        supervision = source.config.get("supervision", "hidden")
        if supervision != "hidden":
            raise CacheFormatError(
                f"{cache_dir}: --to specforge stores the final-norm output (SpecForge's hidden_state); this cache "
                f"stores --supervision {supervision} instead. Export a cache written with --supervision hidden"
            )
        ds: CacheDataset = eagle3.Eagle3CacheDataset(
            cache_dir, keys=["input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"], verify=verify
        )
        if int(source.config["draft_vocab_size"]) < int(source.config["vocab_size"]):
            vocab = eagle3.read_side_file(source.side_file(eagle3.SIDE_FILE), ("d2t", "t2d"))
    elif source.cache_name == layers.CACHE_NAME:
        ds = layers.eagle3_dataset(cache_dir, layer_ids, verify=verify)
    else:
        raise CacheFormatError(
            f"{cache_dir}: --to specforge reads an eagle3 or layers cache, not a {source.cache_name!r} one"
        )

    def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        sample = {
            "input_ids": s["input_ids"].to(torch.int64),
            "loss_mask": s["loss_mask"].to(torch.int64),
            "aux_hidden_state": _own(s["aux_hidden_states"])[None],
            "hidden_state": _own(s["last_hidden_state"])[None],
        }
        return {specforge_path(out, index): sample}

    def finish(out: str, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        if vocab is not None:
            _torch_save(os.path.join(out, VOCAB_MAPPING), vocab)

    return _Export(ds, sample_files, _torch_save, finish)


def _specforge_dflash_family(dspark: bool) -> Callable[[str, CacheSource, Sequence[int] | None, bool], _Export]:
    def plan(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> _Export:
        to = SPECFORGE_DSPARK if dspark else SPECFORGE_DFLASH
        if source.cache_name != layers.CACHE_NAME:
            raise CacheFormatError(
                f"{cache_dir}: --to {to} reads a layers cache (--method dspark, dflash or layers), "
                f"not a {source.cache_name!r} cache"
            )
        ds = (layers.dspark_dataset if dspark else layers.dflash_dataset)(cache_dir, layer_ids, verify=verify)

        def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
            sample = {
                "input_ids": s["input_ids"].to(torch.int64),
                "loss_mask": s["loss_mask"].to(torch.int64),
                "hidden_states": _own(s["target_hidden_states"])[None],
            }
            if dspark:
                sample["target_last_hidden_states"] = _own(s["target_last_hidden_states"])[None]
            return {specforge_path(out, index): sample}

        return _Export(ds, sample_files, _torch_save, lambda out, ids, masks: None)

    return plan


def _speculators(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> _Export:
    if source.cache_name != layers.CACHE_NAME:
        raise CacheFormatError(
            f"{cache_dir}: --to speculators needs the last decoder layer's output before the final norm, which only "
            f"a layers cache stores; this is a {source.cache_name!r} cache. Write one with --method layers "
            "--layers A,B,C --last-prenorm"
        )
    num_layers = int(source.config["num_layers"])
    aux = list(layer_ids) if layer_ids is not None else eagle3.default_aux_layers(num_layers)
    ds = layers.LayerFeatureDataset(cache_dir, {"hidden_states": [*aux, num_layers - 1]}, prenorm=True, verify=verify)
    hidden = int(source.config["hidden_size"])

    def sample_files(out: str, index: int, s: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        ids = s["input_ids"].to(torch.int64)
        states = s["hidden_states"].reshape(ids.numel(), len(aux) + 1, hidden)
        return {speculators_hs_path(out, index): {"hidden_states": states.contiguous(), "token_ids": ids}}

    def finish(out: str, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        import pyarrow as pa
        from datasets import Dataset

        supervised = torch.cat([i[m.bool()] for i, m in zip(ids, masks)]) if ids else torch.empty(0, dtype=torch.long)
        tokens, counts = supervised.unique(return_counts=True)
        _torch_save(os.path.join(out, TOKEN_FREQ), dict(zip(tokens.tolist(), counts.tolist())))
        lengths = torch.tensor([0, *(i.numel() for i in ids)], dtype=torch.int64)
        offsets = pa.array(lengths.cumsum(0).numpy(), pa.int64())

        def column(parts: list[torch.Tensor]) -> pa.Array:
            values = torch.cat(parts).to(torch.int64) if parts else torch.empty(0, dtype=torch.int64)
            return pa.LargeListArray.from_arrays(offsets, pa.array(values.numpy()))

        table = pa.table(
            {"input_ids": column(ids), "loss_mask": column(masks), "seq_len": pa.array(lengths[1:].numpy())}
        )
        data = Dataset(table)
        data.set_format(type="torch")  # as speculators' prepare_data saves it: its trainer compares torch tensors
        data.save_to_disk(out)

    return _Export(ds, sample_files, write_safetensors, finish)


def _batches(ds: CacheDataset) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    for start in range(0, len(ds), ds.shard_size):
        yield start, [dict(s) for s in ds.__getitems__(list(range(start, min(start + ds.shard_size, len(ds)))))]


def export_peer(
    cache_dir: str,
    out: str,
    to: str,
    layer_ids: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
    verify: bool = True,
) -> int:
    """Export ``cache_dir`` to ``out`` in SpecForge's or speculators' offline layout.

    Args:
        cache_dir: a sealed speccache cache (EAGLE-3 with ``hidden`` supervision, or layers).
        out: the output directory (absent or empty).
        to: ``specforge`` (EAGLE-3), ``specforge-dflash``, ``specforge-dspark`` or ``speculators``.
        layer_ids: aux layer ids to read from a layers cache (default: EAGLE-3's for the target's depth).
        log: where the size line goes, before anything is written.
        verify: check the tensors read from each shard against their checksums (``False``: ``--no-verify``).

    Returns:
        The number of samples written.

    Raises:
        CacheCorruptError: (``verify``) a tensor read differs from its checksum; nothing of its shard is written.
        CacheExistsError: ``out`` is not empty.
        CacheFormatError: the cache cannot give what the layout needs (the message says what is missing).
        OutputError: the operating system refuses ``out`` or a write in it.
    """
    if to not in LAYOUTS:
        raise UsageError(f"--to {to!r} is unknown; choose one of {', '.join(LAYOUTS)}")
    check_export_dir(out)
    source = open_source(cache_dir)  # a cache or a view: a view exports the samples it selects
    plans = {
        SPECFORGE: _specforge,
        SPECFORGE_DFLASH: _specforge_dflash_family(dspark=False),
        SPECFORGE_DSPARK: _specforge_dflash_family(dspark=True),
        SPECULATORS: _speculators,
    }
    export = plans[to](cache_dir, source, layer_ids, verify)
    ds = export.dataset
    tokens = sum(ds.sample_lengths())
    if len(ds):
        # Every stored feature is per token, so the first sample's bytes per token give the total.
        first = export.sample_files(out, 0, dict(ds[0]))
        nbytes = sum(t.numel() * t.element_size() for f in first.values() for t in f.values())
        total = nbytes * tokens // max(1, ds[0]["input_ids"].numel())
    else:
        total = 0
    log(
        f"speccache export: {len(ds)} samples, {tokens} tokens -> {out} ({to}, one file per sample): "
        f"about {human_bytes(total)}"
    )
    ensure_writable_dir(out)
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    # Only the writes are wrapped: a failed read of the source keeps its own message. Every file is written
    # atomically, so a full disk leaves nothing half-written under a final name.
    for start, samples in _batches(ds):
        for offset, sample in enumerate(samples):
            for path, tensors in export.sample_files(out, start + offset, sample).items():
                with writes_to(out, SafetensorError):
                    export.write(path, tensors)
            ids.append(sample["input_ids"].to(torch.int64))
            masks.append(sample["loss_mask"].to(torch.int64))
    with writes_to(out, SafetensorError):
        export.finish(out, ids, masks)
    return len(ds)


# ---------------------------------------------------------------------------
# import: every file read and checked, the good ones converted, the rest reported

SKIPPED_FILES = "skipped_files.jsonl"
"""The import's report: one ``{"file", "reason", "detail"}`` object per file left out."""


class BadFile(Exception):
    """A peer file that cannot be imported; ``reason`` is its skip reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class _Entry:
    """A checked sample of the source: where it is and its length."""

    name: str  # relative to the source directory
    source_row: int
    length: int


@dataclass
class _Import:
    """What an import writes: its schema and config, the checked entries, the skipped files, and the rows."""

    cache_name: str
    schema: Any
    config: dict[str, Any]
    entries: list[_Entry]
    skipped: list[dict[str, str]]
    side: Callable[[], dict[str, torch.Tensor]]
    side_name: str
    rows: Callable[[_Entry], dict[str, torch.Tensor]]  # one entry's ragged rows, re-read and re-checked


def _load_specforge(path: str) -> dict[str, Any]:
    """One SpecForge file, read as tensors and plain containers only (never unpickling code)."""
    import gzip
    import io
    import pickle
    import zlib

    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), weights_only=True)
        return torch.load(path, weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise BadFile(
            "unsafe",
            f"needs more than tensors and plain containers to load ({str(exc).splitlines()[0]}); refused rather "
            "than loaded with weights_only=False, which could run code from the file",
        ) from None
    except (OSError, EOFError, RuntimeError, zlib.error, ValueError) as exc:
        raise BadFile("unreadable", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def _check(ok: bool, reason: str, detail: str) -> None:
    if not ok:
        raise BadFile(reason, detail)


def _specforge_sample(raw: Any, hidden: int, vocab: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    _check(isinstance(raw, dict), "bad_keys", f"holds a {type(raw).__name__}, not a dict of tensors")
    missing = [k for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state") if k not in raw]
    _check(not missing, "bad_keys", f"lacks {missing}")
    ids, mask, aux, last = (raw[k] for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"))
    _check(all(isinstance(t, torch.Tensor) for t in (ids, mask, aux, last)), "bad_keys", "a feature is not a tensor")
    ids, mask = ids.reshape(-1), mask.reshape(-1)
    n = ids.numel()
    _check(n > 0 and not ids.is_floating_point(), "bad_shape", f"input_ids {tuple(ids.shape)} {ids.dtype}")
    _check(mask.numel() == n and bool(((mask == 0) | (mask == 1)).all()), "bad_shape", "loss_mask is not 0/1 of [S]")
    _check(bool(((ids >= 0) & (ids < vocab)).all()), "bad_tokens", f"a token id is outside the vocabulary of {vocab}")
    want = {"aux_hidden_state": (1, n, 3 * hidden), "hidden_state": (1, n, hidden)}
    for key, t in (("aux_hidden_state", aux), ("hidden_state", last)):
        _check(tuple(t.shape) == want[key], "bad_shape", f"{key} is {tuple(t.shape)}, expected {want[key]}")
        _check(t.dtype == (dtype or t.dtype), "bad_dtype", f"{key} is {t.dtype}; the first file's features are {dtype}")
    return {"input_ids": ids, "loss_mask": mask, "aux_hidden_states": aux[0], "last_hidden_state": last[0]}


@dataclass
class _Target:
    """What an import takes from the target model: its shape and the weights of its side file."""

    config: Any
    num_layers: int
    hidden: int
    vocab: int
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


def _target(model: str) -> _Target:
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    except OSError as exc:
        raise FileNotFoundError(f"--model {model}: no model directory or loadable model there ({exc})") from None
    text = loaded.config.get_text_config()
    return _Target(
        loaded.config,
        int(text.num_hidden_layers),
        int(text.hidden_size),
        int(text.vocab_size),
        loaded.get_input_embeddings().weight.detach(),
        loaded.get_output_embeddings().weight.detach(),
    )


def _source_digest(src: str) -> str:
    """Names, sizes and times of every file under ``src``: a resumed import must read the same source."""
    import xxhash

    h = xxhash.xxh3_128()
    for root, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            st = os.stat(os.path.join(root, name))
            h.update(f"{os.path.relpath(os.path.join(root, name), src)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _scan(names: Sequence[str], check: Callable[[int, str], int]) -> tuple[list[_Entry], list[dict[str, str]]]:
    """Check every source file (``check(row, name)`` gives its length or raises :class:`BadFile`)."""
    entries: list[_Entry] = []
    skipped: list[dict[str, str]] = []
    for row, name in enumerate(names):
        try:
            entries.append(_Entry(name, row, check(row, name)))
        except BadFile as bad:
            skipped.append({"file": name, "reason": bad.reason, "detail": str(bad)})
    return entries, skipped


def _specforge_import(src: str, target: _Target, layer_ids: Sequence[int] | None, encodings: dict[str, str]) -> _Import:
    names = [os.path.relpath(p, src) for p in _specforge_files(src)]
    if not names:
        raise CacheFormatError(f"{src}: no SpecForge feature files (*.ckpt, *.ckpt.gz) under it")
    dtype: list[torch.dtype] = []

    def load(name: str) -> dict[str, torch.Tensor]:
        sample = _specforge_sample(
            _load_specforge(os.path.join(src, name)), target.hidden, target.vocab, dtype[0] if dtype else None
        )
        dtype[:1] = [sample["aux_hidden_states"].dtype]
        return sample

    entries, skipped = _scan(names, lambda _row, name: load(name)["input_ids"].numel())
    mapping = os.path.join(src, VOCAB_MAPPING)
    if os.path.exists(mapping):
        t2d = _load_specforge(mapping)["t2d"].bool()
        selected = t2d.nonzero()[:, 0]
    else:
        selected = torch.arange(target.vocab)
    draft = int(selected.numel())
    aux = list(layer_ids) if layer_ids is not None else eagle3.default_aux_layers(target.num_layers)
    features = dtype[0] if dtype else torch.bfloat16
    supervision = eagle3.Supervision("hidden")
    schema = eagle3_schema(target.hidden, features, supervision, draft, draft == target.vocab, encodings)
    config = {
        "method": eagle3.CACHE_NAME,
        "aux_layers": aux,
        "supervision": str(supervision),
        "draft_vocab_size": draft,
        "last_hidden_state": "the final-norm output, as SpecForge's hidden_state",
    }
    head = target.lm_head

    def rows(entry: _Entry) -> dict[str, torch.Tensor]:
        s = load(entry.name)
        out = {
            "input_ids": s["input_ids"].to(torch.int32),
            "loss_mask": s["loss_mask"].bool(),
            "aux_hidden_states": s["aux_hidden_states"],
            "last_hidden_state": s["last_hidden_state"],
        }
        if draft < target.vocab:
            argmax = torch.nn.functional.linear(s["last_hidden_state"].float(), head).argmax(-1)
            out["in_draft"] = torch.isin(argmax, selected)
        return out

    def side() -> dict[str, torch.Tensor]:
        return {
            "embed_tokens": target.embed_tokens.to(features).contiguous(),
            "lm_head": head[selected].to(features).contiguous(),
            **vocab_mapping(selected, target.vocab),
        }

    return _Import(eagle3.CACHE_NAME, schema, config, entries, skipped, side, eagle3.SIDE_FILE, rows)


def _specforge_files(src: str) -> list[str]:
    # As SpecForge's list_feature_files: every *.ckpt / *.ckpt.gz under src, in sorted path order.
    found = [
        os.path.join(root, name)
        for root, _dirs, names in os.walk(src)
        for name in names
        if name.endswith((".ckpt", ".ckpt.gz"))
    ]
    return sorted(found)


def _speculators_import(
    src: str, target: _Target, layer_ids: Sequence[int] | None, encodings: dict[str, str]
) -> _Import:
    from safetensors import SafetensorError, safe_open

    try:
        from datasets import load_from_disk

        data = load_from_disk(src).with_format("torch", columns=["input_ids", "loss_mask"])
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise CacheFormatError(
            f"{src}: not a speculators data directory (an Arrow save_to_disk dataset with input_ids and loss_mask): "
            f"{exc}"
        ) from None
    if layer_ids is None:
        raise UsageError("--layers is required for --from speculators: the aux layer ids its hidden_states hold")
    aux = list(layer_ids)
    if target.num_layers - 1 in aux:
        raise UsageError(f"--layers {aux}: the last layer {target.num_layers - 1} is the file's last entry already")
    selection = LayerSelection(tuple(aux), target.num_layers, last_hidden=False, last_prenorm=True)
    keys = [f.key for f in selection.features()]
    want = len(aux) + 1
    dtype: list[torch.dtype] = []

    def load(row: int, tensors: bool) -> dict[str, torch.Tensor]:
        path = speculators_hs_path(src, row)
        name = os.path.relpath(path, src)
        _check(os.path.exists(path), "missing", f"{name} is missing")
        ids, mask = data[row]["input_ids"].reshape(-1), data[row]["loss_mask"].reshape(-1)
        try:
            with safe_open(path, framework="pt") as f:
                _check({"hidden_states", "token_ids"} <= set(f.keys()), "bad_keys", f"{name} lacks hidden_states")
                token_ids = f.get_tensor("token_ids")
                shape = tuple(f.get_slice("hidden_states").get_shape())
                states = f.get_tensor("hidden_states") if tensors else None
        except (SafetensorError, OSError) as exc:
            raise BadFile("unreadable", f"{name}: {exc}") from None
        n = ids.numel()
        _check(torch.equal(token_ids.reshape(-1).long(), ids.long()), "token_mismatch", f"{name}: token_ids differ")
        _check(mask.numel() == n and bool(((mask == 0) | (mask == 1)).all()), "bad_shape", "loss_mask is not 0/1")
        _check(
            shape == (n, want, target.hidden),
            "bad_shape",
            f"{name}: hidden_states {shape}, expected {(n, want, target.hidden)}",
        )
        out = {"input_ids": ids.to(torch.int32), "loss_mask": mask.bool()}
        if states is not None:
            _check(not dtype or states.dtype == dtype[0], "bad_dtype", f"{name}: {states.dtype}, first file {dtype}")
            dtype[:1] = [states.dtype]
            out.update({key: states[:, j] for j, key in enumerate(keys)})
        return out

    names = [os.path.relpath(speculators_hs_path(src, row), src) for row in range(len(data))]
    entries, skipped = _scan(names, lambda row, _name: load(row, False)["input_ids"].numel())
    first = load(entries[0].source_row, True) if entries else {}
    features = first[keys[0]].dtype if first else torch.bfloat16
    schema = layers_schema(selection, target.hidden, features, encodings)
    config = {"method": layers.CACHE_NAME, **selection.manifest_config(target.config)}

    def side() -> dict[str, torch.Tensor]:
        return side_tensors(target.embed_tokens.to(features), target.lm_head.to(features), tied=False)

    return _Import(
        layers.CACHE_NAME, schema, config, entries, skipped, side, layers.SIDE_FILE, lambda e: load(e.source_row, True)
    )


def import_peer(
    src: str,
    out: str,
    layout: str,
    model: str,
    layer_ids: Sequence[int] | None = None,
    encodings: dict[str, str] | None = None,
    shard_size: int = 256,
    resume: bool = False,
) -> Manifest:
    """Import a SpecForge or speculators offline directory as a sealed speccache cache.

    Every file is read and checked first (keys, shapes, dtypes, token ids; SpecForge's pickles with
    ``weights_only=True``); the good ones become samples in sorted order, the others are listed in
    ``skipped_files.jsonl`` with their reason and counted in the manifest's ``stats.skipped_files``.

    Args:
        src: the peer's directory.
        out: the cache to write.
        layout: ``specforge`` (an EAGLE-3 cache, ``hidden`` supervision) or ``speculators`` (a layers cache with
            the aux layers and the last layer before the final norm).
        model: the target model directory the features came from (its embeddings and LM head fill the side file).
        layer_ids: the aux layer ids (speccache's convention, decoder layer ``l``; required for speculators).
        encodings: ``--encode`` per feature.
        shard_size: samples per shard.
        resume: finish an interrupted import of the same source.

    Returns:
        The sealed manifest.

    Raises:
        CacheFormatError: ``src`` is not such a directory, or a file changed while it was imported.
        CacheExistsError, ConfigMismatchError, CacheLockedError: ``out`` cannot be used.
    """
    import json

    from speccache.data import SOURCE_ROW_KEY
    from speccache.format import LENGTHS_KEY
    from speccache.write import CacheWriter, SideFile

    if layout not in IMPORTS:
        raise UsageError(f"--from {layout!r} is unknown; choose one of nemo-eagle3, {', '.join(IMPORTS)}")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such directory")
    target = _target(model)
    plan = (_specforge_import if layout == SPECFORGE else _speculators_import)(src, target, layer_ids, encodings or {})
    if not plan.entries:
        raise CacheFormatError(f"{src}: no importable file ({len(plan.skipped)} skipped: see the reasons above)")
    reasons: dict[str, int] = {}
    for bad in plan.skipped:
        reasons[bad["reason"]] = reasons.get(bad["reason"], 0) + 1
        print(f"speccache import: skipped {bad['file']}: {bad['reason']}: {bad['detail']}")
    config = {
        **plan.config,
        "imported_from": os.path.abspath(src),
        "imported_layout": layout,
        "source_digest": _source_digest(src),
        "model": os.path.abspath(model),
        "max_length": max(e.length for e in plan.entries),
        "dtype": {v: k for k, v in DTYPES.items()}[
            next(s.dtype for s in plan.schema.values() if s.dtype.is_floating_point)
        ],
        "vocab_size": target.vocab,
        "hidden_size": target.hidden,
        "encodings": {k: s.encoding for k, s in plan.schema.items() if s.encoding != "raw"},
    }
    writer = CacheWriter(
        out,
        cache_name=plan.cache_name,
        schema=plan.schema,
        shard_size=shard_size,
        num_samples=len(plan.entries),
        config=config,
        resume=resume,
    )
    side_files = [SideFile(plan.side_name, plan.side, {"speccache_side": plan.cache_name})]
    if plan.skipped:
        report = "".join(json.dumps(bad) + "\n" for bad in plan.skipped).encode()
        side_files.append(SideFile(SKIPPED_FILES, content=lambda: report))
    with writer.writing(side_files=tuple(side_files), overlap=False) as run:
        for index in run.shards:
            batch = plan.entries[index * shard_size : (index + 1) * shard_size]
            try:
                samples = [plan.rows(e) for e in batch]
            except BadFile as bad:
                raise CacheFormatError(
                    f"{src}: a file changed since it was checked ({bad}); re-run the import on a source nobody writes"
                ) from None
            rows = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
            rows[LENGTHS_KEY] = torch.tensor([e.length for e in batch], dtype=torch.int64)
            rows[SOURCE_ROW_KEY] = torch.tensor([e.source_row for e in batch], dtype=torch.int64)
            run.write_shard(out, index, rows)
        run.stats = {"skipped_files": reasons} if reasons else {}
    return writer.manifest

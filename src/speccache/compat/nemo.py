"""NeMo AutoModel's offline layouts: a speccache cache written as its DSpark and EAGLE-3 trainers read it, and back.

Both layouts are the seed layout (fixed-key shards, every sample padded to the
sequence length, see docs/format.md §8) written through
:mod:`speccache.offline_cache`, with the manifest fields and side files of the
home project's ``dspark_cache.py`` and ``eagle3_cache.py`` (nemo-automodel 0.7.0):

* ``nemo-dspark``: ``input_ids``/``loss_mask`` int64 ``[n, S]``,
  ``target_hidden_states`` ``[n, S, K*H]`` (the DSpark layers concatenated in
  order), ``target_last_hidden_states`` ``[n, S, H]``; ``target_weights.safetensors``
  with ``embed_tokens.weight`` and ``lm_head.weight``. Source: a layers cache.
* ``nemo-eagle3``: ``input_ids``/``attention_mask``/``loss_mask`` int64 ``[n, S]``,
  ``aux_hidden_states`` ``[n, S, 3H]``, ``position_mask`` bool ``[n, S, 1]``,
  ``target_probs`` ``[n, S, Vd]``: the softmax of the draft-vocabulary columns of
  ``lm_head(last_hidden_state)``, computed here from the stored last hidden state
  and LM-head rows; ``target_embeddings.safetensors`` (fp32 ``weight``). Source:
  an EAGLE-3 cache with ``hidden`` supervision, or a layers cache holding the aux layers.
  The layout is the draft's view of a sample, as NeMo's producer writes it
  (``nemo_automodel/components/speculative/eagle/target.py``: ``_shift_left_with_zero``
  of the token ids, the loss mask and the logits; ``eagle/core.py``:
  ``_compute_target_distribution``): slot ``j`` holds ``aux_hidden_states`` of row ``j``
  and, shifted left by one with a zero tail, ``input_ids[j + 1]``, ``loss_mask[j + 1]``,
  the target distribution of row ``j + 1`` (the softmax of zero logits, i.e. uniform, at
  the last slot) and ``position_mask`` = ``loss_mask[j + 1] & in_draft[j + 1]``.

``speccache import --from nemo-eagle3 NEMO_DIR OUT`` goes the other way: a NeMo EAGLE-3
cache becomes a speccache EAGLE-3 cache with ``probs`` (or, for a top-k cache, ``topk:K``)
supervision, padding dropped by its ``attention_mask``. NeMo's shifted slots do not keep a
sample's first token, so a sample of ``T`` slots becomes ``T - 1`` speccache rows, row ``r``
being the target's state after the sample's token ``r + 1``: ``aux_hidden_states`` of slot
``r + 1`` and the token, loss mask, distribution and position mask of slot ``r``; every
value NeMo's trainer reads at slots ``1..T-1`` is kept as it is (slot 0's draft step is
what the first token would have fed). NeMo's ``position_mask`` becomes ``in_draft``: the
reader's row-aligned ``position_mask[r] = loss_mask[r + 1] & in_draft[r]`` then supervises
the rows that predict a generated token; with a reduced draft vocabulary it leaves out the
row predicting each turn's first generated token, since NeMo's cache does not record whether
that row's argmax is in the draft vocabulary (its slot is outside NeMo's loss mask). A NeMo
DSpark cache has no attention mask, so its padding cannot be told from tokens: it is not imported.

Export streams one output shard at a time (memory bounded by one padded shard),
prints the size it will take before writing, writes the manifest with
``complete: false`` first and ``true`` after the last shard, and refuses a
non-empty output directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError

from speccache.compat import offline_cache as oc
from speccache.compat._base import DTYPES, batches, check_export_dir, refuse_vision
from speccache.errors import CacheFormatError, UsageError
from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY, Manifest, ShardFile, shard_path, validate_contiguous_shards
from speccache.format.durable import ensure_writable_dir, writes_to
from speccache.methods import eagle3, layers
from speccache.methods.eagle3_producer import eagle3_schema, vocab_mapping
from speccache.methods.side import read_side_file
from speccache.read.source import open_source
from speccache.units import human_bytes
from speccache.write import CacheWriter, SideFile

__all__ = ["TARGETS", "export_cache", "import_nemo_eagle3"]

TARGETS = ("nemo-dspark", "nemo-eagle3")
DSPARK_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
EAGLE3_KEYS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs")


def _pad(samples: Sequence[dict[str, torch.Tensor]], key: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    first = samples[0][key]
    out = torch.zeros((len(samples), length, *first.shape[1:]), dtype=dtype)
    for i, s in enumerate(samples):
        out[i, : s[key].shape[0]] = s[key]
    return out


def _shift_left(t: torch.Tensor) -> torch.Tensor:
    """Row ``j`` of the result is row ``j + 1`` of ``t``; the last row is zeros (NeMo's ``_shift_left_with_zero``)."""
    return torch.cat((t[1:], torch.zeros_like(t[:1])))


def _dspark_shard(samples: list[dict[str, torch.Tensor]], length: int) -> dict[str, torch.Tensor]:
    dtype = samples[0]["target_hidden_states"].dtype
    return {
        "input_ids": _pad(samples, "input_ids", length, torch.int64),
        "loss_mask": _pad(samples, "loss_mask", length, torch.int64),
        "target_hidden_states": _pad(samples, "target_hidden_states", length, dtype),
        "target_last_hidden_states": _pad(samples, "target_last_hidden_states", length, dtype),
    }


class _Eagle3Shard:
    """Pads EAGLE-3 samples and computes their draft-vocabulary target probabilities from the last hidden state."""

    def __init__(self, lm_head_rows: torch.Tensor) -> None:
        self.weight = lm_head_rows

    def __call__(self, samples: list[dict[str, torch.Tensor]], length: int) -> dict[str, torch.Tensor]:
        dtype = samples[0]["aux_hidden_states"].dtype
        for s in samples:
            # As NeMo's producer stores it: softmax (fp32) of the selected columns of lm_head(hidden), cache dtype,
            # of the logits shifted left with a zero tail (whose softmax is uniform).
            logits = torch.nn.functional.linear(s["last_hidden_state"].to(self.weight.dtype), self.weight)
            s["target_probs"] = torch.softmax(_shift_left(logits).float(), dim=-1).to(dtype)
            in_draft = s.get("in_draft")
            supervised = s["loss_mask"] if in_draft is None else s["loss_mask"] & in_draft
            s["position_mask"] = _shift_left(supervised)[:, None]
            s["input_ids"], s["loss_mask"] = _shift_left(s["input_ids"]), _shift_left(s["loss_mask"])
            s["attention_mask"] = torch.ones(s["input_ids"].shape[0], dtype=torch.int64)
        out = {
            "input_ids": _pad(samples, "input_ids", length, torch.int64),
            "attention_mask": _pad(samples, "attention_mask", length, torch.int64),
            "loss_mask": _pad(samples, "loss_mask", length, torch.int64),
            "aux_hidden_states": _pad(samples, "aux_hidden_states", length, dtype),
            "position_mask": _pad(samples, "position_mask", length, torch.bool),
            "target_probs": _pad(samples, "target_probs", length, dtype),
        }
        return out


@dataclass
class _Plan:
    """What an export reads and writes."""

    dataset: Any  # the source reader: LayerFeatureDataset or Eagle3CacheDataset (a ViewDataset of them for a view)
    make: Callable[[list[dict[str, torch.Tensor]], int], dict[str, torch.Tensor]]  # samples -> one padded shard
    keys: tuple[str, ...]
    cache_name: str
    version: int
    manifest: dict[str, Any]
    side_name: str
    side_tensors: dict[str, torch.Tensor]


NO_VISION_PATH = (
    "NeMo AutoModel's offline caches hold text rows (its vision-language drafts train online, on the fused "
    "input embeddings)"
)


def _plan(cache_dir: str, to: str, layer_ids: Sequence[int] | None, verify: bool) -> _Plan:
    """What an export reads and writes: the source dataset, the shard maker, the manifest and the side file."""
    source = open_source(cache_dir)  # a cache or a view: a view exports the samples it selects
    config = source.config
    refuse_vision(cache_dir, config, to, NO_VISION_PATH)
    common = {"num_samples": source.num_samples, "shard_size": source.shard_size, "dtype": config["dtype"]}
    ds: layers.LayerFeatureDataset | eagle3.Eagle3CacheDataset
    if to == "nemo-dspark":
        if source.cache_name != layers.CACHE_NAME:
            raise CacheFormatError(
                f"{cache_dir}: --to nemo-dspark reads a layers cache (--method dspark, dflash or layers), "
                f"not a {source.cache_name!r} cache"
            )
        ds = layers.dspark_dataset(cache_dir, layer_ids, verify=verify)
        ids = list(ds.fields["target_hidden_states"])
        weights = read_side_file(source.side_file(layers.SIDE_FILE), ("embed_tokens", "lm_head"))
        hidden = int(config["hidden_size"])
        nemo = {
            "target_model": config["model"],
            "target_model_type": config.get("model_type"),
            "target_vocab_size": int(config["vocab_size"]),
            "hidden_size": hidden,
            "num_hidden_layers": int(config["num_layers"]),
            "seq_length": int(config["max_length"]),
            "target_hidden_dim": hidden * len(ids),
            "target_last_hidden_dim": hidden,
            "target_layer_ids": ids,
            "train_data_path": config["data"],
            "train_split": None,
            "shuffle_seed": 0,
            "mask_reasoning_content": False,
            "mask_generation_prompt": False,
            "chat_template_sha256": "",
            **common,
        }
        side = {"embed_tokens.weight": weights["embed_tokens"], "lm_head.weight": weights["lm_head"]}
        return _Plan(ds, _dspark_shard, DSPARK_KEYS, "DSpark", 1, nemo, "target_weights.safetensors", side)
    if source.cache_name == eagle3.CACHE_NAME:
        if config.get("supervision", "hidden") != "hidden":
            raise CacheFormatError(
                f"{cache_dir}: --to nemo-eagle3 computes target_probs from last_hidden_state; this cache stores "
                f"--supervision {config['supervision']}. Export a cache written with --supervision hidden"
            )
        ds = eagle3.Eagle3CacheDataset(cache_dir, verify=verify)
        side_tensors = read_side_file(source.side_file(eagle3.SIDE_FILE))
        rows, selected, aux = side_tensors["lm_head"], side_tensors["selected_token_ids"], config["aux_layers"]
    elif source.cache_name == layers.CACHE_NAME:
        ds = layers.eagle3_dataset(cache_dir, layer_ids, verify=verify)
        side_tensors = read_side_file(source.side_file(layers.SIDE_FILE), ("embed_tokens", "lm_head"))
        rows = side_tensors["lm_head"]
        selected, aux = torch.arange(rows.shape[0]), list(ds.fields["aux_hidden_states"])
    else:
        raise CacheFormatError(
            f"{cache_dir}: --to nemo-eagle3 reads an eagle3 or layers cache, not a {source.cache_name!r} one"
        )
    hidden = int(config["hidden_size"])
    nemo = {
        "target_model": config["model"],
        "target_vocab_size": int(config["vocab_size"]),
        "draft_vocab_size": int(selected.numel()),
        "seq_length": int(config["max_length"]),
        "target_probs_topk": 0,
        "aux_hidden_dim": hidden * len(aux),
        "aux_layer_ids": list(aux),
        "selected_token_ids": selected.tolist(),
        "input_data": config["data"],
        "split": None,
        "shuffle_seed": 0,
        "mask_reasoning_content": False,
        "mask_generation_prompt": False,
        **common,
    }
    side = {"weight": side_tensors["embed_tokens"].float()}
    return _Plan(ds, _Eagle3Shard(rows), EAGLE3_KEYS, "EAGLE-3", 2, nemo, "target_embeddings.safetensors", side)


def _bytes_per_sample(plan: _Plan) -> int:
    sample = plan.make([plan.dataset[0]], plan.manifest["seq_length"])
    return sum(t.numel() * t.element_size() for t in sample.values())


def export_cache(
    cache_dir: str,
    out: str,
    to: str,
    layer_ids: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
    verify: bool = True,
) -> dict[str, Any]:
    """Export ``cache_dir`` to ``out`` in a NeMo AutoModel layout, one shard at a time.

    Args:
        cache_dir: a sealed speccache cache (layers or EAGLE-3), or a view of such caches.
        out: the output directory (absent or empty).
        to: ``nemo-dspark`` or ``nemo-eagle3``.
        layer_ids: DSpark layer ids / EAGLE-3 aux layer ids to read from a layers cache (default: the method's).
        log: where the size line goes, before anything is written.
        verify: check the tensors read from each shard against their checksums (``False``: ``--no-verify``).

    Returns:
        The NeMo manifest written.

    Raises:
        CacheCorruptError: (``verify``) a tensor read differs from its checksum; nothing of its shard is written.
        ValueError: an unknown ``to``.
        CacheExistsError: ``out`` is not empty.
        CacheFormatError: the cache cannot give what the layout needs (the message says what it holds).
        OutputError: the operating system refuses ``out`` or a write in it (read-only, no permission, name too
            long, disk full).
    """
    if to not in TARGETS:
        raise UsageError(f"--to {to!r} is unknown; choose one of nemo-dspark, nemo-eagle3")
    check_export_dir(out)
    plan = _plan(cache_dir, to, layer_ids, verify)
    ds, manifest, length = plan.dataset, plan.manifest, plan.manifest["seq_length"]
    side_bytes = sum(t.numel() * t.element_size() for t in plan.side_tensors.values())
    total = _bytes_per_sample(plan) * len(ds) + side_bytes
    log(f"speccache export: {len(ds)} samples padded to {length} tokens -> {out} ({to}): about {human_bytes(total)}")
    ensure_writable_dir(out)
    save_file, _ = oc.load_safetensors(plan.cache_name)
    # Only the writes are wrapped (safetensors reports a full disk as its own error): a failed read of the source
    # keeps its own message. Every write is atomic, so a full disk leaves nothing half-written under a final name.
    with writes_to(out, SafetensorError):
        oc.write_manifest(out, {**manifest, "complete": False}, plan.version)
        oc.atomic_write(os.path.join(out, plan.side_name), lambda tmp: save_file(plan.side_tensors, tmp))
    for index, (_start, samples) in enumerate(batches(ds)):
        tensors = plan.make(samples, length)
        with writes_to(out, SafetensorError):
            oc.write_tensor_shard(out, index, tensors, plan.keys, plan.cache_name)
    with writes_to(out):
        oc.write_manifest(out, {**manifest, "complete": True}, plan.version)
    return manifest


def _ragged_rows(handle: Any, path: str, full_vocab: bool, topk: bool) -> dict[str, torch.Tensor]:
    """One NeMo EAGLE-3 shard (its open ``safe_open`` handle) as speccache ragged rows; refuses what would not come
    back unchanged."""
    t = {k: handle.get_tensor(k) for k in handle.keys()}
    attention = t["attention_mask"].bool()
    lengths = attention.sum(1)
    prefix = torch.arange(attention.shape[1])[None] < lengths[:, None]
    masks_ok = all(bool(((t[k] == 0) | (t[k] == 1)).all()) for k in ("attention_mask", "loss_mask"))
    position = t["position_mask"][..., 0].bool()
    if (
        not masks_ok
        or not torch.equal(attention, prefix)
        or (full_vocab and not torch.equal(position, t["loss_mask"].bool()))
    ):
        raise CacheFormatError(
            f"{path}: not importable without loss: attention_mask must be a 0/1 prefix (right padding), loss_mask "
            "0/1, and position_mask equal to loss_mask when the draft vocabulary is the whole vocabulary"
        )
    # Slots 0..T-2 of the shifted keys and slots 1..T-1 of the aux states make rows 0..T-2 (see the module docstring).
    shifted = attention & (torch.arange(attention.shape[1])[None] < (lengths - 1)[:, None])
    aux_slots = torch.roll(shifted, 1, dims=1)
    rows = {
        "input_ids": t["input_ids"][shifted].to(torch.int32),
        "loss_mask": t["loss_mask"][shifted].bool(),
        "aux_hidden_states": t["aux_hidden_states"][aux_slots],
        LENGTHS_KEY: (lengths - 1).clamp_min(0).to(torch.int64),
        SOURCE_ROW_KEY: torch.full((attention.shape[0],), -1, dtype=torch.int64),
    }
    if topk:
        rows["topk_probs"] = t["target_probs_values"][shifted]
        rows["topk_ids"] = t["target_probs_indices"][shifted].to(torch.int32)
    else:
        rows["target_probs"] = t["target_probs"][shifted]
    if not full_vocab:
        # speccache's position_mask is loss_mask & in_draft: storing NeMo's position_mask as in_draft gives it back.
        rows["in_draft"] = position[shifted]
    return rows


def import_nemo_eagle3(src: str, out: str, resume: bool = False) -> Manifest:
    """Import a NeMo AutoModel EAGLE-3 cache as a speccache EAGLE-3 cache (``probs``, or ``topk:K`` when compressed).

    Lossless for everything its reader yields: padding is dropped by ``attention_mask`` and every stored value is
    kept as it is. The side file holds the target embeddings and the vocabulary maps (there are no LM-head rows).

    Args:
        src: the NeMo cache directory (complete).
        out: the speccache cache to write.
        resume: finish an interrupted import.

    Returns:
        The sealed manifest.

    Raises:
        CacheFormatError: shards missing or extra for the manifest's ``num_samples``, a shard holding another
            sample count or lacking a key, or one that would not come back unchanged.
        CacheCorruptError: a truncated or damaged shard.
        CacheExistsError, ConfigMismatchError, CacheLockedError: ``out`` cannot be used.
    """
    nemo = oc.read_manifest(src, "EAGLE-3", 2, "precompute_eagle3")
    if nemo.get("complete", True) is not True:
        raise CacheFormatError(f"{src}: the NeMo cache is marked incomplete; finish its precompute before importing")
    vocab, draft = int(nemo["target_vocab_size"]), int(nemo["draft_vocab_size"])
    hidden = int(nemo["aux_hidden_dim"]) // len(nemo["aux_layer_ids"])
    topk = int(nemo.get("target_probs_topk") or 0)
    supervision = eagle3.Supervision("topk", topk) if 0 < topk < draft else eagle3.Supervision("probs")
    dtype = DTYPES[nemo["dtype"]]
    schema = eagle3_schema(hidden, dtype, supervision, draft, draft == vocab)
    config = {
        "method": "eagle3",
        "imported_from": os.path.abspath(src),
        "model": nemo["target_model"],
        "max_length": int(nemo["seq_length"]),
        "aux_layers": list(nemo["aux_layer_ids"]),
        "dtype": nemo["dtype"],
        "supervision": str(supervision),
        "draft_vocab_size": draft,
        "vocab_size": vocab,
        "hidden_size": hidden,
    }
    selected = torch.tensor(nemo["selected_token_ids"], dtype=torch.int64)
    embeddings = os.path.join(src, "target_embeddings.safetensors")
    shard_size, num_samples = int(nemo["shard_size"]), int(nemo["num_samples"])
    probs = ("target_probs_values", "target_probs_indices") if supervision.mode == "topk" else ("target_probs",)
    keys = (*(k for k in EAGLE3_KEYS if k != "target_probs"), *probs)

    def open_shard(index: int) -> Any:
        return oc.open_seed_shard(src, index, keys, num_samples, shard_size, "NeMo EAGLE-3")

    def side() -> dict[str, torch.Tensor]:
        return {"embed_tokens": ShardFile(embeddings).tensor("weight").clone(), **vocab_mapping(selected, vocab)}

    writer = CacheWriter(
        out,
        cache_name=eagle3.CACHE_NAME,
        schema=schema,
        shard_size=shard_size,
        num_samples=num_samples,
        config=config,
        resume=resume,
    )
    writer.preflight()  # the output first: reading every shard of the source is the long part
    # Every shard is checked (there, whole, holding the manifest's counts) before anything is written.
    for index in validate_contiguous_shards(src, "NeMo EAGLE-3", num_samples, shard_size):
        open_shard(index)
    side_file = SideFile(eagle3.SIDE_FILE, side, {"speccache_side": eagle3.CACHE_NAME})
    with writer.writing(side_files=(side_file,), overlap=False) as run:
        for index in run.shards:
            rows = _ragged_rows(open_shard(index), shard_path(src, index), draft == vocab, supervision.mode == "topk")
            run.write_shard(out, index, rows)
    return writer.manifest

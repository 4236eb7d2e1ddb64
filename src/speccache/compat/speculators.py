"""speculators' offline layout (speculators 0.9.0), written from a speccache cache and read back into one.

``speculators/train/data.py`` ``ArrowDataset`` reads an Arrow ``save_to_disk`` directory (``input_ids``,
``loss_mask``, ``seq_len``; torch format), ``token_freq.pt`` (the supervised tokens' counts) and
``hidden_states/hs_{row}.safetensors`` holding ``hidden_states`` ``[T, K + 1, H]`` (the K aux layers, then the last
decoder layer before the final norm) and ``token_ids`` int64 ``[T]``.

:mod:`speccache.compat.peers` runs the plans made here; docs/interop.md has the tables.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from speccache.compat._base import BadFile, PeerExport, PeerImport, Target, check, scan, torch_save
from speccache.errors import CacheFormatError, UsageError
from speccache.format import write_safetensors
from speccache.methods import eagle3, layers, layers_producer
from speccache.read.source import CacheSource

__all__ = ["HS_DIR", "SPECULATORS", "TOKEN_FREQ", "export_plan", "import_plan", "speculators_hs_path"]

SPECULATORS = "speculators"
TOKEN_FREQ = "token_freq.pt"
HS_DIR = "hidden_states"


def speculators_hs_path(out: str, index: int) -> str:
    """Row ``index``'s hidden-state file, named as speculators' ``FileTransfer`` looks it up."""
    return os.path.join(out, HS_DIR, f"hs_{index}.safetensors")


def export_plan(cache_dir: str, source: CacheSource, layer_ids: Sequence[int] | None, verify: bool) -> PeerExport:
    """Plan ``--to speculators``: a layers cache's aux layers and its last layer before the final norm."""
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
        torch_save(os.path.join(out, TOKEN_FREQ), dict(zip(tokens.tolist(), counts.tolist())))
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

    return PeerExport(ds, sample_files, write_safetensors, finish)


def import_plan(src: str, target: Target, layer_ids: Sequence[int] | None, encodings: dict[str, str]) -> PeerImport:
    """Plan ``--from speculators``: every row's hidden-state file checked, as a layers cache."""
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
    selection = layers_producer.LayerSelection(tuple(aux), target.num_layers, last_hidden=False, last_prenorm=True)
    keys = [f.key for f in selection.features()]
    want = len(aux) + 1
    dtype: list[torch.dtype] = []

    def load(row: int, tensors: bool) -> dict[str, torch.Tensor]:
        path = speculators_hs_path(src, row)
        name = os.path.relpath(path, src)
        check(os.path.exists(path), "missing", f"{name} is missing")
        ids, mask = data[row]["input_ids"].reshape(-1), data[row]["loss_mask"].reshape(-1)
        try:
            with safe_open(path, framework="pt") as f:
                check({"hidden_states", "token_ids"} <= set(f.keys()), "bad_keys", f"{name} lacks hidden_states")
                token_ids = f.get_tensor("token_ids")
                shape = tuple(f.get_slice("hidden_states").get_shape())
                states = f.get_tensor("hidden_states") if tensors else None
        except (SafetensorError, OSError) as exc:
            raise BadFile("unreadable", f"{name}: {exc}") from None
        n = ids.numel()
        check(torch.equal(token_ids.reshape(-1).long(), ids.long()), "token_mismatch", f"{name}: token_ids differ")
        check(mask.numel() == n and bool(((mask == 0) | (mask == 1)).all()), "bad_shape", "loss_mask is not 0/1")
        check(
            shape == (n, want, target.hidden),
            "bad_shape",
            f"{name}: hidden_states {shape}, expected {(n, want, target.hidden)}",
        )
        out = {"input_ids": ids.to(torch.int32), "loss_mask": mask.bool()}
        if states is not None:
            check(not dtype or states.dtype == dtype[0], "bad_dtype", f"{name}: {states.dtype}, first file {dtype}")
            dtype[:1] = [states.dtype]
            out.update({key: states[:, j] for j, key in enumerate(keys)})
        return out

    names = [os.path.relpath(speculators_hs_path(src, row), src) for row in range(len(data))]
    entries, skipped = scan(names, lambda row, _name: load(row, False)["input_ids"].numel())
    first = load(entries[0].source_row, True) if entries else {}
    features = first[keys[0]].dtype if first else torch.bfloat16
    schema = layers_producer.layers_schema(selection, target.hidden, features, encodings)
    config = {"method": layers.CACHE_NAME, **selection.manifest_config(target.config)}

    def side() -> dict[str, torch.Tensor]:
        return layers_producer.side_tensors(target.embed_tokens.to(features), target.lm_head.to(features), tied=False)

    return PeerImport(
        layers.CACHE_NAME, schema, config, entries, skipped, side, layers.SIDE_FILE, lambda e: load(e.source_row, True)
    )

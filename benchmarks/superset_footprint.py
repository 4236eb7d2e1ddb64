"""Footprint of one layer-superset cache against the sum of per-method caches (EAGLE-3, DSpark, DFlash, MTP).

Writes a Markdown report (``make footprint`` writes docs/footprint_superset.md):

1. the bundled demo target and data, measured: real ``precompute`` runs of each method's dedicated cache
   and of one ``--method layers`` superset holding every layer they use, bytes on disk;
2. Llama-3.1-8B widths (32 layers, H=4096, V=128256), computed with the writer's own layout arithmetic
   (``estimate_shards``, exact for raw bf16) on the same synthetic length distribution as docs/footprint.md.

Usage: python benchmarks/superset_footprint.py --out docs/footprint_superset.md [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from footprint import REAL, mb, sample_lengths
from speccache.demo import demo_data_path, ensure_demo_target
from speccache.methods.eagle3 import Supervision, default_aux_layers
from speccache.methods.eagle3_producer import eagle3_schema
from speccache.methods.layers import dflash_layer_ids, dspark_layer_ids
from speccache.methods.layers_producer import LayerSelection, layers_schema
from speccache.precompute import PrecomputeConfig, run_precompute
from speccache.precompute.estimate import estimate_shards, side_file_bytes
from speccache.write.dist import LocalComm

METHODS = ("eagle3", "dspark", "dflash", "mtp")


def superset_layers(num_layers: int) -> list[int]:
    """Every layer id the four methods read (EAGLE-3's aux ids below L-1 agree with the DSpark convention)."""
    ids = set(default_aux_layers(num_layers)) | set(dspark_layer_ids(num_layers)) | set(dflash_layer_ids(num_layers))
    return sorted(ids)


def measure_demo(work: str) -> dict[str, Any]:
    """Real runs on the demo target: each method's cache and one superset."""
    target = ensure_demo_target()
    num_layers = 8
    runs = {m: {"method": m} for m in METHODS}
    runs["superset"] = {"method": "layers", "layers": superset_layers(num_layers), "last_hidden": True}
    out: dict[str, Any] = {}
    for name, kwargs in runs.items():
        cfg = PrecomputeConfig(
            model=target, data=demo_data_path(), out=os.path.join(work, name), device="cpu", **kwargs
        )
        cfg.check()
        manifest = run_precompute(cfg, comm=LocalComm(), progress=False)
        side = sum(r.bytes for r in manifest.side_files.values())
        out[name] = {
            "shards": manifest.total_bytes,
            "side": side,
            "tokens": manifest.num_tokens,
            "keys": sorted(k for k in manifest.schema if k not in ("input_ids", "loss_mask", "source_row")),
        }
    return out


def compute_real() -> dict[str, Any]:
    """Llama-3.1-8B widths, raw bf16, full draft vocabulary: exact layout arithmetic."""
    num_layers, hidden, vocab = 32, REAL["hidden"], REAL["vocab"]
    lengths = sample_lengths(REAL["samples"], REAL["mean_length"], REAL["max_length"]).tolist()
    schemas = {
        "eagle3": eagle3_schema(hidden, torch.bfloat16, Supervision("hidden"), vocab, True),
        "dspark": layers_schema(
            LayerSelection(tuple(dspark_layer_ids(num_layers)), num_layers, True), hidden, torch.bfloat16
        ),
        "dflash": layers_schema(
            LayerSelection(tuple(dflash_layer_ids(num_layers)), num_layers, True), hidden, torch.bfloat16
        ),
        "mtp": layers_schema(LayerSelection((), num_layers, True), hidden, torch.bfloat16),
        "superset": layers_schema(
            LayerSelection(tuple(superset_layers(num_layers)), num_layers, True), hidden, torch.bfloat16
        ),
    }
    out: dict[str, Any] = {}
    for name, schema in schemas.items():
        cache_name = "eagle3" if name == "eagle3" else "layers"
        shards = estimate_shards(schema, lengths, REAL["shard_size"], 1.0)["total"]
        out[name] = {
            "shards": shards,
            "side": side_file_bytes(vocab, vocab, hidden, torch.bfloat16, cache_name),
            "tokens": sum(lengths),
            "keys": sorted(k for k in schema if k not in ("input_ids", "loss_mask", "source_row")),
        }
    return out


def table(rows: dict[str, Any], fmt=mb) -> list[str]:
    lines = [
        "| cache | float keys | shard bytes | bytes/token | side file |",
        "|---|---|---:|---:|---:|",
    ]
    for name, r in rows.items():
        keys = ", ".join(f"`{k}`" for k in r["keys"])
        lines.append(f"| {name} | {keys} | {fmt(r['shards'])} | {r['shards'] / r['tokens']:.0f} | {fmt(r['side'])} |")
    per = {n: rows[n] for n in METHODS}
    total_shards = sum(r["shards"] for r in per.values())
    total_side = sum(r["side"] for r in per.values())
    sup = rows["superset"]
    lines.append(
        f"| **sum of the four** | | {fmt(total_shards)} | {total_shards / sup['tokens']:.0f} | {fmt(total_side)} |"
    )
    lines += [
        "",
        f"One superset: {fmt(sup['shards'] + sup['side'])} (shards and side file) against "
        f"{fmt(total_shards + total_side)} for the four dedicated caches: "
        f"{(sup['shards'] + sup['side']) / (total_shards + total_side):.2f}x the bytes, "
        f"{sup['shards'] / total_shards:.2f}x in shards, and one target forward instead of four.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="speccache-superset-")
    try:
        demo = measure_demo(work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    real = compute_real()
    lines = [
        "# One layer-superset cache against per-method caches",
        "",
        "Generated by `python benchmarks/superset_footprint.py --out docs/footprint_superset.md` (`make footprint`).",
        "",
        "The superset is `--method layers --layers <every id EAGLE-3, DSpark and DFlash use> --last-hidden`;",
        "its readers give each method batches equal to those of the method's own cache, tensor for tensor",
        "(`tests/test_layers.py::test_superset_reader_equals_dedicated_run`,",
        "`::test_superset_eagle3_reader_equals_an_eagle3_cache`). EAGLE-3 is its default `hidden` supervision",
        "with the full vocabulary. Layer keys shared by several methods are stored once: that, and one",
        "`input_ids`/`loss_mask` instead of four, is the saving.",
        "",
        f"## Demo target (8 layers, H=64, bf16), measured: superset layers {superset_layers(8)}",
        "",
        *table(demo, lambda n: f"{n / 1e6:.2f} MB"),
        "",
        f"## Llama-3.1-8B widths (32 layers, H=4096, V=128256, bf16), computed: superset layers {superset_layers(32)}",
        "",
        f"{REAL['samples']} samples, mean length {REAL['mean_length']} (max {REAL['max_length']}), raw encoding.",
        "",
        *table(real),
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

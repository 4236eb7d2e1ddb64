"""``speccache export`` and ``speccache import``: the commands over every layout of :mod:`speccache.compat`.

NeMo AutoModel's layouts are :mod:`~speccache.compat.nemo`'s; SpecForge's and speculators' are run by
:mod:`~speccache.compat.peers`.
"""

from __future__ import annotations

import argparse
from typing import Any

from speccache.compat.nemo import TARGETS, export_cache, import_nemo_eagle3
from speccache.compat.peers import IMPORTS, LAYOUTS, export_peer, import_peer
from speccache.data import check_model_source
from speccache.errors import UsageError
from speccache.format.encoding import parse_encodings
from speccache.methods import layers
from speccache.read.dataset import NO_VERIFY_HELP

__all__ = ["register_commands"]


def cmd_import(args: argparse.Namespace) -> int:
    """Run ``speccache import``."""
    if args.layout == "nemo-eagle3":
        manifest = import_nemo_eagle3(args.nemo_dir, args.out, resume=args.resume)
    else:
        if not args.model:
            raise UsageError(f"--from {args.layout} needs --model: the target whose features the files hold")
        check_model_source(args.model)
        layer_ids = layers.parse_layer_ids(args.layers, "--layers")
        manifest = import_peer(
            args.nemo_dir,
            args.out,
            args.layout,
            args.model,
            layer_ids,
            parse_encodings(args.encode),
            args.shard_size,
            args.resume,
        )
    print(f"speccache import: {manifest.num_samples} samples, {manifest.num_tokens} tokens -> {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Run ``speccache export``."""
    layer_ids = layers.parse_layer_ids(args.layers, "--layers")
    export = export_peer if args.to in LAYOUTS else export_cache
    export(args.cache_dir, args.out, args.to, layer_ids, verify=not args.no_verify)
    return 0


def register_commands(sub: Any) -> None:
    """Add ``export`` and ``import`` to the CLI."""
    p = sub.add_parser("export", help="write a cache in NeMo AutoModel's, SpecForge's or speculators' layout")
    p.add_argument("--to", required=True, help=f"layout: {', '.join((*TARGETS, *LAYOUTS))}")
    p.add_argument(
        "--layers", default=None, help="layer ids to read from a layers cache (default: DSpark's / EAGLE-3's)"
    )
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    p.add_argument("cache_dir")
    p.add_argument("out")
    p.set_defaults(
        func=cmd_export,
        interrupted=lambda args, command: (
            f"{args.out} holds a partial export, which export refuses to write "
            f"over (no --resume): delete it, then export again: {command}"
        ),
    )
    p = sub.add_parser(
        "import", help="write a NeMo AutoModel EAGLE-3, SpecForge or speculators cache as a speccache cache"
    )
    p.add_argument("--from", dest="layout", required=True, choices=["nemo-eagle3", *IMPORTS], help="layout of SRC")
    p.add_argument("--resume", action="store_true", help="finish an interrupted import")
    p.add_argument("--model", default=None, help="specforge/speculators: the target model directory")
    p.add_argument("--layers", default=None, help="aux layer ids (speculators: required; specforge: default EAGLE-3's)")
    p.add_argument("--encode", default="", help="per-feature encodings, e.g. aux_hidden_states=fp8")
    p.add_argument("--shard-size", type=int, default=256, help="samples per shard (specforge/speculators)")
    p.add_argument("nemo_dir", metavar="SRC")
    p.add_argument("out")
    p.set_defaults(
        func=cmd_import,
        interrupted=lambda args, command: (
            f"the shards written so far in {args.out} are kept; resume with: "
            + (command if args.resume else f"{command} --resume")
        ),
    )

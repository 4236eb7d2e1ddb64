"""The ``speccache`` command line: ``precompute``, ``inspect``, ``verify``, ``estimate``.

Exit codes: 0 success, 1 a failed check or a speccache error (message on
stderr, no traceback), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from speccache.errors import SpeccacheError
from speccache.units import human_bytes


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a cache's schema, counts and sizes."""
    from speccache.read.verify import inspect_cache

    info = inspect_cache(args.cache_dir)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"cache      {info['cache_dir']} ({info['cache_name']}, format v{info['format_version']})")
    print(f"complete   {'yes' if info['complete'] else 'NO (interrupted or still being written)'}")
    print(
        f"samples    {info['num_samples']} in {info['num_shards']} shards of {info['shard_size']}; "
        f"tokens {info['num_tokens']}"
    )
    bpt = info["bytes_per_token"]
    print(f"size       {human_bytes(info['shard_bytes'])} in shards" + (f", {bpt:.1f} bytes per token" if bpt else ""))
    print(f"{'key':<20} {'dtype':<14} {'shape':<10} {'ragged':<7} {'encoding':<9} {'bytes':>12} {'B/token':>9}")
    for name, k in info["keys"].items():
        per = f"{k['bytes_per_token']:.1f}" if k["bytes_per_token"] is not None else "-"
        print(
            f"{name:<20} {k['dtype']:<14} {str(k['shape']):<10} {str(k['ragged']):<7} {k['encoding']:<9} "
            f"{human_bytes(k['bytes']):>12} {per:>9}"
        )
    for name, size in (info["side_file_bytes"] or {}).items():
        print(f"side file  {name}: {human_bytes(size)}")
    stats = info.get("stats")
    errors = stats.get("encoding_error") if isinstance(stats, dict) else None
    for key, err in errors.items() if isinstance(errors, dict) else ():
        if (
            isinstance(err, dict)
            and isinstance(err.get("rms"), (int, float))
            and isinstance(err.get("max"), (int, float))
        ):
            print(f"fp8 error  {key}: relative RMS {err['rms']:.4f}, max {err['max']:.4f}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every file of a cache; exit 1 when anything is wrong."""
    from speccache.read.verify import verify_cache

    progress = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        progress = lambda it: tqdm(it, desc="verify", unit="shard")  # noqa: E731
    report = verify_cache(args.cache_dir, progress)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for shard in report.shards:
            print(
                f"ok       {shard['name']}  samples={shard['samples']} tokens={shard['tokens']} "
                f"bytes={shard['bytes']} xxh3={shard['xxh3_128']}"
            )
        for problem in report.problems:
            print(f"PROBLEM  {problem.file}: {problem.reason}")
        print(
            f"{args.cache_dir}: {'sound' if report.ok else f'{len(report.problems)} problem(s)'} "
            f"({len(report.shards)} shards checked)"
        )
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="speccache", description="Offline feature cache for speculative-decoding drafts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a cache: schema, counts, bytes per key and per token")
    p.add_argument("cache_dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every shard's structure and checksums (exit 1 if anything is wrong)")
    p.add_argument("cache_dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_verify)
    for register in _method_commands():
        register(sub)
    return parser


def _method_commands() -> list[Callable[[Any], None]]:
    from speccache.precompute.estimate import register_commands as register_estimate
    from speccache.precompute.run import register_commands

    return [register_commands, register_estimate]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (SpeccacheError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        print(f"speccache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"speccache {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``speccache`` command line: ``precompute``, ``inspect``, ``verify``, ``estimate``, ``train``, ``evaluate``...

Exit codes: 0 success, 1 a failed check or a speccache error (message on
stderr, no traceback), 2 bad usage, 130 interrupted (Ctrl-C, SIGINT), 143 terminated (SIGTERM): one line says
what was kept and the command that resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from speccache.errors import SpeccacheError, UsageError
from speccache.units import counted, human_bytes

__all__ = ["build_parser", "main"]


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a cache's schema, counts and sizes."""
    import os

    from speccache.format import SKIPPED_ROWS_FILE
    from speccache.format.view import is_view
    from speccache.read.verify import inspect_cache

    if is_view(args.cache_dir):
        return inspect_view(args)
    info = inspect_cache(args.cache_dir)
    if args.json:
        if args.stats:
            from speccache.read.stats import cache_sample_stats

            info["sample_stats"] = cache_sample_stats(args.cache_dir)
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"cache      {info['cache_dir']} ({info['cache_name']}, format v{info['format_version']})")
    print(f"complete   {'yes' if info['complete'] else 'NO (interrupted or still being written)'}")
    gone, here = len(info["reclaimed"]), info["num_shards"]
    samples = f"samples    {info['num_samples']} in {counted(gone + here, 'shard')} of {info['shard_size']}"
    if not gone:
        print(f"{samples}; tokens {info['num_tokens']}")
    elif not here:
        print(f"{samples}, all reclaimed (deleted after a following trainer read them): none left here")
    else:
        print(f"{samples}: {gone} reclaimed after use, {here} here holding {info['num_tokens']} tokens")
    bpt = info["bytes_per_token"]
    print(f"size       {human_bytes(info['shard_bytes'])} in shards" + (f", {bpt:.1f} bytes per token" if bpt else ""))
    print(
        f"{'key':<20} {'dtype':<14} {'shape':<10} {'ragged':<7} {'encoding':<9} {'bytes':>12} {'B/token':>9} "
        f"{'share':>7}"
    )
    for name, k in info["keys"].items():
        per = f"{k['bytes_per_token']:.1f}" if k["bytes_per_token"] is not None else "-"
        share = f"{k['share']:.1%}" if k["share"] is not None else "-"
        print(
            f"{name:<20} {k['dtype']:<14} {str(k['shape']):<10} {str(k['ragged']):<7} {k['encoding']:<9} "
            f"{human_bytes(k['bytes']):>12} {per:>9} {share:>7}"
        )
    for name, size in (info["side_file_bytes"] or {}).items():
        print(f"side file  {name}: {human_bytes(size)}")
    producer = info["producer"]
    command = producer.get("argv")
    print(
        f"producer   written by {producer.get('name', '?')} {producer.get('version', '?')}"
        + (f": speccache {shlex.join(command)} (run in {producer.get('cwd')})" if isinstance(command, list) else "")
    )
    if info["reclaimed"]:
        print(
            f"reclaimed  {len(info['reclaimed'])} shards deleted after use by a trainer that followed the cache "
            f"(reclaim=True): {_listed(info['reclaimed'])}; the sizes above are of the shards still here"
        )
    stats = info.get("stats")
    skipped = stats.get("skipped_rows") if isinstance(stats, dict) else None
    if isinstance(skipped, dict) and skipped:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))
        listed = ""
        if SKIPPED_ROWS_FILE in (info["side_file_bytes"] or {}):
            listed = f" (listed in {os.path.join(args.cache_dir, SKIPPED_ROWS_FILE)})"
        print(f"skipped    {counted(sum(n for n in skipped.values() if isinstance(n, int)), 'row')}: {reasons}{listed}")
    errors = stats.get("encoding_error") if isinstance(stats, dict) else None
    for key, err in errors.items() if isinstance(errors, dict) else ():
        if (
            isinstance(err, dict)
            and isinstance(err.get("rms"), (int, float))
            and isinstance(err.get("max"), (int, float))
        ):
            print(f"fp8 error  {key}: relative RMS {err['rms']:.4f}, max {err['max']:.4f}")
    if args.stats:
        print_sample_stats(args.cache_dir)
    return 0


def _listed(items: list[int], limit: int = 10) -> str:
    return ", ".join(map(str, items[:limit])) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def inspect_view(args: argparse.Namespace) -> int:
    """``inspect`` of a view: its sources, their weights and the samples it selects."""
    from speccache.read.view import ViewDataset

    dataset = ViewDataset(args.cache_dir)
    view = dataset.view
    if args.json:
        body = view.to_json()
        if args.stats:
            from speccache.read.stats import cache_sample_stats

            body["sample_stats"] = cache_sample_stats(args.cache_dir)
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    print(f"view       {args.cache_dir} ({view.cache_name}): {len(dataset)} samples from {len(view.sources)} caches")
    print(f"selection  {json.dumps(view.selection, sort_keys=True)}")
    for number, source in enumerate(view.sources):
        count = sum(end - start for s, start, end in view.runs if s == number)
        where = view.source_dir(number)
        print(f"source     {where}: {count} samples, {len(source.shards)} shards, weight {source.weight:g}")
    if args.stats:
        print_sample_stats(args.cache_dir)
    return 0


def print_sample_stats(cache_dir: str) -> None:
    """Print the distribution of each per-sample statistic (``inspect --stats``)."""
    from speccache.read.stats import cache_sample_stats, histogram

    stats = cache_sample_stats(cache_dir)
    if not stats:
        print("stats      none recorded (the shards were written before per-sample statistics existed)")
    for name, values in stats.items():
        known = [v for v in values if v is not None]
        mean = sum(known) / len(known) if known else float("nan")
        print(f"stats      {name}: {len(values)} samples, mean {mean:.4g}")
        for line in histogram(values):
            print(line)


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every file of a cache (or every shard a view references); exit 1 when anything is wrong."""
    from speccache.format.view import is_view

    if is_view(args.cache_dir):
        from speccache.read.view import verify_view

        problems = verify_view(args.cache_dir)
        if args.json:
            print(
                json.dumps(
                    {"cache_dir": args.cache_dir, "view": True, "ok": not problems, "problems": problems}, indent=2
                )
            )
        else:
            for problem in problems:
                print(f"PROBLEM  {problem}")
            print(f"{args.cache_dir}: {'sound' if not problems else f'{len(problems)} problem(s)'} (view)")
        return 0 if not problems else 1
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
        for shard in report.reclaimed:
            where = f"moved to {shard['moved_to']}" if shard["moved_to"] else "deleted"
            print(
                f"reclaimed {shard['name']}  samples={shard['samples']} tokens={shard['tokens']} "
                f"bytes={shard['bytes']} ({where} after use by a following trainer)"
            )
        for found in report.problems:
            print(f"PROBLEM  {found.file}: {found.reason}")
        reclaimed = f", {len(report.reclaimed)} reclaimed after use" if report.reclaimed else ""
        print(
            f"{args.cache_dir}: {'sound' if report.ok else f'{len(report.problems)} problem(s)'} "
            f"({len(report.shards)} shards checked{reclaimed})"
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
    p.add_argument("--stats", action="store_true", help="also show the distribution of the per-sample statistics")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every shard's structure and checksums (exit 1 if anything is wrong)")
    p.add_argument("cache_dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("merge", help="write a view that concatenates caches of one target and settings")
    p.add_argument("caches", nargs="+")
    p.add_argument("--out", required=True, help="the view directory to write")
    p.add_argument("--weights", default=None, help="mixture weight per cache, e.g. 2,1 (default: all 1)")
    p.set_defaults(func=cmd_merge)
    p = sub.add_parser("subset", help="write a view of the samples whose statistics satisfy --where")
    p.add_argument("cache_dir")
    p.add_argument("--out", required=True, help="the view directory to write")
    p.add_argument("--where", required=True, help="e.g. 'supervised_tokens >= 16 and mean_entropy < 2.5'")
    p.set_defaults(func=cmd_subset)
    for register in _method_commands():
        register(sub)
    return parser


def cmd_merge(args: argparse.Namespace) -> int:
    """Run ``speccache merge``."""
    from speccache.read.view import make_merge_view

    try:
        weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    except ValueError:
        raise UsageError(f"--weights {args.weights!r} must be comma-separated numbers, e.g. 2,1") from None
    view = make_merge_view(args.caches, args.out, weights)
    print(f"{args.out}: view of {view.num_samples} samples from {len(view.sources)} caches")
    return 0


def cmd_subset(args: argparse.Namespace) -> int:
    """Run ``speccache subset``."""
    from speccache.read.view import make_subset_view

    view = make_subset_view(args.cache_dir, args.out, args.where)
    print(f"{args.out}: view of {view.num_samples} samples of {args.cache_dir}")
    return 0


def _method_commands() -> list[Callable[[Any], None]]:
    from speccache.compat.commands import register_commands as register_export
    from speccache.precompute.audit import register_commands as register_audit
    from speccache.precompute.command import register_commands
    from speccache.precompute.estimate import register_commands as register_estimate
    from speccache.precompute.regenerate import register_commands as register_regenerate
    from speccache.train.commands import register_commands as register_train

    return [register_commands, register_regenerate, register_estimate, register_audit, register_export, register_train]


@contextlib.contextmanager
def quiet_libraries(quiet: bool) -> Iterator[None]:
    """``--quiet`` is quiet: transformers' (and huggingface_hub's) progress bars, such as "Loading weights", and
    its log lines below errors are off while the command runs, then as they were."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as transformers_logging

    bars, level = transformers_logging.is_progress_bar_enabled(), transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)
        if bars:
            transformers_logging.enable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run unwinds as on Ctrl-C (the writers' cleanup runs)."""


def _terminate(owner: int) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked worker (the tokenizer pool) dies as it would have without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    return handler


def _interrupted(args: argparse.Namespace, exc: KeyboardInterrupt) -> tuple[int, str]:
    """The exit code and the one line of an interrupted command: what it keeps, how to resume (its ``interrupted``)."""
    how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    describe = getattr(args, "interrupted", None)
    said = "" if describe is None else f"; {describe(args, shlex.join(['speccache', *args.argv]))}"
    return (143 if isinstance(exc, Terminated) else 130), f"speccache {args.command}: {how}{said}"


FAILURES = (SpeccacheError, FileNotFoundError, FileExistsError, NotADirectoryError, ValueError)
"""What a command reports as one line, without a traceback: anything else is a bug, whose traceback says where."""


def _exit_code(exc: BaseException) -> int:
    """2 for a refused flag (bad usage), 1 for every other failure."""
    return 2 if isinstance(exc, UsageError) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    A command may set ``interrupted(args, command) -> str`` (``set_defaults``): what an interrupted run keeps and
    the command that resumes it, printed as one line on Ctrl-C or SIGTERM instead of a traceback.

    An error prints one line, ``speccache COMMAND: error: MESSAGE``, and exits 2 for a refused flag (a
    :class:`UsageError`, as argparse's own refusals), 1 for any other of :data:`FAILURES`: a speccache error, a
    missing or existing path, a ``ValueError`` of a library.
    """
    from speccache.precompute.command import resume_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = resume_argv(argv)
    except (*FAILURES, OSError) as exc:  # the recorded command's manifest may be unreadable
        print(f"speccache precompute: error: {exc}", file=sys.stderr)
        return _exit_code(exc)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate(os.getpid())) if main_thread else None
    try:
        with quiet_libraries(getattr(args, "quiet", False)):
            code = args.func(args)
    except KeyboardInterrupt as exc:
        code, line = _interrupted(args, exc)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, one line for the run
            print(line, file=sys.stderr)
    except FAILURES as exc:
        print(f"speccache {args.command}: error: {exc}", file=sys.stderr)
        code = _exit_code(exc)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    # Only a command that imported the process-group module can have left a group (and the module imports torch).
    dist = sys.modules.get("speccache.write.dist")
    return code if dist is None else dist.exit_after_group(code)


if __name__ == "__main__":
    sys.exit(main())

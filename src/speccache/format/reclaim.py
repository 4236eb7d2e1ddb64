"""Reclaim records: shards a following trainer finished with and deleted (or moved) on purpose.

A trainer that reads a cache while it is written (``follow=True`` with ``reclaim``) frees the disk of the
shards it has finished. It first writes ``shard-NNNNNN.reclaimed`` (atomically and durably): the shard's
table row, checked against the file, and where the file goes. Only then does it delete or move the shard.
The record is the decision: whoever finds a record beside its shard (a reclaimer killed between the two
steps) completes it (:func:`finish_reclaims`). Producers count a reclaimed shard as written (a resume
never recomputes it, the seal lists it), ``verify`` and ``inspect`` report it, and a plain reader refuses a
cache that lacks shards, naming the reclaimed ones. Nothing without a record is ever deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import dataclass

from speccache.errors import CacheFormatError, CacheIncompleteError
from speccache.format.durable import file_checksum, fsync_dir, write_bytes_file
from speccache.format.manifest import Manifest, ShardRecord
from speccache.format.names import RECLAIM_RE, reclaim_path, shard_path
from speccache.format.schema import Schema
from speccache.format.shard import NativeShard

__all__ = ["Reclaim", "finish_reclaims", "read_reclaims", "reclaim_shard", "refuse_reclaimed", "shard_record"]

RECLAIM_VERSION = 1


@dataclass(frozen=True)
class Reclaim:
    """One reclaim record: the shard's table row, the directory it was moved to (``None``: deleted), and how many
    of its samples have no supervised token (``--nonfinite skip`` cleared them; ``None`` in a record written
    before the count was recorded), so that a resume counts them without the file."""

    record: ShardRecord
    moved_to: str | None = None
    cleared: int | None = None


def shard_record(path: str, schema: Schema, index: int, num_samples: int | None) -> ShardRecord:
    """The shard table row of the shard file at ``path``, after checking it whole (every tensor's checksum).

    Raises:
        CacheCorruptError, CacheFormatError: the file is not a whole shard ``index`` of this schema.
        OSError: it cannot be read.
    """
    shard = NativeShard(path, schema, index, num_samples, verify=True)
    try:
        ragged = any(spec.ragged for spec in schema.values())
        tokens = shard.num_rows if ragged else 0
        return ShardRecord(
            index, shard.num_samples, tokens, shard.file.size, file_checksum(path), shard.encoding_error()
        )
    finally:
        shard.close()


def read_reclaims(cache_dir: str) -> dict[int, Reclaim]:
    """The reclaim records in ``cache_dir`` by shard index (empty when there are none or no directory).

    Raises:
        CacheFormatError: a record that cannot be parsed (names the file and the fix).
    """
    try:
        names = os.listdir(cache_dir)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found: dict[int, Reclaim] = {}
    for name in names:
        match = RECLAIM_RE.match(name)
        if match is None:
            continue
        index = int(match.group(1))
        path = os.path.join(cache_dir, name)
        try:
            with open(path, "rb") as f:
                body = json.loads(f.read())
            if not isinstance(body, dict) or body.get("version") != RECLAIM_VERSION:
                raise ValueError(body)
            record = ShardRecord.from_json(body["shard"], path)
            moved_to, cleared = body.get("moved_to"), body.get("cleared")
            if record.index != index or not (moved_to is None or isinstance(moved_to, str)):
                raise ValueError(body)
            if not (cleared is None or (type(cleared) is int and 0 <= cleared <= record.samples)):
                raise ValueError(body)
        except FileNotFoundError:
            continue  # listed, then gone: nobody removes records, but a stale NFS listing can show one
        except (OSError, ValueError, KeyError, CacheFormatError):
            raise CacheFormatError(
                f"{path}: a damaged reclaim record (it should say which shard a following trainer deleted after "
                "use). If that shard is still in the directory, delete the record; otherwise restore it from a "
                "backup, since without it the shard reads as lost."
            ) from None
        found[index] = Reclaim(record, moved_to, cleared)
    return found


def refuse_reclaimed(cache_dir: str, manifest: Manifest) -> None:
    """Refuse to read ``cache_dir`` as a whole cache when a following trainer reclaimed some of its shards.

    Raises:
        CacheIncompleteError: names the reclaimed shards and what can still be read.
    """
    reclaimed = sorted(set(manifest.reclaimed) | set(read_reclaims(cache_dir)))
    if reclaimed:
        shown = reclaimed if len(reclaimed) <= 10 else [*reclaimed[:10], "..."]
        raise CacheIncompleteError(
            f"{cache_dir}: {len(reclaimed)} of its {manifest.num_shards} shards were reclaimed (deleted or moved "
            f"after use) by a trainer that followed the cache with reclaim=True: shards {shown}. Its other shards "
            "can still be read with follow=True (reclaimed ones are skipped); for another epoch over all of it, "
            "re-run the precompute into a new directory."
        )


def reclaim_shard(
    cache_dir: str, index: int, schema: Schema, num_samples: int | None, move_to: str | None = None
) -> ShardRecord:
    """Record shard ``index`` as reclaimed, then delete it (or move it into ``move_to``).

    Returns:
        The shard's table row as recorded.

    Raises:
        CacheCorruptError, CacheFormatError: the shard is not whole (nothing is recorded or deleted).
        OSError: the record or the move could not be written (the shard stays where it was, or the record
            says where it goes, and :func:`finish_reclaims` completes it).
    """
    path = shard_path(cache_dir, index)
    record = shard_record(path, schema, index, num_samples)
    shard = NativeShard(path, schema, index, num_samples)
    try:
        cleared = shard.unsupervised_samples()
    finally:
        shard.close()
    moved_to = None if move_to is None else os.path.abspath(move_to)
    body = {"version": RECLAIM_VERSION, "shard": record.to_json(), "moved_to": moved_to, "cleared": cleared}
    write_bytes_file(reclaim_path(cache_dir, index), (json.dumps(body, sort_keys=True) + "\n").encode())
    _complete(cache_dir, index, moved_to)
    return record


def finish_reclaims(cache_dir: str, reclaims: dict[int, Reclaim]) -> list[int]:
    """Delete (or move) the shards whose reclaim record exists but whose file is still there; their indices."""
    done = []
    for index, reclaim in sorted(reclaims.items()):
        if os.path.lexists(shard_path(cache_dir, index)):
            _complete(cache_dir, index, reclaim.moved_to)
            done.append(index)
    return done


def _complete(cache_dir: str, index: int, moved_to: str | None) -> None:
    source = shard_path(cache_dir, index)
    if moved_to is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(source)
        fsync_dir(cache_dir)
        return
    os.makedirs(moved_to, exist_ok=True)
    target = os.path.join(moved_to, os.path.basename(source))
    try:
        os.replace(source, target)
    except FileNotFoundError:
        return  # completed already
    except OSError as exc:
        if exc.errno != errno.EXDEV:  # another filesystem: there a copy, then a delete, is the move
            raise
        partial = target + ".partial"
        shutil.copyfile(source, partial)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, target)
        os.unlink(source)
    fsync_dir(moved_to)
    fsync_dir(cache_dir)

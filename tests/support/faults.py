"""A shard writer that fails (an ``OSError``, as a full disk) after writing one shard, for resume tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

import speccache.write


@contextlib.contextmanager
def crash_after_one_shard(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Within the block, ``NativeShardWriter`` writes one shard and then raises ``OSError``; yields the indices of
    the shards it wrote. The real writer is back after the block."""
    real_call = speccache.write.NativeShardWriter.__call__
    written: list[int] = []

    def failing_call(self, output_dir, shard_index, samples):
        if written:
            raise OSError("simulated crash after one shard")
        written.append(shard_index)
        return real_call(self, output_dir, shard_index, samples)

    monkeypatch.setattr(speccache.write.NativeShardWriter, "__call__", failing_call)
    try:
        yield written
    finally:
        monkeypatch.setattr(speccache.write.NativeShardWriter, "__call__", real_call)

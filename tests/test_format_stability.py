"""Caches written before the package was reorganised read, and are written, byte for byte the same.

The digests below are of caches written by speccache at commit 917e6ad (before the move to subpackages)
with ``python -m speccache.synthetic OUT --samples 20 --shard-size 8 --hidden 16 --max-len 12 --encoding E
--sync``. Today's writer must produce the same bytes: the on-disk format is the contract, and a resumed run
over a cache written by an earlier version relies on it. (zbf16 is left out: its bytes depend on the
zstandard library's version, not on speccache.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

from speccache.read import CacheDataset
from speccache.testing.synthetic import write_synthetic_cache

BEFORE_THE_MOVE = {
    "raw": {
        "manifest": "87b0431abb93d670959dc263b74917a7",
        "shard-000000.safetensors": "d1c39d06cd57891c556a66910b8cddf1",
        "shard-000001.safetensors": "13da32bfd0129d22d04b7cba70ed2d74",
        "shard-000002.safetensors": "dd63b2b622d32a6fe67cd76e8db149b8",
    },
    "fp8": {
        "manifest": "ff2997dd82589820c91ed22a6cc12bb0",
        "shard-000000.safetensors": "9992d71f5989e5782f8db210b2e8936c",
        "shard-000001.safetensors": "dad4347deac495114c8720a5dcf09cbe",
        "shard-000002.safetensors": "15c97b80c2c7e23c7aba949e922c10b3",
    },
}


@pytest.mark.parametrize("encoding", sorted(BEFORE_THE_MOVE))
def test_the_writer_writes_the_bytes_of_the_version_before_the_move(tmp_path, encoding):
    out = str(tmp_path / encoding)
    write_synthetic_cache(out, num_samples=20, shard_size=8, hidden=16, max_len=12, encoding=encoding, overlap=False)
    found = {}
    for name in sorted(os.listdir(out)):
        data = open(os.path.join(out, name), "rb").read()
        if name == "manifest.json":  # the producer's version is informational
            body = json.loads(data)
            body.pop("producer")
            found["manifest"] = xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode())
        else:
            found[name] = xxhash.xxh3_128_hexdigest(data)
    assert found == BEFORE_THE_MOVE[encoding]
    ds = CacheDataset(out)
    assert len(ds) == 20 and ds[19]["hidden"].dtype == torch.bfloat16 and int(ds[19]["sample_id"]) == 19

"""The on-disk format: the contract between writers and readers (docs/format.md says the same in prose).

It knows nothing of models, data loaders or methods. Its rooms:

* :mod:`~speccache.format.names`: file names, shard numbering, reserved tensor names, limits;
* :mod:`~speccache.format.durable`: atomic durable writes and checksums;
* :mod:`~speccache.format.schema`: the key schema (:class:`KeySpec`) and dtype names;
* :mod:`~speccache.format.encoding`: how a key's rows are stored (raw, fp8, zbf16);
* :mod:`~speccache.format.safetensors_file`: safetensors files written and read directly;
* :mod:`~speccache.format.manifest`: the :class:`Manifest` type;
* :mod:`~speccache.format.shard`: the native shard layout and its checks;
* :mod:`~speccache.format.lock`: the writer lock.
"""

from speccache.format.durable import (
    atomic_write,
    bytes_view,
    file_checksum,
    remove_temp_files,
    temp_path,
    tensor_checksum,
    write_bytes_file,
)
from speccache.format.encoding import get_encoding, part_name
from speccache.format.lock import LOCK_NAME, CacheLock
from speccache.format.manifest import Manifest, ShardRecord, SideFileRecord, load_manifest_json
from speccache.format.names import (
    DROPPED_FIELDS_FILE,
    FORMAT_VERSION,
    LENGTHS_KEY,
    MANIFEST_NAME,
    OFFSETS_KEY,
    SAMPLE_TURN_KEY,
    SHARD_RE,
    SKIPPED_ROWS_FILE,
    SOURCE_ROW_KEY,
    STAT_PREFIX,
    TMP_MARK,
    ceil_div,
    check_shard_size,
    existing_shard_indices,
    manifest_path,
    num_shards,
    shard_path,
    shard_samples,
    validate_contiguous_shards,
)
from speccache.format.safetensors_file import ShardFile, WrittenFile, safetensors_prefix, write_safetensors
from speccache.format.schema import KeySpec, Schema, dtype_from_name, dtype_name, sample_turn_spec, source_row_spec
from speccache.format.shard import NativeShard, expected_parts, write_shard_file

__all__ = [
    "DROPPED_FIELDS_FILE",
    "FORMAT_VERSION",
    "LENGTHS_KEY",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "OFFSETS_KEY",
    "SAMPLE_TURN_KEY",
    "SKIPPED_ROWS_FILE",
    "SOURCE_ROW_KEY",
    "STAT_PREFIX",
    "SHARD_RE",
    "SOURCE_ROW_KEY",
    "TMP_MARK",
    "CacheLock",
    "KeySpec",
    "Manifest",
    "NativeShard",
    "Schema",
    "ShardFile",
    "ShardRecord",
    "SideFileRecord",
    "WrittenFile",
    "atomic_write",
    "bytes_view",
    "ceil_div",
    "check_shard_size",
    "dtype_from_name",
    "dtype_name",
    "existing_shard_indices",
    "expected_parts",
    "file_checksum",
    "get_encoding",
    "load_manifest_json",
    "manifest_path",
    "num_shards",
    "part_name",
    "remove_temp_files",
    "safetensors_prefix",
    "sample_turn_spec",
    "shard_path",
    "shard_samples",
    "source_row_spec",
    "tensor_checksum",
    "write_bytes_file",
    "temp_path",
    "validate_contiguous_shards",
    "write_safetensors",
    "write_shard_file",
]

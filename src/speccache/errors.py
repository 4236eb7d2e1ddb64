"""Exceptions speccache raises.

Each subclasses the built-in a caller of the seed module would already catch
(``ValueError``, ``RuntimeError``...), so ``except ValueError`` keeps working,
while new code can catch the specific case. Messages name the file or argument
at fault and what to do about it; docs/errors.md lists them.
"""

from __future__ import annotations

__all__ = [
    "SpeccacheError",
    "CacheFormatError",
    "CacheCorruptError",
    "CacheIncompleteError",
    "CacheLockedError",
    "ConfigMismatchError",
    "DataError",
    "ShardWriteError",
    "CacheExistsError",
    "DistributedError",
    "NonFiniteFeatureError",
    "AuditError",
    "FollowTimeoutError",
    "OutputError",
    "UsageError",
]


class SpeccacheError(Exception):
    """Base class of every error speccache raises on purpose."""


class CacheFormatError(SpeccacheError, ValueError):
    """A cache directory, manifest or shard does not match the documented format."""


class CacheCorruptError(CacheFormatError):
    """A file's bytes differ from what the manifest or shard header recorded."""


class CacheIncompleteError(SpeccacheError, ValueError):
    """The cache is still being written or its writer was interrupted."""


class CacheLockedError(SpeccacheError, RuntimeError):
    """Another writer holds the cache directory's lock."""


class ConfigMismatchError(SpeccacheError, ValueError):
    """A resumed run's configuration differs from the one the cache was started with."""


class DataError(SpeccacheError, ValueError):
    """An input data file or row cannot be used."""


class ShardWriteError(SpeccacheError, RuntimeError):
    """Writing a shard failed (disk full, permissions...); the shard is named."""


class CacheExistsError(SpeccacheError, FileExistsError):
    """The output directory already holds a cache and ``--resume`` was not given."""


class DistributedError(SpeccacheError, RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or failed first (its error is quoted)."""


class NonFiniteFeatureError(SpeccacheError, ValueError):
    """A computed feature is NaN or Inf (``--nonfinite fail``); the sample, data row, key and layer are named."""


class AuditError(SpeccacheError, ValueError):
    """``speccache audit`` cannot re-run the target on a cache (no recorded model, an unknown method)."""


class FollowTimeoutError(SpeccacheError, TimeoutError):
    """A reader following a cache being written waited longer than its timeout for the next shard."""


class OutputError(SpeccacheError, OSError):
    """The operating system refused to create or write an output path (read-only, no permission, name too long,
    disk full); the path and the fix are named, ``errno`` is the refusal's."""


class UsageError(SpeccacheError, ValueError):
    """A flag or argument value is refused (out of range, unknown, or not for this mode); the message names it and
    the fix. The command line exits 2 for it, as for argparse's own refusals; 1 for every other error."""

"""Reading and making views (:mod:`speccache.format.view`): merged caches and subsets, without rewriting shards.

``make_merge_view`` concatenates sealed caches of one schema and compatible
configuration (they may differ only in their data); ``make_subset_view``
selects the samples of a cache whose per-sample statistics satisfy a
``--where`` expression. :class:`ViewDataset` reads a view like a cache, through
one :class:`speccache.read.CacheDataset` per source.

``--where`` grammar: clauses ``NAME OP NUMBER`` joined by ``and``, where NAME
is a per-sample statistic of the cache (``speccache inspect --stats`` lists
them: ``tokens``, ``supervised_tokens``, ``mean_entropy``, ``mean_top1``) and
OP one of ``>= > <= < == !=``. A sample without a value for NAME is not
selected.
"""

from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from speccache.errors import CacheFormatError, CacheIncompleteError, UsageError
from speccache.format import Manifest, file_checksum, shard_path
from speccache.format.manifest import CONFIG_DEFAULTS
from speccache.format.view import View, new_view_dir, source_record
from speccache.read._shard import Sample
from speccache.read.dataset import CacheDataset
from speccache.read.stats import cache_sample_stats

__all__ = ["ViewDataset", "make_merge_view", "make_subset_view", "parse_where", "verify_view"]

DATA_FIELDS = frozenset({"data", "data_hash", "data_split", "limit", "skip_bad_rows"})
"""Config fields that say what data one file's rows came from (a split is data of its own)."""
CACHE_DATA_FIELDS = DATA_FIELDS | {"appended"}
"""Config fields merged caches may differ in: their data, the files appended to them included."""

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}
_CLAUSE = re.compile(r"^\s*([A-Za-z_]\w*)\s*(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def parse_where(expr: str) -> list[tuple[str, str, float]]:
    """Parse a ``--where`` expression into ``(name, op, number)`` clauses.

    Raises:
        ValueError: a clause that is not ``NAME OP NUMBER``; names the clause and the grammar.
    """
    clauses = []
    for text in re.split(r"\s+and\s+", expr.strip()):
        m = _CLAUSE.match(text)
        if not m:
            raise UsageError(
                f"--where clause {text!r} must look like NAME OP NUMBER (OP one of >= > <= < == !=), "
                "clauses joined by 'and', e.g. 'supervised_tokens >= 16 and mean_entropy < 2.5'"
            )
        clauses.append((m.group(1), m.group(2), float(m.group(3))))
    return clauses


def _sealed(cache_dir: str) -> Manifest:
    manifest = Manifest.read(cache_dir)
    if not manifest.complete:
        raise CacheIncompleteError(f"{cache_dir}: a view needs sealed caches; finish it with --resume first")
    return manifest


def _runs(source: int, indices: Sequence[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for i in indices:
        if runs and runs[-1][2] == i:
            runs[-1] = (source, runs[-1][1], i + 1)
        else:
            runs.append((source, i, i + 1))
    return runs


def make_merge_view(caches: Sequence[str], out: str, weights: Sequence[float] | None = None) -> View:
    """Write a view at ``out`` that concatenates ``caches`` (all of their samples, in order).

    Raises:
        CacheFormatError: the caches differ in kind, schema, shard size or configuration other than their data
            (every difference is listed), or ``weights`` are not finite and > 0 or expand an epoch past
            ``MAX_EPOCH_SAMPLES``.
        UsageError: ``weights`` do not give one weight per cache.
        CacheIncompleteError: a cache is not sealed.
        CacheExistsError: ``out`` is a file or holds a view, a cache or other files.
    """
    new_view_dir(out)
    if weights is not None and len(weights) != len(caches):
        raise UsageError(f"--weights {list(weights)} must give one weight per cache ({len(caches)})")
    manifests = [_sealed(c) for c in caches]
    first = manifests[0]
    for cache, m in zip(caches[1:], manifests[1:]):
        differences = [
            f"{name}: {a!r} != {b!r}"
            for name, a, b in (
                ("cache_name", first.cache_name, m.cache_name),
                (
                    "keys",
                    {k: s.to_json() for k, s in first.schema.items()},
                    {k: s.to_json() for k, s in m.schema.items()},
                ),
            )
            if a != b
        ]
        differences += [
            f"side file {name}: checksum {record.checksum} != {getattr(m.side_files.get(name), 'checksum', None)}"
            for name, record in sorted(first.side_files.items())
            if name not in m.side_files or m.side_files[name].checksum != record.checksum
        ]  # e.g. a draft vocabulary chosen from other data: the sources' features would not mean the same
        # as a resume reads them: a field younger than a cache stands for its default there
        a, b = {**CONFIG_DEFAULTS, **first.config}, {**CONFIG_DEFAULTS, **m.config}
        differences += [
            f"config.{k}: {a.get(k)!r} != {b.get(k)!r}"
            for k in sorted((set(a) | set(b)) - CACHE_DATA_FIELDS)
            if a.get(k) != b.get(k)
        ]
        if differences:
            raise CacheFormatError(
                f"cannot merge {caches[0]} and {cache}: they differ in " + "; ".join(differences) + ". Merge only "
                "caches of the same target and settings (they may differ in their data)"
            )
    sources = [
        source_record(out, cache, m, range(m.num_shards), 1.0 if weights is None else float(weights[i]))
        for i, (cache, m) in enumerate(zip(caches, manifests))
    ]
    runs = [(i, 0, m.num_samples) for i, m in enumerate(manifests) if m.num_samples]
    view = View(first.cache_name, first.schema, sources, runs, {"merge": [str(c) for c in caches]}, out)
    view.write(out)
    return view


def make_subset_view(cache: str, out: str, where: str) -> View:
    """Write a view at ``out`` of the samples of ``cache`` that satisfy ``where`` (see the module docstring).

    Raises:
        ValueError: a malformed ``where``, or one naming a statistic the cache does not record.
        CacheIncompleteError: the cache is not sealed.
        CacheExistsError: ``out`` is a file or holds a view, a cache or other files.
    """
    new_view_dir(out)
    clauses = parse_where(where)
    manifest = _sealed(cache)
    stats = cache_sample_stats(cache)
    unknown = sorted({name for name, _, _ in clauses} - set(stats))
    if unknown:
        raise UsageError(
            f"--where names {unknown}, which {cache} does not record per sample; it records {sorted(stats)}"
        )
    chosen = [
        i
        for i in range(manifest.num_samples)
        if all(stats[name][i] is not None and _OPS[op](stats[name][i], value) for name, op, value in clauses)
    ]
    shards = sorted({i // manifest.shard_size for i in chosen})
    view = View(
        manifest.cache_name,
        manifest.schema,
        [source_record(out, cache, manifest, shards, 1.0)],
        _runs(0, chosen),
        {"subset": str(cache), "where": where},
        out,
    )
    view.write(out)
    return view


class ViewDataset(Dataset):
    """A view as a dataset: sample ``i`` is the ``i``-th selected sample of its source.

    It reads like its sources' reader: ``__getitems__`` hands each source its share of a
    batch, ``prefetch`` announces each source's samples, and what describes the kind of
    samples (:data:`SHARED`: a method reader's ``fields`` or ``supervision``, ``collator``,
    ``schema``...) is the first source's, which every source shares (a merge refuses
    sources of another kind, schema or settings).

    Args:
        view_dir: the view directory.
        *args: passed to each source's reader after its directory (``keys``, or a layer reader's ``fields``).
        dataset_cls: the reader of each source (e.g. :class:`speccache.methods.eagle3.Eagle3CacheDataset`).
        **kwargs: passed to each source's reader (``verify``, ``max_open_shards``...).

    Raises:
        CacheFormatError, CacheCorruptError: the view is malformed, or a source changed or vanished.
    """

    SHARED = frozenset(
        {"cache_name", "schema", "keys", "ragged_keys", "collator", "fields", "supervision", "draft_vocab_size"}
    )
    """Attributes read from the first source: they describe the samples, the same for every source."""

    def __init__(
        self,
        view_dir: str,
        *args: Any,
        dataset_cls: type[CacheDataset] = CacheDataset,
        **kwargs: Any,
    ) -> None:
        self.view = View.read(view_dir)
        self.sources = [dataset_cls(self.view.source_dir(i), *args, **kwargs) for i in range(len(self.view.sources))]
        self._ends: list[int] = []
        total = 0
        for _, start, end in self.view.runs:
            total += end - start
            self._ends.append(total)

    def __getattr__(self, name: str) -> Any:
        # Asked only for names neither the class nor the instance holds; before unpickling restores the instance's
        # state there is no source to ask (and no recursion through self.sources).
        if name in ViewDataset.SHARED and "sources" in self.__dict__:
            return getattr(self.sources[0], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def shard_size(self) -> int:
        """The first source's shard size: the run length a locality sampler groups the view's samples by."""
        return self.sources[0].shard_size

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, sample index in that source)`` of view sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a view of {len(self)}")
        run = bisect.bisect_right(self._ends, index)
        source, start, end = self.view.runs[run]
        return source, end - (self._ends[run] - index)

    def _by_source(self, indices: Sequence[int]) -> dict[int, list[tuple[int, int]]]:
        """``source -> [(position in indices, sample index in the source)]``."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for position, index in enumerate(indices):
            source, local = self.locate(index)
            groups.setdefault(source, []).append((position, local))
        return groups

    def __getitem__(self, index: int) -> Sample:
        source, local = self.locate(index)
        return self.sources[source][local]

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """Samples at ``indices`` (in that order), each source reading its share as one batch."""
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        out: list[Any] = [None] * len(indices)
        for source, members in self._by_source(indices).items():
            samples = self.sources[source].__getitems__([local for _, local in members])
            for (position, _), sample in zip(members, samples):
                out[position] = sample
        return out

    def sample_length(self, index: int) -> int:
        """Rows of view sample ``index`` (:meth:`speccache.read.CacheDataset.sample_length`)."""
        source, local = self.locate(index)
        return self.sources[source].sample_length(local)

    def read(
        self, index: int, rows: slice | None = None, keys: Sequence[str] | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of view sample ``index`` (:meth:`speccache.read.CacheDataset.read`)."""
        source, local = self.locate(index)
        return self.sources[source].read(local, rows, keys)

    def prefetch(self, indices: Iterable[int]) -> None:
        """Announce these samples' long reads to the kernel (:meth:`speccache.read.CacheDataset.prefetch`)."""
        for source, members in self._by_source(list(indices)).items():
            self.sources[source].prefetch([local for _, local in members])

    def sample_lengths(self) -> list[int]:
        """Rows of each view sample's ragged keys (:meth:`speccache.read.CacheDataset.sample_lengths`), from the
        offsets of the shards the view references only."""
        lengths: list[int] = []
        for source, start, end in self.view.runs:
            reader = self.sources[source]
            for index in range(start, end):
                shard, local = reader._split(index)
                offsets = reader._shard(shard).row_offsets
                lengths.append(offsets[local + 1] - offsets[local])
        return lengths

    def sample_weights(self) -> list[float]:
        """Each view sample's mixture weight (its source's ``--weights`` entry)."""
        weights = [s.weight for s in self.view.sources]
        return [weights[source] for source, start, end in self.view.runs for _ in range(end - start)]


def verify_view(view_dir: str) -> list[str]:
    """Check a view: its sources as recorded, then every referenced shard's checksum; returns the problems found."""
    try:
        view = View.read(view_dir)
    except CacheFormatError as exc:
        return [str(exc)]
    problems = []
    for number, source in enumerate(view.sources):
        for index, (_, checksum) in sorted(source.shards.items()):
            path = shard_path(view.source_dir(number), index)
            if file_checksum(path) != checksum:
                problems.append(
                    f"{path}: its checksum differs from the one view {view_dir} records; re-create the view"
                )
    return problems

"""Speed benchmarks: speccache side by side with a plain read/write of the same bytes and with the seed reader.

``make bench`` runs ``python benchmarks/run.py --out docs/benchmarks.md``. Every
figure is a ratio of two timings taken in the same run, interleaved round by
round, so that a busy machine slows both sides alike: the best of ``--rounds``
for sections 1, 2, 5 and the non-finite guard; for the read sections (3, 4, 4b),
whose cold reads wait on a disk whose speed drifts between rounds, the median of
the per-round ratios over ``--read-rounds``, job order shuffled each round:

1. write throughput of a cache (``CacheWriter`` + ``NativeShardWriter``: encode,
   hash, temp file, fsync, rename) against writing the same bytes to plain files
   with fsync;
2. precompute wall time with a synthetic compute step (a sleep, as a GPU forward
   leaves the CPU free) calibrated to the measured write time, for the overlapped
   loop (``compute_shard_runs`` + ``OverlappedShardWriter``) and for the seed's
   synchronous ``write_cache_shards``, against ``max(compute, write)``;
3. shuffled batch reads through a DataLoader (``CacheDataset`` + ``PadCollator``,
   ``num_workers=0``) of large (~2 MB) and small (~32 KB) samples, in the order of
   ``LocalityShuffleSampler`` and of a plain random permutation, warm and cold,
   against reading the same files into a reused buffer (warm) and sequentially
   (cold);
4. the same reads with NeMo AutoModel 0.7.0's ``offline_cache`` module (its cache
   layout: fixed keys, samples padded to the longest length);
4b. the drop-in ``speccache.offline_cache`` (``CachedTensorDataset`` + ``collate_cached``)
   against that module, the same calls on the same seed-layout cache, batches of 8;
5. reader start-up (open and first batch) on a 10,000-shard cache.

The seed module is loaded from ``--upstream`` (default: the wheel unpacked at
/tmp/nemo), or downloaded with ``pip download --no-deps nemo-automodel==0.7.0``
into the work directory; sections 4 and 4b are skipped when neither works (4b says so).
Cold reads drop the page cache through /proc/sys/vm/drop_caches when permitted,
else with ``posix_fadvise(DONTNEED)`` per file; the report says which, and how
much of the files was still cached afterwards (``mincore``).

The report is written between ``<!-- run-benchmark:begin -->`` and ``<!-- run-benchmark:end -->`` in
``--out``; the other scripts' sections of that file are kept.

Usage: python benchmarks/run.py --out docs/benchmarks.md [--work bench-out] [--scale 1.0] [--rounds 3]
[--read-rounds 7] [--only SECTION ...] (sections: write, overlap, reads (3 and 4), dropin (4b), startup, nonfinite)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import gc
import glob
import importlib
import importlib.util
import json
import logging
import math
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import types
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from docsection import replace_section  # benchmarks/, beside this script
from speccache.format import LENGTHS_KEY, shard_path
from speccache.read import CacheDataset, PackCollator, PadCollator
from speccache.read.sampler import LocalityShuffleSampler
from speccache.read.view import make_merge_view
from speccache.testing.synthetic import synthetic_schema
from speccache.write import CacheWriter, compute_shard_runs

log = logging.getLogger("bench")
logging.basicConfig(level=logging.WARNING)

UPSTREAM_DEFAULT = "/tmp/nemo/nemo_automodel/components/datasets/llm/offline_cache.py"
UPSTREAM_MEMBER = "nemo_automodel/components/datasets/llm/offline_cache.py"
SEED_KEYS = ("input_ids", "loss_mask", "hidden", "sample_id")
SEED_VERSION = 1
PAGE = mmap.PAGESIZE
SECTIONS = ["write", "overlap", "reads", "dropin", "startup", "nonfinite"]
BEGIN, END = "<!-- run-benchmark:begin -->", "<!-- run-benchmark:end -->"


@dataclass
class Kind:
    """A family of samples: ``min_len..max_len`` tokens of ``hidden`` bf16 values each."""

    name: str
    num_samples: int
    shard_size: int
    hidden: int
    min_len: int
    max_len: int
    batch: int

    def scaled(self, scale: float) -> Kind:
        n = max(self.shard_size * 4, int(self.num_samples * scale) // self.shard_size * self.shard_size)
        return Kind(self.name, n, self.shard_size, self.hidden, self.min_len, self.max_len, self.batch)


LARGE = Kind("large", num_samples=640, shard_size=32, hidden=4096, min_len=192, max_len=256, batch=8)
SMALL = Kind("small", num_samples=16384, shard_size=256, hidden=256, min_len=48, max_len=64, batch=64)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    targets: list[tuple[str, str, bool | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self.add("| " + " | ".join(header) + " |")
        self.add("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.add("| " + " | ".join(str(c) for c in row) + " |")
        self.add()

    def target(self, what: str, measured: str, met: bool | None, why: str = "") -> None:
        """Record a target; ``why`` explains a miss (it goes to the notes only when the target is not met)."""
        self.targets.append((what, measured, met))
        if met is False and why:
            self.notes.append(f"- **{what}**: measured {measured}. {why}")


# ---------------------------------------------------------------------------
# machine, page cache


def machine_description(work: str) -> list[str]:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    usage = shutil.disk_usage(work)
    dev = os.stat(work).st_dev
    block = _block_device(dev)
    disk = f"{usage.total / 2**30:.0f} GiB filesystem"
    if block:
        rot = _read(f"/sys/block/{block}/queue/rotational")
        ra = _read(f"/sys/block/{block}/queue/read_ahead_kb")
        disk += f" on /dev/{block} ({'rotational' if rot == '1' else 'non-rotational'}, read-ahead {ra} KiB)"
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores; memory {mem:.0f} GiB",
        f"- disk: {disk}",
        f"- {platform.system()} {platform.release()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}, numpy {np.__version__}",
    ]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _block_device(dev: int) -> str | None:
    name = f"{os.major(dev)}:{os.minor(dev)}"
    for path in glob.glob("/sys/block/*/dev") + glob.glob("/sys/block/*/*/dev"):
        if _read(path) == name:
            parts = path.split("/")
            return parts[3]
    return None


def last_level_cache() -> str:
    """The size of cpu0's last-level cache as /sys gives it (e.g. ``32768K``), or ``unknown``."""
    sizes = sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"))
    return _read(sizes[-1]) if sizes else "unknown"


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(paths: Sequence[str]) -> float:
    """Fraction of the files' pages in the page cache (``mincore``)."""
    total = resident = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        anchor = ctypes.c_char.from_buffer(mm)
        pages = -(-size // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        total += pages
        del anchor
        mm.close()
    return resident / total if total else 0.0


class PageCache:
    """Empties the page cache of given files, by the strongest means permitted; remembers how."""

    def __init__(self) -> None:
        self.method = ""
        self.residue = 0.0

    def drop(self, paths: Sequence[str]) -> None:
        gc.collect()
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            method = "`echo 3 > /proc/sys/vm/drop_caches`"
        except OSError:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            method = "`posix_fadvise(POSIX_FADV_DONTNEED)` per file (drop_caches not permitted)"
        self.method = method
        self.residue = max(self.residue, resident_fraction(paths))


# ---------------------------------------------------------------------------
# data


class Pool:
    """Random bf16 rows that samples are cut from (views; content does not matter to raw reads and writes)."""

    def __init__(self, hidden: int, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        self.rng = np.random.default_rng(seed)

    def take(self, n: int) -> torch.Tensor:
        start = int(self.rng.integers(0, self.rows.shape[0] - n + 1))
        return self.rows[start : start + n]


def sample_lengths(kind: Kind, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(kind.min_len, kind.max_len + 1, kind.num_samples).tolist()


def native_shard(lengths: Sequence[int], first: int, pool: Pool) -> dict[str, torch.Tensor]:
    """One shard's samples as the native writers take them (ragged keys with ``__lengths__``)."""
    total = int(sum(lengths))
    ids = torch.arange(total, dtype=torch.int32) % 32000
    return {
        "input_ids": ids,
        "loss_mask": ids % 3 != 0,
        "hidden": pool.take(total),
        "sample_id": torch.arange(first, first + len(lengths), dtype=torch.int64),
        LENGTHS_KEY: torch.tensor(lengths, dtype=torch.int64),
    }


def seed_shard(lengths: Sequence[int], first: int, width: int, pool: Pool) -> dict[str, torch.Tensor]:
    """The same samples in the seed's layout: fixed keys, every sample padded to ``width`` tokens."""
    n = len(lengths)
    real = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    ids = (torch.arange(n * width, dtype=torch.int32) % 32000).view(n, width) * real
    return {
        "input_ids": ids,
        "loss_mask": real & (ids % 3 != 0),
        "hidden": pool.take(n * width).view(n, width, -1),
        "sample_id": torch.arange(first, first + n, dtype=torch.int64),
    }


def shard_paths(cache_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache_dir, "shard-*.safetensors")))


def write_native_cache(cache_dir: str, kind: Kind, pool: Pool) -> None:
    """A sealed native cache of ``kind`` through the producer path (reused when a previous run left it)."""
    config = {
        "bench": kind.name,
        "n": kind.num_samples,
        "shard_size": kind.shard_size,
        "hidden": kind.hidden,
        "len": [kind.min_len, kind.max_len],
    }
    if _sealed(cache_dir, config):
        return
    shutil.rmtree(cache_dir, ignore_errors=True)
    lengths = sample_lengths(kind)
    writer = CacheWriter(
        cache_dir,
        cache_name="synthetic",
        schema=synthetic_schema(kind.hidden),
        shard_size=kind.shard_size,
        num_samples=kind.num_samples,
        config=config,
    )
    with writer.writing() as run:
        for index in run.shards:
            a = index * kind.shard_size
            run.write_shard(cache_dir, index, native_shard(lengths[a : a + kind.shard_size], a, pool))


def merged_view(work: str, kind: Kind, native_dir: str) -> tuple[str, list[str]]:
    """A view merging the cache at ``native_dir`` with a second cache of ``kind`` (other rows), and the shard files
    of both (reused when a previous run left them)."""
    other = os.path.join(work, f"read-{kind.name}-b")
    pool = Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=4)
    write_native_cache(other, kind, pool)
    del pool
    view_dir = os.path.join(work, f"read-{kind.name}-view")
    shutil.rmtree(view_dir, ignore_errors=True)  # its sources' identities change when they are rewritten
    make_merge_view([native_dir, other], view_dir)
    return view_dir, shard_paths(native_dir) + shard_paths(other)


def _sealed(cache_dir: str, config: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(cache_dir, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(manifest.get("complete")) and manifest.get("config") == config


def write_seed_cache(cache_dir: str, kind: Kind, pool: Pool) -> None:
    """The same samples as a seed-layout cache, written as the seed does (``safetensors.torch.save_file``)."""
    from safetensors.torch import save_file

    manifest = {
        "format_version": SEED_VERSION,
        "shard_size": kind.shard_size,
        "num_samples": kind.num_samples,
        "bench": [kind.name, kind.hidden, kind.min_len, kind.max_len],
    }
    try:
        with open(os.path.join(cache_dir, "manifest.json")) as f:
            if json.load(f) == manifest:
                return
    except (OSError, ValueError):
        pass
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(cache_dir)
    lengths = sample_lengths(kind)
    for index, a in enumerate(range(0, kind.num_samples, kind.shard_size)):
        save_file(seed_shard(lengths[a : a + kind.shard_size], a, kind.max_len, pool), shard_path(cache_dir, index))
    with open(os.path.join(cache_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


# ---------------------------------------------------------------------------
# the seed module


def load_upstream(path: str, work: str) -> tuple[types.ModuleType | None, str]:
    """NeMo AutoModel 0.7.0's offline_cache module, loaded by file with its one import stubbed; or ``None`` and why."""
    if not os.path.exists(path):
        path = _download_upstream(work)
        if path is None:
            return None, "nemo-automodel 0.7.0 not found (pass --upstream FILE, or allow `pip download`)"

    def safe_import_from(module: str, name: str) -> tuple[bool, Any]:
        try:
            return True, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False, None

    for name in ("nemo_automodel", "nemo_automodel.shared"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("nemo_automodel.shared.import_utils")
    utils.safe_import_from = safe_import_from  # type: ignore[attr-defined]
    sys.modules["nemo_automodel.shared.import_utils"] = utils
    spec = importlib.util.spec_from_file_location("nemo_offline_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _download_upstream(work: str) -> str | None:
    target = os.path.join(work, "upstream")
    member = os.path.join(target, UPSTREAM_MEMBER)
    if os.path.exists(member):
        return member
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", target, "nemo-automodel==0.7.0"],
            check=True,
            timeout=300,
        )
        wheel = glob.glob(os.path.join(target, "nemo_automodel-0.7.0-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            z.extract(UPSTREAM_MEMBER, target)
        return member
    except (OSError, subprocess.SubprocessError, IndexError, KeyError):
        return None


# ---------------------------------------------------------------------------
# timing helpers


def best_of(rounds: int, jobs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Run every job once per round, interleaved; keep each job's smallest time."""
    best = {name: math.inf for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            best[name] = min(best[name], job())
    return best


@dataclass
class Paired:
    """Each job's time in every round of :func:`paired_rounds`."""

    times: dict[str, list[float]]

    def __getitem__(self, name: str) -> float:
        """The job's median time."""
        return statistics.median(self.times[name])

    def ratios(self, baseline: str, job: str) -> list[float]:
        """``baseline``'s time / ``job``'s time, round by round."""
        return [a / b for a, b in zip(self.times[baseline], self.times[job])]

    def ratio(self, baseline: str, job: str) -> float:
        """The median of :meth:`ratios`."""
        return statistics.median(self.ratios(baseline, job))

    def spread(self, baseline: str, job: str) -> str:
        """The smallest and largest of :meth:`ratios`."""
        r = self.ratios(baseline, job)
        return f"{min(r):.2f}-{max(r):.2f}x"


def paired_rounds(rounds: int, jobs: dict[str, Callable[[], float]], seed: int = 0) -> Paired:
    """Run every job once per round, in a new shuffled order each round; keep every time.

    Cold reads are compared round by round: this shared virtual disk's speed drifts by up to 2x between
    rounds (the plain read of one cache took 0.55-1.2 s in one hour), so the best time of each job alone
    would compare one job's fastest disk with another's slowest.
    """
    order = list(jobs)
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(jobs[name]())
    return Paired(times)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "**not met**")


# ---------------------------------------------------------------------------
# 1. write throughput


def bench_write(report: Report, work: str, scale: float, rounds: int) -> float:
    kind = Kind(
        "write",
        num_samples=max(64, int(384 * scale)) // 8 * 8,
        shard_size=8,
        hidden=4096,
        min_len=256,
        max_len=256,
        batch=8,
    )
    pool = Pool(kind.hidden, 8192, seed=1)
    lengths = sample_lengths(kind)
    shards = [
        native_shard(lengths[a : a + kind.shard_size], a, pool) for a in range(0, kind.num_samples, kind.shard_size)
    ]
    out = os.path.join(work, "write")
    schema = synthetic_schema(kind.hidden)

    def cache() -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        writer = CacheWriter(
            out,
            cache_name="synthetic",
            schema=schema,
            shard_size=kind.shard_size,
            num_samples=kind.num_samples,
            config={"bench": "write"},
        )
        with writer.writing(overlap=False) as run:
            for index in run.shards:
                run.write_shard(out, index, shards[index])
        return time.perf_counter() - t

    def plain() -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()
        t = time.perf_counter()
        for index, shard in enumerate(shards):
            with open(os.path.join(out, f"plain-{index}"), "wb") as f:
                for value in shard.values():
                    f.write(memoryview(value.contiguous().view(torch.uint8).numpy()))
                os.fsync(f.fileno())
        return time.perf_counter() - t

    best = best_of(rounds, {"cache": cache, "plain": plain})
    nbytes = sum(os.path.getsize(p) for p in shard_paths(out)) if shard_paths(out) else 0
    if not nbytes:
        cache()
        nbytes = sum(os.path.getsize(p) for p in shard_paths(out))
    shutil.rmtree(out, ignore_errors=True)
    report.add("## 1. Write throughput")
    report.add()
    report.add(
        f"{len(shards)} shards of {kind.shard_size} samples x {kind.max_len} tokens x {kind.hidden} bf16 "
        f"({nbytes / 1e6:.0f} MB). The cache path encodes, hashes (per tensor and per file), writes a temp "
        "file, fsyncs, renames and fsyncs the directory per shard, then seals the manifest; the plain path "
        "writes the same tensor bytes to one file per shard and fsyncs it."
    )
    report.add()
    report.table(
        ["path", "seconds", "MB/s"],
        [
            ["speccache cache write", f"{best['cache']:.2f}", f"{nbytes / best['cache'] / 1e6:.0f}"],
            ["plain write + fsync", f"{best['plain']:.2f}", f"{nbytes / best['plain'] / 1e6:.0f}"],
        ],
    )
    r = best["plain"] / best["cache"]
    report.add(f"Cache write throughput / plain write throughput: **{r:.2f}x**.")
    report.add()
    report.target("write throughput vs plain write + fsync (reported, no target)", f"{r:.2f}x", None)
    return best["cache"]


# ---------------------------------------------------------------------------
# 2. precompute overlap


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _first_index(batch: list[int]) -> int:
    return batch[0]


def bench_overlap(report: Report, work: str, scale: float, rounds: int, upstream: types.ModuleType | None) -> None:
    shard_size, batch, length, hidden = 8, 4, 256, 4096
    n = max(64, int(384 * scale)) // shard_size * shard_size
    pool = Pool(hidden, 8192, seed=2)
    native = [native_shard([length] * batch, a, pool) for a in range(0, n, batch)]
    seed = [seed_shard([length] * batch, a, length, pool) for a in range(0, n, batch)]
    schema = synthetic_schema(hidden)
    loader = DataLoader(_Indices(n), batch_size=batch, collate_fn=_first_index)
    out = os.path.join(work, "overlap")
    ragged = [k for k, s in schema.items() if s.ragged]
    delay = {"ours": 0.0, "seed": 0.0}

    def compute(outputs: list[dict[str, torch.Tensor]], who: str) -> Callable[[int], dict[str, torch.Tensor]]:
        def step(first: int) -> dict[str, torch.Tensor]:
            if delay[who]:
                time.sleep(delay[who])
            return outputs[first // batch]

        return step

    def ours(write: str) -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        if write == "none":  # compute alone: the same loop, shards dropped
            compute_shard_runs(
                loader,
                out,
                shard_size,
                range(n // shard_size),
                compute(native, "ours"),
                lambda d, i, s: shard_path(d, i),
                log,
                ragged_keys=ragged,
            )
            return time.perf_counter() - t
        writer = CacheWriter(
            out,
            cache_name="synthetic",
            schema=schema,
            shard_size=shard_size,
            num_samples=n,
            config={"bench": "overlap"},
        )
        with writer.writing(overlap=write == "overlapped") as run:
            compute_shard_runs(
                loader, out, shard_size, run.shards, compute(native, "ours"), run.write_shard, log, ragged_keys=ragged
            )
        return time.perf_counter() - t

    def theirs(write: bool = True) -> float:
        assert upstream is not None
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()

        def write_fn(d: str, i: int, s: dict[str, torch.Tensor]) -> str:
            return upstream.write_tensor_shard(d, i, s, SEED_KEYS, "bench") if write else shard_path(d, i)

        t = time.perf_counter()
        upstream.write_cache_shards(
            dataloader=loader,
            output_dir=out,
            shard_size=shard_size,
            start_shard_index=0,
            compute_batch=compute(seed, "seed"),
            write_shard_fn=write_fn,
            logger=log,
        )
        elapsed = time.perf_counter() - t
        os.sync()  # its writes skip fsync: flush them before the next timing, outside this one
        return elapsed

    # Writes alone (no compute) calibrate each loop's compute step to take as long in all.
    alone = best_of(rounds, {"ours": lambda: ours("sync"), **({"seed": theirs} if upstream else {})})
    delay["ours"] = alone["ours"] / len(native)

    def without_compute(who: str, loop: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            step, delay[who] = delay[who], 0.0
            try:
                return loop()
            finally:
                delay[who] = step

        return run

    # The writes are timed again in the same rounds as the loops, so that the disk's drift between the
    # calibration and the rounds does not move the bound.
    jobs: dict[str, Callable[[], float]] = {
        "compute": lambda: ours("none"),
        "writes": without_compute("ours", lambda: ours("sync")),
        "overlapped": lambda: ours("overlapped"),
        "sync": lambda: ours("sync"),
    }
    if upstream is not None:
        delay["seed"] = alone["seed"] / len(seed)
        jobs.update(
            {
                "seed compute": lambda: theirs(write=False),
                "seed writes": without_compute("seed", theirs),
                "seed": theirs,
            }
        )
    best = best_of(rounds, jobs)
    shutil.rmtree(out, ignore_errors=True)
    c, w = best["compute"], best["writes"]
    bound = max(c, w)
    report.add("## 2. Precompute: compute overlapped with writing")
    report.add()
    report.add(
        f"{n // shard_size} shards of {shard_size} samples x {length} tokens x {hidden} bf16, batches of {batch}. "
        "The compute step is a sleep (the CPU stays free, as during a GPU forward) calibrated so that the loop "
        "with compute only takes as long as the loop with writes only: "
        f"{delay['ours'] * 1e3:.1f} ms per batch for speccache (`CacheWriter` + `compute_shard_runs`, "
        "`OverlappedShardWriter` or the `NativeShardWriter` itself)"
        + (
            f", {delay['seed'] * 1e3:.1f} ms for the seed's `write_cache_shards`, whose `save_file` writes "
            "do not fsync."
            if upstream is not None
            else "."
        )
        + " The writes-only loops are timed again in the rounds of the others (best of each), so that the bound "
        "moves with the disk as the loops do."
    )
    report.add()
    rows = [
        ["speccache: compute only (shards dropped)", f"{c:.2f}", ""],
        ["speccache: writes only (no compute)", f"{w:.2f}", ""],
        [
            "speccache: overlapped loop",
            f"{best['overlapped']:.2f}",
            f"{best['overlapped'] / bound:.2f}x max(compute, write)",
        ],
        [
            "speccache: synchronous loop",
            f"{best['sync']:.2f}",
            f"{best['sync'] / bound:.2f}x max(compute, write); {best['sync'] / (c + w):.2f}x (compute + write)",
        ],
    ]
    if upstream is not None:
        cs, ws = best["seed compute"], best["seed writes"]
        rows += [
            ["seed: compute only", f"{cs:.2f}", ""],
            ["seed: writes only", f"{ws:.2f}", ""],
            [
                "seed: synchronous loop",
                f"{best['seed']:.2f}",
                f"{best['seed'] / max(cs, ws):.2f}x max(compute, write); {best['seed'] / (cs + ws):.2f}x (compute "
                "+ write)",
            ],
        ]
    report.table(["run", "seconds", "ratio"], rows)
    r = best["overlapped"] / bound
    report.target(
        "precompute overlapped loop <= 1.15x max(compute, write)",
        f"{r:.2f}x",
        r <= 1.15,
        f"Writing the last shard ({w / (n // shard_size):.2f} s) and entering and sealing `CacheWriter.writing` "
        "cannot overlap any "
        "compute; beyond that, the writer thread (hashing, copying into the page cache, fsync) and the producer's "
        "thread contend for this machine's 2 shared cores, which the two single-resource loops do not.",
    )
    if upstream is not None:
        report.target(
            "seed synchronous loop: about compute + write (reported)",
            f"{best['seed'] / (cs + ws):.2f}x (compute + write)",
            None,
        )


# ---------------------------------------------------------------------------
# 3 and 4. shuffled batch reads


def read_files(paths: Sequence[str], *bufs: mmap.mmap | memoryview) -> int:
    """Read ``paths`` whole into ``bufs``, a buffer's length at a time, one buffer after the other in turn (two:
    as a loader fills a batch while its consumer still holds the one before)."""
    total = k = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(bufs[k % len(bufs)]):
                total += n
                k += 1
    return total


def epoch(
    dataset: Dataset, order: Iterable[int], batch: int, collate: Callable[[list[Any]], dict[str, torch.Tensor]]
) -> float:
    loader = DataLoader(dataset, batch_size=batch, sampler=order, collate_fn=collate, num_workers=0)
    t = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t


def bare_copies(cache_dir: str, order: Sequence[int], batch: int) -> float:
    """One epoch of nothing but one ``memoryview`` copy per sample and raw key, from the mappings of a fresh
    dataset's shards into one reused buffer, each batch of ``order`` packed from its start: what a reader with one
    Python statement per sample and key costs at least (no DataLoader, collator or checks). Reads the reader's
    internals on purpose."""
    ds = CacheDataset(cache_dir)
    shards = [ds._open_shard(i) for i in range(len(shard_paths(cache_dir)))]
    keys = [(k, info.row_bytes, info.ragged) for k, info in shards[0].infos.items() if shards[0].bases.get(k)]
    out = mmap.mmap(-1, 64 << 20)
    dst = memoryview(out)
    size = ds.shard_size
    t = time.perf_counter()
    for first in range(0, len(order), batch):
        position = 0
        for key, row_bytes, ragged in keys:
            for index in order[first : first + batch]:
                source, local = shards[index // size], index % size
                a, b = (source.row_offsets[local], source.row_offsets[local + 1]) if ragged else (local, local + 1)
                n = (b - a) * row_bytes
                dst[position : position + n] = source.mapped[key][a * row_bytes : b * row_bytes]
                position += n
    spent = time.perf_counter() - t
    dst.release()
    out.close()
    return spent


def warmed(buf: mmap.mmap, files: list[str], job: Callable[[], float]) -> Callable[[], float]:
    """``job`` run right after reading ``files`` whole (a warm page cache)."""

    def run() -> float:
        read_files(files, buf)
        return job()

    return run


def cooled(cache: PageCache, files: list[str], job: Callable[[], float]) -> Callable[[], float]:
    """``job`` run right after dropping ``files`` from the page cache."""

    def run() -> float:
        cache.drop(files)
        return job()

    return run


def bench_reads(
    report: Report, work: str, kinds: Sequence[Kind], rounds: int, upstream: types.ModuleType | None, cache: PageCache
) -> None:
    rows3, rows4 = [], []
    sizes: list[str] = []
    for kind in kinds:
        native_dir = os.path.join(work, f"read-{kind.name}")
        seed_dir = os.path.join(work, f"read-{kind.name}-seed")
        pool = Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=3)
        write_native_cache(native_dir, kind, pool)
        if upstream is not None:
            write_seed_cache(seed_dir, kind, pool)
        del pool
        native_files = shard_paths(native_dir)
        seed_files = shard_paths(seed_dir) if upstream is not None else []
        every = native_files + seed_files
        orders = {
            "locality": LocalityShuffleSampler(kind.num_samples, kind.shard_size, seed=0).rank_order().tolist(),
            "random": np.random.default_rng(0).permutation(kind.num_samples).tolist(),
        }
        buf = mmap.mmap(-1, 16 << 20)
        nbytes = sum(os.path.getsize(p) for p in native_files)
        batch_bytes = nbytes // kind.num_samples * kind.batch
        pair = [mmap.mmap(-1, batch_bytes) for _ in range(2)]
        for b in pair:
            b.write(bytes(batch_bytes))  # faulted in before the rounds, as a loader's reused batch memory is
        ragged = ["input_ids", "loss_mask", "hidden"]
        collators = {"pack": PackCollator(ragged), "pad": PadCollator(ragged)}
        seed_collate = functools.partial(upstream.collate_cached, keys=SEED_KEYS) if upstream is not None else None

        warm = functools.partial(warmed, buf)
        cold = functools.partial(cooled, cache)
        jobs: dict[str, Callable[[], float]] = {
            "plain warm": warm(native_files, lambda: timed(lambda: read_files(native_files, buf))),
            "plain cold": cold(native_files, lambda: timed(lambda: read_files(native_files, buf))),
            "plain warm, two batch buffers": warm(native_files, lambda: timed(lambda: read_files(native_files, *pair))),
            "bare copies warm": warm(
                native_files, functools.partial(bare_copies, native_dir, orders["locality"], kind.batch)
            ),
        }
        for order_name, order in orders.items():
            for variant, collate in collators.items():

                def ours(
                    order: list[int] = order, local: bool = order_name == "locality", collate: Any = collate
                ) -> float:
                    ds = CacheDataset(native_dir)
                    sampler = (
                        LocalityShuffleSampler(ds, ds.shard_size, seed=0, prefetch=ds.prefetch) if local else order
                    )
                    return epoch(ds, sampler, kind.batch, collate)

                jobs[f"ours-{variant} {order_name} warm"] = warm(native_files, ours)
                jobs[f"ours-{variant} {order_name} cold"] = cold(every, ours)
            if upstream is not None:

                def theirs(order: list[int] = order) -> float:
                    ds = upstream.CachedTensorDataset(
                        cache_dir=seed_dir, cache_name="bench", format_version=SEED_VERSION, disk_keys=SEED_KEYS
                    )
                    return epoch(ds, order, kind.batch, seed_collate)

                jobs[f"seed {order_name} warm"] = warm(seed_files, theirs)
                jobs[f"seed {order_name} cold"] = cold(every, theirs)
        if kind.name == SMALL.name:  # a view's reads, on the cheaper kind: this cache merged with one more like it
            view_dir, view_files = merged_view(work, kind, native_dir)
            jobs["plain warm, both caches"] = warm(view_files, lambda: timed(lambda: read_files(view_files, buf)))
            view_order = np.random.default_rng(0).permutation(2 * kind.num_samples).tolist()
            jobs["ours-pack view random warm"] = warm(
                view_files, lambda: epoch(CacheDataset(view_dir), view_order, kind.batch, collators["pack"])
            )
        runs = paired_rounds(rounds, jobs)
        seed_bytes = sum(os.path.getsize(p) for p in seed_files)
        label = (
            f"{kind.name} ({kind.num_samples} samples of {kind.min_len}-{kind.max_len} tokens x {kind.hidden} bf16, "
            f"~{nbytes / kind.num_samples / 1e6:.2f} MB; batch {kind.batch})"
        )
        for order_name in orders:
            for state in ("warm", "cold"):
                ours, plain = f"ours-pack {order_name} {state}", f"plain {state}"
                r = runs.ratio(plain, ours)
                target = {("large", "warm"): 0.9, ("large", "cold"): 0.9, ("small", "warm"): 0.5}.get(
                    (kind.name, state)
                )
                met = None if target is None or order_name != "locality" else r >= target
                rows3.append(
                    [
                        label,
                        order_name,
                        state,
                        f"{runs[ours]:.2f}",
                        f"{runs[plain]:.2f}",
                        f"{r:.2f}x",
                        runs.spread(plain, ours),
                        f">= {target}x" if target and order_name == "locality" else "",
                        verdict(met) if met is not None else "",
                    ]
                )
                if met is not None:
                    report.target(
                        f"{kind.name} {state} shuffled reads (locality sampler) >= {target}x plain "
                        f"{'read into a reused buffer' if state == 'warm' else 'sequential read'}",
                        f"{r:.2f}x",
                        met,
                        (WHY.get((kind.name, state)) or WHY[state]).format(
                            bare=runs["bare copies warm"],
                            bare_ratio=runs.ratio("plain warm", "bare copies warm"),
                            pair=runs["plain warm, two batch buffers"],
                            pair_ratio=runs.ratio("plain warm", "plain warm, two batch buffers"),
                            batch_mb=batch_bytes / 1e6,
                            llc=last_level_cache(),
                            ours_warm=runs["ours-pack locality warm"],
                            ours_cold=runs["ours-pack locality cold"],
                            plain_warm=runs["plain warm"],
                            plain_cold=runs["plain cold"],
                            rounds=rounds,
                            spread=runs.spread("plain cold", "ours-pack locality cold"),
                        ),
                    )
                if upstream is not None:
                    seed, ours = f"seed {order_name} {state}", f"ours-pad {order_name} {state}"
                    seed_t, ours_t = runs[seed], runs[ours]
                    r4 = runs.ratio(seed, ours)
                    met4 = r4 >= 3 if kind.name == "small" else None
                    rows4.append(
                        [
                            label,
                            order_name,
                            state,
                            f"{ours_t:.2f}",
                            f"{seed_t:.2f}",
                            f"{r4:.2f}x",
                            runs.spread(seed, ours),
                            ">= 3x" if kind.name == "small" else "",
                            verdict(met4) if met4 is not None else "",
                        ]
                    )
                    if met4 is not None:
                        ours_w, seed_w = runs[f"ours-pad {order_name} warm"], runs[f"seed {order_name} warm"]
                        why = WHY[f"seed {state}"].format(
                            ours=ours_t,
                            seed=seed_t,
                            ours_warm=ours_w,
                            seed_warm=seed_w,
                            ours_io=ours_t - ours_w,
                            seed_io=seed_t - seed_w,
                        )
                        report.target(
                            f"small {state} reads ({order_name} order) >= 3x the seed reader", f"{r4:.2f}x", met4, why
                        )
        if "ours-pack view random warm" in runs.times:
            rows3.append(
                [
                    f"{kind.name}, a view merging two such caches ({2 * kind.num_samples} samples)",
                    "random",
                    "warm",
                    f"{runs['ours-pack view random warm']:.2f}",
                    f"{runs['plain warm, both caches']:.2f}",
                    f"{runs.ratio('plain warm, both caches', 'ours-pack view random warm'):.2f}x",
                    runs.spread("plain warm, both caches", "ours-pack view random warm"),
                    "",
                    "",
                ]
            )
        sizes.append(
            f"{kind.name} {nbytes / 1e6:.0f} MB"
            + (f" ({seed_bytes / 1e6:.0f} MB in the seed's layout)" if seed_bytes else "")
        )
        buf.close()
        for b in pair:
            b.close()
    report.add("## 3. Shuffled batch reads against a plain read of the same files")
    report.add()
    report.add(
        "One epoch through `DataLoader(CacheDataset, batch_size=B, sampler=..., collate_fn=PackCollator, "
        "num_workers=0)`, a fresh dataset each time (shards opened during the epoch); caches: "
        f"{', '.join(sizes)}. PackCollator concatenates the samples, so the batches hold exactly the "
        "shards' data bytes, like the baseline. Locality order: `LocalityShuffleSampler(dataset, shard_size, "
        "prefetch=dataset.prefetch)` (windows of 8 shards; each window's samples are announced when it starts "
        "within one window of the position, and a background thread reads them into the page cache in file order "
        "while batches are collated); random order: a uniform permutation as a plain list. The baseline "
        "reads every shard file whole into one reused 16 MiB buffer: warm, right after a read that fills the "
        "page cache; cold, sequentially after dropping it. "
        f"{rounds} rounds, every job once per round in a new shuffled order: the times are each job's median, "
        "the ratio is the median of the rounds' baseline time / speccache time (1.00x: as fast as the plain "
        "read), and 'rounds' gives the smallest and largest of those per-round ratios. The last row reads a view "
        "(`speccache merge`) of the small cache and a second cache like it, in a uniform random order (a batch "
        "mixes both sources), against the plain read of both caches' files."
    )
    report.add()
    report.table(["samples", "order", "cache", "speccache s", "plain s", "ratio", "rounds", "target", ""], rows3)
    if upstream is not None:
        report.add("## 4. The same reads with NeMo AutoModel 0.7.0's offline cache")
        report.add()
        report.add(
            "`CachedTensorDataset` + `collate_cached` of nemo-automodel 0.7.0's `offline_cache` module, over a "
            "cache of the same samples in its layout (fixed keys `input_ids`, `loss_mask`, `hidden`, `sample_id`, "
            "each sample padded to the longest length, as it requires; same bytes per real token), the same "
            "orders and batch sizes. speccache uses `PadCollator` here, so that both produce padded batches "
            "(its pad to the batch's longest sample). Ratio: seed time / speccache time, in the same rounds and "
            "with the same statistics as section 3."
        )
        report.add()
        report.table(["samples", "order", "cache", "speccache s", "seed s", "speedup", "rounds", "target", ""], rows4)
    if cache.method:
        report.add(
            f"Page cache dropped with {cache.method}; afterwards at most {cache.residue:.1%} of the files' "
            "pages were still cached (`mincore`)."
        )
        report.add()


WHY = {
    ("small", "warm"): (
        "In the same rounds, an epoch of nothing but one `memoryview` copy per sample and raw key from the "
        "shards' mappings into a reused buffer, each batch packed (no DataLoader, collator or checks), took "
        "{bare:.2f} s, {bare_ratio:.2f}x the plain read; the reader took {ours_warm:.2f} s and the plain read "
        "{plain_warm:.2f} s. "
        "Between the bare loop and the reader lie the DataLoader's and the collator's per-batch work and the "
        "per-sample bookkeeping (a SampleView each, its shard's rows); between the plain read and the bare loop, "
        "one interpreted copy per sample and key (~30 KB samples in 4 keys here). Below that needs the gather of a "
        "batch's rows in compiled code, one call per batch and key across several files' mappings, which none of "
        "the project's dependencies offers."
    ),
    ("large", "warm"): (
        "In the same rounds, the same plain read into two batch-sized buffers ({batch_mb:.0f} MB) in turn took "
        "{pair:.2f} s, {pair_ratio:.2f}x the plain read into one 16 MiB buffer: that buffer stays in the CPU's "
        "last-level cache ({llc} here) and two batches do not, and a loader fills each batch while its consumer "
        "still holds the one before: a ceiling for any batch loader on this machine. "
        "An epoch of nothing but one copy per sample and key from the mappings of a fresh dataset's shards into "
        "one reused buffer, each batch packed as the collator packs it, took {bare:.2f} s, {bare_ratio:.2f}x the "
        "plain read; the reader took {ours_warm:.2f} s and the plain read {plain_warm:.2f} s. What the reader adds "
        "beyond the two buffers is the kernel's copy of `pread` for the 2 MB samples and the DataLoader's and the "
        "collator's per-batch work. Copying the 2 MB samples from the mapping instead saved 4-17% of the epoch "
        "in paired development runs, but the pages stayed mapped, counted in the trainer's resident memory while "
        "the shard is open, and unmapping them after each batch (`MADV_DONTNEED`, rounded out to the 2 MiB folios "
        "that one fault maps on this kernel) cost as much as it saved or more: the reader keeps `pread`."
    ),
    "cold": (
        "The cold epoch took {ours_cold:.2f} s (median of {rounds} rounds), the plain sequential read "
        "{plain_cold:.2f} s and the warm epoch {ours_warm:.2f} s; the per-round ratios ranged over {spread}. "
        "A background thread reads each window's samples into the page cache shard by shard in file order "
        "(touching samples as one `sendfile` to /dev/null) while batches are collated, so the disk streams as "
        "for the plain read. What the epoch adds to that stream: reading the first shard's header before the "
        "stream starts, and the copies of the last window, which begin only when its last shard is read (each of "
        "its batches has samples in every shard of the window), about the warm epoch's time times the last "
        "window's share of the cache. Where the copies are slower than the disk (busy cores: compare the warm "
        "epoch with the plain cold read), the epoch is the copies, not the stream."
    ),
    "seed warm": (
        "Both readers did the same work as in the other rows; the seed reader's per-sample overhead is what "
        "speccache removes, and it was smaller in this run ({seed:.2f} s against {ours:.2f} s)."
    ),
    "seed cold": (
        "Cold, both readers wait for the same disk: beyond its warm time, speccache spent {ours_io:.2f} s and the "
        "seed reader {seed_io:.2f} s on reading (the seed's cache is larger by its padding). The target holds when "
        "the disk time is small next to the seed's per-sample overhead ({seed_warm:.2f} s warm against "
        "{ours_warm:.2f} s), which depends on how fast this shared virtual disk was during the run."
    ),
}


# ---------------------------------------------------------------------------
# 4b. the NeMo drop-in against the module it replaces

DROPIN_BATCH = 8
DROPIN_WHY = {
    ("large", "warm"): (
        "Warm, both readers copy every byte of the batch once ({ours:.2f} s against {theirs:.2f} s): the drop-in "
        "with one `pread` per sample and key into reused batch memory, the original with `torch.stack` from a "
        "fresh `safe_open` mapping, whose page faults cost about what the kernel's copy costs. In development "
        "runs replaying the epoch's 640 reads of 2 MB, `pread` took 0.49 s and fault-and-copy 0.47 s; copying "
        "from a mapping whose pages were already mapped took about half as long, but every epoch here opens a "
        "fresh dataset. With 2 MB samples, the per-sample Python work the drop-in saves is under 5% of the epoch."
    ),
}


def bench_dropin(
    report: Report, work: str, kinds: Sequence[Kind], rounds: int, upstream: types.ModuleType, cache: PageCache
) -> None:
    """``speccache.offline_cache`` against NeMo AutoModel 0.7.0's module: same calls, same seed-layout cache."""
    import speccache.offline_cache as dropin

    rows = []
    buf = mmap.mmap(-1, 16 << 20)
    for kind in kinds:
        seed_dir = os.path.join(work, f"read-{kind.name}-seed")
        write_seed_cache(seed_dir, kind, Pool(kind.hidden, max(8192, kind.shard_size * kind.max_len * 2), seed=3))
        files = shard_paths(seed_dir)
        order = np.random.default_rng(1).permutation(kind.num_samples).tolist()

        def reader(module: types.ModuleType, seed_dir: str = seed_dir, order: list[int] = order) -> Callable[[], float]:
            def run() -> float:
                ds = module.CachedTensorDataset(
                    cache_dir=seed_dir, cache_name="bench", format_version=SEED_VERSION, disk_keys=SEED_KEYS
                )
                return epoch(ds, order, DROPIN_BATCH, functools.partial(module.collate_cached, keys=SEED_KEYS))

            return run

        jobs = {}
        for state, prepare in (("warm", functools.partial(warmed, buf)), ("cold", functools.partial(cooled, cache))):
            jobs[f"drop-in {state}"] = prepare(files, reader(dropin))
            jobs[f"seed {state}"] = prepare(files, reader(upstream))
        runs = paired_rounds(rounds, jobs)
        for state in ("warm", "cold"):
            ours, theirs = runs[f"drop-in {state}"], runs[f"seed {state}"]
            r = runs.ratio(f"seed {state}", f"drop-in {state}")
            rows.append(
                [
                    f"{kind.name} ({kind.num_samples} samples, {sum(map(os.path.getsize, files)) / 1e6:.0f} MB)",
                    state,
                    f"{ours:.2f}",
                    f"{theirs:.2f}",
                    f"{r:.2f}x",
                    runs.spread(f"seed {state}", f"drop-in {state}"),
                    ">= 1.2x",
                    verdict(r >= 1.2),
                ]
            )
            report.target(
                f"NeMo drop-in {kind.name} {state} reads >= 1.2x the original module",
                f"{r:.2f}x",
                r >= 1.2,
                DROPIN_WHY.get((kind.name, state), "").format(ours=ours, theirs=theirs),
            )
    buf.close()
    report.add("## 4b. The NeMo drop-in against the module it replaces")
    report.add()
    report.add(
        "`speccache.offline_cache.CachedTensorDataset` + `collate_cached` against the same two of nemo-automodel "
        "0.7.0's `offline_cache` module, called the same way on the same seed-layout caches as in section 4 "
        f"(`DataLoader(dataset, batch_size={DROPIN_BATCH}, sampler=<one uniform permutation>, collate_fn="
        "partial(collate_cached, keys=...), num_workers=0)`, a fresh dataset each time). Section 4 compares the "
        "native reader with the original; this one is what a NeMo user gets by switching the import. "
        "Ratio: original time / drop-in time, in rounds and with statistics as in section 3."
    )
    report.add()
    report.table(["samples", "cache", "drop-in s", "original s", "speedup", "rounds", "target", ""], rows)
    report.add(f"Page cache dropped with {cache.method}.")
    report.add()


# ---------------------------------------------------------------------------
# 5. start-up


def write_many_shards(cache_dir: str, seed_dir: str | None, shards: int) -> None:
    kind = Kind("startup", num_samples=2 * shards, shard_size=2, hidden=16, min_len=4, max_len=8, batch=64)
    pool = Pool(kind.hidden, 1024, seed=4)
    write_native_cache(cache_dir, kind, pool)
    if seed_dir is not None:
        write_seed_cache(seed_dir, kind, pool)


def startup_child(cache_dir: str, reader: str, upstream_path: str) -> None:
    """Runs in a fresh process: time opening the cache and reading its first batch (in locality order)."""
    if reader == "ours":
        t = time.perf_counter()
        ds: Any = CacheDataset(cache_dir)
        opened = time.perf_counter() - t
        collate: Any = PadCollator(ds.ragged_keys)
    else:
        upstream, _ = load_upstream(upstream_path, os.path.dirname(cache_dir))
        assert upstream is not None
        t = time.perf_counter()
        ds = upstream.CachedTensorDataset(
            cache_dir=cache_dir, cache_name="bench", format_version=SEED_VERSION, disk_keys=SEED_KEYS
        )
        opened = time.perf_counter() - t
        collate = functools.partial(upstream.collate_cached, keys=SEED_KEYS)
    sampler = LocalityShuffleSampler(len(ds), ds.shard_size)
    next(iter(DataLoader(ds, batch_size=64, sampler=sampler, collate_fn=collate)))
    print(json.dumps({"open": opened, "total": time.perf_counter() - t}))


def bench_startup(
    report: Report,
    work: str,
    rounds: int,
    upstream: types.ModuleType | None,
    upstream_path: str,
    cache: PageCache,
    shards: int,
) -> None:
    native_dir = os.path.join(work, "startup")
    seed_dir = os.path.join(work, "startup-seed")
    t = time.perf_counter()
    write_many_shards(native_dir, seed_dir if upstream is not None else None, shards)
    built = time.perf_counter() - t

    def child(cache_dir: str, reader: str, drop: bool) -> dict[str, float]:
        if drop:
            cache.drop([os.path.join(cache_dir, "manifest.json"), *shard_paths(cache_dir)[:: max(1, shards // 1000)]])
        out = subprocess.run(
            [sys.executable, __file__, "--startup-child", cache_dir, reader, "--upstream", upstream_path],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    results: dict[str, dict[str, float]] = {}
    readers = [("ours", native_dir)] + ([("seed", seed_dir)] if upstream is not None else [])
    for _ in range(rounds):
        for reader, d in readers:
            for state in ("warm", "cold"):
                got = child(d, reader, state == "cold")
                key = f"{reader} {state}"
                if key not in results or got["total"] < results[key]["total"]:
                    results[key] = got
    report.add(f"## 5. Reader start-up on a {shards:,}-shard cache")
    report.add()
    origin = f"built in {built:.0f} s" if built >= 1 else "built by an earlier run"
    report.add(
        f"Caches of {shards:,} shards of 2 samples ({origin}, kept in the work directory). A fresh "
        "process (imports done) times the dataset's construction (manifest, shard listing) and then its first "
        "batch of 64 through a DataLoader in locality order. Cold: page cache dropped before the process starts."
    )
    report.add()
    rows = []
    for state in ("warm", "cold"):
        o = results[f"ours {state}"]
        row = [state, f"{o['open'] * 1e3:.0f} ms", f"{o['total'] * 1e3:.0f} ms"]
        if upstream is not None:
            s = results[f"seed {state}"]
            row += [f"{s['open'] * 1e3:.0f} ms", f"{s['total'] * 1e3:.0f} ms", ratio(s["total"], o["total"])]
        rows.append(row)
        report.target(f"start-up on {shards:,} shards < 1 s ({state})", f"{o['total']:.3f} s", o["total"] < 1.0)
    header = ["cache", "speccache open", "speccache open + first batch"]
    if upstream is not None:
        header += ["seed open", "seed open + first batch", "seed / speccache"]
    report.table(header, rows)


# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# 6. the non-finite guard


def bench_nonfinite(report: Report, work: str, scale: float, rounds: int) -> None:
    """The guard's share of a precompute run (target: <= 3%), and its throughput against the section-1 write."""
    from speccache.demo import build_tiny_model_dir, demo_data_path
    from speccache.methods import eagle3_producer as eagle3
    from speccache.methods.finite import guard_nonfinite
    from speccache.precompute.run import PrecomputeConfig, run_precompute

    model = build_tiny_model_dir(os.path.join(work, "guard-model"), "llama", seed=0)
    out = os.path.join(work, "guard-cache")
    limit = max(16, int(240 * scale))
    cfg = PrecomputeConfig(
        model=model, data=demo_data_path("sharegpt"), out=out, batch_size=8, shard_size=64, max_length=512,
        limit=limit, model_dtype="fp32", device="cpu",
    )  # fmt: skip
    spent = [0.0]

    def timed_guard(*args: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        try:
            return guard_nonfinite(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    shares: list[tuple[float, float, float]] = []
    eagle3.guard_nonfinite = timed_guard  # the name compute_batch looks up at call time
    try:
        for _ in range(rounds):
            shutil.rmtree(out, ignore_errors=True)
            spent[0] = 0.0
            total = timed(lambda: run_precompute(cfg, progress=False))
            shares.append((spent[0] / total, spent[0], total))
    finally:
        eagle3.guard_nonfinite = guard_nonfinite
    share, guard_s, total_s = sorted(shares)[len(shares) // 2]  # the median round

    rows = max(1, int(8 * 256 * 48 * scale))
    feats = {"__lengths__": torch.full((rows // 256 or 1,), 256), "x": torch.randn(rows, 4096).to(torch.bfloat16)}
    guard_only = min(timed(lambda: guard_nonfinite(feats, "fail", lambda k, c: "")) for _ in range(rounds))
    nbytes = feats["x"].numel() * 2
    report.add("## 6. Non-finite guard")
    report.add()
    report.add(
        f"`speccache precompute` of the demo target (tiny Llama, fp32 on the CPU) over {limit} demo conversations, "
        "batches of 8, bf16 storage, with the guard (`speccache.methods.finite.guard_nonfinite`, called by "
        "`compute_batch` before the copy to the host) timed inside the same run; the median of "
        f"{rounds} runs. The guard costs one `aminmax` per float key and one host sync per batch."
    )
    report.add()
    alone = f"{guard_only:.2f} s ({nbytes / guard_only / 1e6:.0f} MB/s)"
    report.table(
        ["measure", "value"],
        [
            ["precompute wall time", f"{total_s:.2f} s"],
            ["time in the guard", f"{guard_s * 1000:.1f} ms"],
            ["guard share of the run", f"{share * 100:.2f}%"],
            [f"guard alone over {nbytes / 1e6:.0f} MB of bf16 rows", alone],
        ],
    )
    report.add(
        "The last row is the guard over the bytes of section 1, for comparison with the cache write throughput "
        "there: on a GPU the same reduction runs at memory bandwidth (TB/s), before the copy to the host."
    )
    report.add()
    report.target("non-finite guard share of the precompute run <= 3%", f"{share * 100:.2f}%", share <= 0.03)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/benchmarks.md")
    p.add_argument("--work", default="bench-out", help="scratch directory; its caches are reused by later runs")
    p.add_argument(
        "--upstream", default=UPSTREAM_DEFAULT, help="nemo_automodel/.../offline_cache.py of nemo-automodel 0.7.0"
    )
    p.add_argument("--scale", type=float, default=1.0, help="scale the data sizes (1.0: ~1.2 GB large-sample caches)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of sections 1, 2, 5 and nonfinite (best of)")
    p.add_argument("--read-rounds", type=int, default=7, help="rounds of sections 3, 4 and 4b (medians)")
    p.add_argument("--shards", type=int, default=10_000, help="shards of the start-up cache")
    p.add_argument("--only", nargs="*", choices=SECTIONS)
    p.add_argument("--startup-child", nargs=2, metavar=("CACHE", "READER"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.startup_child:
        startup_child(*a.startup_child, a.upstream)
        return
    torch.set_num_threads(1)
    os.makedirs(a.work, exist_ok=True)
    started = time.perf_counter()
    load_start = load_average()
    sections = set(a.only or SECTIONS)
    if sections & {"overlap", "reads", "dropin", "startup"}:
        upstream, upstream_where = load_upstream(a.upstream, a.work)
    else:
        upstream, upstream_where = None, "not needed by these sections"
    report = Report()
    cache = PageCache()
    body = Report()
    if "write" in sections:
        bench_write(body, a.work, a.scale, a.rounds)
    if "overlap" in sections:
        bench_overlap(body, a.work, a.scale, a.rounds, upstream)
    if "reads" in sections:
        bench_reads(body, a.work, [LARGE.scaled(a.scale), SMALL.scaled(a.scale)], a.read_rounds, upstream, cache)
    if "dropin" in sections:
        if upstream is None:
            body.add(f"Section 4b (the NeMo drop-in against the original) skipped: {upstream_where}.")
        else:
            bench_dropin(body, a.work, [LARGE.scaled(a.scale), SMALL.scaled(a.scale)], a.read_rounds, upstream, cache)
    if "startup" in sections:
        bench_startup(
            body, a.work, a.rounds, upstream, a.upstream if upstream is None else upstream_where, cache, a.shards
        )
    if "nonfinite" in sections:
        bench_nonfinite(body, a.work, a.scale, a.rounds)
    elapsed = time.perf_counter() - started

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report.add("# speccache benchmarks")
    report.add()
    report.add(
        f"Generated by `make bench` (`python benchmarks/run.py --out {a.out}`) on {now} in {elapsed / 60:.1f} min "
        f"(scale {a.scale}; best of {a.rounds} interleaved rounds, read sections: medians of {a.read_rounds})."
    )
    report.add()
    report.add("Machine:")
    report.add()
    for line in machine_description(a.work):
        report.add(line)
    report.add(
        f"- load average (1/5/15 min) at start {load_start}, at end {load_average()}: other jobs shared the "
        "machine, which is why every figure is a ratio of timings interleaved in the same run"
    )
    report.add(f"- seed module: {upstream_where}")
    report.add()
    report.add("## Targets")
    report.add()
    report.table(["target", "measured", ""], [[what, measured, verdict(met)] for what, measured, met in body.targets])
    if body.notes:
        report.add("Why the targets marked not met were missed:")
        report.add()
        report.lines.extend(body.notes)
        report.add()
    report.lines.extend(body.lines)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    text = "\n".join([BEGIN, *report.lines]).rstrip() + f"\n{END}\n"
    replace_section(a.out, text, BEGIN, END)


if __name__ == "__main__":
    main()

"""What every benchmark script shares: the machine's description, paired timing rounds, page cache control, targets
and their verdicts, and the script's own section of the shared Markdown report (docs/benchmarks.md).

A script builds a :class:`Report` (tables, targets met or not from the numbers it measured) and hands it to
:func:`write_report`, which adds the run's line (command, date, machine, load) and the targets table and replaces
the script's section between ``<!-- NAME-benchmark:begin -->`` and ``<!-- NAME-benchmark:end -->`` of ``--out``,
keeping the rest of the file. Why a figure is what it is belongs in docs/benchmarks.md's prose, not here.

Only the standard library is imported at the top: the engine scripts run this module in a virtual environment of
their own, and tests load scripts that use it alone.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import math
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PAGE = mmap.PAGESIZE


# ---------------------------------------------------------------------------
# the report


@dataclass
class Report:
    """A section's lines (printed as they are added, when ``echo``) and its targets, each ``(what, measured, met)``."""

    lines: list[str] = field(default_factory=list)
    targets: list[tuple[str, str, bool | None]] = field(default_factory=list)
    echo: bool = True

    def add(self, text: str = "") -> None:
        self.lines.append(text)
        if self.echo:
            print(text, flush=True)

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self.add("| " + " | ".join(header) + " |")
        self.add("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.add("| " + " | ".join(str(c) for c in row) + " |")
        self.add()

    def target(self, what: str, measured: str, met: bool | None) -> None:
        """Record a target (``met=None``: a figure reported with no target)."""
        self.targets.append((what, measured, met))


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "**not met**")


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of the section named ``name`` in the shared report."""
    return f"<!-- {name}-benchmark:begin -->", f"<!-- {name}-benchmark:end -->"


def replace_section(path: str, text: str, begin: str, end: str) -> None:
    """Write ``text`` (which starts with ``begin`` and ends with ``end`` and a newline) over the section between
    those markers in ``path``, or append it when the file has none; the rest of the file is kept."""
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) + 1 :]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(new)


# ---------------------------------------------------------------------------
# one script's run: its common flags, then its section


def bench_args(doc: str, scale: float | None = 1.0, rounds: int = 3) -> argparse.ArgumentParser:
    """An argument parser with the flags every section script takes: --out, --work, --rounds, and --scale unless
    ``scale`` is None (a script whose sizes do not scale)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=None, help="the Markdown file whose section of this script is replaced")
    p.add_argument("--work", default="bench-out", help="scratch directory; its caches are reused by later runs")
    if scale is not None:
        p.add_argument("--scale", type=float, default=scale, help=f"scale the data sizes (default {scale})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    return p


@dataclass
class Run:
    """One script's run: started when made, so that :func:`write_report` states its duration and loads."""

    script: str
    work: str
    settings: str
    started: float = field(default_factory=time.perf_counter)
    load_start: str = field(default_factory=lambda: load_average())

    def line(self) -> str:
        """Where and how the section's numbers were measured, in one paragraph."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        minutes = (time.perf_counter() - self.started) / 60
        command = " ".join(["python", f"benchmarks/{self.script}", *filter(None, [self.settings])])
        return (
            f"`{command}` on {now} in {minutes:.1f} min. "
            f"{'; '.join(machine_description(self.work))}; load average (1/5/15 min) {self.load_start} at the "
            f"start, {load_average()} at the end."
        )


def write_report(name: str, report: Report, run: Run, out: str | None) -> None:
    """``report`` as the section ``name``: its title line first, then the run's line and its targets table, then
    the rest; written over that section of ``out`` (when given) and printed."""
    begin, end = markers(name)
    title, *body = report.lines
    head = Report(echo=False)
    head.add(title)
    head.add()
    head.add(run.line())
    head.add()
    if report.targets:
        head.table(["target", "measured", ""], [[w, m, verdict(met)] for w, m, met in report.targets])
    text = "\n".join([begin, *head.lines, *body]).rstrip() + f"\n{end}\n"
    print("\n".join(head.lines[1:]), flush=True)
    if out:
        replace_section(out, text, begin, end)


# ---------------------------------------------------------------------------
# the machine


def machine_description(work: str = ".") -> list[str]:
    """The CPU, memory, the disk under ``work`` and the software, one phrase each."""
    import numpy as np
    import torch

    usage = shutil.disk_usage(work)
    block = _block_device(os.stat(work).st_dev)
    disk = f"{usage.total / 2**30:.0f} GiB filesystem"
    if block:
        rot = _read(f"/sys/block/{block}/queue/rotational")
        ra = _read(f"/sys/block/{block}/queue/read_ahead_kb")
        disk += f" on /dev/{block} ({'rotational' if rot == '1' else 'non-rotational'}, read-ahead {ra} KiB)"
    return [
        machine_summary(),
        f"disk: {disk}",
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}, numpy {np.__version__}",
    ]


def machine_summary() -> str:
    """The CPU's name, its cores and the memory, e.g. ``AMD EPYC, 2 cores, 24 GiB memory``."""
    cpu = platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB memory"


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


# ---------------------------------------------------------------------------
# timing


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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


# ---------------------------------------------------------------------------
# the page cache


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


_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(paths: Sequence[str]) -> float:
    """Fraction of the files' pages in the page cache (``mincore``)."""
    import numpy as np

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

    def describe(self) -> str:
        """How the page cache was dropped and how much of the files stayed cached, for the report."""
        return (
            f"Page cache dropped with {self.method}; afterwards at most {self.residue:.1%} of the files' pages "
            "were still cached (`mincore`)."
        )


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


def settings_of(argv: Sequence[str] | None) -> str:
    """The command line's flags as the report quotes them (``--out`` included)."""
    return " ".join(sys.argv[1:] if argv is None else argv)


def start(p: argparse.ArgumentParser, script: str, argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Run]:
    """Parse a section script's flags, pin torch to one thread, make the work directory; the run begins now."""
    import torch

    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    return args, Run(os.path.basename(script), args.work, settings_of(argv))

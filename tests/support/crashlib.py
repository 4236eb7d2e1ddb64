"""Crash-test machinery: killable producer processes, reference caches and the checks run after each kill.

Producers run as real, separate processes. Starting a fresh interpreter costs
about 5 s here (importing torch), far longer than the run itself, so that a
random kill time would nearly always land in the import. Instead a *fork
server* (``python tests/support/crashlib.py serve``) imports ``speccache`` once and, per
request, forks a child that runs ``speccache.testing.synthetic.main(argv)`` (what
``python -m speccache.testing.synthetic ARGV`` runs) or ``speccache.cli.main(argv)``
with its own environment and log file. The server kills the child with
``SIGKILL`` after ``kill_after`` seconds when asked, reaps it and reports its
exit status. The server itself never runs torch code, so forking it is safe.
``SPECCACHE_FAULT`` (see ``speccache.testing.faults``) kills a child at a named point instead:
the child arms it with ``install_from_env()`` once its environment is set, as
``python -m speccache.testing.faults MODULE ARGV`` does in a fresh interpreter.
A request can also send SIGINT instead of SIGKILL, run the child under a file-size
limit (RLIMIT_FSIZE) or skip ``fsync`` (which only matters for power loss, not for a
killed process, and makes runs several times faster so that more kills fit).
A child that outlives its timeout has its stacks dumped into its log (faulthandler)
before it is killed, and is reported with rc 124.

A :class:`Scenario` is a chain of killed runs on one directory followed by one
uninterrupted ``--resume``; after every kill :func:`check_after_kill` checks
what a reader could see, and at the end :func:`check_final` checks the cache is
byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

PRODUCER = "speccache.testing.synthetic"
CLI = "speccache.cli"
FAULTS = "speccache.testing.faults"


# ---------------------------------------------------------------------------
# the fork server


def _child(req: dict[str, Any]) -> None:
    """Run one request in a forked child; never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.pop("SPECCACHE_FAULT", None)
        os.environ.update(req.get("env") or {})
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks, dumped before it is killed
        # Ctrl-C as at a terminal, even where the tests were started with SIGINT ignored (a background job of a
        # shell without job control), which the fork server and its children would otherwise inherit
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if req.get("fsize_limit") is not None:
            # a file-size limit (like a full quota): writes past it fail with EFBIG once SIGXFSZ is ignored
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize_limit"], req["fsize_limit"]))
        if req.get("nofsync"):
            # fsync only matters when the machine loses power; a killed process's writes stay in the page
            # cache. Skipping it makes a run several times faster, so more kills fit in the time budget.
            os.fsync = lambda fd: None
        from speccache.testing import faults

        faults.install_from_env()  # SPECCACHE_FAULT, from the request's environment
        module = importlib.import_module(req["module"])
        result = module.main(list(req["argv"]))
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, kill_after: float | None, timeout: float, signum: int = signal.SIGKILL) -> tuple[int, bool, float]:
    """Wait for ``pid``, sending ``signum`` after ``kill_after`` s; returns (status as rc, signalled by us, seconds)."""
    t0 = time.monotonic()
    fd = os.pidfd_open(pid)
    killed = False
    try:
        if kill_after is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, kill_after))
            if not ready:
                os.kill(pid, signum)
                killed = True
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:  # a hung run: dump its stacks into its log, then report it as such
            os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124, killed, time.monotonic() - t0
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), killed, time.monotonic() - t0


def serve() -> None:
    """The fork server loop: one JSON request per stdin line, one JSON reply per stdout line."""
    for name in (PRODUCER, CLI, FAULTS, "speccache.read.verify"):
        importlib.import_module(name)
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        # A signal meant for the child must not arrive before it is in _child (where it is handled):
        # block SIGINT across the fork; the child unblocks it once its output is redirected.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pid = os.fork()
        if pid == 0:
            _child(req)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signum = getattr(signal, req.get("signal") or "SIGKILL")
        rc, killed, elapsed = _wait(pid, req.get("kill_after"), float(req.get("timeout", 120)), signum)
        print(json.dumps({"pid": pid, "rc": rc, "killed": killed, "elapsed": elapsed}), file=out, flush=True)


@dataclass
class RunResult:
    """How a producer (or CLI) process ended."""

    rc: int
    killed: bool
    elapsed: float
    log: str
    pid: int

    @property
    def sigkilled(self) -> bool:
        """Whether it died of SIGKILL (ours or its fault hook's)."""
        return self.rc == -signal.SIGKILL

    def output(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


class ForkServer:
    """A client of one fork server process; one request at a time (use one per thread)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env.pop("SPECCACHE_FAULT", None)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("fork server failed to start")
        self._lock = threading.Lock()
        self._count = 0

    def run(
        self,
        module: str,
        argv: list[str],
        log: str,
        env: dict[str, str] | None = None,
        kill_after: float | None = None,
        timeout: float = 120.0,
        signal_name: str = "SIGKILL",
        nofsync: bool = False,
        fsize_limit: int | None = None,
    ) -> RunResult:
        """Run ``module.main(argv)`` in a forked child and wait (sending ``signal_name`` after ``kill_after`` s)."""
        req = {"module": module, "argv": argv, "log": log, "env": env or {}, "kill_after": kill_after,
               "timeout": timeout, "signal": signal_name, "nofsync": nofsync, "fsize_limit": fsize_limit}  # fmt: skip
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fork server died")
        reply = json.loads(line)
        return RunResult(reply["rc"], reply["killed"], reply["elapsed"], log, reply["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------
# caches and their comparison


@dataclass(frozen=True)
class Producer:
    """The synthetic producer's settings for a crash scenario."""

    samples: int = 192
    shard_size: int = 4
    batch_size: int = 4
    hidden: int = 64
    max_len: int = 48
    seed: int = 0
    encoding: str = "raw"

    @property
    def num_shards(self) -> int:
        return -(-self.samples // self.shard_size)

    def argv(self, out: str, resume: bool = False, sync: bool = False) -> list[str]:
        args = [
            out,
            "--samples", str(self.samples),
            "--shard-size", str(self.shard_size),
            "--batch-size", str(self.batch_size),
            "--hidden", str(self.hidden),
            "--max-len", str(self.max_len),
            "--seed", str(self.seed),
            "--encoding", self.encoding,
        ]  # fmt: skip
        return args + ["--resume"] * resume + ["--sync"] * sync


def read_tree(path: str) -> dict[str, bytes]:
    """Every file directly in ``path``, by name (a cache directory has no subdirectories)."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        assert os.path.isfile(full), f"unexpected non-file {full}"
        with open(full, "rb") as f:
            out[name] = f.read()
    return out


UNSEALED_ONLY = ("shards", "num_tokens", "total_bytes", "stats")  # stats: encoding errors gathered at the seal


@dataclass
class Reference:
    """An uninterrupted run's cache, the yardstick of every crash scenario."""

    producer: Producer
    path: str
    files: dict[str, bytes]
    manifest: dict[str, Any]
    elapsed: float
    fast_elapsed: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, server: ForkServer, producer: Producer, path: str, sync: bool = False) -> Reference:
        result = server.run(PRODUCER, producer.argv(path, sync=sync), log=path + ".log")
        assert result.rc == 0, f"reference run failed (rc {result.rc}):\n{result.output()}"
        files = read_tree(path)
        ref = cls(producer, path, files, json.loads(files["manifest.json"]), result.elapsed)
        fast = server.run(
            PRODUCER, producer.argv(path + "-nofsync", sync=not sync), log=path + "-nofsync.log", nofsync=True
        )
        assert fast.rc == 0, f"reference run failed (rc {fast.rc}):\n{fast.output()}"
        assert read_tree(path + "-nofsync") == files, "skipping fsync or overlapping the writes changed the cache"
        ref.fast_elapsed = fast.elapsed
        from speccache.read import CacheDataset

        ds = CacheDataset(path)
        ref.samples = [{k: v.clone() for k, v in s.items()} for s in ds.__getitems__(range(len(ds)))]
        return ref

    def unsealed_manifest(self) -> dict[str, Any]:
        """What the manifest says while the cache is being written (before the seal)."""
        body = {k: v for k, v in self.manifest.items() if k not in UNSEALED_ONLY}
        body["complete"] = False
        return body


def classify(name: str) -> str:
    """What a reader makes of a file name in a cache directory: manifest, shard, lock, temp or other."""
    from speccache.format import MANIFEST_NAME, SHARD_RE, TMP_MARK
    from speccache.format.lock import LOCK_NAME

    if name == MANIFEST_NAME:
        return "manifest"
    if SHARD_RE.match(name):
        return "shard"
    if name == LOCK_NAME:
        return "lock"
    if TMP_MARK in name:
        return "temp"
    return "other"


def check_after_kill(out: str, ref: Reference) -> dict[str, int]:
    """What a killed writer left must be safe to read: whole shards, a parsable manifest, temp names no reader takes.

    Returns counts of what was found (for the report).
    """
    import torch

    from speccache.errors import CacheIncompleteError
    from speccache.read import CacheDataset

    found = {"shard": 0, "temp": 0, "lock": 0, "manifest": 0}
    if not os.path.isdir(out):
        return found
    tree = read_tree(out)
    for name, data in tree.items():
        kind = classify(name)
        assert kind != "other", f"{out}: unexpected file {name!r} after a kill"
        found[kind] += 1
        if kind == "shard":
            assert data == ref.files.get(name), f"{out}/{name}: a shard under its final name differs from the reference"
        elif kind == "manifest":
            manifest = json.loads(data)  # an atomic rename: always whole JSON
            if manifest.get("complete"):
                assert data == ref.files["manifest.json"], f"{out}: a sealed manifest differs from the reference"
            else:
                assert manifest == ref.unsealed_manifest(), (
                    f"{out}: the unsealed manifest differs from the expected one"
                )
    if "manifest.json" not in tree:
        return found
    sealed = json.loads(tree["manifest.json"]).get("complete")
    if sealed:
        ds = CacheDataset(out, verify=True)
        assert len(ds) == len(ref.samples)
    else:
        try:
            CacheDataset(out)
        except CacheIncompleteError as exc:
            assert "--resume" in str(exc)
        else:
            raise AssertionError(f"{out}: an unsealed cache was readable without allow_incomplete")
        ds = CacheDataset(out, allow_incomplete=True, verify=True)
        prefix = 0
        while f"shard-{prefix:06d}.safetensors" in tree:
            prefix += 1
        assert len(ds) == min(prefix * ref.producer.shard_size, ref.producer.samples)
    got = ds.__getitems__(range(len(ds)))
    for i, (a, b) in enumerate(zip(got, ref.samples)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
            f"{out}: sample {i} differs from the reference"
        )
    return found


def check_final(out: str, ref: Reference) -> None:
    """The resumed cache is the uninterrupted one, byte for byte, and ``verify`` finds it sound."""
    from speccache.read.verify import verify_cache

    tree = read_tree(out)
    assert sorted(tree) == sorted(ref.files), f"{out}: files {sorted(tree)} != reference {sorted(ref.files)}"
    for name, data in tree.items():
        assert data == ref.files[name], f"{out}/{name} differs from the uninterrupted run"
    report = verify_cache(out)
    assert report.ok, report.problems


# ---------------------------------------------------------------------------
# scenarios


@dataclass(frozen=True)
class Kill:
    """How one run dies: after ``seconds`` (a random moment), or at a fault point (``SPECCACHE_FAULT``)."""

    seconds: float | None = None
    fault: str | None = None
    sync: bool = False

    def describe(self) -> str:
        mode = "sync" if self.sync else "overlapped"
        return f"SIGKILL after {self.seconds:.3f}s ({mode})" if self.fault is None else f"fault {self.fault} ({mode})"


@dataclass
class Scenario:
    """Killed runs on one directory, then a final ``--resume``."""

    name: str
    producer: Producer
    kills: list[Kill]
    final_sync: bool = False
    cli_verify: bool = True
    fsync: bool = False


@dataclass
class Outcome:
    scenario: Scenario
    kill_points: int = 0
    completed_early: int = 0
    notes: list[str] = field(default_factory=list)


def run_scenario(server: ForkServer, scenario: Scenario, ref: Reference, workdir: str) -> Outcome:
    """Run ``scenario`` in ``workdir``; raise AssertionError (with the run logs) on any failed check."""
    out = os.path.join(workdir, "cache")
    outcome = Outcome(scenario)
    history: list[str] = []

    def fail(message: str, result: RunResult | None = None) -> None:
        log = f"\n--- last run's output ---\n{result.output()}" if result is not None else ""
        raise AssertionError(f"[{scenario.name}] {message}\nruns: {history}{log}")

    for i, kill in enumerate(scenario.kills):
        env = {"SPECCACHE_FAULT": kill.fault} if kill.fault else {}
        result = server.run(
            PRODUCER,
            scenario.producer.argv(out, resume=i > 0, sync=kill.sync),
            log=os.path.join(workdir, f"run{i}.log"),
            env=env,
            kill_after=kill.seconds,
            nofsync=not scenario.fsync,
        )
        history.append(f"{kill.describe()} -> rc {result.rc} in {result.elapsed:.3f}s")
        if result.sigkilled:
            outcome.kill_points += 1
        elif result.rc == 0:
            outcome.completed_early += 1  # the run finished before its kill time or fault point
        else:
            fail(f"run {i} ended with rc {result.rc}", result)
        try:
            found = check_after_kill(out, ref)
        except AssertionError as exc:
            fail(f"after run {i}: {exc}", result)
        outcome.notes.append(f"{kill.describe()}: rc {result.rc}, left {found}")
    result = server.run(
        PRODUCER,
        scenario.producer.argv(out, resume=True, sync=scenario.final_sync),
        log=os.path.join(workdir, "final.log"),
        nofsync=not scenario.fsync,
    )
    history.append(f"final resume -> rc {result.rc}")
    if result.rc != 0:
        fail(f"the final --resume failed with rc {result.rc}", result)
    try:
        check_final(out, ref)
    except AssertionError as exc:
        fail(str(exc), result)
    if scenario.cli_verify:
        result = server.run(CLI, ["verify", out], log=os.path.join(workdir, "verify.log"))
        if result.rc != 0:
            fail(f"speccache verify exited {result.rc}", result)
    return outcome


FAULT_POINTS_FRESH = (
    "after_manifest_begin",
    "mid_manifest_write:1",
    "mid_manifest_write:2",
    "before_seal",
    "after_seal",
)


def make_scenarios(
    rng: random.Random, refs: dict[Producer, Reference], count: int, fsync_share: float = 0.25
) -> list[Scenario]:
    """``count`` scenarios: first every named fault point (fresh and in a resume), then seeded random chains.

    Random kill times are uniform over the whole run (``[0, 1.05 x`` the uninterrupted run ``]``);
    a resumed run is shorter, so later kills in a chain are drawn over a shorter span. A share
    ``fsync_share`` of the random scenarios (and two fixed ones) run with real fsync calls.
    """
    producers = list(refs)
    scenarios: list[Scenario] = []
    base = producers[0]
    n = base.num_shards
    fixed: list[list[Kill]] = [
        [Kill(fault=p, sync=s)] for p, s in zip(FAULT_POINTS_FRESH, (False, True, False, True, False))
    ]
    fixed += [
        [Kill(fault="mid_shard_write:1")],
        [Kill(fault=f"mid_shard_write:{n // 2}", sync=True)],
        [Kill(fault=f"mid_shard_write:{n}")],
        # kills during resumes: the resumed begin, a resumed shard, the resumed seal
        [
            Kill(fault=f"mid_shard_write:{n // 3}"),
            Kill(fault="after_manifest_begin", sync=True),
            Kill(fault="mid_shard_write:2"),
        ],
        [
            Kill(fault=f"mid_shard_write:{n // 4}", sync=True),
            Kill(fault="mid_manifest_write:2"),
            Kill(fault="after_seal"),
        ],
    ]
    for i, kills in enumerate(fixed[:count]):
        scenarios.append(Scenario(f"fault-{i}", base, kills, final_sync=bool(i % 2), fsync=i in (0, 6)))
    for i in range(len(scenarios), count):
        producer = rng.choice(producers)
        fsync = rng.random() < fsync_share
        span = (refs[producer].elapsed if fsync else refs[producer].fast_elapsed) * 1.05
        kills = []
        remaining = 1.0
        for _ in range(rng.choice((1, 2, 2, 3))):
            if rng.random() < 0.2:
                point = rng.choice(("after_manifest_begin", "before_seal", "after_seal", "mid_manifest_write:1",
                                    "mid_manifest_write:2", "mid_shard_write"))  # fmt: skip
                if point == "mid_shard_write":
                    point += f":{rng.randint(1, max(1, int(producer.num_shards * remaining)))}"
                kills.append(Kill(fault=point, sync=rng.random() < 0.5))
            else:
                seconds = rng.uniform(0.0, span * remaining + 0.05)
                kills.append(Kill(seconds=seconds, sync=rng.random() < 0.5))
                remaining = max(0.15, remaining - seconds / span)
        scenarios.append(Scenario(f"random-{i}", producer, kills, final_sync=rng.random() < 0.5,
                                  cli_verify=rng.random() < 0.5, fsync=fsync))  # fmt: skip
    return scenarios


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: python tests/support/crashlib.py serve")

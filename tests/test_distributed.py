"""Distributed precompute on CPU with Gloo: real process groups of 1, 2 and 3 ranks, and torchrun.

Every run writes the synthetic cache (``speccache.testing.synthetic``) and is compared,
file by file and byte for byte (shards and manifest), with the same cache
written by one process here. The spawned ranks also check, through hooks:

* rank 0 writes the unsealed manifest before any rank writes a shard, and the
  sealed one exactly once, after every shard (manifest writes are counted);
* a ``compute_batch`` that all-reduces on every call is called the same number
  of times on every rank (fresh runs, and resumed runs where ranks have
  different amounts of work left), so the lockstep padding holds;
* a configuration mismatch or any error on rank 0 while ``CacheWriter.writing``
  prepares the directory (a side file that cannot be written) is raised on every
  rank with the same type and message, and nobody waits at a barrier; so is a
  rank that cannot see the lock file rank 0 holds (no shared filesystem), before
  any manifest or shard is written;
* an empty dataset reads no sample and writes only a sealed 0-sample manifest;
* a rank much slower than another (more real steps than the other's cheap
  dummy ones, for longer than the timeout in all) does not make the fast one
  time out at the seal: ranks meet every ``LOCKSTEP_SYNC_EVERY`` steps;
* a hung rank makes the other one fail with ``DistributedError`` within the
  timeout; the cache then resumes at another world size.

A separate test kills one of three ranks (``SPECCACHE_FAULT`` armed by
``python -m speccache.testing.faults``, a real SIGKILL in the middle of a shard
write), checks that the two others fail fast with a
message naming the ``--resume`` way out, and resumes with ``torchrun`` on two ranks.

Processes start slowly here (importing torch takes seconds), so each group runs
many scenarios; ``torch.set_num_threads(1)`` everywhere keeps results bitwise comparable.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import speccache.format.manifest as manifest_module
import speccache.testing.synthetic as synthetic
import speccache.write.cache_writer as cache_writer_module
import speccache.write.loops as loops_module
from speccache.cli import main as cli_main
from speccache.errors import CacheExistsError, ConfigMismatchError, DistributedError, OutputError, SpeccacheError
from speccache.format import load_manifest_json, manifest_path, shard_path
from speccache.format.lock import LOCK_NAME
from speccache.read.verify import verify_cache
from speccache.write import partition_cache_shards
from speccache.write.cache_writer import CacheWriter, SideFile
from speccache.write.dist import TorchComm, _rebuild_error, collective_failure_message, init_from_env, shutdown
from speccache.write.writers import NativeShardWriter
from support.cachecmp import file_tree

COMMON = dict(hidden=16, max_len=24, seed=3)
CONFIGS: dict[str, dict[str, int]] = {
    "uneven": dict(num_samples=27, shard_size=4, batch_size=2),  # 7 shards: 4+3 over 2 ranks, 3+2+2 over 3
    "tiny": dict(num_samples=3, shard_size=4, batch_size=2),  # 1 shard: every rank but 0 owns none
    "empty": dict(num_samples=0, shard_size=4, batch_size=2),
}
RESUME_MISSING = {0, 1, 5}  # deleted before the resume
RESUME_CORRUPT = {6}  # one byte flipped: must fail its checksum and be recomputed
RESUME_KEPT = {2, 3, 4}
GROUP_TIMEOUT = 60.0  # generous: joining waits for the slowest interpreter start
HANG_TIMEOUT = 4.0  # the group the hung-rank scenario runs on
HANG_AT_CALL = 3  # rank 1 hangs in this compute call (after writing its first shard)
SLOW_STEP = 0.8  # seconds per compute call of the slow rank: 8 steps take longer than HANG_TIMEOUT
LOCKSTEP_DEFAULT = loops_module.LOCKSTEP_SYNC_EVERY
PRODUCER = "speccache.testing.synthetic"
FAULTS = "speccache.testing.faults"


# ---------------------------------------------------------------------------
# helpers


@contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _barrier(comm: Any) -> None:
    """Wait for every rank of ``comm``'s default group (a :class:`Comm` has no barrier: producers never need one)."""
    if comm.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _assert_same_cache(out: Path, ref: Path) -> None:
    got, want = file_tree(out), file_tree(ref)
    assert sorted(got) == sorted(want), f"{out}: files {sorted(got)} != reference {sorted(want)}"
    for name in want:
        assert got[name] == want[name], f"{out}/{name} differs from the single-process cache"
    report = verify_cache(str(out))
    assert report.ok, report.problems
    assert cli_main(["verify", str(out)]) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expected_steps(cfg: dict[str, int], world: int, todo: set[int]) -> int:
    """The lockstep count: the most batches any rank needs for the shards of its block in ``todo``."""
    n, size, batch = cfg["num_samples"], cfg["shard_size"], cfg["batch_size"]
    most = 0
    for rank in range(world):
        start, _, local = partition_cache_shards(n, size, world, rank)
        mine = [i for i in range(start, start + math.ceil(local / size)) if i in todo]
        runs: list[list[int]] = []
        for i in mine:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        steps = sum(math.ceil((min(b * size, n) - a * size) / batch) for a, b in runs)
        most = max(most, steps)
    return most


def _make_interrupted(ref: Path, dst: Path) -> None:
    """``ref`` as an interrupted run leaves it: some shards missing, one torn, the manifest unsealed, a temp file."""
    shutil.copytree(ref, dst)
    for i in RESUME_MISSING:
        os.unlink(shard_path(str(dst), i))
    for i in RESUME_CORRUPT:
        data = bytearray(Path(shard_path(str(dst), i)).read_bytes())
        data[-5] ^= 0x40
        Path(shard_path(str(dst), i)).write_bytes(bytes(data))
    manifest = load_manifest_json(manifest_path(str(dst)))
    for key in ("shards", "num_tokens", "total_bytes"):
        manifest.pop(key)
    manifest["complete"] = False
    Path(manifest_path(str(dst))).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    Path(shard_path(str(dst), 5) + ".tmp-deadhost-1-0123abcd").write_bytes(b"torn")


class _Abandoned(Exception):
    """Raised by the hung rank once the other rank has given up on it."""


class _Hooks:
    """Counts manifest writes, compute calls and sample reads; checks the manifest is unsealed at each shard write.

    The compute step all-reduces on every call (like a target sharded across ranks) unless ``collective`` is false;
    it sleeps ``slow`` seconds per call; with ``hang`` it blocks at call :data:`HANG_AT_CALL` until that file exists.
    """

    def __init__(self, comm: Any, collective: bool = True, hang: Path | None = None, slow: float = 0.0) -> None:
        self.comm = comm
        self.collective = collective
        self.hang = hang
        self.slow = slow
        self.manifest_writes: list[bool] = []
        self.calls = 0
        self.reads = 0
        self.violations: list[str] = []

    @contextmanager
    def installed(self) -> Iterator[_Hooks]:
        originals = [
            (manifest_module, "write_manifest_file", manifest_module.write_manifest_file),
            (NativeShardWriter, "__call__", NativeShardWriter.__call__),
            (synthetic, "make_compute", synthetic.make_compute),
            (synthetic.SyntheticSamples, "__getitem__", synthetic.SyntheticSamples.__getitem__),
        ]
        hooks = self

        def write_manifest_file(cache_dir: str, body: dict[str, Any]) -> str:
            hooks.manifest_writes.append(bool(body.get("complete")))
            return originals[0][2](cache_dir, body)

        def shard_call(writer: Any, output_dir: str, index: int, samples: Any) -> str:
            try:
                if load_manifest_json(manifest_path(output_dir)).get("complete") is not False:
                    hooks.violations.append(f"shard {index} written while the manifest is sealed")
            except FileNotFoundError:
                hooks.violations.append(f"shard {index} written before the manifest")
            return originals[1][2](writer, output_dir, index, samples)

        def make_compute(hidden: int, dtype: torch.dtype, seed: int) -> Any:
            inner = originals[2][2](hidden, dtype, seed)

            def compute(batch: Any) -> Any:
                hooks.calls += 1
                if hooks.hang is not None and hooks.calls == HANG_AT_CALL:
                    deadline = time.monotonic() + 120
                    while not hooks.hang.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    raise _Abandoned()
                time.sleep(hooks.slow)
                if hooks.collective:
                    total = hooks.comm.sum_tensor(torch.ones(1, dtype=torch.int64))
                    if int(total) != hooks.comm.world_size:
                        hooks.violations.append(f"all-reduce gave {int(total)}")
                return inner(batch)

            return compute

        def getitem(dataset: Any, index: int) -> Any:
            hooks.reads += 1
            return originals[3][2](dataset, index)

        for (owner, name, _), new in zip(originals, (write_manifest_file, shard_call, make_compute, getitem)):
            setattr(owner, name, new)
        try:
            yield self
        finally:
            for owner, name, old in originals:
                setattr(owner, name, old)


def _check_run(comm: Any, hooks: _Hooks, what: str, expected_steps: int) -> None:
    """Gather every rank's counts and check them (on every rank)."""
    rows = comm.all_gather((hooks.manifest_writes, hooks.calls, hooks.reads, hooks.violations))
    writes = [r[0] for r in rows]
    assert writes[0] == [False, True] and all(w == [] for w in writes[1:]), f"{what}: manifest writes per rank {writes}"
    calls = [r[1] for r in rows]
    assert calls == [expected_steps] * comm.world_size, (
        f"{what}: compute calls per rank {calls}, expected {expected_steps}"
    )
    assert [r[3] for r in rows] == [[]] * comm.world_size, f"{what}: {[r[3] for r in rows]}"
    if what.endswith("empty"):
        assert [r[2] for r in rows] == [0] * comm.world_size, f"{what}: an empty dataset was read"


def _same_error_everywhere(comm: Any, fn: Any, kind: type[BaseException]) -> None:
    try:
        fn()
        error = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    errors = comm.all_gather(error)
    assert errors[0] is not None and errors[0][0] == kind.__name__, errors
    if kind is DistributedError:
        assert "does not see" in errors[0][1] and "shares" in errors[0][1], errors
    assert all(e == errors[0] for e in errors), f"ranks raised different errors: {errors}"


def _worker(rank: int, world: int, port: int, root: str) -> None:
    """One rank of a spawned group (or, for ``world == 1``, the test process itself)."""
    if world > 1:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        os.environ.pop("SPECCACHE_FAULT", None)
    with _one_thread():
        comm = init_from_env(torch.device("cpu"), GROUP_TIMEOUT)
        assert (comm.rank, comm.world_size) == (rank, world)
        if world > 1:
            assert isinstance(comm, TorchComm) and comm.owns_group
        base = Path(root)
        # fresh runs
        for name, cfg in CONFIGS.items():
            out = base / f"fresh-{name}"
            with _Hooks(comm).installed() as hooks:
                manifest = synthetic.write_synthetic_cache(str(out), **cfg, **COMMON, comm=comm)
            assert manifest.complete and manifest.num_samples == cfg["num_samples"]
            _check_run(comm, hooks, f"world {world} fresh {name}", _expected_steps(cfg, world, set(range(10_000))))
        # resume: each rank keeps its block's valid shards, recomputes the rest, in lockstep
        cfg = CONFIGS["uneven"]
        with _Hooks(comm).installed() as hooks:
            synthetic.write_synthetic_cache(str(base / "resume-uneven"), **cfg, **COMMON, resume=True, comm=comm)
        _check_run(comm, hooks, f"world {world} resume", _expected_steps(cfg, world, RESUME_MISSING | RESUME_CORRUPT))
        # errors while writing() prepares the directory: the same exception on every rank, nothing changed, no lock left
        done = base / "fresh-uneven"
        before = file_tree(done)
        _barrier(comm)  # rank 0 takes the lock (a file) as soon as it starts the next run
        _same_error_everywhere(
            comm,
            lambda: synthetic.write_synthetic_cache(str(done), **cfg, **{**COMMON, "seed": 4}, resume=True, comm=comm),
            ConfigMismatchError,
        )
        _same_error_everywhere(
            comm, lambda: synthetic.write_synthetic_cache(str(done), **cfg, **COMMON, comm=comm), CacheExistsError
        )
        _barrier(comm)
        assert file_tree(done) == before

        def deny() -> dict[str, torch.Tensor]:
            raise PermissionError(f"[Errno 13] Permission denied: {str(base / 'side.bin')!r}")

        side = base / "side-fails"
        writer = CacheWriter(
            str(side),
            cache_name="synthetic",
            schema=synthetic.synthetic_schema(8),
            shard_size=4,
            num_samples=8,
            config={},
            comm=comm,
        )

        def write_with_failing_side_file() -> None:
            with writer.writing(side_files=(SideFile("side.bin", deny),)):
                raise AssertionError("the run started although rank 0 could not write its side file")

        _same_error_everywhere(comm, write_with_failing_side_file, OutputError)
        _barrier(comm)
        assert not (side / LOCK_NAME).exists() and not (side / "manifest.json").exists()
        if world > 1:
            # the last rank writes to "another filesystem": it cannot see the lock file rank 0 holds
            saved = cache_writer_module.SHARED_FS_WAIT_S, cache_writer_module.lock_path
            cache_writer_module.SHARED_FS_WAIT_S = 0.5
            if rank == world - 1:
                cache_writer_module.lock_path = lambda d: os.path.join(d + "-node-local", LOCK_NAME)
            try:
                _same_error_everywhere(
                    comm,
                    lambda: synthetic.write_synthetic_cache(str(base / "not-shared"), **cfg, **COMMON, comm=comm),
                    DistributedError,
                )
            finally:
                cache_writer_module.SHARED_FS_WAIT_S, cache_writer_module.lock_path = saved
            if rank == 0:  # refused before rank 0 wrote anything: no lock, no manifest, no shard
                assert sorted(p.name for p in (base / "not-shared").iterdir()) == [], list(
                    (base / "not-shared").iterdir()
                )
        if world != 2:
            _barrier(comm)
            shutdown(comm)
            return
        # two scenarios on a group with a short timeout
        import torch.distributed as dist

        hang_comm = TorchComm(
            torch.device("cpu"),
            timeout_s=HANG_TIMEOUT,
            group=dist.new_group(timeout=_seconds(HANG_TIMEOUT), backend="gloo"),
        )
        # a slow rank: the fast one pads with cheap dummy steps, then would wait at the seal for the slow one's
        # remaining work (longer than this group's timeout) but for the periodic lockstep meetings
        loops_module.LOCKSTEP_SYNC_EVERY = 1
        try:
            with _Hooks(hang_comm, collective=False, slow=SLOW_STEP if rank == 1 else 0.0).installed():
                synthetic.write_synthetic_cache(str(base / "slow-uneven"), **cfg, **COMMON, comm=hang_comm)
        finally:
            loops_module.LOCKSTEP_SYNC_EVERY = LOCKSTEP_DEFAULT
        # a hung rank: the other fails within the group's timeout
        flag = base / "hang-released"
        out = base / "hang-uneven"
        if rank == 1:
            with _Hooks(hang_comm, collective=False, hang=flag).installed():
                with pytest.raises(_Abandoned):
                    synthetic.write_synthetic_cache(str(out), **cfg, **COMMON, comm=hang_comm)
            return  # leaves without another collective, like a killed rank
        started = time.monotonic()
        try:
            synthetic.write_synthetic_cache(str(out), **cfg, **COMMON, comm=hang_comm)
            result: dict[str, Any] = {"error": None}
        except DistributedError as exc:
            result = {"error": str(exc), "seconds": time.monotonic() - started}
        (base / "hang-result.json").write_text(json.dumps(result))
        flag.touch()


def _seconds(s: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=s)


# ---------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The single-process caches every distributed run must equal."""
    root = tmp_path_factory.mktemp("reference")
    with _one_thread():
        for name, cfg in CONFIGS.items():
            synthetic.write_synthetic_cache(str(root / name), **cfg, **COMMON)
    return {name: root / name for name in CONFIGS}


def test_reference_layout(references: dict[str, Path]) -> None:
    assert sorted(p.name for p in references["empty"].iterdir()) == ["manifest.json"]
    manifest = load_manifest_json(manifest_path(str(references["empty"])))
    assert manifest["complete"] and manifest["num_samples"] == 0 and manifest["shards"] == []
    assert len(load_manifest_json(manifest_path(str(references["uneven"])))["shards"]) == 7


@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.torchrun), pytest.param(3, marks=pytest.mark.torchrun)]
)
def test_process_group_matches_single_process(world: int, references: dict[str, Path], tmp_path: Path) -> None:
    _make_interrupted(references["uneven"], tmp_path / "resume-uneven")
    kept = {i: os.stat(shard_path(str(tmp_path / "resume-uneven"), i)).st_ino for i in RESUME_KEPT}
    if world == 1:
        _worker(0, 1, 0, str(tmp_path))
    else:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for name in CONFIGS:
        _assert_same_cache(tmp_path / f"fresh-{name}", references[name])
    resumed = tmp_path / "resume-uneven"
    _assert_same_cache(resumed, references["uneven"])
    assert {i: os.stat(shard_path(str(resumed), i)).st_ino for i in RESUME_KEPT} == kept, "valid shards were rewritten"
    if world != 2:
        return
    _assert_same_cache(tmp_path / "slow-uneven", references["uneven"])
    # the hung-rank scenario: rank 0 failed within the timeout, clearly, and released the lock
    result = json.loads((tmp_path / "hang-result.json").read_text())
    assert result["error"] is not None, "rank 0 sealed although rank 1 never finished"
    message = result["error"]
    assert "rank 0 of 2" in message and f"--timeout of {HANG_TIMEOUT:g} s" in message and "--resume" in message, message
    assert "did not reach" in message, message
    assert HANG_TIMEOUT <= result["seconds"] < HANG_TIMEOUT + 20, result
    hung = tmp_path / "hang-uneven"
    assert not (hung / LOCK_NAME).exists()
    assert load_manifest_json(manifest_path(str(hung)))["complete"] is False
    assert not verify_cache(str(hung)).ok
    # resume the hung run's cache at world size 1
    with _one_thread():
        synthetic.write_synthetic_cache(str(hung), **CONFIGS["uneven"], **COMMON, resume=True)
    _assert_same_cache(hung, references["uneven"])


def _cli_args(cfg: dict[str, int]) -> list[str]:
    return [
        "--samples", str(cfg["num_samples"]), "--shard-size", str(cfg["shard_size"]),
        "--batch-size", str(cfg["batch_size"]), "--hidden", str(COMMON["hidden"]), "--max-len", str(COMMON["max_len"]),
        "--seed", str(COMMON["seed"]),
    ]  # fmt: skip


@pytest.mark.torchrun
def test_killed_rank_fails_the_others_then_torchrun_resumes_on_fewer_ranks(
    references: dict[str, Path], tmp_path: Path
) -> None:
    """Three ranks; rank 1 is SIGKILLed in the middle of its second shard write.

    Rank 1 runs ``SPECCACHE_FAULT=mid_shard_write:2 python -m speccache.testing.faults speccache.testing.synthetic``,
    the others the plain ``python -m speccache.testing.synthetic ...``.
    """
    out = tmp_path / "cache"
    timeout = 60
    args = [str(out), *_cli_args(CONFIGS["uneven"]), "--timeout", str(timeout)]
    port = _free_port()
    procs, logs = [], []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        env.pop("SPECCACHE_FAULT", None)
        cmd = [sys.executable, "-m", PRODUCER, *args]
        if rank == 1:
            env["SPECCACHE_FAULT"] = "mid_shard_write:2"
            cmd = [sys.executable, "-m", FAULTS, PRODUCER, *args]
        logs.append(open(tmp_path / f"rank{rank}.log", "w+"))
        procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 180
    try:
        while len(ended) < 3 and time.monotonic() < deadline:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = {}
    for rank, f in enumerate(logs):
        f.seek(0)
        output[rank] = f.read()
        f.close()
    assert len(ended) == 3, f"ranks still running after 180 s: {output}"
    assert procs[1].returncode == -signal.SIGKILL, output[1]
    for rank in (0, 2):
        assert procs[rank].returncode == 1, output[rank]
        assert ended[rank] - ended[1] < timeout, f"rank {rank} took {ended[rank] - ended[1]:.1f} s to notice"
        assert "DistributedError" in output[rank] and f"rank {rank} of 3" in output[rank], output[rank]
        assert "--resume" in output[rank], output[rank]
    # what is left: every shard but rank 1's second (torn, as a temp file), an unsealed manifest, no lock
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if n.startswith("shard-") and n.endswith(".safetensors")] == [
        os.path.basename(shard_path(str(out), i)) for i in (0, 1, 2, 3, 5, 6)
    ], names
    assert any(".tmp" in n for n in names) and LOCK_NAME not in names, names
    assert load_manifest_json(manifest_path(str(out)))["complete"] is False
    # resume under torchrun with two ranks (a different split: 4 + 3 shards)
    resume = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", PRODUCER,
         str(out), *_cli_args(CONFIGS["uneven"]), "--timeout", str(timeout), "--resume"],
        env={k: v for k, v in os.environ.items() if k != "SPECCACHE_FAULT"},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stdout + resume.stderr
    _assert_same_cache(out, references["uneven"])


# ---------------------------------------------------------------------------
# in-process units


def test_rebuilt_errors_keep_type_and_message() -> None:
    err = _rebuild_error(0, "speccache.errors", "ConfigMismatchError", "cannot resume")
    assert type(err) is ConfigMismatchError and str(err) == "cannot resume"
    assert type(_rebuild_error(0, "builtins", "PermissionError", "denied")) is PermissionError
    other = _rebuild_error(2, "somewhere.else", "OddError", "boom")
    assert isinstance(other, DistributedError) and isinstance(other, SpeccacheError) and isinstance(other, RuntimeError)
    assert "rank 2" in str(other) and "OddError" in str(other) and "boom" in str(other)


def test_collective_failure_message_names_rank_timeout_and_resume() -> None:
    lost = collective_failure_message(1, 4, "all_gather", 30.0, RuntimeError("Connection reset by peer"))
    assert (
        "rank 1 of 4" in lost and "--timeout of 30 s" in lost and "--resume" in lost and "lost the connection" in lost
    )
    hung = collective_failure_message(0, 2, "barrier", 5.0, RuntimeError("Timed out waiting 5000ms for recv"))
    assert "did not reach" in hung and "--timeout of 5 s" in hung


def test_join_fails_within_timeout_when_no_peer_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()  # nobody listens there
    for key, value in dict(
        RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 of 2: could not join the gloo process group .* within 1 s"):
        init_from_env(torch.device("cpu"), 1.0)
    assert time.monotonic() - started < 30
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_local_comm_without_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    comm = init_from_env(torch.device("cpu"), 1.0)
    assert (comm.rank, comm.world_size) == (0, 1)
    shutdown(comm)  # no-op


_LEAVE_GROUP = """
import os, sys, torch
from speccache.write.dist import init_from_env, shutdown
comm = init_from_env(torch.device("cpu"), 60.0)
from transformers import AutoConfig  # after joining, as in a precompute: it imports torch.distributed.nn
AutoConfig.from_pretrained(sys.argv[1])
shutdown(comm)
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
left = [t for t in threads if "gloo" in t]
assert not left, f"the group outlived shutdown(): {left}"
"""


@pytest.mark.torchrun
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the thread names from /proc")
def test_shutdown_frees_the_group_and_its_gloo_threads(tmp_path: Path) -> None:
    # A group still referenced after destroy_process_group keeps its Gloo threads until the interpreter's
    # teardown, which now and then aborts a rank that finished its work.
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path / "model")
    (tmp_path / "leave.py").write_text(_LEAVE_GROUP)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*launcher, str(tmp_path / "leave.py"), str(tmp_path / "model")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_cli_ends_a_process_that_left_its_group_with_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import speccache.write.dist as dist_module

    ended: list[int] = []

    def fake_exit(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(dist_module.os, "_exit", fake_exit)
    assert cli_main(["inspect", "/nonexistent/cache"]) == 1  # no group left: an ordinary return
    assert ended == []
    monkeypatch.setattr(dist_module, "_left_group", True)
    with pytest.raises(SystemExit):
        cli_main(["inspect", "/nonexistent/cache"])
    assert ended == [1]

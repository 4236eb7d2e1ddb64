"""Concurrent writers and readers: the writer lock, its recovery, and readers beside writers.

Lock holders are real processes forked from the test process; a forked child only
takes and drops the lock (no torch work), which is safe after fork.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from speccache.errors import CacheIncompleteError, CacheLockedError
from speccache.format.lock import LOCK_NAME, CacheLock
from speccache.testing.synthetic import write_synthetic_cache
from support import SOAK
from support.cachecmp import all_samples, same_samples

pytestmark = pytest.mark.soak_suite  # `make soak` runs it with SPECCACHE_SOAK=1, which multiplies its trials

ARGS = dict(num_samples=48, shard_size=4, hidden=32, max_len=32)


def _fork_holder(cache_dir: str) -> tuple[int, int]:
    """Fork a child that takes the lock, says so, and holds it until its pipe closes; returns (pid, write end)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            lock = CacheLock(cache_dir).acquire()
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            lock.release()
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    return pid, go_w


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "cache")
    write_synthetic_cache(path, overlap=False, **ARGS)
    return path, all_samples(path)


def test_second_writer_is_refused_naming_the_holder(tmp_path, reference):
    out = str(tmp_path / "cache")
    pid, go = _fork_holder(out)
    try:
        for resume in (False, True):
            with pytest.raises(CacheLockedError) as info:
                write_synthetic_cache(out, resume=resume, **ARGS)
            message = str(info.value)
            assert f"process {pid}" in message and socket.gethostname() in message and "still running" in message, (
                message
            )
            assert os.listdir(out) == [LOCK_NAME], "the refused writer changed the directory"
    finally:
        os.close(go)
        assert os.waitpid(pid, 0)[1] == 0
    write_synthetic_cache(out, **ARGS)  # the holder is done: the lock is free
    assert same_samples(all_samples(out), reference[1])


def test_lock_of_a_killed_writer_is_recovered(tmp_path, reference):
    out = str(tmp_path / "cache")
    pid, go = _fork_holder(out)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(go)
    assert json.load(open(os.path.join(out, LOCK_NAME)))["pid"] == pid
    write_synthetic_cache(out, resume=True, **ARGS)
    assert same_samples(all_samples(out), reference[1])
    assert LOCK_NAME not in os.listdir(out)


def test_lock_of_a_killed_but_not_yet_reaped_writer_is_recovered(tmp_path):
    """A parent that kills the producer and retries before wait() leaves a zombie, which answers kill(pid, 0)."""
    out = str(tmp_path / "cache")
    pid, go = _fork_holder(out)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        with CacheLock(out):
            pass
    finally:
        os.close(go)
        os.waitpid(pid, 0)


def test_lock_held_on_another_host_is_refused_naming_it(tmp_path):
    out = tmp_path / "cache"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": "node-17.cluster", "pid": 4242, "since": 0}))
    with pytest.raises(CacheLockedError, match=r"process 4242 on host 'node-17.cluster'.*delete .*\.speccache\.lock"):
        CacheLock(str(out)).acquire()


@pytest.mark.parametrize("content", ["", "{", "[]"])
def test_unreadable_lock_is_refused_not_taken(tmp_path, content):
    out = tmp_path / "cache"
    out.mkdir()
    (out / LOCK_NAME).write_text(content)
    with pytest.raises(CacheLockedError, match="unreadable lock file|locked by"):
        CacheLock(str(out)).acquire()
    assert (out / LOCK_NAME).read_text() == content


def test_writers_recovering_one_stale_lock_at_once_never_both_hold_it(tmp_path):
    """Many writers find the same dead holder's lock at the same moment: at most one holds the lock at a time."""
    trials = 200 if SOAK else 12
    for trial in range(trials):
        out = str(tmp_path / f"c{trial}")
        os.makedirs(out)
        dead = subprocess.Popen(["true"])
        dead.wait()
        with open(os.path.join(out, LOCK_NAME), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": dead.pid, "since": 0}, f)
        log = os.path.join(out, "holders.log")
        start = time.time() + 0.1
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    while time.time() < start:
                        pass
                    deadline = time.time() + 5
                    while time.time() < deadline:
                        try:
                            lock = CacheLock(out).acquire()
                        except CacheLockedError:
                            time.sleep(0.001)
                            continue
                        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                        os.write(fd, b"+\n")
                        time.sleep(0.01)
                        os.write(fd, b"-\n")
                        os.close(fd)
                        lock.release()
                        code = 0
                        break
                finally:
                    os._exit(code)
            pids.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
        assert statuses == [0] * len(pids), "a writer never got the lock"
        depth = most = 0
        for line in open(log).read().split():
            depth += 1 if line == "+" else -1
            most = max(most, depth)
        assert most == 1, f"trial {trial}: {most} writers held the lock at once"
        assert sorted(os.listdir(out)) == ["holders.log"]


def test_two_readers_and_a_writer_on_different_directories_do_not_interfere(tmp_path, reference):
    other = str(tmp_path / "other")
    write_synthetic_cache(other, overlap=False, **{**ARGS, "hidden": 16})
    other_samples = all_samples(other)
    errors: list[BaseException] = []
    done = threading.Event()
    reads = [0, 0]

    def reader(slot: int, path: str, expected) -> None:
        try:
            while not done.is_set() or reads[slot] < 2:
                assert same_samples(all_samples(path, verify=True), expected)
                reads[slot] += 1
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=reader, args=(0, reference[0], reference[1])),
               threading.Thread(target=reader, args=(1, other, other_samples))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        new = str(tmp_path / "new")
        write_synthetic_cache(new, overlap=True, **ARGS)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert same_samples(all_samples(new, verify=True), reference[1])
    assert min(reads) >= 2


def test_a_reader_beside_a_live_writer_sees_nothing_or_a_correct_prefix(tmp_path, reference):
    """A reader polling the directory a writer is filling: no manifest, an unsealed cache, or the whole cache.

    A reader of the unsealed prefix keeps reading when the writer seals under it (the same run's manifest).
    """
    out = str(tmp_path / "cache")
    seen = {"missing": 0, "incomplete": 0, "complete": 0}
    errors: list[BaseException] = []
    writing = threading.Event()
    writing.set()

    def poll() -> None:
        try:
            while writing.is_set() or not seen["complete"]:
                try:
                    got = all_samples(out, verify=True)
                except FileNotFoundError:
                    seen["missing"] += 1
                    continue
                except CacheIncompleteError as exc:
                    assert "--resume" in str(exc)
                    seen["incomplete"] += 1
                    prefix = all_samples(out, allow_incomplete=True, verify=True)
                    assert same_samples(prefix, reference[1][: len(prefix)])
                    continue
                assert same_samples(got, reference[1])
                seen["complete"] += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=poll)
    t.start()
    try:
        write_synthetic_cache(out, overlap=True, **ARGS)
    finally:
        writing.clear()
        t.join()
    assert not errors, errors
    assert seen["complete"] >= 1


def test_writer_killed_while_taking_the_lock_leaves_no_lock_nobody_can_recover(tmp_path, reference):
    """SIGKILL while the lock file is being written: the next writer must still get the lock (no empty lock file)."""
    out = str(tmp_path / "cache")
    os.makedirs(out)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            import speccache.format.lock as lock_module

            class _DieWhileWriting:
                def __getattr__(self, name):
                    return getattr(json, name)

                @staticmethod
                def dump(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGKILL)

            lock_module.json = _DieWhileWriting()
            CacheLock(out).acquire()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    write_synthetic_cache(out, resume=True, **ARGS)
    assert same_samples(all_samples(out), reference[1])
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference[0])), "a temporary file of the killed writer was left"


@pytest.mark.parametrize("guard", ["dead holder", "old and unreadable"])
def test_writer_killed_while_recovering_a_stale_lock_does_not_block_the_next(tmp_path, guard):
    """A recovering writer killed while it held the recovery guard: the guard must not keep the lock stale."""
    out = tmp_path / "cache"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "since": 0}
    (out / LOCK_NAME).write_text(json.dumps(stale))
    guard_path = out / (LOCK_NAME + ".tmp-recover")
    if guard == "dead holder":
        guard_path.write_text(json.dumps({**stale, "since": 1}))
    else:
        guard_path.write_text("")
        os.utime(guard_path, (time.time() - 3600, time.time() - 3600))
    with CacheLock(str(out)) as lock:
        assert lock.holder()["pid"] == os.getpid()
    assert sorted(os.listdir(out)) == []

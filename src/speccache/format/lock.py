"""The writer lock of a cache directory.

One file, ``.speccache.lock``, holding the holder's host and process id. It is
written whole under a temporary name and hard-linked into place (atomic and
exclusive on local filesystems and on NFS; ``O_EXCL`` where there are no hard
links). A lock whose holder is a dead process on this host (a zombie included) is
stale and is taken over, one recovering writer at a time; a lock held from another
host cannot be checked from here, so the error says how to remove it by hand.
"""

from __future__ import annotations

import json
import os
import socket
import time
from types import TracebackType

from speccache.errors import CacheLockedError
from speccache.format.durable import temp_path
from speccache.format.names import LOCK_GUARD_NAME, LOCK_NAME

__all__ = ["LOCK_NAME", "CacheLock", "lock_path"]


def lock_path(cache_dir: str) -> str:
    """The writer lock's path inside ``cache_dir``."""
    return os.path.join(cache_dir, LOCK_NAME)


_ABANDONED_GUARD_S = 10.0


def _read_json(path: str) -> dict | None:
    """The JSON object in ``path``; ``None`` when there is no such file, ``{}`` when it is unreadable."""
    try:
        with open(path) as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _place(staged: str, target: str, me: dict) -> None:
    """Create ``target`` holding ``me`` (staged whole in ``staged``); ``FileExistsError`` when it exists."""
    try:
        os.link(staged, target)
        return
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links (or the staged file was removed)
        pass
    fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())


def _clear_abandoned_guard(guard: str) -> None:
    """Remove the recovery guard if its holder died on this host or it is too old to be in use."""
    owner = _read_json(guard)
    if owner is None:
        return
    pid = owner.get("pid")
    dead = owner.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)
    try:
        if dead or time.time() - os.stat(guard).st_mtime > _ABANDONED_GUARD_S:
            os.unlink(guard)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process whose parent has not reaped it yet (a zombie) still answers signal 0.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class CacheLock:
    """Exclusive writer lock on ``cache_dir``; a context manager.

    Args:
        cache_dir: the cache directory (created if missing).

    Raises:
        CacheLockedError: on ``acquire`` when a live writer holds the lock; the
            message names its host and process id.
    """

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.path = lock_path(cache_dir)
        self._held = False
        self._me: dict | None = None

    def holder(self) -> dict | None:
        """The holder recorded in the lock file, or ``None`` when unlocked."""
        return _read_json(self.path)

    def acquire(self) -> CacheLock:
        """Take the lock, recovering it from a dead holder on this host.

        The lock file appears whole: it is written under a temporary name, then hard-linked into
        place, which is atomic and fails if the lock exists (NFS included). A writer killed while
        taking the lock thus never leaves an empty lock file naming no one (which no writer could
        recover). Without hard links the lock is created with ``O_EXCL``, then written.
        """
        os.makedirs(self.cache_dir, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._me = me
        staged = temp_path(self.path)
        try:
            with open(staged, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            for _ in range(3):
                try:
                    _place(staged, self.path, me)
                except FileExistsError:
                    self._recover_or_raise(staged, me)
                    continue
                self._held = True
                return self
        finally:
            try:
                os.unlink(staged)
            except FileNotFoundError:
                pass
        raise CacheLockedError(
            f"could not take the writer lock {self.path}: it keeps reappearing; is another writer starting?"
        )

    def _recover_or_raise(self, staged: str, me: dict) -> None:
        info = self.holder()
        if info is None:
            return
        host, pid = info.get("host"), info.get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            self._remove_stale(info, staged, me)
            return
        if not info:
            reason = "an unreadable lock file (a writer may be creating it)"
        elif host == socket.gethostname():
            reason = f"process {pid} on this host ({host}), which is still running"
        else:
            reason = f"process {pid} on host {host!r}"
        raise CacheLockedError(
            f"cache directory {self.cache_dir} is locked by {reason}. Wait for that writer to finish, or if it is "
            f"gone, delete {self.path} and re-run with --resume."
        )

    def _remove_stale(self, info: dict, staged: str, me: dict) -> None:
        """Delete the lock of the dead holder ``info``, unless another writer has taken the lock since.

        Recovering writers take turns through a guard file (placed like the lock, naming its holder)
        and delete the lock only if it still names ``info``: otherwise two of them could each delete
        the lock the other had just taken, and both would write. A guard whose holder died on this
        host, or older than a few seconds (holding it takes microseconds), is removed.
        """
        guard = os.path.join(self.cache_dir, LOCK_GUARD_NAME)
        try:
            _place(staged, guard, me)
        except FileExistsError:
            _clear_abandoned_guard(guard)
            time.sleep(0.01)  # let the other recovering writer finish
            return
        try:
            if self.holder() == info:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            try:
                os.unlink(guard)
            except FileNotFoundError:  # removed as a temp file by the writer that took the lock
                pass

    def release(self) -> None:
        """Drop the lock (no-op when not held)."""
        # The lock may also be ours if an interrupt landed between placing it and marking it held.
        if self._held or (self._me is not None and self.holder() == self._me):
            self._held = False
            self._me = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> CacheLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

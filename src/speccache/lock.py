"""The writer lock of a cache directory.

One file, ``.speccache.lock``, created with ``O_EXCL`` (atomic on local
filesystems and on NFSv3+), holding the holder's host and process id. A lock
whose holder is a dead process on this host is stale and is taken over; a lock
held from another host cannot be checked from here, so the error says how to
remove it by hand.
"""

from __future__ import annotations

import json
import os
import socket
import time
from types import TracebackType

from speccache.errors import CacheLockedError
from speccache.format import temp_path

LOCK_NAME = ".speccache.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
        self.path = os.path.join(cache_dir, LOCK_NAME)
        self._held = False

    def holder(self) -> dict | None:
        """The holder recorded in the lock file, or ``None`` when unlocked."""
        try:
            with open(self.path) as f:
                info = json.load(f)
            return info if isinstance(info, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "CacheLock":
        """Take the lock, recovering it from a dead holder on this host."""
        os.makedirs(self.cache_dir, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._recover_or_raise()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self._held = True
            return self
        raise CacheLockedError(f"could not take the writer lock {self.path}: it keeps reappearing; is another writer starting?")

    def _recover_or_raise(self) -> None:
        info = self.holder()
        if info is None:
            return
        host, pid = info.get("host"), info.get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            # Rename first so that two recovering writers cannot both delete a lock one of them just took.
            stale = temp_path(self.path)
            try:
                os.replace(self.path, stale)
            except FileNotFoundError:
                return
            os.unlink(stale)
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

    def release(self) -> None:
        """Drop the lock (no-op when not held)."""
        if self._held:
            self._held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "CacheLock":
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

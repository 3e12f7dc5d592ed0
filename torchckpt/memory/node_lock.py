"""A node-wide exclusive lock: one process of a machine pins host memory at a time.

# NOTE [ Node registration lock ]
# 1. Registering host memory with CUDA (``cudaHostRegister``) from several processes of one
#    node at once slows every one of them down: the kernel work of pinning pages serializes
#    inside the driver and the memory system anyway (Maurya et al., HiPC'22). So registrations
#    take this lock.
# 2. The lock is an exclusive ``flock`` on a file in /dev/shm (a RAM file system present on
#    every Linux node; the temp directory where it is missing). ``TORCHCKPT_REGISTER_LOCK``
#    names another file. The kernel drops a flock when the holding process dies, however it
#    dies (SIGKILL included), so a crashed rank never wedges the node.
# 3. The native pool (NOTE [ Native host pool ] Rule 4, csrc/host_pool.cpp) takes the same file around each
#    registration; this Python class is the same lock for Python code and for tests.
# 4. flock locks belong to an open file description: two ``NodeLock`` objects exclude each
#    other even inside one process; one object is not re-entrant.
# 5. Fairness: flock alone lets a process that releases and at once re-takes the lock keep it
#    while another waits. A turnstile makes it fair: take ``<path>.gate``, then ``<path>``, then drop
#    the gate. While one process holds the lock the next waiter holds the gate, so the holder
#    cannot take the lock again before that waiter had it. The gate is a flock too, so a dead
#    holder never wedges it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import time
from types import TracebackType

_LOCK_NAME = "torchckpt-register.lock"


def default_lock_path() -> str:
    """The node registration lock's file: ``$TORCHCKPT_REGISTER_LOCK``, else /dev/shm, else the temp dir.

    Returns:
        An absolute path (the file is created on first use).

    Example::

        >>> default_lock_path().endswith("torchckpt-register.lock") or "TORCHCKPT_REGISTER_LOCK" in os.environ
        True
    """
    env = os.environ.get("TORCHCKPT_REGISTER_LOCK")
    if env:
        return env
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return os.path.join("/dev/shm", _LOCK_NAME)
    return os.path.join(tempfile.gettempdir(), _LOCK_NAME)


class NodeLock:
    """An exclusive lock shared by every process of this machine (see NOTE [ Node registration lock ]).

    Args:
        path: the lock file (``None``: :func:`default_lock_path`).
        enabled: ``False`` makes acquire/release no-ops (the "parallel registration" comparison).

    Example::

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "demo.lock")
        >>> with NodeLock(path) as lock:
        ...     lock.locked
        True
        >>> NodeLock(path).acquire(timeout=0.0)
        True
    """

    def __init__(self, path: str | None = None, enabled: bool = True) -> None:
        self.path = path if path is not None else default_lock_path()
        self.enabled = bool(enabled)
        self._fd: int | None = None
        self._gate: int | None = None
        self.locked = False

    @staticmethod
    def _open_file(path: str) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise OSError(
                e.errno,
                f"torchckpt: could not open the node registration lock {path!r} ({e.strerror}); set "
                "TORCHCKPT_REGISTER_LOCK to a writable file, or pass node_lock=False.",
            ) from e
        try:
            os.fchmod(fd, 0o666)  # best effort: other users of the node may share it
        except OSError:
            pass
        return fd

    def _open(self) -> tuple[int, int]:
        if self._fd is None:
            self._fd = self._open_file(self.path)
        if self._gate is None:
            self._gate = self._open_file(self.path + ".gate")
        return self._fd, self._gate

    @staticmethod
    def _take(fd: int, deadline: float | None) -> bool:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # releases the GIL while it waits
            return True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the lock; ``timeout`` seconds at most (``None``: wait as long as it takes).

        Returns:
            Whether the lock is now held by this object.
        """
        if not self.enabled:
            return True
        if self.locked:
            raise RuntimeError("torchckpt: NodeLock is not re-entrant; release it before acquiring it again.")
        fd, gate = self._open()
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if not self._take(gate, deadline):  # NOTE [ Node registration lock ] Rule 5: the turnstile
            return False
        try:
            if not self._take(fd, deadline):
                return False
            self.locked = True
            return True
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)

    def release(self) -> None:
        """Drop the lock (a no-op when not held)."""
        if self.locked and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.locked = False

    def close(self) -> None:
        """Release the lock and close its file."""
        self.release()
        for fd in (self._fd, self._gate):
            if fd is not None:
                os.close(fd)
        self._fd = self._gate = None

    def __enter__(self) -> NodeLock:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

"""One build of a cached checkpoint at a time: an exclusive lock on a file in the cache.

Governing idea: the process that builds a checkpoint holds ``fcntl.flock`` on ``<name>-<key>.lock``
beside it for the whole build; another process that needs the same checkpoint waits for the lock
and then finds the checkpoint built (or, if the builder was stopped, its saved progress to resume
from). The kernel releases a flock when its holder's file is closed, which happens however the
process ends (Ctrl-C, ``kill -9``, a crash), so the lock of a dead builder never blocks anyone. The
holder writes its pid into the file only for the waiting line; nothing trusts it. The lock file
stays (a few bytes): removing it while another process waits on it would let a third one lock a
new file of the same name and build beside the second.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class WaitInterrupted(KeyboardInterrupt):
    """Ctrl-C while waiting for another process's build (this process built nothing).

    Attributes:
        holder: the pid the lock file named, or None.
    """

    def __init__(self, holder: int | None):
        super().__init__(holder)
        self.holder = holder


def _holder(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


@contextmanager
def build_lock(path: Path, what: str) -> Iterator[int | None]:
    """Hold the exclusive lock on ``path`` (created if missing) for the ``with`` body.

    When another process holds it, prints one line on stderr,
    ``waiting for another process building WHAT (pid P)...``, and blocks until that process ends
    its build (finished, failed, interrupted or killed).

    Yields:
        the pid of the process waited for, or None when the lock was free.

    Raises:
        WaitInterrupted: Ctrl-C while waiting (a ``KeyboardInterrupt``).
        OSError: the cache directory cannot be created or the file opened.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = _holder(fd)
            pid = f" (pid {waited})" if waited is not None else ""
            print(f"waiting for another process building {what}{pid}...", file=sys.stderr, flush=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except KeyboardInterrupt:
                raise WaitInterrupted(waited) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield waited
        finally:
            os.ftruncate(fd, 0)  # still held: a process that waits next reads no stale pid
    finally:
        os.close(fd)  # releases the lock

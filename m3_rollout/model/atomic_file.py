"""Writing a file so that its path holds either the old contents or all of the new ones.

Governing idea: write under a temporary name beside the target (same directory, so same
filesystem), optionally fsync, then ``os.replace`` onto the target (atomic on POSIX). A write
stopped midway (an error, a Ctrl-C, a killed process) leaves the target as it was; the temporary
file is removed unless the process itself dies. For a rename that survives a power cut as well,
fsync the directory afterwards (:func:`fsync_dir`), once after all the renames of one save. A
directory written whole and then renamed into place (a checkpoint) is made durable the same way:
:func:`fsync_tree` on it before the rename, :func:`fsync_dir` on its parent after
(:func:`write_dir_atomic` does the whole of it).

It lives in the model layer, the lowest layer all of its users may import: the model's checkpoint
writer (``loading.save_checkpoint``), the trainers' warm-start progress store and training
checkpoints, the rollout-dump writer (which may import this module and ``selection_record`` only
of the model layer) and the jobs (the builtin checkpoint build, the GRPO job's final save, the
export, the dump command's ``--json``). It imports nothing of the
project, and must not: the dump layer's allowance rests on that.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def write_atomic(
    path: str | os.PathLike,
    write: Callable[[str], None],
    *,
    fsync: bool = True,
    mode: int | None = None,
) -> None:
    """``write(tmp)`` (``tmp``: a path beside ``path``, as ``str``), then rename it onto ``path``.

    Args:
        path: the file to create or replace.
        write: writes the whole file at the path it is given (e.g. ``torch.save(obj, p)``,
            safetensors' ``save_file(ts, p)``); it must close the file before returning.
        fsync: flush the new file to the disk before the rename (False: the rename is atomic for
            other processes, but a power cut may leave an empty or partial file at ``path``).
        mode: permission bits set on the file before the rename (None: what ``write`` made).

    Raises:
        whatever ``write`` raises, or OSError from the fsync / rename; ``path`` is then unchanged
        and the temporary file removed.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        write(tmp)
        if fsync:
            _fsync_file(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:  # fsync flushes the file's data whichever descriptor names it
        os.fsync(f.fileno())


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every regular file under the directory ``path``, then every directory (each after its
    contents, ``path`` last), so the whole tree is on the disk before ``path`` is renamed into
    place. Symbolic links are not followed.

    Raises:
        OSError: a file that cannot be opened or fsynced (directories: as :func:`fsync_dir`).
    """
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f):
                _fsync_file(f)
        fsync_dir(root)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory ``path``, making the renames and removals in it durable. A no-op where
    directories cannot be opened (platforms without directory file descriptors)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def write_dir_atomic(final: str | os.PathLike) -> Iterator[Path]:
    """Write a directory that appears at ``final`` whole and on the disk (a checkpoint).

    Yields a new temporary directory beside ``final`` (mode 0755: ``mkdtemp`` makes 0700, and
    checkpoints are shared like any output) for the caller to fill. On a normal exit its files and
    directories are fsynced (:func:`fsync_tree`), an earlier ``final`` is removed, the temporary
    directory is renamed to ``final`` and the parent fsynced (:func:`fsync_dir`: the rename and the
    removal). On an exception (a Ctrl-C included) the temporary directory is removed and
    ``final`` is left as it was. The parent is created if missing.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        yield tmp
        fsync_tree(tmp)  # on the disk before the rename makes it look complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)

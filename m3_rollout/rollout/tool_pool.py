"""Run tool calls in worker processes that are killed at a time limit (design.md §6).

Governing idea: a tool is model-driven code, so it never runs in the rollout process. A small
pool of forked workers holds the tool functions (inherited at fork, so nothing is pickled but
the call's name and JSON arguments); each call gets a deadline, and a worker that misses it is
SIGKILLed and replaced together with every process it started: each worker leads its own
process group and the whole group is killed. Tool output is capped in length inside the worker,
before it crosses the pipe (lone surrogates, which the tokenizer cannot encode, become U+FFFD);
what a tool prints goes to /dev/null, and what it writes to stderr reaches the trainer's stderr
capped the same way, once per call. Every failure (timeout, exception, a worker that died during or between
calls, arguments that cannot be sent) comes back as an ``Error: ...`` text for the model, never
as an exception in the rollout loop; a run interrupted from outside (e.g. Ctrl-C) replaces the
workers it left busy, so no stale reply is ever read as a later call's result. An idle worker
whose pool process died without closing it (SIGKILL, a ``timeout``'s SIGTERM) ends itself and its
process group within a second.
"""

from __future__ import annotations

import atexit
import fcntl
import math
import multiprocessing as mp
import os
import re
import select
import signal
import struct
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

__all__ = ["ToolProcessPool", "cap_output"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def cap_output(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters plus a marker saying how much was dropped; lone
    surrogates (not encodable, so not tokenizable) become U+FFFD."""
    if len(text) > max_chars:
        text = text[:max_chars] + f"...[truncated {len(text) - max_chars} characters]"
    return _SURROGATE.sub("\ufffd", text)


def _run_one(fns: dict[str, Callable[..., object]], name: str, kwargs: dict, max_chars: int) -> str:
    fn = fns.get(name)
    if fn is None:
        return f"Error: unknown tool {name!r}"
    try:
        out = str(fn(**kwargs))
    except TypeError as exc:
        out = f"Error: bad arguments for {name}: {exc}"
    except Exception as exc:  # a tool bug is an observation, not a crash
        out = f"Error: {type(exc).__name__}: {exc}"
    return cap_output(out, max_chars)


class _StderrCapture:
    """Worker side: fd 2 becomes a pipe that a thread drains while a call runs, keeping the first
    ``4 * max_chars`` bytes (enough for ``max_chars`` characters of UTF-8) and counting the rest,
    so neither the tool nor a process it started can flood the trainer's stderr or block on a
    full pipe. ``forward`` writes what one call wrote, capped to ``max_chars`` characters with a
    marker, to the real stderr. NOTE: output of a worker that dies inside a call is lost."""

    def __init__(self, max_chars: int):
        self._real = os.dup(2)
        self._read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        # Python-level writes go to the pipe too (sys.stderr may not be fd 2, e.g. under pytest).
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        self._max_chars = max_chars
        self._kept = bytearray()
        self._total = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()

    def _pending(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self._read_fd, termios.FIONREAD, b"\0\0\0\0"))[0]

    def _read_available(self) -> None:
        """Read what the pipe holds now (the caller holds the lock, so the read never blocks)."""
        n = self._pending()
        if n:
            data = os.read(self._read_fd, min(n, 1 << 16))
            self._total += len(data)
            self._kept += data[: max(0, 4 * self._max_chars - len(self._kept))]

    def _drain(self) -> None:
        while True:
            select.select([self._read_fd], [], [])
            with self._lock:
                self._read_available()

    def forward(self, name: str) -> None:
        """Write what call ``name`` wrote to stderr, capped, to the real stderr; then start afresh."""
        sys.stderr.flush()
        with self._lock:
            for _ in range(64):  # what the call wrote is in the pipe; a writer left running is cut off
                if not self._pending():
                    break
                self._read_available()
            kept, total = bytes(self._kept), self._total
            self._kept.clear()
            self._total = 0
        if not total:
            return
        text = kept.decode("utf-8", "replace")
        if len(text) > self._max_chars or total > len(kept):
            text = text[: self._max_chars] + f"...[truncated: {total} bytes in all]"
        data = f"[tool {name!r} stderr]\n{text}\n".encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(self._real, data) :]
        except OSError:
            pass


def _exit_if_orphaned(pool_pid: int) -> None:
    """End this worker, and what its tools left running, once the pool's process is gone.

    A pool process killed from outside (SIGKILL, the OOM killer, the SIGTERM of ``timeout``) runs
    no exit hook, and the far end of this worker's pipe stays open in this and later-forked workers
    (inherited at fork), so ``recv`` never sees EOF: without this check the workers live on, holding
    whatever the pool's stdout / stderr were (a shell pipeline reading them never ends)."""
    if os.getppid() == pool_pid:
        return
    if os.getpgid(0) == os.getpid():  # leads its own group: the group is this worker and its tools
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _worker_main(conn: Connection, fns: dict, max_chars: int, pool_pid: int) -> None:
    # Own process group, so a timeout kills every process the tool started (the parent also sets
    # it right after the fork; whichever runs first wins, the other is a no-op).
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    # What a tool prints is not its result: keep it off the trainer's stdout (a chatty tool
    # would also block on a full pipe and time out).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # C-level writes
        os.close(devnull)
        sys.stdout = open(os.devnull, "w")  # Python-level prints (sys.stdout may not be fd 1)
    except OSError:
        pass
    stderr = _StderrCapture(max_chars)
    while True:
        try:
            while not conn.poll(1.0):  # idle: check once a second that the pool's process lives
                _exit_if_orphaned(pool_pid)
            msg = conn.recv()
        except (EOFError, OSError):
            return
        name, kwargs = msg
        result = _run_one(fns, name, kwargs, max_chars)
        stderr.forward(name)
        conn.send(result)


class _Worker:
    __slots__ = ("proc", "conn")

    def __init__(self, ctx, fns: dict, max_chars: int):
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fns, max_chars, os.getpid()), daemon=True)
        self.proc.start()
        try:
            os.setpgid(self.proc.pid, self.proc.pid)
        except OSError:  # the worker did it first (or, under spawn, has exec'd: it does it itself)
            pass
        child.close()
        self.conn = parent

    def kill_group(self) -> None:
        """SIGKILL every process left in the worker's group (the worker and what its tools started)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.kill_group()
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _close_at_exit(ref: weakref.ref[ToolProcessPool]) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


class ToolProcessPool:
    """A pool of worker processes running named tool functions with a per-call time limit.

    Args:
        fns: tool name -> function called with keyword arguments; must exist before the first
            call (workers are forked on first use and inherit them).
        num_workers: processes; calls beyond that wait for a free worker.
        timeout_s: wall-clock limit per call (seconds); a worker past it is killed, with every
            process its tool started, and replaced.
        max_output_chars: longest output returned, and longest stderr text forwarded per call
            (longer is cut, with a marker).

    Raises:
        ValueError: a non-positive ``num_workers``, ``timeout_s`` or ``max_output_chars``.
    """

    def __init__(
        self,
        fns: dict[str, Callable[..., object]],
        num_workers: int = 2,
        timeout_s: float = 1.0,
        max_output_chars: int = 2048,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s={timeout_s}: must be a finite number of seconds > 0")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars={max_output_chars}: must be >= 1")
        self.fns = dict(fns)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_output_chars = max_output_chars
        # NOTE: fork (Linux) so workers inherit the tool functions and start in milliseconds;
        # they only run plain Python tool code, never torch.
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self._workers: list[_Worker] = []
        self.stats = {"calls": 0, "timeouts": 0, "worker_deaths": 0}
        atexit.register(_close_at_exit, weakref.ref(self))

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.fns, self.max_output_chars))

    def run(self, calls: list[tuple[str, dict]]) -> list[str]:
        """Run ``(tool name, keyword arguments)`` calls, up to ``num_workers`` at a time.

        Returns:
            One output text per call, in order; failures as ``Error: ...`` texts.
        """
        if not calls:
            return []
        self._ensure_workers()
        results: list[str | None] = [None] * len(calls)
        queue = list(range(len(calls)))
        free = list(range(len(self._workers)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, deadline)
        try:
            self._run(calls, results, queue, free, busy)
        except BaseException:
            # Interrupted with calls in flight: their replies would sit in the pipes and be read
            # as the results of a later run's calls. Replace those workers.
            for slot in busy:
                self._replace(slot)
            raise
        return [r if r is not None else "Error: no result" for r in results]

    def _send(self, slot: int, call: tuple[str, dict]) -> str | None:
        """Send ``call`` to worker ``slot``; a worker found dead (killed between runs) is
        replaced and the call resent once. Returns an error text when the call cannot be sent."""
        for attempt in range(2):
            try:
                self._workers[slot].conn.send(call)
                return None
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                self.stats["worker_deaths"] += 1
                self._replace(slot)
                if attempt:
                    return f"Error: tool {call[0]!r} could not be started ({type(exc).__name__})"
            except Exception as exc:  # e.g. arguments that cannot be pickled; nothing was written
                return f"Error: could not send the call to {call[0]!r} ({type(exc).__name__}: {exc})"
        return None

    def _run(self, calls, results, queue, free, busy) -> None:
        while queue or busy:
            while queue and free:
                slot, i = free.pop(), queue.pop(0)
                error = self._send(slot, calls[i])
                if error is not None:
                    results[i] = error
                    free.append(slot)
                    continue
                busy[slot] = (i, time.monotonic() + self.timeout_s)
                self.stats["calls"] += 1
            if not busy:
                continue
            deadline = min(d for _, d in busy.values())
            ready = wait([self._workers[s].conn for s in busy], timeout=max(0.0, deadline - time.monotonic()))
            for slot in list(busy):
                w, (i, d) = self._workers[slot], busy[slot]
                if w.conn in ready:
                    try:
                        results[i] = w.conn.recv()
                    except (EOFError, OSError):
                        results[i] = f"Error: tool {calls[i][0]!r} crashed its worker process"
                        self.stats["worker_deaths"] += 1
                        self._replace(slot)
                elif time.monotonic() >= d:
                    results[i] = f"Error: tool {calls[i][0]!r} timed out after {self.timeout_s:g} s"
                    self.stats["timeouts"] += 1
                    self._replace(slot)
                else:
                    continue
                del busy[slot]
                free.append(slot)

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.fns, self.max_output_chars)

    def close(self) -> None:
        """Stop all workers and what their tools left running in the background (also run at
        interpreter exit). NOTE: killed, not asked to exit: a worker holds no state worth a clean
        exit, and killing its group while it still leads it is what reaches those processes."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

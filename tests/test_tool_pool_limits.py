"""ToolProcessPool limits that reach past the worker itself: processes a tool starts, and stderr."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from m3_rollout.rollout.tool_pool import ToolProcessPool


def _spawn(pid_file: str, hang: bool) -> str:
    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    if hang:
        time.sleep(60)
    return "started"


def _loud(n: int) -> str:
    print("e" * n, file=sys.stderr)  # line-buffered, as the interpreter's own stderr
    os.write(2, b"E" * n)  # C-level, bypassing sys.stderr
    return "done"


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie left unreaped by a container's init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, limit_s: float = 10.0) -> bool:
    end = time.monotonic() + limit_s
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def _pid(pid_file) -> int:
    return int(pid_file.read_text())


def test_timeout_kills_the_processes_a_tool_started(tmp_path):
    pid_file = tmp_path / "pid"
    pool = ToolProcessPool({"spawn": _spawn}, num_workers=1, timeout_s=1.0)
    try:
        out = pool.run([("spawn", {"pid_file": str(pid_file), "hang": True})])
        assert out == ["Error: tool 'spawn' timed out after 1 s"]
        pid = _pid(pid_file)
        try:
            assert _wait_gone(pid), "the tool's child outlived the tool's time limit"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # The replacement worker runs calls as before.
        assert pool.run([("spawn", {"pid_file": str(pid_file), "hang": False})]) == ["started"]
    finally:
        pool.close()
    pid = _pid(pid_file)
    try:
        assert _wait_gone(pid), "a process a tool left running outlived the pool"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


POOL_KILLED_FROM_OUTSIDE = """
import os, signal, subprocess, sys
from m3_rollout.rollout.tool_pool import ToolProcessPool

def spawn():
    return f"{os.getpid()} {subprocess.Popen(['sleep', '60']).pid}"  # the worker, and a process its tool started

pool = ToolProcessPool({"spawn": spawn}, num_workers=2, timeout_s=30.0)
with open(sys.argv[1], "w") as f:
    f.write(" ".join(pool.run([("spawn", {}), ("spawn", {})])))
os.kill(os.getpid(), signal.SIGKILL)  # no atexit hook runs: the pool never closes its workers
"""


def test_workers_end_when_the_pool_process_is_killed(tmp_path):
    """A trainer killed from outside (SIGKILL, OOM, ``timeout``'s SIGTERM) left its idle tool
    workers, and what their tools started, running forever, holding its stdout / stderr open."""
    script, pid_file = tmp_path / "pool.py", tmp_path / "pids"
    script.write_text(POOL_KILLED_FROM_OUTSIDE)
    # stdout / stderr not captured: an orphaned worker holding the pipes would block the run
    proc = subprocess.run([sys.executable, str(script), str(pid_file)], stdout=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    pids = [int(p) for p in pid_file.read_text().split()]
    workers, tool_children = pids[0::2], pids[1::2]
    assert len(set(workers)) == 2 and len(tool_children) == 2
    try:
        for pid in pids:
            assert _wait_gone(pid, limit_s=30.0), f"process {pid} outlived the killed pool process"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_tool_stderr_is_capped_like_its_output(capfd):
    pool = ToolProcessPool({"loud": _loud}, num_workers=1, timeout_s=30.0, max_output_chars=50)
    try:
        # 2 x 100 000 bytes (+ a newline): more than a pipe holds, so the worker must drain while the tool writes.
        assert pool.run([("loud", {"n": 100_000})]) == ["done"]
        assert pool.run([("loud", {"n": 3})]) == ["done"]
    finally:
        pool.close()
    err = capfd.readouterr().err
    first = "[tool 'loud' stderr]\n" + "e" * 50 + "...[truncated: 200001 bytes in all]\n"
    assert err == first + "[tool 'loud' stderr]\neee\nEEE\n"

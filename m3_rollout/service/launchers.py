"""Launchers: host the EP group's RolloutWorkers as Ray actors or torch.multiprocessing processes.

Governing idea: the service sees one interface, ``Launcher``: ``start(spec)`` brings up P
workers (rank r gets ``RolloutWorker(spec, r)``), ``call(method, per_rank_args)`` invokes a
worker method on every rank concurrently and returns the P results, and ``shutdown()`` ends
them. A worker that dies (process gone / actor died) or raises turns into one
:class:`GroupFailure` naming the ranks, raised as soon as it is seen (polling, never a blocking
wait without a deadline), so the service can tear the group down and restart it.

- :class:`ProcessLauncher`: ``torch.multiprocessing`` forkserver processes, one ``Pipe`` each.
  Messages cross BY VALUE (plain pickle bytes: a tensor's data is in the message, never a
  shared-memory handle that dies with the process that sent it, e.g. a worker that replies and
  exits). For machines without Ray (the GPU test machines). A worker's traceback survives its
  death: a rank that fails (e.g. loading its checkpoint) sends the traceback before it exits,
  and the failure reports it rather than the exit code.
- :class:`RayLauncher` (default where Ray is installed): one actor per rank asking for
  ``num_cpus`` (fractional: two workers + a trainer fit on two cores) and, on GPU, one GPU;
  ``ray.init`` through :func:`init_ray` (a local instance, or a cluster's address).
"""

from __future__ import annotations

import abc
import pickle
import re
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import wait as wait_ready
from typing import Any

import torch.multiprocessing as mp

from .worker import RolloutWorker, WorkerSpec

_POLL_S = 0.01


def cause_line(text: str) -> str:
    """The line of a traceback / error text that names the cause: the last ``SomeError: ...``
    line (Ray wraps the worker's traceback in text of its own), else the last line; '?' if empty."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "?"
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
    return causes[-1] if causes else lines[-1]


class GroupFailure(RuntimeError):
    """A worker died, raised, or did not answer in time; the EP group must be restarted.

    Attributes: ``ranks`` (the failed ranks), ``method`` (the call), ``details`` (per-rank text,
    e.g. the worker's traceback); the message names each rank's cause (``cause_line``).
    """

    def __init__(self, method: str, ranks: list[int], details: dict[int, str]):
        self.method, self.ranks, self.details = method, sorted(ranks), details
        text = "; ".join(f"rank {r}: {cause_line(details.get(r, ''))}" for r in self.ranks)
        super().__init__(f"EP worker group failed during {method!r}: {text}")


class Launcher(abc.ABC):
    """Starts, calls and stops the P workers of one EP group."""

    world_size: int = 0

    @abc.abstractmethod
    def start(self, spec: WorkerSpec, timeout_s: float) -> None:
        """Start ``spec.group.world_size`` workers and wait until all are constructed.
        Raises GroupFailure (with the worker's traceback) when one fails or times out."""

    @abc.abstractmethod
    def call(self, method: str, per_rank_args: Sequence[tuple] | tuple = (), timeout_s: float | None = None) -> list:
        """Call ``RolloutWorker.method`` on every rank (``per_rank_args[r]`` or the same args
        for all) concurrently; return the results by rank. Raises GroupFailure."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """Process id of each rank (tests, diagnostics)."""

    @abc.abstractmethod
    def shutdown(self, graceful: bool = True) -> None:
        """End every worker (graceful: ask first, kill after 3 s; else kill at once, as after a
        failure, when survivors may sit in a broken collective). Safe to call twice."""

    @staticmethod
    def _args(per_rank_args, world: int) -> list[tuple]:
        if (
            isinstance(per_rank_args, list)
            and len(per_rank_args) == world
            and all(isinstance(a, tuple) for a in per_rank_args)
        ):
            return per_rank_args
        return [tuple(per_rank_args)] * world


# ---------------------------------------------------------------------------- processes
def send_by_value(conn, obj) -> None:
    """Send ``obj`` through a ``Connection`` as plain pickle bytes (tensors by value)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv_by_value(conn):
    """Receive what ``send_by_value`` sent. Raises EOFError / OSError when the peer is gone."""
    return pickle.loads(conn.recv_bytes())


def _reply(conn, status: str, value) -> bool:
    """Send a worker's (status, value) reply; False when the driver is gone (its pipe end closed:
    it exited, e.g. stopped while this worker started), which ends the worker without a word.
    A reply that cannot be pickled raises (reported as the call's error)."""
    try:
        send_by_value(conn, (status, value))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False
    return True


def _process_main(spec: WorkerSpec, rank: int, conn) -> None:
    """Body of one worker process: construct the worker, then serve (method, args) messages.
    Ctrl-C is the driver's (it reaches every process of the terminal's group): the driver ends
    the workers, which ignore SIGINT instead of printing a KeyboardInterrupt traceback each. A
    driver that is gone (its pipe closed; stopped while this worker loaded the model) ends the
    worker quietly: it printed a BrokenPipeError traceback twice, from the reply and from the
    error report of that reply."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = RolloutWorker(spec, rank)
    except BaseException:  # noqa: BLE001 - reported to the parent
        _reply(conn, "error", traceback.format_exc())
        return
    if not _reply(conn, "ok", None):
        return
    while True:
        try:
            method, args = recv_by_value(conn)
        except (EOFError, OSError):
            break  # parent went away
        try:
            sent = _reply(conn, "ok", getattr(worker, method)(*args))
        except BaseException:  # noqa: BLE001 - reported to the parent, which restarts the group
            sent = _reply(conn, "error", traceback.format_exc())
        if not sent or method == "shutdown":
            break


def _context():
    """ "forkserver" with the worker module preloaded: the first start pays the imports once, later
    starts (restarts after a failure) fork from a clean, already-imported, single-threaded server
    (no CUDA initialised there). "spawn" where forkserver does not exist."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # pragma: no cover - platforms without forkserver
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(["m3_rollout.service._preload"])
    return ctx


def start_forkserver(ctx) -> None:
    """Start ``ctx``'s forkserver now (if it is not running) with SIGINT ignored, so that it
    inherits the ignored disposition across its exec. The forkserver ignores SIGINT itself only
    after its preload imports (torch: seconds); a Ctrl-C in that window printed its
    KeyboardInterrupt traceback under the driver's one line. A Ctrl-C in the parent during this
    call (the spawn, milliseconds) is ignored too. No-op for other start methods and off the main
    thread (only it may set signal handlers; the server then starts with the first worker)."""
    if ctx.get_start_method() != "forkserver" or threading.current_thread() is not threading.main_thread():
        return
    from multiprocessing import forkserver

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, old)


class ProcessLauncher(Launcher):
    """EP workers as ``torch.multiprocessing`` processes (forkserver; no Ray needed)."""

    def __init__(self):
        self._procs: list = []
        self._conns: list = []
        # Set when a call failed: ranks that had not answered may still send that call's reply,
        # which the next call would read as its own. Every later call fails until a restart.
        self._broken: str | None = None

    def start(self, spec: WorkerSpec, timeout_s: float) -> None:
        ctx = _context()
        start_forkserver(ctx)
        self.world_size = spec.group.world_size
        if str(spec.device).startswith("cuda"):  # workers inherit it; each also sets it before NCCL starts
            from m3_rollout.parallel.process_group import disable_nvlink_multicast

            disable_nvlink_multicast()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process_main, args=(spec, rank, child), daemon=True, name=f"m3-rollout-ep{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start", timeout_s)

    def call(self, method: str, per_rank_args=(), timeout_s: float | None = None) -> list:
        if not self._procs:
            ranks = list(range(self.world_size))
            raise GroupFailure(method, ranks, {r: "the group is shut down; start it again" for r in ranks})
        args = self._args(per_rank_args, self.world_size)
        if self._broken is not None:
            ranks = list(range(self.world_size))
            raise GroupFailure(
                method, ranks, {r: f"group broken by the failed {self._broken!r} call; restart it" for r in ranks}
            )
        failed: dict[int, str] = {}
        for rank, conn in enumerate(self._conns):
            try:
                send_by_value(conn, (method, args[rank]))
            except (BrokenPipeError, OSError) as exc:
                failed[rank] = f"worker process gone ({exc})"
        if failed:
            self._broken = method
            raise GroupFailure(method, list(failed), failed)
        try:
            return self._collect(method, timeout_s)
        except GroupFailure:
            self._broken = method
            raise

    def _collect(self, method: str, timeout_s: float | None) -> list:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        while pending:
            for rank in sorted(pending):
                proc = self._procs[rank]
                alive = proc.is_alive()  # before the poll: a reply sent before death is then seen
                got = self._reply(rank)
                if got is not None:
                    status, value = got
                    if status != "ok":
                        errors[rank] = value
                    results[rank] = value
                    pending.discard(rank)
                elif not alive:
                    errors[rank] = f"worker process died (exit code {proc.exitcode})"
                    pending.discard(rank)
            if errors:
                raise self._failure(method, errors)
            if pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise GroupFailure(method, sorted(pending), {r: f"no answer within {timeout_s} s" for r in pending})
                # Sleep until a reply or a death (or the poll interval for the deadline): a reply
                # is read as soon as it is sent, not up to a poll interval later.
                wait_ready([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], _POLL_S)
        return results

    def _reply(self, rank: int):
        """The (status, value) reply waiting in rank's pipe, or None (nothing there / pipe gone)."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                return recv_by_value(conn)
        except (EOFError, OSError):
            pass
        return None

    def _failure(self, method: str, errors: dict[int, str], grace_s: float = 1.0) -> GroupFailure:
        """Name the root cause: a peer's collective error often arrives before the dead rank is
        seen dead, so wait briefly for process deaths and report dead ranks first. A dead rank's
        own message (the traceback it sent before exiting) is kept, with the exit code added."""
        end = time.monotonic() + grace_s
        while True:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() > end:
                break
            time.sleep(_POLL_S)
        details = dict(errors)
        for r in dead:
            code = f"worker process died (exit code {self._procs[r].exitcode})"
            if r not in errors:
                got = self._reply(r)
                if got is not None and got[0] != "ok":
                    details[r] = got[1]
            details[r] = f"{code}\n{details[r]}" if r in details and details[r] != code else code
        return GroupFailure(method, dead or list(errors), details)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self, graceful: bool = True) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if graceful and proc.is_alive():
                try:
                    send_by_value(conn, ("shutdown", ()))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + (3.0 if graceful else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


# ---------------------------------------------------------------------------- Ray
class _RayWorker:
    """Actor body: a RolloutWorker plus a generic ``invoke`` (so the launcher calls any method)."""

    def __init__(self, spec: WorkerSpec, rank: int):
        self.worker = RolloutWorker(spec, rank)

    def invoke(self, method: str, args: tuple):
        return getattr(self.worker, method)(*args)


def init_ray(address: str | None = None, **kwargs: Any) -> None:
    """``ray.init`` for the launcher: a Ray instance it starts runs its worker processes at the
    driver's niceness instead of 15 above it.

    Ray's raylet renices every worker process by its ``worker_niceness`` setting (15) so that
    it and the GCS stay responsive. EP ranks are peers in collectives, so a reniced rank stalls
    the whole group whenever anything else wants the CPU: on a 2-core machine with two other
    busy processes the reniced actors got ~4 % of a core and the EP=2 generation test took
    190 s against 16 s idle (2026-12-07). Ray accepts that setting only from a driver that
    starts the instance, so ``address`` None (Ray's own lookup: ``RAY_ADDRESS``, then a
    cluster started by ``ray start`` on this machine, else a new instance) that finds a
    cluster joins it as before and keeps that cluster's setting; so does any other address.

    Args:
        address: None, "local" (always a new instance), "auto" or "host:port".
        kwargs: passed to ``ray.init`` (e.g. ``num_cpus``, ``log_to_driver``).
    Raises ImportError when Ray is not installed; ``ray.init``'s errors otherwise.
    """
    import ray

    kwargs.setdefault("ignore_reinit_error", True)
    if address in (None, "", "local"):
        try:
            local = {"include_dashboard": False, **kwargs}
            ray.init(address=address or None, _system_config={"worker_niceness": 0}, **local)
            return
        except ValueError as exc:  # Ray found a running cluster to join: it refuses the setting
            if "_system_config" not in str(exc):
                raise
        print(
            "[rollout] joining the running Ray cluster Ray found (RAY_ADDRESS or `ray start`): its worker "
            "processes run at its worker_niceness (Ray's default renices them by 15, which stalls EP ranks on a "
            "busy host; `ray start --system-config='{\"worker_niceness\": 0}'` avoids it, cluster.ray_address=local "
            "starts a new instance instead)",
            flush=True,
        )
    ray.init(address=address or None, **kwargs)


class RayLauncher(Launcher):
    """EP workers as Ray actors.

    Args:
        address: ``cluster.ray_address`` (None: Ray's own lookup, else a new local instance;
            "local": a new local instance; see :func:`init_ray`).
        num_cpus: CPUs each actor asks for (fractional is fine, e.g. 0.5).
        num_gpus: GPUs each actor asks for (1 per rank on GPU machines, 0 on CPU).
    Raises ImportError (naming the pip extra) when Ray is not installed.
    """

    def __init__(self, address: str | None = None, num_cpus: float = 0.5, num_gpus: float = 0.0):
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError(
                "cluster.launcher=ray needs Ray: pip install 'm3-rollout[ray]' (or set cluster.launcher=mp)"
            ) from exc
        self.ray = ray
        if not ray.is_initialized():
            init_ray(address, log_to_driver=True)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self._actors: list = []

    def start(self, spec: WorkerSpec, timeout_s: float) -> None:
        ray = self.ray
        self.world_size = spec.group.world_size
        cls = ray.remote(_RayWorker)
        self._actors = [
            cls.options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_task_retries=0, name=None
            ).remote(spec, rank)
            for rank in range(self.world_size)
        ]
        self.call("info", (), timeout_s)  # waits for every constructor (errors surface here)

    def call(self, method: str, per_rank_args=(), timeout_s: float | None = None) -> list:
        ray = self.ray
        args = self._args(per_rank_args, self.world_size)
        refs = [a.invoke.remote(method, args[r]) for r, a in enumerate(self._actors)]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list[Any] = [None] * self.world_size
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            for ref in ready:
                r = rank_of[ref]
                try:
                    results[r] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayActorError / RayTaskError: the group is broken
                    raise self._failure(method, {r: f"{type(exc).__name__}: {exc}"}, pending, rank_of) from None
            if pending and deadline is not None and time.monotonic() >= deadline:
                late = [rank_of[ref] for ref in pending]
                raise GroupFailure(method, late, {r: f"no answer within {timeout_s} s" for r in late})
        return results

    def _failure(
        self, method: str, errors: dict[int, str], pending: list, rank_of: dict, grace_s: float = 2.0
    ) -> GroupFailure:
        """Name the root cause: prefer ranks whose actor died over peers whose collective failed."""
        ray = self.ray
        dead = {r for r, text in errors.items() if "Died" in text or "ActorError" in text}
        end = time.monotonic() + grace_s
        while pending and not dead and time.monotonic() < end:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            for ref in ready:
                r = rank_of[ref]
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    errors[r] = f"{type(exc).__name__}: {exc}"
                    if "Died" in type(exc).__name__ or "ActorError" in type(exc).__name__:
                        dead.add(r)
        return GroupFailure(method, sorted(dead) or list(errors), errors)

    def pids(self) -> list[int]:
        return [info["pid"] for info in self.call("info", (), 30.0)]

    def shutdown(self, graceful: bool = True) -> None:
        for a in self._actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self._actors = []


def make_launcher(kind: str, ray_address: str | None = None, num_cpus: float = 0.5, num_gpus: float = 0.0) -> Launcher:
    """ "ray", "mp", or "auto" (Ray when importable, else processes). Raises ValueError otherwise."""
    if kind == "auto":
        import importlib.util

        kind = "ray" if importlib.util.find_spec("ray") is not None else "mp"
    if kind == "ray":
        return RayLauncher(ray_address, num_cpus, num_gpus)
    if kind == "mp":
        return ProcessLauncher()
    raise ValueError(f"cluster.launcher={kind!r}: must be 'auto', 'ray' or 'mp'")

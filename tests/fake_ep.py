"""A fake EP worker group for RolloutService's failure paths (no processes, no model).

``fake_service(...)`` builds a ``RolloutService`` over :class:`FakeLauncher`: every sample gets
one :func:`fake_token` per lockstep step, keyed like the real sampler (seed, sample index,
position), so a resubmitted sample repeats its tokens and logprobs bitwise, stamped with the
version of the weights the group holds (0, the checkpoint's, until it receives an update); chosen
calls and restarts fail. Used by tests/test_service_ep.py and tests/test_server_ep.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
import types

import m3_rollout.weight_sync
from m3_rollout.config import WeightSyncConfig
from m3_rollout.engine.interface import SampleOutput, StreamDelta
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutService, WorkerSpec
from m3_rollout.service.launchers import GroupFailure, Launcher


def fake_token(seed: int, index: int, pos: int) -> tuple[int, float]:
    """The fake group's token (3..10; 3 is EOS) and logprob at position ``pos`` of sample
    ``index``, keyed as the real sampler: a resubmitted sample repeats them."""
    h = int.from_bytes(hashlib.blake2b(f"{seed},{index},{pos}".encode(), digest_size=8).digest(), "little")
    return 3 + h % 8, -(h % 997) / 997


class FakeLauncher(Launcher):
    """In-process stand-in for the worker group (no processes; failure paths only). ``run`` steps
    every sample one :func:`fake_token` per lockstep step (stream deltas for streamed requests,
    aborts of the rank's own samples, pause) until a stop token or ``max_new_tokens``; the run calls numbered in
    ``log["fail_runs"]`` (counted over all groups from 1) fail, and so do the first
    ``run_failures``; every start after the first fails while ``start_failures`` lasts; a method
    named in ``log["fail_calls"]`` fails that many times. Each run call's new requests are logged
    as (group, request id, n, sample_index). Weights: the group starts on the checkpoint's
    (version 0); after ``init_weight_sync`` (a trainer's group joined) ``receive_weights`` applies
    ``log["trainer_version"]`` with the outcome popped from ``log["trainer_outcomes"]`` ("ok" when
    empty; see :meth:`_receive`); outputs carry the version held."""

    def __init__(self, log: dict):
        self.log = log
        self.world_size = 2
        self.samples: list[dict] = []  # the group's unfinished samples, in arrival order
        self.paused = False
        self.version = 0  # the weights this group holds: the checkpoint's
        self.joined = False  # in a trainer's weight-sync group
        self.sleeping = False

    def start(self, spec, timeout_s):
        self.log["starts"] += 1
        if self.log["starts"] > 1 and self.log["start_failures"] > 0:
            self.log["start_failures"] -= 1
            raise GroupFailure("start", [1], {1: "Traceback (most recent call last):\nOSError: disk gone"})

    def _finished(self, s: dict, reason: str) -> SampleOutput:
        q = s["req"]
        return SampleOutput(q.request_id, s["index"], list(q.prompt_ids), s["ids"], s["lps"], reason, self.version)

    def _run(self, per_rank_args) -> list[dict]:
        outs: list = []
        steps = 0
        for rank, args in enumerate(per_rank_args):
            new, steps, aborts, stream = (*args, (), ())[:4]  # generate() sends (new, steps)
            for q in new:
                self.log["added"].append((self.log["starts"], q.request_id, q.params.n, q.sample_index))
                for j in range(q.params.n):
                    s = {"req": q, "index": q.sample_index + j, "ids": [], "lps": [], "stream": q.request_id in stream}
                    self.samples.append(s | {"rank": rank})
            # a rank's engine aborts its own samples only (another rank's abort of an id finds nothing)
            ended = [s for s in self.samples if s["req"].request_id in aborts and s["rank"] == rank]
            outs += [self._finished(s, "abort") for s in ended]
            self.samples = [s for s in self.samples if not any(s is e for e in ended)]
        ran = 0
        while ran < (0 if self.paused else steps) and self.samples:
            ran += 1
            for s in list(self.samples):
                p = s["req"].params
                tok, lp = fake_token(p.seed, s["index"], len(s["ids"]))
                s["ids"].append(tok)
                s["lps"].append(lp)
                if s["stream"]:
                    outs.append(StreamDelta(s["req"].request_id, s["index"], [tok], [lp], [self.version]))
                if tok in p.stop_token_ids or len(s["ids"]) == p.max_new_tokens:
                    outs.append(self._finished(s, "stop" if tok in p.stop_token_ids else "length"))
                    self.samples.remove(s)
        ep = {"tokens_per_expert": [], "dispatch_s": 0.0, "expert_s": 0.0, "combine_s": 0.0}
        return [
            {"outputs": outs, "steps": ran, "ep": ep, "engine": {}},
            {"outputs": [], "steps": ran, "ep": ep, "engine": {}},
        ]

    def call(self, method, per_rank_args=(), timeout_s=None):
        if self.log["fail_calls"].get(method, 0) > 0:
            self.log["fail_calls"][method] -= 1
            raise GroupFailure(method, [1], {1: "RuntimeError: peer died"})
        if method == "info":
            return [{"pid": r, "rank": r} for r in range(2)]
        if method == "count_weight_write":  # every start gives the new workers the group's write count
            self.log.setdefault("writes", []).append(per_rank_args[0])
            return [None, None]
        if method in ("pause", "resume"):
            self.paused = method == "pause"
            return [None, None]
        if method in ("sleep", "wake_up"):
            # a rank's engine refuses (RuntimeError / ValueError), which the launcher reports as any
            # exception of a worker: a GroupFailure
            if method == "sleep" and self.samples:
                text = f"RuntimeError: sleep: {len(self.samples)} samples are unfinished"
                raise GroupFailure(method, [0, 1], {0: text, 1: text})
            if method == "sleep" and per_rank_args[0] not in (1, 2):
                text = f"ValueError: sleep(level={per_rank_args[0]}): level must be 1 or 2"
                raise GroupFailure(method, [0, 1], {0: text, 1: text})
            self.sleeping = method == "sleep"
            level = per_rank_args[0] if self.sleeping else 0
            return [{"level": level, "seconds": 0.0}] * 2
        if method == "reset_prefix_cache":
            return [None, None]
        if method == "init_weight_sync":
            self.joined = True
            self.broadcast = len(per_rank_args) == 6  # update_weights' group (join_weight_sync's adds rank_offset)
            while "wire" in self.log and not self.log["wire"].empty():  # a new group: nothing of the old one's
                self.log["wire"].get()
            return [[], []]
        if method == "init_ipc_sync":  # fake_ipc_service: update_weights' updates come over the wire too
            self.broadcast = True
            return [None, None]
        if method == "receive_weights" and getattr(self, "broadcast", False):
            return self._receive_broadcast()
        if method == "receive_weights":
            if not self.joined:  # the worker's weight_sync is None
                raise GroupFailure(method, [0, 1], {0: "AttributeError: 'NoneType' object has no attribute 'update'"})
            if self.log.get("http_trainer"):  # fake_http_trainer: the update FakeSender sends
                return self._receive_broadcast()
            outcomes = self.log.setdefault("trainer_outcomes", [])
            return self._receive(self.log["trainer_version"], outcomes.pop(0) if outcomes else "ok")
        if method == "run":
            self.log["runs"] += 1
            if self.log["run_failures"] > 0 or self.log["runs"] in self.log["fail_runs"]:
                self.log["run_failures"] = max(0, self.log["run_failures"] - 1)
                raise GroupFailure("run", [0], {0: "RuntimeError: peer died"})
            if self.sleeping and any(args[0] for args in per_rank_args):  # the ranks' engines refuse
                text = "RuntimeError: engine is asleep (level 1): call wake_up() before you add a request"
                raise GroupFailure("run", [0, 1], {0: text, 1: text})
            return self._run(per_rank_args)
        if method == "shutdown":
            raise GroupFailure("shutdown", [0], {0: "group broken"})
        raise AssertionError(method)

    def _receive_broadcast(self) -> list[dict]:
        """Every rank's ``receive_weights`` for the update :class:`FakeSender` sends (:meth:`_receive`)."""
        version, include_frozen, replace, outcome = self.log["wire"].get(timeout=30)
        self.log["received"].append((version, include_frozen, replace, outcome))
        return self._receive(version, outcome)

    def _receive(self, version: int, outcome: str) -> list[dict]:
        """Every rank's ``receive_weights`` for update ``version``: "ok" applies it; "partial" is
        rejected after rank 1 wrote part of it (atomic=false): rank 1 turns invalid and hands back
        its samples (the fake keeps no ranks: all of them); "dies" / "dies_unseen": rank 1 fails
        during it (GroupFailure)."""
        if outcome in ("dies", "dies_unseen"):
            raise GroupFailure("receive_weights", [1], {1: "RuntimeError: peer died"})
        base = {"seconds": 0.0, "paused_seconds": 0.0, "probe_drift": None, "outputs": [], "handed_back": []}
        if outcome == "ok":
            self.version = version
            return [{**base, "ok": True, "version": version, "wrote": True, "valid": True, "errors": []}] * 2
        handed = [
            dataclasses.replace(s["req"], params=dataclasses.replace(s["req"].params, n=1), sample_index=s["index"])
            for s in self.samples
        ]
        self.samples = []
        error = f"rank 1: update {version} failed after weights were written: rank invalid"
        return [
            {**base, "ok": False, "version": self.version, "wrote": False, "valid": True, "errors": []},
            {**base, "ok": False, "version": self.version, "wrote": True, "valid": False, "errors": [error]}
            | {"handed_back": handed},
        ]

    def pids(self):
        return [0, 1]

    def shutdown(self, graceful=True):
        self.log["shutdowns"] += 1


def fake_service(
    run_failures: int, start_failures: int, max_restarts: int = 2, fail_runs=(), refit="broadcast", log=None
) -> tuple[RolloutService, dict]:
    """A RolloutService (EP=2) over :class:`FakeLauncher` and the log its groups share: "starts",
    "shutdowns", "runs" (run calls so far), "added" (see FakeLauncher), "writes", "fail_calls"
    ({method: failures to come}), "trainer_version" (what ``receive_weights`` applies); the first
    ``run_failures`` run calls and those numbered in ``fail_runs`` fail, and ``start_failures``
    restarts. ``log``: a dict to fill (:func:`fake_ipc_service`'s)."""
    log = {} if log is None else log
    log.update(starts=0, shutdowns=0, run_failures=run_failures, start_failures=start_failures)
    log.update(runs=0, fail_runs=set(fail_runs), added=[], fail_calls={}, trainer_version=1)
    spec = WorkerSpec(model_dir="unused", group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=5))
    svc = RolloutService(
        spec,
        launcher=lambda: FakeLauncher(log),
        max_restarts=max_restarts,
        weight_sync=WeightSyncConfig(),
        refit=refit,
    )
    return svc, log


class FakeSender:
    """The trainer end of ``update_weights``' broadcast group over :class:`FakeLauncher` (stands
    in for WeightSyncGroup, BroadcastChannel and WeightSender: :func:`fake_broadcast`). Each
    update goes to the group's ``receive_weights`` through ``log["wire"]`` with its outcome,
    popped from ``log["send_outcomes"]`` ("ok" when empty; "partial": rejected after rank 1 wrote
    part of it; "dies": rank 1 fails during it), and any but "ok" raises WeightUpdateError, as the
    real sender does: at once (gloo sees its peers' connections reset), except for "dies_unseen",
    where rank 1 fails during it and the send does not see it, as an NCCL send waits for dead
    peers: it ends when its group is closed (an abort) or after ``log["send_timeout_s"]`` (the
    collective timeout), and puts which ended it ("closed" / "timed out") on ``log["send_ends"]``."""

    def __init__(self, log: dict, named_tensors, channel, *args, probe=None, reference=None):
        self.log, self.named_tensors, self.channel, self.reference = log, named_tensors, channel, reference
        self.stats: dict = {}

    def handshake(self) -> None:
        pass

    def update(self, version: int, include_frozen: bool = False, replace: bool = False) -> dict:
        outcome = self.log["send_outcomes"].pop(0) if self.log["send_outcomes"] else "ok"
        self.log["wire"].put((version, include_frozen, replace, outcome))
        if outcome == "dies_unseen":
            closed = self.channel.group.closed.wait(self.log.get("send_timeout_s", 30.0))
            self.log["send_ends"].put("closed" if closed else "timed out")
            raise m3_rollout.weight_sync.WeightUpdateError(f"weight update {version} interrupted: peers gone")
        if outcome != "ok":
            raise m3_rollout.weight_sync.WeightUpdateError(
                f"rank 1: update {version} failed after weights were written: rank invalid"
            )
        return {}


class _FakeGroup:
    def __init__(self, *args):
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


class _FakeChannel:
    def __init__(self, group, double_buffer=True):
        self.group = group


def fake_broadcast(monkeypatch, log: dict, module=m3_rollout.weight_sync) -> None:
    """Patch the trainer end of the broadcast weight-sync group (``RolloutService._push_weights``)
    with :class:`FakeSender`: ``update_weights`` then runs over :class:`FakeLauncher`. Adds to
    ``log``: "send_outcomes" (see FakeSender), "received" ((version, include_frozen, replace,
    outcome) per update the group received), "wire", "send_ends". ``module``: where the trainer end's names
    are looked up."""
    log.update(send_outcomes=[], received=[], wire=queue.Queue(), send_ends=queue.Queue())
    monkeypatch.setattr(module, "WeightSyncGroup", _FakeGroup)
    monkeypatch.setattr(module, "BroadcastChannel", _FakeChannel)
    monkeypatch.setattr(module, "WeightSender", lambda *a, **k: FakeSender(log, *a, **k))


class FakeIpcRefit:
    """The trainer end of the IPC refit (stands in for ``service/ipc_refit.IpcRefit``:
    :func:`fake_ipc_service`): each update goes to the group's ``receive_weights`` through
    ``log["wire"]`` as :class:`FakeSender`'s; the source holds the last version every rank
    accepted (a rejected fill overwrote it)."""

    def __init__(self, log: dict, *args):
        self.sender = FakeSender(log, None, None)
        self.channel = types.SimpleNamespace(source_device=None, stats={})
        self.worker_args = ("fake endpoint", {})
        self.stage_version: int | None = None
        self.fresh = True

    def send(self, version: int, named_tensors, replace: bool = False) -> dict:
        self.stage_version = None  # the fill overwrites it
        stats = self.sender.update(version, include_frozen=self.fresh, replace=replace)
        self.fresh, self.stage_version = False, int(version)
        return stats

    def holds(self, version: int) -> bool:
        return self.stage_version == version

    def resend(self) -> dict:
        stats = self.sender.update(self.stage_version, include_frozen=True)
        self.fresh = False
        return stats

    def lost_workers(self) -> None:
        self.fresh = True

    def close(self) -> None:
        pass


def fake_ipc_service(monkeypatch, **kwargs) -> tuple[RolloutService, dict]:
    """:func:`fake_service` with ``refit="ipc"`` over :class:`FakeIpcRefit`; the log gains
    "send_outcomes", "received", "wire" (see :func:`fake_broadcast`)."""
    import m3_rollout.service.service

    log: dict = {"send_outcomes": [], "received": [], "wire": queue.Queue()}
    monkeypatch.setattr(m3_rollout.service.service, "IpcRefit", lambda *a, **k: FakeIpcRefit(log))
    return fake_service(refit="ipc", log=log, **kwargs)


def fake_http_trainer(monkeypatch, log: dict) -> None:
    """:func:`fake_broadcast` for ``HTTPBackend`` (m3_rollout.server.client): the updates it sends
    reach the fake group that joined over /init_weight_sync (``receive_weights`` applies the version
    on the wire; a join drops what an earlier group left on it)."""
    import m3_rollout.server.client

    fake_broadcast(monkeypatch, log, m3_rollout.server.client)
    log["http_trainer"] = True

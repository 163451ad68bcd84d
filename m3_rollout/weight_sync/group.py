"""The weight-sync process group: the trainer's ranks + every rollout rank (design.md §3, §5).

Governing idea: a group of its own that never touches the ranks' default or EP groups. It is
built directly from a ``TCPStore`` on its own port (hosted by the trainer, rank 0) and a backend
object (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU) with a short timeout, never via
``init_process_group`` / ``new_group``. Each (re)build publishes a fresh random token in the
store and prefixes the group's rendezvous keys with it, so a rebuild after a failure (a sender
killed midway, a receive timeout) never reads stale keys, whether the trainer survived or was
restarted with a new store.

Rank layout: 0 .. T-1 = the trainer's ranks (``train_world_size`` T, 1 unless the trainer is
data-parallel: NeMo RL's policy workers all join the group), rank 0 the store host and the source
of every broadcast; T .. W-1 = rollout ranks (any order the launcher chooses; it passes each
worker its rank). Trainer ranks 1 .. T-1 take part in every collective (a broadcast from rank 0
lands in their buffers too) and report a verdict like any rank (``sender.BroadcastChannel``).
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

_TOKEN_KEY = "weight_sync/token"


class WeightSyncTimeout(RuntimeError):
    """A weight-sync collective failed or timed out (peer died, sender interrupted); rebuild the group."""


class WeightSyncGroup:
    """Trainer + rollout ranks on a private TCPStore.

    Args:
        host, port: where rank 0 hosts the TCPStore (port must be free there; not the port of
            the ranks' own default group).
        rank, world_size: ranks below ``train_world_size`` are the trainer's (0: the source);
            world_size = train_world_size + number of rollout ranks.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors; one rank per GPU).
        timeout_s: limit for every collective and for the rendezvous.
        device: where this rank's wire buffers live (cpu for gloo; its GPU for nccl).
        train_world_size: how many of the ranks are the trainer's (>= 1, < world_size).

    Raises WeightSyncTimeout when the rendezvous does not complete in time; ValueError for a
    rank or train_world_size outside its range.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
        train_world_size: int = 1,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight_sync backend={backend!r}: must be 'gloo' or 'nccl'")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight-sync rank {rank} outside [0, {world_size})")
        if not 1 <= train_world_size < world_size:
            raise ValueError(
                f"weight-sync train_world_size={train_world_size}: must be in [1, {world_size}) "
                f"(world_size={world_size} counts the trainer's ranks and at least one rollout rank)"
            )
        self.host, self.port, self.rank, self.world_size = host, int(port), int(rank), int(world_size)
        self.train_world_size = int(train_world_size)
        self.backend = backend
        if backend == "nccl":
            from m3_rollout.parallel.process_group import disable_nvlink_multicast

            disable_nvlink_multicast()
        self.timeout = timedelta(seconds=float(timeout_s))
        self.device = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        self._store: dist.TCPStore | None = None
        self._pg = None
        self._token: str | None = None
        self.generation = 0
        self.connect()

    # ---------------------------------------------------------------- build / rebuild
    def connect(self) -> None:
        """(Re)create the store connection and the backend group under a new token."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.rank == 0:
            if self._store is None:
                self._store = dist.TCPStore(self.host, self.port, None, True, self.timeout, wait_for_workers=False)
            token = uuid.uuid4().hex
            self._store.set(_TOKEN_KEY, token)
        else:
            # A fresh client each time: the trainer (store host) may have been restarted.
            self._store = None
            last = self._token
            while True:
                try:
                    if self._store is None:
                        self._store = dist.TCPStore(
                            self.host, self.port, None, False, self.timeout, wait_for_workers=False
                        )
                    token = self._store.get(_TOKEN_KEY).decode()
                except (RuntimeError, dist.DistStoreError) as exc:  # store not up yet / went away
                    self._store = None
                    token, err = None, exc
                if token is not None and token != last:
                    break
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(
                        f"weight-sync rank {self.rank}: no new group from the trainer at {self.host}:{self.port} "
                        f"within {self.timeout.total_seconds():.0f} s" + ("" if token else f" ({err})")
                    )
                time.sleep(0.05)
        self._token = token
        store = dist.PrefixStore(f"weight_sync/{token}/", self._store)
        try:
            self._pg = self._make_backend(store)
        except RuntimeError as exc:
            raise WeightSyncTimeout(f"weight-sync rank {self.rank}: group rendezvous failed: {exc}") from exc
        self.generation += 1

    def _make_backend(self, store):
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            ifname = os.environ.get("GLOO_SOCKET_IFNAME")
            dev = (
                dist.ProcessGroupGloo.create_device(interface=ifname)
                if ifname
                else dist.ProcessGroupGloo.create_device(
                    hostname=self.host if self.host in ("127.0.0.1", "localhost") else ""
                )
            )
            opts._devices = [dev]
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        torch.cuda.set_device(self.device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)

    def rebuild(self) -> None:
        """Drop the (broken) backend group and rendezvous again under a new token.

        The trainer publishes the new token; rollout ranks wait (up to the timeout) for a token
        different from the one they last used."""
        self.close_backend()
        self.connect()

    def close_backend(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            for meth in ("abort", "shutdown"):
                if hasattr(pg, meth) and self.backend == "nccl":
                    try:
                        getattr(pg, meth)()
                        break
                    except RuntimeError:
                        pass

    def close(self) -> None:
        """Release the backend group and the store connection."""
        self.close_backend()
        self._store = None

    # ---------------------------------------------------------------- collectives
    def broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        """Broadcast ``tensor`` from rank 0 (the trainer) in place; returns the Work if async.

        Raises WeightSyncTimeout on failure or timeout (synchronous calls)."""
        if self._pg is None:
            raise WeightSyncTimeout("weight-sync group is closed; rebuild() it")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            work = self._pg.broadcast([tensor], opts)
            if async_op:
                return work
            work.wait()
        except RuntimeError as exc:
            raise WeightSyncTimeout(f"weight-sync rank {self.rank}: broadcast failed: {exc}") from exc
        return None

    @staticmethod
    def wait(work) -> None:
        """Wait for an async broadcast; raises WeightSyncTimeout on failure."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise WeightSyncTimeout(f"weight-sync broadcast failed: {exc}") from exc

    def exchange_objects(self, obj) -> list:
        """All-gather one picklable object per rank; returns the list indexed by rank."""
        if self._pg is None:
            raise WeightSyncTimeout("weight-sync group is closed; rebuild() it")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        try:
            n = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
            self._pg.allgather([sizes], [n]).wait()
            width = int(max(int(s) for s in sizes))
            buf = torch.zeros(width, dtype=torch.uint8, device=self.device)
            buf[: data.numel()] = data.to(self.device)
            outs = [torch.empty_like(buf) for _ in range(self.world_size)]
            self._pg.allgather([outs], [buf]).wait()
        except RuntimeError as exc:
            raise WeightSyncTimeout(f"weight-sync rank {self.rank}: status exchange failed: {exc}") from exc
        return [pickle.loads(o[: int(s)].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]

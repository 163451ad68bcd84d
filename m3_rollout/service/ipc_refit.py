"""Driver side of the refit of rollout workers beside the trainer (``RolloutService`` with
``refit="ipc"``: ``policy.generation.colocated_placement=worker_process``): one worker on the
trainer's device, or P EP workers on the GPUs of its node (rank r on cuda:r, the trainer sharing
one of them; on CPU all on the CPU).

Governing idea: a worker on the trainer's GPU cannot join an NCCL group with it (one rank of a
group per GPU), and a host round trip would cost two PCIe transfers of the model, so the driver
(the trainer's process) owns an ``IpcChannel`` whose source every worker opens once
(``weight_sync/ipc.py``: the trainer's attested compute copy on a GPU when the trainer computes
in the generation dtype, else a stage the trainer fills) and a ``WeightSender`` that reads the
trainer's live tensors: no host copy; each rank copies its own tensors (an EP rank its own experts),
from another GPU by peer copies. The source doubles as the record of the weights the
workers accepted last: a restarted worker is given the source as it stands
(``IpcChannel.resend_stage``), which holds exactly the bytes its lost predecessor had accepted
while it is not rewritten: the stage until the next refit fills it, even when the trainer has
trained since; the compute copy until the trainer's next cast (its next optimizer step). A worker
lost after that cannot be handed the served weights (``holds``): the service then refuses
``generate`` until the next refit, which the GRPO loop runs right after training anyway.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable

import torch

from m3_rollout.weight_sync import IpcChannel, ProbeSettings, ReleasedTensors, WeightSender


class IpcRefit:
    """The trainer end of one group's IPC refit: channel, sender, and which version the stage holds.

    Args:
        ws: the ``weight_sync`` config section (atomic, in_flight, recompute_kv_after_update and
            timeout_s reach the workers; timeout_s bounds every wait).
        n_workers: workers that connect (the group's world size).
        device: the source's device = the trainer's (CUDA IPC; cpu: shared memory); the workers
            sit on it or on other GPUs of its node.
        generation_dtype: the workers' dtype (wire dtype; router >= fp32).
        frozen: names sent with a worker's first update only.
        probe / reference: ``weight_sync.probe`` settings and the trainer's scorer (None: off).
    """

    def __init__(
        self,
        ws,
        n_workers: int,
        device: torch.device | str,
        generation_dtype: torch.dtype,
        frozen: Callable[[str], bool],
        probe: ProbeSettings | None = None,
        reference=None,
    ):
        self.channel = IpcChannel(n_workers, device, ws.timeout_s)
        self._named: Iterable = []  # the trainer's (name, tensor) pairs of the last update
        self.sender = WeightSender(
            lambda: self._named,
            self.channel,
            ws.bucket_size_mb,
            generation_dtype,
            frozen,
            probe=probe,
            reference=reference,
        )
        self.options = dict(
            atomic=ws.atomic,
            in_flight=ws.in_flight,
            recompute_kv_after_update=ws.recompute_kv_after_update,
            timeout_s=ws.timeout_s,
            # A CPU stage's handle is a file descriptor, which the worker fetches from this
            # process's multiprocessing resource sharer; that connection authenticates with the
            # process authkey, which a torch.multiprocessing child inherits but a Ray actor lacks.
            process_authkey=bytes(multiprocessing.current_process().authkey),
        )
        # The version whose bytes the stage holds, accepted by every worker (None: nothing yet, or
        # the last fill was not accepted everywhere).
        self.stage_version: int | None = None
        self.fresh = True  # the connected workers have had no update: the next one carries the frozen tensors

    @property
    def worker_args(self) -> tuple:
        """``RolloutWorker.init_ipc_sync`` arguments: (endpoint, options)."""
        return (self.channel.endpoint, self.options)

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], replace: bool = False) -> dict:
        """Fill the stage from ``named_tensors`` (released names, on any device; a
        ``ReleasedTensors`` is resolved once and reused) and update every worker. Returns the
        sender's stats plus ``fill_seconds``. Raises WeightUpdateError / HandshakeError (the
        stage then holds no accepted version, unless the sender withdrew the update before
        touching it: then it still holds the version every worker kept, for ``resend``)."""
        held = (self._named, self.stage_version)
        self._named = named_tensors if isinstance(named_tensors, ReleasedTensors) else list(named_tensors)
        self.stage_version = None  # the fill overwrites it
        try:
            stats = self.sender.update(version, include_frozen=self.fresh, replace=replace)
        except Exception:
            if self.sender.withdrawn == version:  # refused before the fill: stage and workers as they were
                self._named, self.stage_version = held
            raise
        self.fresh, self.stage_version = False, int(version)
        return {**stats, "fill_seconds": self.channel.stats.get("fill_seconds", 0.0)}

    def holds(self, version: int) -> bool:
        """Whether the source still holds ``version`` as every worker accepted it (``resend``
        can hand it to restarted workers)."""
        return self.stage_version == version and self.channel.can_resend()

    def resend(self) -> dict:
        """Give freshly connected workers the source as it stands (``stage_version``, frozen
        tensors included), without refilling it from the trainer, which may have trained since.
        No probe: its reference would score the trainer's newer weights. Raises RuntimeError
        when the source holds no accepted version (``holds``), WeightUpdateError /
        HandshakeError as ``send``."""
        if self.stage_version is None or not self.holds(self.stage_version):
            raise RuntimeError("IpcRefit.resend: the source holds no version every worker accepted")
        probe, self.sender.probe = self.sender.probe, None
        self.channel.resend_stage = True
        try:
            stats = self.sender.update(self.stage_version, include_frozen=True)
        finally:
            self.sender.probe, self.channel.resend_stage = probe, False
        self.fresh = False
        return {**stats, "fill_seconds": 0.0}

    def lost_workers(self) -> None:
        """The group is being restarted: drop the connections (the stage stays); the new workers
        connect, and the next update re-runs the handshake and hands them the stage."""
        self.channel.discard_connections()
        self.sender.manifest = None
        self.fresh = True

    def close(self) -> None:
        """Tell the workers to stop serving and stop listening (the service's shutdown)."""
        self.channel.close()
        self._named = []

"""A rollout engine's weight-sync endpoint: receiver + in-flight policy + probe scorer, for an
EP worker behind a broadcast group (``RolloutWeightSync``) or the in-process engine behind the
colocated direct copy (``LocalWeightSync``).

Governing idea: both build the same ``WeightReceiver`` with the engine's ``InFlightPolicy`` and
scorer from one function (``engine_receiver``), so a refit of the in-process engine and of N EP
ranks runs the same checks, version rules, in-flight policy and probe; only the transport
differs. ``RolloutWeightSync.update()`` is called when the driver announces an update (while the
trainer calls ``WeightSender.update``): it rebuilds the group first if the previous update broke
it (the rank kept serving on its old weights in the meantime), re-runs the handshake after a
rebuild, then receives. ``LocalWeightSync.update_weights`` is the ``GenerationBackend`` entry for
callers holding tensors (the trainer's own sender may instead drive ``.channel`` directly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .group import WeightSyncGroup, WeightSyncTimeout
from .in_flight import InFlightOutcome, InFlightPolicy
from .manifest import HandshakeError
from .probe import ProbeSettings, Scorer
from .receiver import UpdateResult, WeightReceiver
from .released import ReleasedTensors
from .sender import ColocatedChannel, WeightSender, WeightUpdateError


def engine_scorer(engine) -> Scorer:
    """Probe scorer over an ``LLMEngine``: ``engine.score`` with the served weights. The probe runs
    before the update's verdict, so a refusal left by an earlier failed update does not apply."""

    def score(ids: torch.Tensor) -> torch.Tensor:
        refuse, engine.refuse_reason = engine.refuse_reason, None
        try:
            return engine.score(ids.tolist())
        finally:
            engine.refuse_reason = refuse

    return score


def engine_receiver(
    engine,
    atomic: bool = True,
    double_buffer: bool = True,
    in_flight: str = "abort",
    recompute_kv_after_update: bool = False,
    drain: Callable[[], list] | None = None,
) -> WeightReceiver:
    """The receiver of an ``LLMEngine``: its model, version, validity (invalid while the engine
    refuses requests after a failed non-atomic update), in-flight policy and probe scorer.
    Raises ValueError for a bad ``in_flight`` / ``recompute_kv_after_update`` (naming the key)."""
    policy = InFlightPolicy(engine, in_flight, recompute_kv_after_update, drain)
    receiver = WeightReceiver(
        engine.model,
        atomic=atomic,
        double_buffer=double_buffer,
        version=engine.weight_version,
        in_flight=policy,
        scorer=engine_scorer(engine),
    )
    # A receiver built for an engine whose weights a failed non-atomic update left invalid (a new
    # group joined since, e.g. /init_weight_sync again) starts invalid too: only an accepted update
    # may lift the refusal, never a refused one.
    receiver.valid = engine.refuse_reason is None
    # Only the checkpoint the engine loaded may be "re-sent" at its version without ``replace`` (a
    # fresh receiver's first update): once an update was accepted, a new group's receiver keeps
    # the version rule (the same version again is refused unless it says replace). Not the write
    # count: an EP service counts a write at every group start too.
    receiver.received = engine.weights_updated
    return receiver


class RolloutWeightSync:
    """EP-rank side of weight sync for an ``LLMEngine``.

    Args:
        engine: the rank's ``LLMEngine`` (its model may be an EP shard).
        group: this rank's ``WeightSyncGroup`` (rank >= 1).
        bucket_size_mb, atomic, double_buffer, in_flight, recompute_kv_after_update: the
            ``weight_sync`` config section.
        drain: lockstep drain loop under EP (``InFlightPolicy``; default: the engine alone).
    """

    def __init__(
        self,
        engine,
        group: WeightSyncGroup,
        bucket_size_mb: float = 512,
        atomic: bool = True,
        double_buffer: bool = True,
        in_flight: str = "abort",
        recompute_kv_after_update: bool = False,
        drain: Callable[[], list] | None = None,
    ):
        self.engine, self.group = engine, group
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        self.receiver = engine_receiver(engine, atomic, double_buffer, in_flight, recompute_kv_after_update, drain)
        self.needs_rebuild = False
        self.last: InFlightOutcome | None = None

    def handshake(self) -> None:
        """Run the handshake (raises HandshakeError listing differences)."""
        self.receiver.handshake(self.group)

    def update(self, expect_version: int | None = None) -> InFlightOutcome:
        """Receive one update under the in-flight policy; never raises for a bad update.
        ``expect_version``: refuse an update of another version (``receive_update``)."""
        handshake = self.receiver.manifest is None  # the last handshake found differences
        if self.needs_rebuild:
            try:
                self.group.rebuild()
            except WeightSyncTimeout as exc:
                return InFlightOutcome(self.receiver.interrupted(f"group rebuild failed: {exc}"))
            self.needs_rebuild, handshake = False, True
        if handshake:  # the trainer's sender runs its handshake first in this update too
            try:
                self.receiver.handshake(self.group)
            except WeightSyncTimeout as exc:
                self.needs_rebuild = True
                return InFlightOutcome(self.receiver.interrupted(f"handshake failed: {exc}"))
            except HandshakeError as exc:  # the group is in step: the next update handshakes again
                return InFlightOutcome(self.receiver.refused(f"{exc}; the next update runs the handshake again"))
        result: UpdateResult = self.receiver.receive_update(self.group, self.bucket_bytes, expect_version)
        self.needs_rebuild = result.needs_rebuild
        policy = self.receiver.in_flight
        self.last = policy.last if policy.last is not None and policy.last.result is result else InFlightOutcome(result)
        return self.last


class LocalWeightSync:
    """The in-process engine's endpoint: ``engine_receiver`` behind ``ColocatedChannel(direct=True)``.

    Args:
        engine: the ``LLMEngine``.
        atomic, in_flight, recompute_kv_after_update: the ``weight_sync`` config section.
        probe: ``weight_sync.probe`` settings (None: off); ``reference`` is the trainer's scorer
            (``probe.model_scorer``) it needs (or ``set_probe_reference`` before the first update).
        frozen: names left out of updates after the first (``policy.freeze``, unless
            ``weight_sync.send_frozen``); default none.
    """

    def __init__(
        self,
        engine,
        atomic: bool = True,
        in_flight: str = "abort",
        recompute_kv_after_update: bool = False,
        probe: ProbeSettings | None = None,
        reference: Scorer | None = None,
        frozen: Callable[[str], bool] = lambda name: False,
    ):
        self.engine = engine
        self.receiver = engine_receiver(engine, atomic, True, in_flight, recompute_kv_after_update)
        device = next(engine.model.parameters()).device
        self.channel = ColocatedChannel([self.receiver], device, direct=True)
        self._tensors: list[tuple[str, torch.Tensor]] = []
        dtype = engine.model.model.embed_tokens.weight.dtype  # wire dtype: the rollout's (router stays >= fp32)
        self.sender = WeightSender(
            lambda: self._tensors, self.channel, generation_dtype=dtype, frozen=frozen, probe=probe, reference=reference
        )

    def set_probe_reference(self, reference: Scorer) -> None:
        """The trainer's probe scorer (``probe.model_scorer``) for ``weight_sync.probe``."""
        self.sender.reference = reference

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> InFlightOutcome:
        """Copy a full set of released-name tensors into the engine's weights, in place, through
        the receiver (all its checks; ``weight_sync.atomic``: nothing changes on a rejection).

        Returns the in-flight outcome (drained outputs, handed-back requests) for the caller to
        deliver. Raises ValueError naming the rank and tensors when the update is rejected
        (missing / unexpected / mis-shaped / non-finite tensors, a version that does not
        increase, a failed probe)."""
        # a ReleasedTensors passes through unexpanded: the sender resolves it once, not per refit
        self._tensors = named_tensors if isinstance(named_tensors, ReleasedTensors) else list(named_tensors)
        first = not self.receiver.received
        try:
            self.sender.update(version, include_frozen=first)
        except (HandshakeError, WeightUpdateError) as exc:
            raise ValueError(
                f"weight update rejected (version {self.receiver.version}{'' if self.receiver.valid else ', invalid'}):"
                f" {exc}"
            ) from exc
        finally:
            self._tensors = []
        return self.receiver.in_flight.last

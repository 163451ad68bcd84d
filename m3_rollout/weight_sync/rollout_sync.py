"""One rollout rank's weight-sync endpoint: group + receiver + engine + in-flight policy.

Governing idea: what a rollout worker (service/launcher) holds. ``update()`` is called when the
driver announces an update (while the trainer calls ``WeightSender.update``): it rebuilds the
group first if the previous update broke it (the rank kept serving on its old weights in the
meantime), re-runs the handshake after a rebuild, then receives under the in-flight policy.
"""

from __future__ import annotations

from collections.abc import Callable

from .group import WeightSyncGroup, WeightSyncTimeout
from .in_flight import InFlightOutcome, update_with_policy
from .receiver import UpdateResult, WeightReceiver


class RolloutWeightSync:
    """Rollout-rank side of weight sync for an ``LLMEngine``.

    Args:
        engine: the rank's ``LLMEngine`` (its model may be an EP shard).
        group: this rank's ``WeightSyncGroup`` (rank >= 1).
        bucket_size_mb, atomic, double_buffer, in_flight, recompute_kv_after_update: the
            ``weight_sync`` config section.
        step: lockstep step function for draining under EP (default ``engine.step``).
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
        step: Callable[[], list] | None = None,
    ):
        self.engine, self.group = engine, group
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        self.receiver = WeightReceiver(
            engine.model, atomic=atomic, double_buffer=double_buffer, version=engine.weight_version
        )
        self.in_flight, self.recompute_kv, self.step = in_flight, recompute_kv_after_update, step
        self.needs_rebuild = False
        self.last: InFlightOutcome | None = None

    def handshake(self) -> None:
        """Run the handshake (raises HandshakeError listing differences)."""
        self.receiver.handshake(self.group)

    def update(self) -> InFlightOutcome:
        """Receive one update under the in-flight policy; never raises for a bad update."""

        def receive() -> UpdateResult:
            if self.needs_rebuild:
                try:
                    self.group.rebuild()
                    self.receiver.handshake(self.group)
                except WeightSyncTimeout as exc:
                    return self.receiver.interrupted(f"group rebuild failed: {exc}")
                self.needs_rebuild = False
            result = self.receiver.receive_update(self.group, self.bucket_bytes)
            self.needs_rebuild = result.needs_rebuild
            return result

        self.last = update_with_policy(self.engine, receive, self.in_flight, self.recompute_kv, self.step)
        return self.last

"""What running requests do when new weights arrive (``weight_sync.in_flight``, design.md §2).

Governing idea: the receiver owns an ``InFlightPolicy`` and brackets every update with it
(``begin`` before the first byte is applied, ``end`` with the update's result), whatever the
channel (colocated copy, broadcast to N EP ranks); the policy wraps the engine's pause / resume /
abort_all so that every generated token is stamped with the version of the weights that produced
it (the engine stamps ``engine.weight_version`` at sampling time):

- ``abort``: drop every unfinished sample and re-queue it from its prompt after the swap (all of
  its tokens carry the new version; the keyed sampler keeps its randomness stream).
- ``drain``: step until nothing is unfinished (all tokens on the old version), then swap. Refused
  (``refusal``) while the engine is paused with samples unfinished: they cannot finish.
- ``continue``: pause between steps, swap, resume; tokens sampled before carry the old version,
  later ones the new. The KV of the running samples was computed under the old weights: kept
  (default) or recomputed under the new ones (``recompute_kv_after_update``: every running
  sample is preempted and re-prefilled).

An engine paused before the update (``pause()`` by its caller) stays paused after it; one the
policy paused resumes. After a successful swap the prefix cache is reset once (no page computed under the old weights
is reused) and the engine's version is set. Every end that wrote weight bytes (an accepted update,
or a rejected non-atomic one that left the rank invalid) counts a weight write on the engine
(``engine.count_weight_write``): its write count, stamped on every token, changes even when the
version number does not (an update re-sent with ``replace``), and the KV of running samples is
marked stale. A rank left invalid by a failed update refuses new
requests (``engine.refuse_reason``) and hands its unfinished samples back for placement elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

POLICIES = ("abort", "drain", "continue")

INVALID_REASON = (
    "weights invalid after a failed weight update (weight_sync.atomic=false); "
    "this rank refuses requests until a full update succeeds"
)


@dataclass
class InFlightOutcome:
    """Result of one update under an in-flight policy.

    Attributes:
        result: the rank's UpdateResult.
        outputs: engine outputs produced while draining (``drain``); the caller delivers them.
        requeued: samples aborted and re-queued (``abort``).
        handed_back: requests this rank gave up because it is invalid (re-place them elsewhere).
        paused_seconds: time no forward ran for regular work (pause/drain end -> resume).
        drain_seconds: time spent finishing in-flight work on the old weights.
    """

    result: object
    outputs: list = field(default_factory=list)
    requeued: int = 0
    handed_back: list = field(default_factory=list)
    paused_seconds: float = 0.0
    drain_seconds: float = 0.0


class InFlightPolicy:
    """The engine side of an update: ``begin()`` -> (weights change) -> ``end(result)``.

    Args:
        engine: an ``LLMEngine`` (duck-typed: pause / resume / abort_all / add_request / step /
            has_unfinished / reset_prefix_cache / set_weight_version / count_weight_write /
            preempt_all / refuse_reason).
        policy: one of ``POLICIES`` (``weight_sync.in_flight``).
        recompute_kv: ``weight_sync.recompute_kv_after_update`` (only with ``continue``).
        drain: finishes every unfinished sample and returns the outputs (default: ``engine.step``
            until nothing is unfinished; EP workers pass their lockstep loop, whose collectives
            need every rank stepping until no rank has work).
    Raises ValueError for an unknown policy or recompute_kv without ``continue`` (naming the key).
    """

    def __init__(
        self, engine, policy: str = "abort", recompute_kv: bool = False, drain: Callable[[], list] | None = None
    ):
        if policy not in POLICIES:
            raise ValueError(f"weight_sync.in_flight={policy!r}: must be one of {list(POLICIES)}")
        if recompute_kv and policy != "continue":
            raise ValueError(
                f"weight_sync.recompute_kv_after_update=true only applies with weight_sync.in_flight=continue "
                f"(got {policy!r})"
            )
        self.engine, self.policy, self.recompute_kv = engine, policy, bool(recompute_kv)
        self.drain = drain or self._drain_local
        self.active = False
        self.last: InFlightOutcome | None = None

    def refusal(self) -> str | None:
        """Why an update cannot run under this policy now, or None: ``drain`` while the engine is
        paused with samples unfinished (no forward runs while paused, so the drain would never
        end). The receiver refuses the update with this text before anything is written."""
        eng = self.engine
        if self.policy != "drain" or self.active or not eng.paused or not eng.has_unfinished():
            return None
        return (
            f"weight_sync.in_flight='drain' refused: the engine is paused with {eng.num_unfinished()} unfinished "
            "sample(s), which cannot finish while paused; resume() it first, or update with in_flight 'continue' "
            "or 'abort'"
        )

    def begin(self) -> None:
        """Bring the engine to a state where weights may change (drain / pause / abort). An engine
        already paused is not drained (``refusal`` refused that update) and stays paused."""
        if self.active:
            return
        eng = self.engine
        self._was_paused = eng.paused
        self._outputs: list = []
        self._t_drain = time.perf_counter()
        if self.policy == "drain" and not self._was_paused:
            self._outputs = list(self.drain())
        self._t0 = time.perf_counter()
        eng.pause()
        self._requeue = eng.abort_all() if self.policy == "abort" else []
        self.active = True

    def _drain_local(self) -> list:
        outputs: list = []
        while self.engine.has_unfinished():
            outputs += self.engine.step()
        return outputs

    def cancel(self) -> None:
        """The update raised (a bug, not a bad update): keep serving as before."""
        if not self.active:
            return
        for req in self._requeue:
            self.engine.add_request(req)
        if not self._was_paused:
            self.engine.resume()
        self.active = False

    def end(self, result) -> InFlightOutcome:
        """Finish the update with ``result`` (an ``UpdateResult``): count a weight write when bytes
        were written (or may have been: an invalid rank), reset the prefix cache and set the version
        when the weights changed, refuse requests when the rank is invalid, resume (unless the
        engine was paused before the update)."""
        eng = self.engine
        requeue = self._requeue
        if result.wrote:
            eng.count_weight_write()  # before preempt_all: a preempted sample recomputes, its KV is fresh
        if result.changed and result.valid:
            eng.reset_prefix_cache()
            eng.set_weight_version(result.version)
            if self.policy == "continue" and self.recompute_kv:
                eng.preempt_all()
        handed_back = []
        if not result.valid:
            eng.refuse_reason = INVALID_REASON
            handed_back = requeue + eng.abort_all()
            eng.reset_prefix_cache()
            requeue = []
        else:
            eng.refuse_reason = None
        for req in requeue:
            eng.add_request(req)
        if not self._was_paused:
            eng.resume()
        self.active = False
        self.last = InFlightOutcome(
            result, self._outputs, len(requeue), handed_back, time.perf_counter() - self._t0, self._t0 - self._t_drain
        )
        return self.last

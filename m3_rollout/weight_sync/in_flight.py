"""What running requests do when new weights arrive (``weight_sync.in_flight``, design.md §2).

Governing idea: the update itself is a callable; this module only wraps it in the engine's
pause / resume / abort_all so that every generated token is stamped with the version of the
weights that produced it (the engine stamps ``engine.weight_version`` at sampling time):

- ``abort``: drop every unfinished sample and re-queue it from its prompt after the swap (all of
  its tokens carry the new version; the keyed sampler keeps its randomness stream).
- ``drain``: step until nothing is unfinished (all tokens on the old version), then swap.
- ``continue``: pause between steps, swap, resume; tokens sampled before carry the old version,
  later ones the new. The KV of the running samples was computed under the old weights: kept
  (default) or recomputed under the new ones (``recompute_kv_after_update``: every running
  sample is preempted and re-prefilled).

After a successful swap the prefix cache is reset (no page computed under the old weights is
reused) and the engine's version is set. A rank left invalid by a failed non-atomic update
refuses new requests (``engine.refuse_reason``) and hands its unfinished samples back for
placement elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .receiver import UpdateResult

POLICIES = ("abort", "drain", "continue")


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

    result: UpdateResult
    outputs: list = field(default_factory=list)
    requeued: int = 0
    handed_back: list = field(default_factory=list)
    paused_seconds: float = 0.0
    drain_seconds: float = 0.0


def update_with_policy(
    engine,
    do_update: Callable[[], UpdateResult],
    policy: str = "abort",
    recompute_kv: bool = False,
    step: Callable[[], list] | None = None,
) -> InFlightOutcome:
    """Run ``do_update`` on ``engine`` (an ``LLMEngine``) under in-flight ``policy``.

    ``step`` is the step function used to drain (default ``engine.step``; EP workers pass their
    lockstep step). Raises ValueError for an unknown policy (naming ``weight_sync.in_flight``).
    """
    if policy not in POLICIES:
        raise ValueError(f"weight_sync.in_flight={policy!r}: must be one of {list(POLICIES)}")
    step = step or engine.step
    outputs: list = []
    t_drain = time.perf_counter()
    if policy == "drain":
        while engine.has_unfinished():
            outputs += step()
    t0 = time.perf_counter()
    engine.pause()
    requeue = engine.abort_all() if policy == "abort" else []
    try:
        result = do_update()
    except BaseException:
        for req in requeue:  # the update raised (a bug, not a bad update): keep serving as before
            engine.add_request(req)
        engine.resume()
        raise
    if result.changed:
        engine.reset_prefix_cache()
        engine.set_weight_version(result.version)
        if policy == "continue" and recompute_kv:
            engine.preempt_all()
    handed_back = []
    if not result.valid:
        engine.refuse_reason = (
            "weights invalid after a failed weight update (weight_sync.atomic=false); "
            "this rank refuses requests until a full update succeeds"
        )
        handed_back = requeue + engine.abort_all()
        engine.reset_prefix_cache()
        requeue = []
    else:
        engine.refuse_reason = None
    for req in requeue:
        engine.add_request(req)
    engine.resume()
    return InFlightOutcome(result, outputs, len(requeue), handed_back, time.perf_counter() - t0, t0 - t_drain)

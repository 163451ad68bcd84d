"""Where a GRPO step gets its groups: synchronously, or from a background rollout thread (async GRPO).

Governing idea: the loop asks ``collector.get_groups(step, policy_version)`` for the step's GRPO
groups and hands new weights over with ``collector.push_weights(version, tensors)``; whether the
groups were generated just now or while the previous step trained is the collector's business.

Async form (design.md §2, NeMo RL's ``grpo.async_grpo``): a producer thread generates one prompt
batch at a time (batch b = the prompts the synchronous loop would use at step b) into a queue of
groups tagged with the weight version they were generated with. It applies pushed weights only
between batches, so every token of a group comes from one version. It may start batch b only while
b <= (steps started) + max_trajectory_age_steps, so it never produces groups that are stale by
construction. The consumer drops groups with policy_version - version > max age (counted) and
waits at most ``group_timeout_s`` for a step's groups; on timeout it trains on what it has.

With age limit 1 the steady state is: while the trainer trains step s (policy version s-1), the
producer generates batch s+1 with weights s-1; step s+1 then trains on groups of age 1.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from m3_rollout.rollout.trajectory import Trajectory

# generate(batch_index) -> (groups: list of lists of trajectories, rollout metrics dict)
GenerateFn = Callable[[int], tuple[list[list[Trajectory]], dict]]


class RefitRejected(ValueError):
    """The generator refused a weight update that the async producer applied before its next
    batch (the backend's ``update_weights`` ValueError, message kept); ``version``: the refused one."""

    def __init__(self, version: int, message: str):
        super().__init__(message)
        self.version = int(version)


@dataclass
class GroupRecord:
    """One GRPO group as produced.

    Attributes:
        trajectories: the n samples of one prompt.
        version: weight version every token of the group was generated with.
        batch_index: the prompt batch it came from.
        generation_seconds: wall time of the whole batch's generation.
    """

    trajectories: list[Trajectory]
    version: int
    batch_index: int
    generation_seconds: float = 0.0


@dataclass
class CollectedStep:
    """What one step receives: groups plus accounting for the metrics.

    Attributes:
        groups: accepted groups (each a list of trajectories).
        versions: weight version per accepted group.
        stale_dropped: groups dropped for age at this step.
        timed_out: the step stopped waiting at the timeout.
        wait_seconds: time the trainer waited for groups.
        generation_seconds: generation time of the batches the groups came from (sync: all of it
            is on the critical path; async: overlapped with training).
        metrics: rollout metrics of the generation calls (tokens, tokens/s).
    """

    groups: list[list[Trajectory]]
    versions: list[int]
    stale_dropped: int = 0
    timed_out: bool = False
    wait_seconds: float = 0.0
    generation_seconds: float = 0.0
    metrics: dict = field(default_factory=dict)


def split_groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories ordered by group -> list of groups (by ``group_index``, order kept)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_index, []).append(t)
    return list(groups.values())


class SyncCollector:
    """Generates a step's groups when asked (the synchronous GRPO loop).

    Args:
        backend: the ``GenerationBackend`` (weights pushed here go straight into it).
        generate: GenerateFn.
        next_batch: index of the next prompt batch (restored on resume).
    """

    def __init__(self, backend, generate: GenerateFn, next_batch: int = 1):
        self.backend, self.generate, self.next_batch = backend, generate, next_batch

    def draw_batch(self) -> tuple[list[GroupRecord], dict]:
        """Generate the next prompt batch now; returns its groups and rollout metrics."""
        b = self.next_batch
        self.next_batch += 1
        t0 = time.perf_counter()
        groups, m = self.generate(b)
        dt = time.perf_counter() - t0
        v = self.backend.weight_version
        return [GroupRecord(g, v, b, dt) for g in groups], m

    def get_groups(self, step: int, policy_version: int) -> CollectedStep:
        recs, m = self.draw_batch()
        return CollectedStep(
            [r.trajectories for r in recs],
            [r.version for r in recs],
            generation_seconds=recs[0].generation_seconds if recs else 0.0,
            metrics=m,
        )

    def push_weights(self, version: int, named_tensors) -> float:
        """Update the generator now (the backend's receiver resets its prefix cache once); returns
        seconds spent."""
        t0 = time.perf_counter()
        self.backend.update_weights(version, named_tensors)
        return time.perf_counter() - t0

    def run_exclusive(self, fn: Callable):
        """Run ``fn(backend)`` (e.g. validation) with the generator's current weights."""
        return fn(self.backend)

    def state(self) -> dict:
        return {"next_batch": self.next_batch}

    def close(self) -> None:
        pass


class AsyncCollector(SyncCollector):
    """Background-thread producer + bounded, age-checked consumer (see module docstring).

    Args:
        backend, generate, next_batch: as for :class:`SyncCollector`.
        groups_per_step: groups a step wants (``grpo.num_prompts_per_step``).
        max_age: ``grpo.async_grpo.max_trajectory_age_steps`` (>= 1).
        timeout_s: ``grpo.async_grpo.group_timeout_s``.
        last_batch: the producer stops after this prompt batch (``grpo.max_num_steps``; None = never),
            so no generation is wasted past the last step.
    """

    def __init__(
        self,
        backend,
        generate: GenerateFn,
        groups_per_step: int,
        max_age: int,
        timeout_s: float,
        next_batch: int = 1,
        last_batch: int | None = None,
    ):
        super().__init__(backend, generate, next_batch)
        if max_age < 1:
            raise ValueError(f"max_trajectory_age_steps={max_age}: must be >= 1 for async GRPO")
        self.groups_per_step, self.max_age, self.timeout_s = groups_per_step, max_age, timeout_s
        self.last_batch = last_batch
        self._queue: queue.Queue[GroupRecord] = queue.Queue()
        self._cond = threading.Condition()
        self._gen_lock = threading.Lock()  # held while the generator runs or its weights change
        self._pending: tuple[int, dict] | None = None
        self._steps_started = next_batch - 1
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._metrics: list[dict] = []
        self.stale_total = 0
        self._thread = threading.Thread(target=self._produce, name="grpo-rollout-producer", daemon=True)
        self._thread.start()

    # ---- producer ---------------------------------------------------------------------
    def _apply_pending(self) -> None:
        if self._pending is not None:
            version, tensors = self._pending
            self._pending = None
            try:
                self.backend.update_weights(version, tensors.items())  # resets the prefix cache once
            except ValueError as exc:  # the backend's rejection (a rank refused a tensor, version or probe)
                raise RefitRejected(version, str(exc)) from exc

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while not self._stop.is_set() and self.next_batch > self._steps_started + self.max_age:
                        self._cond.wait(0.5)
                    if self._stop.is_set() or (self.last_batch is not None and self.next_batch > self.last_batch):
                        return
                    b = self.next_batch
                    self.next_batch += 1
                with self._gen_lock:
                    with self._cond:
                        self._apply_pending()
                    v = self.backend.weight_version
                    t0 = time.perf_counter()
                    groups, m = self.generate(b)
                    dt = time.perf_counter() - t0
                with self._cond:
                    self._metrics.append(m)
                for g in groups:
                    self._queue.put(GroupRecord(g, v, b, dt))
        except BaseException as exc:  # surfaced to the trainer thread in get_groups
            self._error = exc

    # ---- consumer ---------------------------------------------------------------------
    def get_groups(self, step: int, policy_version: int) -> CollectedStep:
        """Up to ``groups_per_step`` groups with age <= max_age, waiting at most ``timeout_s``.

        Raises:
            RefitRejected: the generator refused the weights the producer applied before its batch.
            RuntimeError: the producer thread failed otherwise (its exception is chained).
        """
        with self._cond:
            self._steps_started = max(self._steps_started, step)
            self._cond.notify_all()
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        accepted: list[GroupRecord] = []
        stale = 0
        timed_out = False
        while len(accepted) < self.groups_per_step:
            if isinstance(self._error, RefitRejected):
                raise self._error
            if self._error is not None:
                raise RuntimeError("async rollout producer failed") from self._error
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                timed_out = True
                break
            try:
                rec = self._queue.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if policy_version - rec.version > self.max_age:
                stale += 1
                continue
            accepted.append(rec)
        self.stale_total += stale
        with self._cond:
            ms, self._metrics = self._metrics, []
        gen_tokens = sum(m.get("generated_tokens", 0) for m in ms)
        gen_s = sum(m.get("rollout_seconds", 0.0) for m in ms)
        metrics = {
            "generated_tokens": gen_tokens,
            "generation_tokens_per_s": gen_tokens / gen_s if gen_s else 0.0,
            "rollout_seconds": gen_s,
        }
        return CollectedStep(
            [r.trajectories for r in accepted],
            [r.version for r in accepted],
            stale,
            timed_out,
            time.perf_counter() - t0,
            gen_s,
            metrics,
        )

    def push_weights(self, version: int, named_tensors) -> float:
        """Stage a copy of the weights; the producer applies it before its next batch.
        Returns seconds spent (the copy), never waits for generation."""
        t0 = time.perf_counter()
        snapshot = {n: t.detach().clone() for n, t in named_tensors}
        with self._cond:
            self._pending = (version, snapshot)
        return time.perf_counter() - t0

    def run_exclusive(self, fn: Callable):
        """Wait for the generator to be idle, bring it to the newest pushed weights, run
        ``fn(backend)`` (validation); the producer resumes afterwards."""
        with self._gen_lock:
            with self._cond:
                self._apply_pending()
            return fn(self.backend)

    def state(self) -> dict:
        # NOTE: batches produced but not yet trained on are regenerated after a resume.
        return {"next_batch": self._steps_started + 1}

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer (after its current batch) and join it."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

"""Engine counters and the metrics dict built from them (host numbers only, no tensors).

Governing idea: the step loop only adds to :class:`EngineStats`; :func:`engine_metrics` is the
one place that turns the counters, the page manager and the scheduler into the flat
``metrics()`` dict (pages, prefix-cache hits, preemptions, throughput, host time per phase).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.scheduler import Scheduler

# Host phases of a step (perf_counter seconds in EngineStats.phase_seconds): schedule, prepare
# (step tensors), forward (launch; includes the graph fill), sample (sampler launch), sync
# (waiting for the sampled ids / logprobs on the host), output (bookkeeping, stop checks).
PHASES = ("schedule", "prepare", "forward", "sample", "sync", "output")


@dataclass
class EngineStats:
    """Counters behind ``LLMEngine.metrics`` (host numbers only)."""

    steps: int = 0
    forward_seconds: float = 0.0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0  # prompt positions whose K/V were computed (not prefix hits)
    batched_tokens: int = 0
    rows: int = 0
    forks: int = 0
    # Async scheduling: decode rows whose input id was taken on the device (the previous step's
    # sampled id, not yet on the host), and sampled tokens dropped because their sample had
    # finished or was aborted while the step ran.
    device_input_rows: int = 0
    dropped_tokens: int = 0
    graph_steps: int = 0  # steps run on the decode graphs
    # Host seconds per step phase (always on, ~0.1 us per reading); keys: PHASES.
    phase_seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def engine_metrics(st: EngineStats, bm: BlockManager, scheduler: Scheduler, async_scheduling: bool) -> dict:
    """KV pages in use, prefix-cache hit rate, preemptions, tokens/s, batch size per step and
    host milliseconds per step phase (``host_ms_per_step_<phase>``)."""
    return {
        "kv_pages_in_use": bm.num_used_pages,
        "kv_pages_total": bm.num_pages,
        "kv_usage": bm.num_used_pages / bm.num_pages,
        "prefix_cache_hit_rate": bm.hit_rate,
        "prefix_cache_hit_tokens": bm.hit_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "generated_tokens": st.generated_tokens,
        "prompt_tokens_computed": st.prompt_tokens_computed,
        "steps": st.steps,
        "forks": st.forks,
        "async_scheduling": async_scheduling,
        "device_input_rows": st.device_input_rows,
        "dropped_tokens": st.dropped_tokens,
        "graph_steps": st.graph_steps,
        "generation_tokens_per_s": st.generated_tokens / st.forward_seconds if st.forward_seconds else 0.0,
        "mean_batch_rows_per_step": st.rows / st.steps if st.steps else 0.0,
        "mean_tokens_per_step": st.batched_tokens / st.steps if st.steps else 0.0,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        **{f"host_ms_per_step_{k}": 1000 * v / st.steps if st.steps else 0.0 for k, v in st.phase_seconds.items()},
    }

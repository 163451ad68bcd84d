"""``/metrics`` in the Prometheus text exposition format (version 0.0.4).

Names follow vLLM's where one exists (``num_requests_running``, ``kv_cache_usage_perc``, ...)
under the ``m3:`` prefix. Counts of running / waiting requests are the engine's samples (a request
with n samples counts n); requests held at the server's admission gate (paused) are added to the
waiting count as one each (the gate holds requests, before their samples exist).
"""

from __future__ import annotations

from m3_rollout.engine.interface import FINISH_ERROR

from .control import Controller

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(ctl: Controller, model_name: str) -> str:
    """The metrics text: one HELP / TYPE / sample triple per metric, labelled with the model name."""
    r = ctl.runner
    m = r.engine_metrics()
    running = m.get("num_running", sum(ctl.live.values()))
    rows = [
        ("num_requests_running", "gauge", "Samples running in the engine.", running),
        (
            "num_requests_waiting",
            "gauge",
            "Samples waiting in the engine, plus requests held at the admission gate (one each).",
            m.get("num_waiting", 0) + ctl.waiting,
        ),
        ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache pages in use (0..1).", m.get("kv_usage", 0.0)),
        ("kv_cache_pages_used", "gauge", "KV-cache pages in use.", m.get("kv_pages_in_use", 0)),
        ("kv_cache_pages_total", "gauge", "KV-cache pages in the pool.", m.get("kv_pages_total", 0)),
        ("prefix_cache_hit_rate", "gauge", "Prefix-cache hit rate (0..1).", m.get("prefix_cache_hit_rate", 0.0)),
        ("num_preemptions_total", "counter", "Preemptions by recompute.", m.get("num_preemptions", 0)),
        ("generation_tokens_total", "counter", "Tokens generated through this server.", r.generated_tokens),
        ("prompt_tokens_total", "counter", "Prompt tokens submitted (times samples).", r.prompt_tokens),
        (
            "generation_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 s.",
            r.tokens_per_second(),
        ),
        ("weight_version", "gauge", "Version of the weights served.", r.weight_version),
        ("weight_update_in_progress", "gauge", "1 while a weight update runs.", int(ctl.updating)),
        ("paused", "gauge", "1 while the server is paused.", int(ctl.pause_mode is not None)),
        (
            "refit_seconds_last",
            "gauge",
            "Seconds of the last weight update (receive + commit).",
            r.last_refit.seconds if r.last_refit else 0.0,
        ),
        ("refit_seconds_total", "counter", "Seconds spent in weight updates.", r.refit_seconds_total),
        ("refits_total", "counter", "Weight updates received.", r.refits),
    ]
    label = f'model_name="{_escape(model_name)}"'
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP m3:{name} {doc}", f"# TYPE m3:{name} {kind}", f"m3:{name}{{{label}}} {float(value)}"]
    lines += [
        "# HELP m3:request_finished_total Finished samples by finish reason.",
        "# TYPE m3:request_finished_total counter",
    ]
    for reason in ("stop", "length", "abort", FINISH_ERROR):
        lines.append(
            f'm3:request_finished_total{{{label},finished_reason="{reason}"}} {float(r.requests_finished[reason])}'
        )
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a metrics text by metric name without labels (the first sample of each name);
    for clients and tests."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        out.setdefault(name_labels.split("{", 1)[0], float(value))
    return out

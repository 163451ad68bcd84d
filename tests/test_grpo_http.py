"""GRPO through the rollout server (policy.generation.backend=http) against the in-process engine.

Sampling is keyed by (seed, sample, position), so a job whose generation goes over HTTP to a server
it started itself must see the same tokens, rewards, logprob mismatch and held-out accuracies as
the same job generating in-process; and the backend's unsupported combinations fail at load time.
"""

import json
import math
import re

import pytest

from m3_rollout.config import ConfigError, load_config
from m3_rollout.jobs.grpo import run
from m3_rollout.jobs.stack import SERVER_SHUTDOWN_TIMEOUT_S, SERVER_STOP_GRACE_S, server_command
from m3_rollout.server.cli import parse_args

SMOKE = [
    "policy.generation.expert_parallel_size=1",
    "cluster.launcher=auto",
    "grpo.max_num_steps=2",
    "checkpointing.enabled=false",
]
# Wall-clock and throughput metrics differ between any two runs; everything else must not.
TIMING = re.compile(r"^timing/|^performance/|_gb_|memory/|timed_out")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _run(out, extra=()) -> tuple[dict, list[dict]]:
    cfg = load_config("configs/grpo_smoke.yaml", [*SMOKE, f"logger.log_dir={out}", *extra])
    summary = run(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def _numeric(row: dict) -> dict:
    return {
        k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and not TIMING.search(k)
    }


def test_http_backend_matches_in_process(cache):
    native_summary, native = _run(cache / "native")
    http_summary, http = _run(cache / "http", ["policy.generation.backend=http"])
    assert [s for s, _ in http_summary["val_history"]] == [0, 2]
    assert http_summary["val_history"] == native_summary["val_history"]
    assert [r["step"] for r in http] == [r["step"] for r in native]
    train = [r for r in http if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["train/num_tokens"] > 0 for r in train)
    for a, b in zip(native, http):
        na, nb = _numeric(a), _numeric(b)
        assert na.keys() == nb.keys()
        diff = {k: (na[k], nb[k]) for k in na if not (na[k] == nb[k] or (math.isnan(na[k]) and math.isnan(nb[k])))}
        assert not diff, f"step {a['step']}: in-process vs http differ in {diff}"
    for a, b in zip([r for r in native if "train/loss" in r], train):
        assert a["train/reward"] == b["train/reward"]
        assert a["train/token_mult_prob_error"] == b["train/token_mult_prob_error"]
    # the job's server was started with the engine's settings and stopped at the end
    log = (cache / "http" / "rollout_server.log").read_text()
    assert "m3-rollout server: serving" in log


def test_server_command_carries_engine_settings(cache):
    cfg = load_config(
        "configs/grpo_smoke.yaml",
        [
            *SMOKE,
            "policy.generation.backend=http",
            "policy.generation.enable_prefix_caching=false",
            "policy.generation.http_api_key=k",
            "policy.routing_replay=true",
            "policy.generation.msa_prefill_scratch_mb=1040",
        ],
    )
    cmd = server_command(cfg, cache / "model", 192, 1234)
    assert cmd[1:3] == ["-m", "m3_rollout.serve"]
    args = parse_args(cmd[3:])  # the serve CLI takes every flag the job passes
    assert (args.model, args.host, args.port) == (str(cache / "model"), "127.0.0.1", 1234)
    assert (args.dtype, args.device, args.max_model_len, args.max_num_seqs) == ("bfloat16", "cpu", 192, 256)
    assert (args.max_num_batched_tokens, args.kv_cache_memory_fraction, args.async_scheduling) == (4096, 0.8, "auto")
    assert args.no_prefix_caching and args.record_routing and args.api_key == "k"
    assert args.msa_prefill_scratch_mb == 1040.0
    # the server's wait for requests in flight ends well before the job's SIGKILL, so its engine stops
    assert args.graceful_shutdown_timeout == SERVER_SHUTDOWN_TIMEOUT_S == 10.0 < SERVER_STOP_GRACE_S
    default = server_command(load_config("configs/grpo_smoke.yaml", [*SMOKE]), cache / "model", 192, 1234)
    assert "--msa-prefill-scratch-mb" not in default and parse_args(default[3:]).msa_prefill_scratch_mb is None


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["policy.generation.expert_parallel_size=2", "cluster.launcher=mp"], "policy.generation.expert_parallel_size"),
        (["policy.generation.sleep_level=1"], "policy.generation.sleep_level"),
        (["cluster.launcher=mp"], "cluster.launcher"),
        (["policy.generation.http_base_url=localhost:8000"], "policy.generation.http_base_url"),
        (["policy.generation.http_startup_timeout_s=0"], "policy.generation.http_startup_timeout_s"),
        (["weight_sync.probe.enabled=true"], "weight_sync.probe.enabled"),
        (["weight_sync.master_port=29500"], "weight_sync.master_port"),
        (["weight_sync.method=colocated"], "weight_sync.method"),
    ],
)
def test_http_backend_rejects(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key) + "="):
        load_config(None, ["policy.generation.backend=http", *overrides])


def test_http_keys_need_http_backend():
    with pytest.raises(ConfigError, match=r"policy\.generation\.http_base_url=.*backend=http"):
        load_config(None, ["policy.generation.http_base_url=http://127.0.0.1:8000"])


def test_http_backend_accepts_broadcast_keys():
    cfg = load_config(
        None,
        [
            "policy.generation.backend=http",
            "policy.generation.http_base_url=http://127.0.0.1:8000",
            "weight_sync.bucket_size_mb=64",
            "weight_sync.timeout_s=30",
            "weight_sync.backend=gloo",
        ],
    )
    assert cfg.policy.generation.http_base_url == "http://127.0.0.1:8000"
    assert cfg.weight_sync.bucket_size_mb == 64.0

"""FP8 index queries as a configuration choice (``policy.generation.quantize_index_queries``).

With ``index_cache_dtype=fp8_e4m3`` the score kernels can quantize the index queries too (fp8 x
fp8 dots, the fastest index format in docs/benchmarks.md). One value travels from the GRPO job
config (or the server's ``--quantize-index-queries``) to the engine's ``EngineConfig`` (its KV
cache's ``FP8IndexCache``), the EP workers' (``engine_kwargs``), a job-started server
(``stack.server_command``) and the trainer's batch-invariant scorer (whose index cache must read
the same format as the engine's, or the two select blocks from other scores).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_rollout.config import ConfigError, load_config
from m3_rollout.jobs.stack import server_command
from m3_rollout.server.cli import build_backend, parse_args

MAIN = "configs/grpo_bf16_ep.yaml"
FP8Q = ["policy.generation.index_cache_dtype=fp8_e4m3", "policy.generation.quantize_index_queries=true"]


def test_the_key_needs_fp8_index_keys_and_reaches_engine_kwargs():
    with pytest.raises(ConfigError, match=r"policy\.generation\.quantize_index_queries.*needs .*fp8_e4m3"):
        load_config(MAIN, ["policy.generation.quantize_index_queries=true"])
    gen = load_config(MAIN, FP8Q).policy.generation
    assert gen.engine_kwargs()["quantize_index_queries"] is True
    assert load_config(MAIN, []).policy.generation.engine_kwargs()["quantize_index_queries"] is False


def test_server_command_and_flag_reach_the_engine(tmp_path, monkeypatch):
    import m3_rollout.model as model_pkg
    import m3_rollout.service.factory as factory

    http = ["policy.generation.backend=http", "policy.generation.expert_parallel_size=1"]
    args = parse_args(server_command(load_config(MAIN, [*http, *FP8Q]), tmp_path, 64, 1234)[3:])
    assert args.index_cache_dtype == "fp8_e4m3" and args.quantize_index_queries
    default = server_command(load_config(MAIN, http), tmp_path, 64, 1234)
    assert "--quantize-index-queries" not in default and not parse_args(default[3:]).quantize_index_queries
    # the in-process engine's KV cache reads the FP8 index keys with quantized queries
    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=16, layers=2)
    monkeypatch.setattr(model_pkg, "load_checkpoint", lambda *a, **kw: model)
    base = ["--model", str(tmp_path), "--device", "cpu", "--max-num-seqs", "2", "--index-cache-dtype", "fp8_e4m3"]
    engine = build_backend(parse_args([*base, "--quantize-index-queries"]), tmp_path, [0], 40, None).engine
    assert engine.config.quantize_index_queries and engine.kv.quantize_index_queries
    plain = build_backend(parse_args(base), tmp_path, [0], 40, None).engine
    assert not plain.config.quantize_index_queries and not plain.kv.quantize_index_queries
    # --engine-process / EP: the job config the rollout service's workers are built from
    seen = []
    monkeypatch.setattr(factory, "build_rollout_service", lambda cfg, *a: seen.append(cfg) or SimpleNamespace())
    build_backend(parse_args([*base, "--quantize-index-queries", "--engine-process"]), tmp_path, [0], 40, None)
    assert seen[-1].policy.generation.engine_kwargs()["quantize_index_queries"] is True
    # a bad combination names the flag's engine field
    with pytest.raises(ValueError, match="quantize_index_queries"):
        build_backend(parse_args(base[:-2] + ["--quantize-index-queries"]), tmp_path, [0], 40, None)


def test_trainer_scorer_reads_the_same_index_format(monkeypatch):
    import m3_rollout.jobs.invariant_scoring as scoring_mod

    built = []
    monkeypatch.setattr(scoring_mod, "PagedScorer", lambda *a, **kw: built.append(a) or SimpleNamespace())
    monkeypatch.setattr(scoring_mod, "paged_ops_for", lambda *a, **kw: None)
    cfg = load_config(MAIN, ["policy.generation.batch_invariant=true", *FP8Q])
    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=16, layers=2)
    scoring_mod.invariant_scorer(cfg, model, 40)
    assert built and built[-1][6:8] == ("fp8_e4m3", True)

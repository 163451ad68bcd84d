"""The batch-invariant sparse attention as a configuration choice (``invariant_sparse_attention``).

One value travels from the GRPO job's ``policy.generation.invariant_sparse_attention`` (or the
server's ``--invariant-sparse-attention``) to every ops table of the job: the engine's
(``EngineConfig`` -> ``paged_ops_for``), the EP workers' (``engine_kwargs``), a job-started
server's (``stack.server_command``) and the trainer's scorer (``jobs/invariant_scoring.py``). The
engine and the scorer must bind the same one, or the rollout's and the trainer's logprobs reduce in
different orders and bitwise on-policy breaks. Here: the values are checked with errors naming the
key, and the engine and the scorer built from one job config (CPU: ``paged_ops_for`` swapped for
the interpreted invariant table it would build on CUDA, so the choice's effect on the table shows)
get the same choice. The default is page partials everywhere (the kernels' ``DEFAULT_SPARSE_IMPL``,
``EngineConfig``, the job config, the server flag): a job config that does not name the key runs
them in the engine and the scorer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_kernels.msa_interpret import interpreted_invariant_attention
from m3_rollout.config import ConfigError, load_config
from m3_rollout.engine import config as engine_config
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.ops import interpreted_paged_ops, invariant_attention_fields
from m3_rollout.jobs.stack import server_command
from m3_rollout.server.cli import build_backend, parse_args

MAIN = "configs/grpo_bf16_ep.yaml"
ON = ["policy.generation.batch_invariant=true", "policy.generation.expert_parallel_size=1"]
CHOICES = ("union", "page_partials")
DEFAULT = "page_partials"  # issue 24's 32K-prefill target met, GPU-checked 2026-12-05 (design.md §4.6)


def test_choices_agree_and_default_is_page_partials():
    ia = interpreted_invariant_attention()
    assert engine_config.INVARIANT_SPARSE_ATTENTIONS == ia.SPARSE_IMPLS == CHOICES
    assert engine_config.DEFAULT_INVARIANT_SPARSE_ATTENTION == ia.DEFAULT_SPARSE_IMPL == DEFAULT
    assert EngineConfig(max_model_len=8).validate().invariant_sparse_attention == DEFAULT
    assert load_config(None).policy.generation.invariant_sparse_attention == DEFAULT  # the schema's default
    assert load_config(MAIN).policy.generation.invariant_sparse_attention == DEFAULT
    # the ops' own defaults: a call that names no choice builds the page-partials table
    fields = invariant_attention_fields(interpret=True)
    assert fields["takes_prefill_scratch"] and fields["msa_attention"].keywords["sparse_impl"] == DEFAULT
    for choice in CHOICES:
        gen = load_config(MAIN, [f"policy.generation.invariant_sparse_attention={choice}"]).policy.generation
        assert gen.engine_kwargs()["invariant_sparse_attention"] == choice  # also the EP workers' engine dict
        assert EngineConfig(max_model_len=8, **gen.engine_kwargs()).validate().invariant_sparse_attention == choice


def test_bad_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"policy\.generation\.invariant_sparse_attention='pages'.*page_partials"):
        load_config(MAIN, ["policy.generation.invariant_sparse_attention=pages"])
    with pytest.raises(ValueError, match=r"EngineConfig\.invariant_sparse_attention='pages'.*page_partials"):
        EngineConfig(max_model_len=8, invariant_sparse_attention="pages").validate()
    with pytest.raises(ValueError, match="invariant_sparse_attention='pages'"):  # on any device, any mode
        from m3_rollout.engine.ops import paged_ops_for

        paged_ops_for("cpu", torch.float32, invariant_sparse_attention="pages")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(["--model", "m", "--invariant-sparse-attention", "pages"])


def test_a_choice_without_batch_invariant_mode_is_warned_about(capsys):
    """union with the mode off does nothing: the job logs a [warn] line and the server prints a
    warning (not errors: an A/B of the two modes flips batch_invariant alone); the default, or the
    mode on, says nothing."""
    from m3_rollout.config import ignored_setting_warnings

    (w,) = ignored_setting_warnings(load_config(MAIN, ["policy.generation.invariant_sparse_attention=union"]))
    assert w.startswith("[warn] policy.generation.invariant_sparse_attention=union has no effect")
    assert "policy.generation.batch_invariant is false" in w
    assert ignored_setting_warnings(load_config(MAIN)) == []
    assert (
        ignored_setting_warnings(load_config(MAIN, [*ON, "policy.generation.invariant_sparse_attention=union"])) == []
    )
    base = ["--model", "m"]
    parse_args([*base, "--invariant-sparse-attention", "union"])
    assert "--invariant-sparse-attention union has no effect without --batch-invariant" in capsys.readouterr().err
    for args in ([*base], [*base, "--invariant-sparse-attention", DEFAULT], [*base, "--batch-invariant",
                 "--invariant-sparse-attention", "union"]):  # fmt: skip
        parse_args(args)
        assert "no effect" not in capsys.readouterr().err


@pytest.mark.parametrize("choice", [None, *CHOICES], ids=["unnamed", *CHOICES])
def test_engine_and_trainer_scorer_get_the_jobs_choice(choice, monkeypatch, tmp_path):
    """One job config, the engine as the job builds it (``EngineConfig(**engine_kwargs)``) and the
    trainer's scorer (``invariant_scorer``): both ask ``paged_ops_for`` for the invariant table
    with the config's choice, and the tables they bind (scratch included) run the same sparse
    attention. None: a job config whose YAML does not name the key gets the default, page partials."""
    import m3_rollout.engine.engine as engine_mod
    import m3_rollout.jobs.invariant_scoring as scoring_mod

    asked = []

    def interpreted_table(device, dtype, batch_invariant=False, *, invariant_sparse_attention, **kw):
        """What ``paged_ops_for`` builds on CUDA, with the kernels interpreted on the CPU (no default
        for the choice: a caller that does not pass one fails here)."""
        asked.append((batch_invariant, invariant_sparse_attention))
        fields = invariant_attention_fields(interpret=True, invariant_sparse_attention=invariant_sparse_attention)
        return dataclasses.replace(interpreted_paged_ops(batch_invariant=True), **fields)

    monkeypatch.setattr(engine_mod, "paged_ops_for", interpreted_table)
    monkeypatch.setattr(scoring_mod, "paged_ops_for", interpreted_table)
    over = ["policy.generation.max_num_batched_tokens=16"]
    path = MAIN
    if choice is None:  # the main config without its invariant_sparse_attention line
        lines = Path(MAIN).read_text().splitlines(keepends=True)
        kept = [line for line in lines if "invariant_sparse_attention:" not in line]
        assert len(kept) == len(lines) - 1
        path = tmp_path / "grpo.yaml"
        path.write_text("".join(kept))
    else:
        over.append(f"policy.generation.invariant_sparse_attention={choice}")
    cfg = load_config(path, [*ON, *over])
    choice = choice or DEFAULT
    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=16, layers=2)
    engine = engine_mod.LLMEngine(
        model, EngineConfig(max_model_len=40, max_num_seqs=2, num_pages=8, **cfg.policy.generation.engine_kwargs())
    )
    scorer = scoring_mod.invariant_scorer(cfg, model, 40)
    assert asked == [(True, choice), (True, choice)]
    pp = choice == "page_partials"
    # a table built with page partials takes the KV-major scratch: both bound one of their own
    assert (engine.prefill_scratch is not None and engine.prefill_scratch.numel() > 0) == pp
    assert (scorer.prefill_scratch is not None and scorer.prefill_scratch.numel() > 0) == pp
    for ops in (engine.runner.ops, scorer.ops):
        assert not ops.takes_prefill_scratch  # bound (or none taken)
        assert ops.paged_attention.keywords["sparse_impl"] == ops.msa_attention.keywords["sparse_impl"] == choice
        assert ("scratch" in ops.msa_attention.keywords) == pp


def test_server_flag_reaches_the_engine_config(tmp_path, monkeypatch):
    """``--invariant-sparse-attention`` (default page_partials) reaches the in-process engine's EngineConfig
    and, with ``--engine-process`` / EP, the job config the rollout service's workers are built from."""
    import m3_rollout.model as model_pkg
    import m3_rollout.service.factory as factory

    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=16, layers=2)
    monkeypatch.setattr(model_pkg, "load_checkpoint", lambda *a, **kw: model)
    base = ["--model", str(tmp_path), "--device", "cpu", "--max-num-seqs", "2"]
    assert parse_args(base).invariant_sparse_attention == DEFAULT
    for choice in CHOICES:
        args = parse_args([*base, "--batch-invariant", "--invariant-sparse-attention", choice])
        with pytest.warns(UserWarning, match="batch_invariant"):  # CPU: the kernels need CUDA
            backend = build_backend(args, tmp_path, [0], 40, None)
        assert backend.engine.config.invariant_sparse_attention == choice
        assert backend.engine.config.batch_invariant
    with pytest.warns(UserWarning, match="batch_invariant"):
        backend = build_backend(parse_args([*base, "--batch-invariant"]), tmp_path, [0], 40, None)
    assert backend.engine.config.invariant_sparse_attention == DEFAULT
    seen = []
    monkeypatch.setattr(factory, "build_rollout_service", lambda cfg, *a: seen.append(cfg) or SimpleNamespace())
    for flag in ([], ["--invariant-sparse-attention", "union"]):
        build_backend(parse_args([*base, "--engine-process", *flag]), tmp_path, [0], 40, None)
        gen = seen[-1].policy.generation
        want = flag[-1] if flag else DEFAULT
        assert gen.invariant_sparse_attention == gen.engine_kwargs()["invariant_sparse_attention"] == want


def test_server_command_passes_the_jobs_choice(tmp_path):
    http = [*ON, "policy.generation.backend=http"]
    for choice in CHOICES:
        cfg = load_config(MAIN, [*http, f"policy.generation.invariant_sparse_attention={choice}"])
        args = parse_args(server_command(cfg, tmp_path, 64, 1234)[3:])
        assert args.batch_invariant and args.invariant_sparse_attention == choice

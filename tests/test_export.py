"""`m3-rollout export --format transformers-text`: transformers' text class loads the export with no
missing or unexpected keys and computes the same logits (spec §2.2b); the released layout stays.

Where transformers' M3 departs from the spec (spec §2.2b) the comparison is set up so it does not
matter or is refused: no init blocks (the export refuses `sparse_init_block > 0`), router and RoPE
in the model dtype (compared in fp32), `torch.topk` ties (random continuous weights have none).
"""

from __future__ import annotations

import json

import pytest
import torch

from m3_rollout import cli
from m3_rollout.chat.template import normalize_messages, render
from m3_rollout.model import M3ForCausalLM, load_checkpoint, save_checkpoint, tiny_config
from m3_rollout.model.loading import iter_transformers_text_tensors

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

# fp32, eager attention and eager experts: measured 0.0 (the same op order as this code); the
# default sdpa + grouped_mm path measured 7e-6 on logits of magnitude ~5.
EAGER_TOL = 1e-5
DEFAULT_TOL = 1e-4


def _randomised_model() -> M3ForCausalLM:
    """Weights under which every feature matters: Gemma norm weights, a router bias that changes
    expert choice, gate/up pre-activations beyond the +-7 clamps."""
    cfg = tiny_config(bos_token_id=None, eos_token_id=None)  # the real ids are outside the tiny vocab
    model = M3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("e_score_correction_bias"):
                std = 0.5
            elif name.endswith((".w13", "gate_proj.weight", "up_proj.weight")):
                std = 0.3
            elif name.endswith((".w2", "down_proj.weight")):
                std = 0.02
            else:
                std = 0.1 if "embed_tokens" not in name else 1.0
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _logits(model, ids):
    """[B, S, V] fp32 logits of this project's model (returns a tensor) or transformers' (an output)."""
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _randomised_model()
    out = tmp_path_factory.mktemp("hf_text")
    save_checkpoint(model, model.config, out, layout="transformers-text")
    ids = torch.randint(0, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(2))
    return model, out, ids


def test_text_class_loads_every_tensor_and_matches_logits(exported):
    model, out, ids = exported
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl_text" and config["architectures"] == ["MiniMaxM3VLForCausalLM"]
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", experts_implementation="eager"
    )
    assert type(hf).__name__ == "MiniMaxM3VLForCausalLM"
    assert {k: v for k, v in info.items() if v} == {}, info  # missing, unexpected, mismatched, errors
    ours = {name: tuple(t.shape) for name, t in iter_transformers_text_tensors(model)}
    assert {name: tuple(t.shape) for name, t in hf.state_dict().items()} == ours  # no vision tower
    # 200 tokens > top-k 4 x block 16: the sparse layers select blocks
    assert (_logits(hf.eval(), ids) - _logits(model, ids)).abs().max().item() <= EAGER_TOL
    default = AutoModelForCausalLM.from_pretrained(out).eval()  # sdpa attention, grouped experts
    assert (_logits(default, ids) - _logits(model, ids)).abs().max().item() <= DEFAULT_TOL


def test_export_reads_back_bitwise(exported):
    model, out, ids = exported
    back = load_checkpoint(out)
    assert torch.equal(_logits(back, ids), _logits(model, ids))
    for (name, a), (_, b) in zip(iter_transformers_text_tensors(model), iter_transformers_text_tensors(back)):
        assert torch.equal(a, b), name


def test_fused_names_and_shapes():
    cfg = tiny_config()
    names = dict(iter_transformers_text_tensors(M3ForCausalLM(cfg)))
    inter, hidden, experts = cfg.intermediate_size, cfg.hidden_size, cfg.num_local_experts
    assert names["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * cfg.dense_intermediate_size, hidden)
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape == (experts, 2 * inter, hidden)
    assert names["model.layers.1.mlp.experts.down_proj"].shape == (experts, hidden, inter)
    shared = names["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]
    assert shared.shape == (2 * cfg.shared_intermediate_size, hidden)
    assert "model.layers.1.self_attn.indexer.q_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    released_only = [n for n in names if "block_sparse_moe" in n or "index_" in n or n.endswith(".up_proj.weight")]
    assert released_only == []


def test_init_blocks_are_refused(tmp_path):
    cfg = tiny_config(sparse_init_block=1)
    with pytest.raises(ValueError, match="sparse_init_block=1: transformers' minimax_m3_vl has no MSA init blocks"):
        save_checkpoint(M3ForCausalLM(cfg), cfg, tmp_path, layout="transformers-text")
    with pytest.raises(ValueError, match="layout='hf'"):
        save_checkpoint(M3ForCausalLM(cfg), cfg, tmp_path, layout="hf")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_cli_exports_a_builtin_checkpoint(cache, capsys):
    out = cache / "text"
    assert (
        cli.main(["export", "--model", "builtin:tiny-random", "--out", str(out), "--format", "transformers-text"]) == 0
    )
    printed = capsys.readouterr().out
    assert "AutoModelForCausalLM" in printed
    (src,) = (p for p in (cache / "cache").iterdir() if p.is_dir())  # the build, beside its lock file
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "chat_template_kwargs.json",
    } <= files
    assert all((out / n).stat().st_mode & 0o777 == 0o644 for n in ("model.safetensors", "config.json"))
    # the template kwargs the builtin model was trained with travel along, and the command says how
    # to pass them to transformers (which does not read the file)
    kwargs = json.loads((out / "chat_template_kwargs.json").read_text())
    assert kwargs == json.loads((src / "chat_template_kwargs.json").read_text()) == {"thinking_mode": "disabled"}
    assert "apply_chat_template(messages, add_generation_prompt=True, **{'thinking_mode': 'disabled'})" in printed
    ours = load_checkpoint(src)
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", experts_implementation="eager"
    )
    assert {k: v for k, v in info.items() if v} == {}
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("12 * 34 = 408, " * 12)])
    assert ids.shape[1] > 64  # past top-k x block: sparse selection
    assert (_logits(hf.eval(), ids) - _logits(ours, ids)).abs().max().item() <= EAGER_TOL
    # transformers' own apply_chat_template on the export renders OpenAI tool calls once
    # normalize_messages has turned their JSON-string arguments into dicts
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}
    messages = [{"role": "user", "content": "12*34?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = tok.apply_chat_template(normalize_messages(messages), tokenize=False)
    assert text == render(tok.chat_template, messages) and "12*34" in text
    # with the printed kwargs transformers renders the prompt the builtin model was trained on
    ask = [{"role": "user", "content": "12*34?"}]
    trained = render(tok.chat_template, ask, add_generation_prompt=True, thinking_mode="disabled")
    assert tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True, **kwargs) == trained
    assert trained != render(tok.chat_template, ask, add_generation_prompt=True)  # the template's own default

    # the default format is the released (VL-shaped) layout, unchanged
    released = cache / "released"
    assert cli.main(["export", "--model", str(src), "--out", str(released)]) == 0
    assert json.loads((released / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert torch.equal(_logits(load_checkpoint(released), ids), _logits(ours, ids))
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_pretrained(released)  # why the text export exists


def test_cli_warns_about_a_build_outside_its_window(cache, capsys):
    """A builtin build whose warm start stopped outside its accuracy window (a loaded machine's
    time cap) warned only in the GRPO job; an export of it said nothing."""
    assert cli.main(["export", "--model", "builtin:tiny-random", "--out", str(cache / "a")]) == 0
    assert "WARNING" not in capsys.readouterr().err
    (src,) = (p for p in (cache / "cache").iterdir() if p.is_dir())  # the build, beside its lock file
    report = json.loads((src / "build_report.json").read_text())
    report.update(in_window=False, time_capped=True, warm_start_steps=100, heldout_accuracy=0.0)
    (src / "build_report.json").write_text(json.dumps(report))
    assert cli.main(["export", "--model", "builtin:tiny-random", "--out", str(cache / "b")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: the checkpoint's warm start ran" in err and "kept step 100" in err and f"delete {src}" in err


def test_cli_errors_exit_2(cache, capsys):
    assert cli.main(["export", "--model", str(cache / "nope"), "--out", str(cache / "x")]) == 2
    err = capsys.readouterr().err
    assert f"{cache / 'nope'} does not exist" in err and "builtin:tiny-random" in err
    (cache / "empty").mkdir()
    assert cli.main(["export", "--model", str(cache / "empty"), "--out", str(cache / "x")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    # an unusable chat_template_kwargs.json in the source is named before anything is written
    assert cli.main(["export", "--model", "builtin:tiny-random", "--out", str(cache / "a")]) == 0
    capsys.readouterr()
    src = cache / "a"
    (src / "chat_template_kwargs.json").write_text('{"thinking_mode": "sometimes"}')
    bad = {
        "unknown mode": '{"thinking_mode": "sometimes"}',
        "NaN": '{"x": NaN}',
        "not UTF-8": b'{"x": "caf\xe9"}',
        "a directory": None,
    }
    for why, text in bad.items():
        path = src / "chat_template_kwargs.json"
        if path.is_dir():
            path.rmdir()
        if text is None:
            path.unlink()
            path.mkdir()
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        assert cli.main(["export", "--model", str(src), "--out", str(cache / "b")]) == 2, why
        assert "chat_template_kwargs.json" in capsys.readouterr().err and not (cache / "b").exists(), why


def test_cli_export_of_an_old_builtin_build_keeps_its_chat_defaults(cache, capsys):
    """A builtin build from before chat_template_kwargs.json existed: the export writes the default
    serve applies to it, so serving the export renders the prompts serving the builtin does."""
    assert cli.main(["export", "--model", "builtin:tiny-random", "--out", str(cache / "a")]) == 0
    (src,) = (p for p in (cache / "cache").iterdir() if p.is_dir())  # the build, beside its lock file
    (src / "chat_template_kwargs.json").unlink()
    capsys.readouterr()
    assert cli.main(["export", "--model", "builtin:tiny-random", "--out", str(cache / "b")]) == 0
    assert "**{'thinking_mode': 'disabled'}" in capsys.readouterr().out
    assert json.loads((cache / "b" / "chat_template_kwargs.json").read_text()) == {"thinking_mode": "disabled"}
    assert cli.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err

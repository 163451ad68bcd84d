"""Released / transformers tensor names, in-place loading, safetensors save + load (spec §2)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3_rollout.model import (
    M3ForCausalLM,
    iter_released_tensors,
    load_checkpoint,
    load_hf_state_dict,
    load_released_tensor,
    save_checkpoint,
    tiny_config,
)

hfm = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig  # noqa: E402


def _model(seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def _expected_names(cfg) -> set[str]:
    """Released text-only names of the tiny config, written out from spec §2.2 / §2.3."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        if cfg.is_sparse_layer(i):
            names |= {p + f"self_attn.index_{n}.weight" for n in ("q_proj", "k_proj", "q_norm", "k_norm")}
        if cfg.is_moe_layer(i):
            m = p + "block_sparse_moe."
            names |= {m + "gate.weight", m + "e_score_correction_bias"}
            names |= {m + f"shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
            names |= {m + f"experts.{e}.{w}.weight" for e in range(cfg.num_local_experts) for w in ("w1", "w2", "w3")}
        else:
            names |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return names


def _hf_state_dict(cfg, seed: int) -> dict[str, torch.Tensor]:
    tc = cfg.to_dict()["text_config"]
    tc.update(bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    hf = hfm.MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**tc))
    return {k: v.clone() for k, v in hf.state_dict().items()}


def test_released_names_order_and_views():
    model = _model(0)
    cfg = model.config
    items = list(iter_released_tensors(model))
    names = [n for n, _ in items]
    assert names == [n for n, _ in iter_released_tensors(model)]  # deterministic
    assert len(names) == len(set(names)) and all(n.startswith("language_model.") for n in names)
    assert {n.removeprefix("language_model.") for n in names} == _expected_names(cfg)
    tensors = dict(iter_released_tensors(model, prefix=""))
    moe = model.model.layers[1].block_sparse_moe.experts
    inter = cfg.intermediate_size
    w1, w3, w2 = (tensors[f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"] for w in ("w1", "w3", "w2"))
    assert w1.data_ptr() == moe.w13[3, :inter].data_ptr() and torch.equal(w1, moe.w13[3, :inter])
    assert w3.data_ptr() == moe.w13[3, inter:].data_ptr() and w2.data_ptr() == moe.w2[3].data_ptr()
    w1.fill_(1.5)  # views: writing them writes the model
    assert (moe.w13[3, :inter] == 1.5).all() and not (moe.w13[3, inter:] == 1.5).any()


def test_load_released_tensor_copies_in_place():
    dst, src = _model(0), _model(1)
    ptrs = {n: p.data_ptr() for n, p in dst.named_parameters()}
    for name, t in iter_released_tensors(src):
        load_released_tensor(dst, name, t.to(torch.bfloat16) if "q_proj" in name else t)
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == ptrs
    for (n, a), (_, b) in zip(dst.state_dict().items(), src.state_dict().items()):
        tol = 1e-2 if "q_proj" in n else 0
        assert (a - b).abs().max() <= tol, n
    with pytest.raises(ValueError, match=r"shape \(8, 128\) != expected \(1024, 128\)"):
        load_released_tensor(dst, "lm_head.weight", torch.zeros(8, 128))
    with pytest.raises(KeyError):
        load_released_tensor(dst, "model.layers.1.block_sparse_moe.experts.8.w1.weight", torch.zeros(32, 128))
    with pytest.raises(KeyError):
        load_released_tensor(dst, "model.layers.0.self_attn.index_q_proj.weight", torch.zeros(64, 128))
    with pytest.raises(ValueError, match="not a floating-point"):
        load_released_tensor(dst, "model.norm.weight", torch.zeros(128, dtype=torch.long))


def test_save_single_file_released_names_router_fp32(tmp_path):
    model = _model(2).cast_for_inference(torch.bfloat16)
    files = save_checkpoint(model, model.config, tmp_path)
    assert files == ["model.safetensors"] and not (tmp_path / "model.safetensors.index.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert {k.removeprefix("language_model.") for k in keys} == _expected_names(model.config)
        for router in ("gate.weight", "e_score_correction_bias"):
            assert f.get_tensor(f"language_model.model.layers.2.block_sparse_moe.{router}").dtype == torch.float32
        assert f.get_tensor("language_model.lm_head.weight").dtype == torch.bfloat16
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["text_config"]["sparse_attention_config"]["sparse_topk_blocks"] == 4
    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    # re-saving sharded into the same directory removes the stale single file, and vice versa
    save_checkpoint(model, model.config, tmp_path, max_shard_bytes=300_000)
    assert not (tmp_path / "model.safetensors").exists() and (tmp_path / "model.safetensors.index.json").exists()
    save_checkpoint(model, model.config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_hf_text_and_vl_names_load_and_skip_vision_and_mtp(tmp_path):
    cfg = tiny_config()
    sd = _hf_state_dict(cfg, seed=3)
    a = M3ForCausalLM(cfg)
    assert load_hf_state_dict(a, sd) == []
    # transformers' VL naming + vision + MTP tensors, through a checkpoint directory
    vl = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in sd.items()}
    extra = {
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight": torch.zeros(4, 4),
        "model.multi_modal_projector.linear_1.weight": torch.zeros(4, 4),
        "model.language_model.mtp.layers.0.eh_proj.weight": torch.zeros(4, 4),
    }
    save_file({**vl, **extra}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    b = load_checkpoint(tmp_path)
    ids = torch.randint(0, 1024, (1, 90))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    assert torch.equal(b.model.layers[1].block_sparse_moe.experts.w13, sd["model.layers.1.mlp.experts.gate_up_proj"])
    dense_gate_up = sd["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(b.model.layers[0].mlp.gate_proj.weight, dense_gate_up[: cfg.dense_intermediate_size])
    # released VL names + vision + MTP keys
    released = {n: t.clone() for n, t in iter_released_tensors(a)}
    released["vision_tower.vision_model.pre_layrnorm.weight"] = torch.zeros(3)
    released["language_model.model.mtp.layers.0.enorm.weight"] = torch.zeros(128)
    c = M3ForCausalLM(cfg)
    skipped = load_hf_state_dict(c, released)
    assert sorted(skipped) == [
        "language_model.model.mtp.layers.0.enorm.weight",
        "vision_tower.vision_model.pre_layrnorm.weight",
    ]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_loader_lists_missing_unexpected_and_misshaped_together():
    cfg = tiny_config()
    sd = _hf_state_dict(cfg, seed=4)
    del sd["model.layers.2.self_attn.indexer.k_norm.weight"]
    del sd["lm_head.weight"]
    sd["model.layers.0.self_attn.index_q_proj.weight"] = torch.zeros(64, 128)  # dense layer: no indexer
    sd["model.layers.3.mlp.experts.down_proj"] = torch.zeros(8, 128, 31)
    sd["model.norm.weight"] = torch.zeros(127)
    with pytest.raises(ValueError) as e:
        load_hf_state_dict(M3ForCausalLM(cfg), sd)
    msg = str(e.value)
    assert "2 missing" in msg and "model.layers.2.self_attn.index_k_norm.weight" in msg and "lm_head.weight" in msg
    assert "1 unexpected" in msg and "model.layers.0.self_attn.index_q_proj.weight" in msg
    assert "2 mis-shaped" in msg
    assert "model.layers.3.mlp.experts.down_proj: shape (8, 128, 31) != expected (8, 128, 32)" in msg
    assert "model.norm.weight: shape (127,) != expected (128,)" in msg


# ---------------------------------------------------------------------------- unusable files
from m3_rollout.model.loading import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(_model(0), tiny_config(), out)
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_or_garbage_safetensors_name_the_file(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "trunc")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="^" + re.escape(str(weights)) + r": not a readable safetensors file"):
        load_checkpoint(d)
    weights.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n")  # an LFS pointer
    with pytest.raises(CheckpointError, match="^" + re.escape(str(weights)) + r": .*re-download"):
        load_checkpoint(d)


@pytest.mark.parametrize(
    "index_text,what",
    [("{not json", "not valid JSON"), ('{"metadata": {}}', "no 'weight_map'"), ("\xff\xfe", "not UTF-8")],
)
def test_bad_index_file_names_the_file(saved_dir, tmp_path, index_text, what):
    d = _copy(saved_dir, tmp_path / "idx")
    index = d / "model.safetensors.index.json"
    index.write_bytes(index_text.encode("latin-1"))
    with pytest.raises(CheckpointError, match="^" + re.escape(str(index)) + ": " + what):
        load_checkpoint(d)


def test_index_naming_a_missing_shard_names_it(saved_dir, tmp_path):
    d = _copy(saved_dir, tmp_path / "missing")
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(d)


def test_non_finite_weight_is_refused_naming_the_tensor(tmp_path):
    m = _model(0)
    with torch.no_grad():
        m.model.norm.weight[3] = float("nan")
    save_checkpoint(m, tiny_config(), tmp_path)
    with pytest.raises(CheckpointError, match=r"'language_model\.model\.norm\.weight' holds 1 non-finite"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("content,what", [(b'{"a": "\xe9"}', "not UTF-8"), (b"{,}", "not valid JSON \\(line 1")])
def test_unreadable_config_json_names_the_file(saved_dir, tmp_path, content, what):
    d = _copy(saved_dir, tmp_path / "cfg")
    (d / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="^" + re.escape(str(d / "config.json")) + ": " + what):
        load_checkpoint(d)

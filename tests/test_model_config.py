"""M3Config parsing (both config.json shapes), derivations, and validate() messages (spec §1, §6)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from m3_rollout.model import M3Config, tiny_config
from m3_rollout.model.configuration import _SPARSE_FLAT_ALIASES, _SPARSE_KEYS, CheckpointError, read_config_json

tfc = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")


def _raw_text_config(cfg: M3Config) -> dict:
    """Released-checkpoint shape: raw keys only, sparse keys nested in sparse_attention_config."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _SPARSE_KEYS}
    d["sparse_attention_config"] = {"use_sparse_attention": True, **{k: getattr(cfg, k) for k in _SPARSE_KEYS}}
    d["router_aux_loss_coef"] = 0.001  # training-only key: ignored
    return d


def _flat_text_config(cfg: M3Config) -> dict:
    """transformers shape: flattened index_* / layer_types / mlp_layer_types / rope_parameters, no
    sparse_attention_config, no sparse_init_block / sparse_disable_index_value, hidden_act 'silu'."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _SPARSE_KEYS}
    for k in ("rope_theta", "partial_rotary_factor", "moe_layer_freq", "num_local_experts"):
        d.pop(k)
    d["num_experts"] = cfg.num_local_experts
    d.update({flat: getattr(cfg, raw) for raw, flat in _SPARSE_FLAT_ALIASES.items()})
    d["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in cfg.sparse_attention_freq]
    d["mlp_layer_types"] = ["sparse" if f else "dense" for f in cfg.moe_layer_freq]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 0.5}
    d["hidden_act"] = "silu"
    return d


@pytest.mark.parametrize("shape", ["raw", "flat"])
@pytest.mark.parametrize("nested", [True, False])
def test_both_shapes_nested_or_not_parse_to_the_same_config(shape, nested):
    cfg = tiny_config()
    tc = _raw_text_config(cfg) if shape == "raw" else _flat_text_config(cfg)
    d = {"model_type": "minimax_m3_vl", "vision_config": {"hidden_size": 1280}, "text_config": tc} if nested else tc
    assert M3Config.from_dict(d) == cfg


def test_to_dict_roundtrips_and_transformers_loads_it():
    cfg = tiny_config(sparse_init_block=1, sparse_local_block=2)
    d = json.loads(json.dumps(cfg.to_dict()))  # JSON-clean
    assert d["model_type"] == "minimax_m3_vl" and d["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    assert d["tie_word_embeddings"] is False
    assert M3Config.from_dict(d) == cfg
    tc = d["text_config"]
    assert tc["sparse_attention_config"]["sparse_block_size"] == 16 and tc["moe_layer_freq"] == [0, 1, 1, 1]
    for hf_text in (tfc.MiniMaxM3VLTextConfig(**tc), tfc.MiniMaxM3VLConfig(**d).text_config,
                    tfc.MiniMaxM3VLConfig.from_dict(d).text_config):  # fmt: skip
        assert hf_text.index_block_size == 16 and hf_text.index_topk_blocks == 4
        assert hf_text.index_local_blocks == 2 and hf_text.index_n_heads == 2 and hf_text.index_head_dim == 32
        assert hf_text.layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 3
        assert hf_text.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
        assert hf_text.rope_parameters["partial_rotary_factor"] == 0.5
        assert hf_text.rope_parameters["rope_theta"] == 5e6
        assert hf_text.num_local_experts == 8 and hf_text.shared_intermediate_size == 32
        # what transformers writes back parses to the same config (it drops sparse_attention_config;
        # the top-level sparse_init_block copy and our other raw keys survive as extra attributes)
        assert M3Config.from_dict(hf_text.to_dict()) == cfg


def test_real_defaults_roundtrip():
    cfg = M3Config()
    assert cfg.validate() is cfg and M3Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.num_kv_groups == 16 and cfg.is_sparse_layer(3) and not cfg.is_sparse_layer(2)
    assert cfg.is_moe_layer(59) and not cfg.is_moe_layer(0) and cfg.moe_layer_ids == list(range(3, 60))


def test_rotary_dim_and_partial_factor_are_derived_or_rejected():
    base = _raw_text_config(tiny_config())
    only_dim = {k: v for k, v in base.items() if k != "partial_rotary_factor"}
    assert M3Config.from_dict(only_dim).partial_rotary_factor == 0.5
    only_factor = {k: v for k, v in base.items() if k != "rotary_dim"}
    only_factor["partial_rotary_factor"] = 0.25
    assert M3Config.from_dict(only_factor).rotary_dim == 8
    with pytest.raises(ValueError, match="rotary_dim=16 disagrees"):
        M3Config.from_dict({**base, "partial_rotary_factor": 0.25})
    with pytest.raises(ValueError, match="partial_rotary_factor: conflicting"):
        M3Config.from_dict({**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        M3Config.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


def test_conflicting_raw_and_flat_keys_rejected():
    d = {**_raw_text_config(tiny_config()), "index_block_size": 128}
    with pytest.raises(ValueError, match="sparse_block_size: conflicting.*index_block_size=128"):
        M3Config.from_dict(d)


def test_validate_lists_every_violation_with_key_and_value():
    bad = dataclasses.replace(
        tiny_config(),
        swiglu_beta=0.0,
        hidden_act="silu",
        sparse_num_index_heads=4,
        sparse_local_block=0,
        qk_norm_type="per_layer",
        moe_layer_freq=[0, 1, 1],
    )
    with pytest.raises(ValueError) as e:
        bad.validate()
    msg = str(e.value)
    for piece in (
        "swiglu_beta=0.0",
        "hidden_act='silu'",
        "sparse_num_index_heads=4: must equal num_key_value_heads=2",
        "sparse_local_block=0",
        "qk_norm_type='per_layer'",
        "moe_layer_freq=[0, 1, 1]: must be a list of 4",
    ):
        assert piece in msg, piece
    with pytest.raises(ValueError, match="sparse_init_block=3: sparse_init_block \\+ sparse_local_block=2"):
        tiny_config(sparse_init_block=3, sparse_local_block=2)
    with pytest.raises(ValueError, match="sparse_disable_index_value"):
        tiny_config(sparse_disable_index_value=[0, 0, 1, 1])
    # kernel limits are not model semantics: tiny blocks / heads are fine
    assert tiny_config().sparse_block_size == 16


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("rms_norm_eps", "1e-6", "must be a finite number"),
        ("routed_scaling_factor", None, "must be a finite number"),
        ("rope_theta", float("inf"), "must be a finite number"),
        # a JSON int past the float range: named, not an OverflowError from math.isfinite
        pytest.param("rope_theta", 10**400, "must be a finite number", id="rope_theta-int-past-float-range"),
        ("swiglu_limit", True, "must be a finite number"),
        ("eos_token_id", "</s>", "must be null or a token id (an int >= 0), or a list of them"),
        ("eos_token_id", [2, -1], "must be null or a token id (an int >= 0), or a list of them"),
        ("pad_token_id", 1.5, "must be null or a token id (an int >= 0)"),
        # bools where an int is wanted, and a string where a bool is ("false" was truthy: bias on)
        ("n_shared_experts", True, "must be 1 (one always-on shared expert)"),
        ("sparse_local_block", True, "must be an int >= 1 (the query's own block is always selected)"),
        ("sparse_init_block", False, "must be an int >= 0"),
        ("use_routing_bias", "false", "must be true or false"),
    ],
)
def test_values_of_the_wrong_type_are_named_not_a_type_error(key, value, allowed):
    # a config.json value of the wrong type used to reach a comparison and raise TypeError
    with pytest.raises(ValueError) as e:
        dataclasses.replace(tiny_config(), **{key: value}).validate()
    assert f"{key}={value!r}: {allowed}" in str(e.value)
    staged = key not in ("n_shared_experts", "sparse_local_block", "sparse_init_block", "use_routing_bias")
    # a value of a wrong type or range stops before the rules between keys, and says so
    assert str(e.value).endswith("(the rules between keys are checked once these values are fixed)") == staged
    assert dataclasses.replace(tiny_config(), eos_token_id=[2, 3], pad_token_id=None).validate()


@pytest.mark.parametrize(
    "edit,key",
    [
        ({"head_dim": None}, "head_dim"),  # a TypeError while deriving rotary_dim
        ({"head_dim": float("nan")}, "head_dim"),  # int(nan): "cannot convert float NaN to integer"
        ({"head_dim": 10**30, "rotary_dim": ...}, "head_dim"),  # past int64: OverflowError, or torch's at the build
        ({"partial_rotary_factor": "x"}, "partial_rotary_factor"),
        ({"partial_rotary_factor": float("inf")}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 1e308}, "rotary_dim"),  # finite, but head_dim * it is not
        ({"rotary_dim": "64", "partial_rotary_factor": ...}, "rotary_dim"),  # ...: key removed
        ({"head_dim": 0, "partial_rotary_factor": ...}, "head_dim"),  # rotary_dim / head_dim: ZeroDivisionError
        ({"hidden_size": 2**63}, "hidden_size"),  # torch: "Overflow when unpacking long long"
        ({"layer_types": 5}, "layer_types"),
        ({"layer_types": [["full_attention"]] * 60}, "layer_types"),
        ({"mlp_layer_types": [{}] * 60}, "mlp_layer_types"),
    ],
)
def test_config_json_values_that_cannot_be_combined_are_named(edit, key):
    # from_dict derives rotary_dim / partial_rotary_factor and maps layer_types before validate():
    # a value of the wrong type or size is named (ValueError "invalid M3 config" with the key),
    # not a TypeError / OverflowError / ZeroDivisionError message that names no key
    d = M3Config().to_transformers_text_dict()
    for k, v in edit.items():
        if v is ...:
            d.pop(k)
            d["rope_parameters"].pop(k, None)
        else:
            d[k] = v
            if k in d["rope_parameters"]:
                d["rope_parameters"][k] = v
    with pytest.raises(ValueError, match=r"invalid M3 config:\n") as e:
        M3Config.from_dict(d)
    assert f"\n  {key}" in str(e.value), str(e.value)


def test_config_json_nested_too_deeply_is_named_not_a_recursion_error(tmp_path):
    # json.loads raises RecursionError (not JSONDecodeError) on deep nesting: a traceback from
    # grpo / serve / export instead of the one line naming the file
    (tmp_path / "config.json").write_text('{"text_config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(
        CheckpointError, match=f"^{re.escape(str(tmp_path / 'config.json'))}: JSON arrays / objects nested too deeply"
    ):
        read_config_json(tmp_path)


def test_from_pretrained_reads_config_json(tmp_path):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert M3Config.from_pretrained(tmp_path) == cfg
    assert M3Config.from_pretrained(tmp_path / "config.json") == cfg

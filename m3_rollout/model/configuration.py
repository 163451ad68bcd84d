"""M3Config: the MiniMax-M3 text_config as a typed dataclass (spec §1, §6).

Governing idea: one flat record with the *raw* checkpoint key names (spec §1.2), parsed from
either config.json shape that exists in the wild:

- raw (released checkpoint / vLLM): `sparse_attention_config{...}`, `moe_layer_freq`,
  `rope_theta`, `rotary_dim`, `partial_rotary_factor`;
- flattened (transformers >= 5): `index_n_heads`, `index_head_dim`, `index_block_size`,
  `index_topk_blocks`, `index_local_blocks`, `layer_types`, `mlp_layer_types`,
  `rope_parameters{rope_theta, partial_rotary_factor}`;

either nested under `text_config` (VL wrapper) or not. `to_dict()` writes both shapes at once so
that this class, vLLM and transformers all read the same file.

Defaults are the real model's values (spec §1.2). `tiny_config()` is preset A of spec §7.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class CheckpointError(ValueError):
    """A file of a checkpoint directory cannot be used (unreadable, not the expected format, or
    holding bad values). The message starts with the file's path and says what to do."""


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``<path>/config.json`` (or ``path`` itself if it is a file), unvalidated.

    The one reader of a checkpoint's config file, so every command (grpo, serve, export, dump)
    names it the same way when it is unusable, before anything else of the checkpoint is read.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is not UTF-8 text, not JSON (or nested too deeply to parse), or
            not a JSON object.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{p}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 4]!r}); re-save it as UTF-8 JSON"
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix or re-download it"
        ) from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise CheckpointError(f"{p}: JSON arrays / objects nested too deeply to parse; fix or re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{p}: the top level must be a JSON object of config keys, got {type(data).__name__}")
    return data


def _real_layer_list() -> list[int]:
    # Real model: layers 0..2 dense + full attention, 3..59 MoE + sparse attention.
    return [0, 0, 0] + [1] * 57


# Raw sparse_attention_config subkey -> transformers' flattened key (spec §1.2).
_SPARSE_FLAT_ALIASES = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}
_SPARSE_KEYS = (
    "sparse_index_dim",
    "sparse_num_index_heads",
    "sparse_topk_blocks",
    "sparse_block_size",
    "sparse_score_type",
    "sparse_init_block",
    "sparse_local_block",
    "sparse_attention_freq",
    "sparse_disable_index_value",
)
# transformers' per-layer type strings (spec §1.2).
_ATTN_TYPE = {"full_attention": 0, "minimax_m3_sparse": 1}
_MLP_TYPE = {"dense": 0, "sparse": 1}


@dataclass
class M3Config:
    """MiniMax-M3 text model hyper-parameters (raw `text_config` names, spec §1.2).

    Per-layer lists (`moe_layer_freq`, `sparse_attention_freq`, `sparse_disable_index_value`)
    hold one 0/1 entry per layer. `rotary_dim == int(head_dim * partial_rotary_factor)` always
    holds for a parsed config (spec §1.2: vLLM and transformers read only the factor, sglang only
    `rotary_dim`, so both are kept and must agree).
    """

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    routed_scaling_factor: float = 2.0
    moe_layer_freq: list[int] = field(default_factory=_real_layer_list)
    hidden_act: str = "swigluoai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    swiglu_beta: float = 1.0
    rms_norm_eps: float = 1e-6
    use_gemma_norm: bool = True
    use_qk_norm: bool = True
    qk_norm_type: str = "per_head"
    attention_output_gate: bool = False
    rope_theta: float = 5000000.0
    rotary_dim: int = 64
    partial_rotary_factor: float = 0.5
    # NOTE: 524288 is the vLLM/HF default; some derivatives quote 1048576 (spec §8.1). Read it
    # from the checkpoint's config.json.
    max_position_embeddings: int = 524288
    tie_word_embeddings: bool = False
    # NOTE: vLLM defaults to 1, transformers to 0 (spec §8.2); MTP is never built here.
    num_mtp_modules: int = 1
    bos_token_id: int | None = 200034
    eos_token_id: int | list[int] | None = 200020
    pad_token_id: int | None = None
    # sparse_attention_config (spec §1.2)
    sparse_index_dim: int = 128
    sparse_num_index_heads: int = 4
    sparse_topk_blocks: int = 16
    sparse_block_size: int = 128
    sparse_score_type: str = "max"
    sparse_init_block: int = 0
    sparse_local_block: int = 1
    sparse_attention_freq: list[int] = field(default_factory=_real_layer_list)
    sparse_disable_index_value: list[int] = field(default_factory=_real_layer_list)

    # ------------------------------------------------------------------ helpers
    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size); head h uses KV head h // num_kv_groups."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse_layer(self, i: int) -> bool:
        """True if layer i uses the lightning indexer + block-sparse attention."""
        return bool(self.sparse_attention_freq[i])

    def is_moe_layer(self, i: int) -> bool:
        """True if layer i's FFN is the routed MoE (else the dense MLP)."""
        return bool(self.moe_layer_freq[i])

    @property
    def moe_layer_ids(self) -> list[int]:
        """Indices of the MoE layers, in order (the layer axis of routing records)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, validate: bool = True) -> M3Config:
        """Parse a config.json dict of either shape (module docstring), nested or not.

        Unknown keys (vision_config, training-only keys, ...) are ignored. Raises ValueError when
        the same quantity is given twice with different values (e.g. `sparse_block_size` and
        `index_block_size`, or `rotary_dim` vs `head_dim * partial_rotary_factor`), when the RoPE
        type is not plain "default", and (with `validate=True`) on any `validate()` violation.
        """
        tc = d.get("text_config", d)
        if not isinstance(tc, Mapping):
            raise ValueError(f"text_config must be a dict, got {type(tc).__name__}")
        errors: list[str] = []
        kw: dict[str, Any] = {}
        sparse_keys = set(_SPARSE_KEYS)
        derived = {"rope_theta", "rotary_dim", "partial_rotary_factor", "moe_layer_freq"}
        for f in dataclasses.fields(cls):
            if f.name in tc and f.name not in sparse_keys and f.name not in derived:
                kw[f.name] = tc[f.name]
        if "num_local_experts" not in kw and "num_experts" in tc:
            kw["num_local_experts"] = tc["num_experts"]  # transformers' attribute alias

        def pick(name: str, candidates: list[tuple[str, Any]]) -> None:
            given = [(label, v) for label, v in candidates if v is not None]
            if not given:
                return
            first = given[0][1]
            if any(v != first for _, v in given[1:]):
                shown = ", ".join(f"{label}={v!r}" for label, v in given)
                errors.append(f"{name}: conflicting values {shown}")
            kw[name] = first

        sac = tc.get("sparse_attention_config") or {}
        if not isinstance(sac, Mapping):
            raise ValueError(f"sparse_attention_config must be a dict, got {type(sac).__name__}")
        attn_from_types = _layer_list(tc.get("layer_types"), _ATTN_TYPE, "layer_types", errors)
        mlp_from_types = _layer_list(tc.get("mlp_layer_types"), _MLP_TYPE, "mlp_layer_types", errors)
        for key in _SPARSE_KEYS:
            cands = [
                (f"sparse_attention_config.{key}", sac.get(key)),
                (key, tc.get(key)),  # raw key written at top level
            ]
            if key in _SPARSE_FLAT_ALIASES:
                cands.append((_SPARSE_FLAT_ALIASES[key], tc.get(_SPARSE_FLAT_ALIASES[key])))
            if key == "sparse_attention_freq":
                cands.append(("layer_types", attn_from_types))
            pick(key, cands)
        pick("moe_layer_freq", [("moe_layer_freq", tc.get("moe_layer_freq")), ("mlp_layer_types", mlp_from_types)])
        if "sparse_disable_index_value" not in kw and "sparse_attention_freq" in kw:
            # transformers drops this key; it only implements the score-only indexer, i.e. 1 on
            # every sparse layer (what M3 ships).
            kw["sparse_disable_index_value"] = [1 if f else 0 for f in kw["sparse_attention_freq"]]

        rope = tc.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ValueError(f"rope_parameters must be a dict, got {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            errors.append(f"rope_parameters.rope_type={rope_type!r}: only 'default' RoPE is implemented")
        if tc.get("rope_scaling"):
            errors.append(f"rope_scaling={tc['rope_scaling']!r}: RoPE scaling is not implemented (must be absent)")
        pick(
            "rope_theta",
            [("rope_theta", tc.get("rope_theta")), ("rope_parameters.rope_theta", rope.get("rope_theta"))],
        )
        pick(
            "partial_rotary_factor",
            [
                ("partial_rotary_factor", tc.get("partial_rotary_factor")),
                ("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor")),
            ],
        )
        if tc.get("rotary_dim") is not None:
            kw["rotary_dim"] = tc["rotary_dim"]
        head_dim = kw.get("head_dim", cls.head_dim)
        has_rd, has_pf = "rotary_dim" in kw, "partial_rotary_factor" in kw
        # a value the derivation cannot combine (a string, NaN, 0, past the float range) is left
        # as given: validate() names its key
        if has_rd and has_pf:
            rd = _derived(lambda: int(head_dim * kw["partial_rotary_factor"]))
            if rd is not None and kw["rotary_dim"] != rd:
                errors.append(
                    f"rotary_dim={kw['rotary_dim']} disagrees with head_dim * partial_rotary_factor = "
                    f"{head_dim} * {kw['partial_rotary_factor']} = {head_dim * kw['partial_rotary_factor']}"
                )
        elif has_rd:
            pf = _derived(lambda: kw["rotary_dim"] / head_dim)
            if pf is not None:
                kw["partial_rotary_factor"] = pf
        else:
            rd = _derived(lambda: int(head_dim * kw.get("partial_rotary_factor", cls.partial_rotary_factor)))
            if rd is not None:
                kw["rotary_dim"] = rd

        # transformers rewrites hidden_act to "silu" and always computes SwiGLU-OAI inline.
        if kw.get("hidden_act") == "silu" and ("layer_types" in tc or "mlp_layer_types" in tc):
            kw["hidden_act"] = "swigluoai"
        if errors:
            raise ValueError("invalid M3 config:\n  " + "\n  ".join(errors))
        cfg = cls(**kw)
        if validate:
            cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> M3Config:
        """Read `<path>/config.json` (or `path` itself if it is a file) and validate it.

        Raises:
            FileNotFoundError: no such file.
            CheckpointError: the file is not UTF-8 text, not JSON, or not a JSON object.
            ValueError: the config's values are invalid (listed).
        """
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict[str, Any]:
        """A VL-shaped config.json dict that this class, vLLM and transformers all load.

        `text_config` carries the raw keys (incl. `sparse_attention_config`, `moe_layer_freq`,
        `rope_theta`, `rotary_dim`, `partial_rotary_factor`) AND transformers' flattened keys
        (`index_*`, `layer_types`, `mlp_layer_types`, `rope_parameters`), all consistent, plus a
        top-level copy of `sparse_init_block` (transformers drops `sparse_attention_config`).
        """
        tc: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name not in _SPARSE_KEYS:
                v = getattr(self, f.name)
                tc[f.name] = list(v) if isinstance(v, list) else v
        tc["sparse_attention_config"] = {"use_sparse_attention": any(self.sparse_attention_freq)}
        for key in _SPARSE_KEYS:
            v = getattr(self, key)
            tc["sparse_attention_config"][key] = list(v) if isinstance(v, list) else v
        for raw, flat in _SPARSE_FLAT_ALIASES.items():
            tc[flat] = getattr(self, raw)
        # NOTE: transformers drops sparse_attention_config (and has no init-block key) but keeps
        # unknown top-level keys, so a top-level copy lets init blocks survive its save/load.
        tc["sparse_init_block"] = self.sparse_init_block
        tc["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in self.sparse_attention_freq]
        tc["mlp_layer_types"] = ["sparse" if f else "dense" for f in self.moe_layer_freq]
        tc["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        return {
            "model_type": "minimax_m3_vl",
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "tie_word_embeddings": False,
            "text_config": tc,
        }

    def to_transformers_text_dict(self) -> dict[str, Any]:
        """A flat config.json dict for transformers' text class (`model_type: minimax_m3_vl_text`).

        `AutoConfig` reads it as `MiniMaxM3VLTextConfig` and `AutoModelForCausalLM` builds
        `MiniMaxM3VLForCausalLM` (no vision tower) from it. The keys are `to_dict()`'s
        `text_config` (both the raw and the flattened spellings), so this class reads the file
        back as well (spec §1.2, §2.2b).
        """
        return {
            "model_type": "minimax_m3_vl_text",
            "architectures": ["MiniMaxM3VLForCausalLM"],
            **self.to_dict()["text_config"],
        }

    # ------------------------------------------------------------------ checks
    def validate(self) -> M3Config:
        """Check the model-semantics invariants of spec §6 plus basic sanity; return self.

        Kernel limits (block size 128, head size 128, top-k < 64) are NOT checked: they belong to
        the kernels that have them. Raises ValueError listing every violation as
        `key=value: allowed ...`, in two stages: every value of a wrong type or range first (then
        the rules between keys, which need those values, are not checked yet: the message says
        so), else every broken rule between keys.
        """
        errs: list[str] = []

        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                errs.append(f"{key}={getattr(self, key)!r}: {allowed}")

        for key in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "shared_intermediate_size", "dense_intermediate_size",
            "num_local_experts", "num_experts_per_tok", "sparse_index_dim", "sparse_num_index_heads",
            "sparse_topk_blocks", "sparse_block_size", "max_position_embeddings", "rotary_dim",
        ):  # fmt: skip
            v = getattr(self, key)
            # below 2**63: a tensor size (torch's int64), and products with it stay in the float range
            need(_is_int(v) and 0 < v < 2**63, key, "must be a positive int (below 2**63)")
        for key in (
            "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "swiglu_beta", "rms_norm_eps", "rope_theta",
            "partial_rotary_factor",
        ):  # fmt: skip
            v = getattr(self, key)
            need(_finite_number(v), key, "must be a finite number")
        for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
            v = getattr(self, key)
            ids = v if key == "eos_token_id" and isinstance(v, list) else [v]
            allowed = "must be null or a token id (an int >= 0)" + (
                ", or a list of them" if key == "eos_token_id" else ""
            )
            need(v is None or all(_is_int(i) and i >= 0 for i in ids), key, allowed)
        if errs:  # the relations below assume positive ints and numbers
            errs.append("(the rules between keys are checked once these values are fixed)")
            raise ValueError("invalid M3 config:\n  " + "\n  ".join(errs))

        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"must be a multiple of num_key_value_heads={self.num_key_value_heads}")  # fmt: skip
        need(self.num_experts_per_tok <= self.num_local_experts, "num_experts_per_tok",
             f"must be <= num_local_experts={self.num_local_experts}")  # fmt: skip
        need(
            self.n_shared_experts == 1 and _is_int(self.n_shared_experts),
            "n_shared_experts",
            "must be 1 (one always-on shared expert)",
        )
        need(self.scoring_func == "sigmoid", "scoring_func", "must be 'sigmoid'")
        need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        need(self.hidden_act == "swigluoai", "hidden_act", "must be 'swigluoai'")
        need(self.swiglu_beta == 1.0, "swiglu_beta", "must be 1.0 (the +1 on the up branch)")
        need(self.swiglu_limit > 0, "swiglu_limit", "must be > 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(isinstance(self.use_routing_bias, bool), "use_routing_bias", "must be true or false")
        need(self.use_gemma_norm is True, "use_gemma_norm", "must be true (scale 1 + w)")
        need(self.use_qk_norm is True, "use_qk_norm", "must be true")
        need(self.qk_norm_type == "per_head", "qk_norm_type", "must be 'per_head'")
        need(self.attention_output_gate is False, "attention_output_gate", "must be false (no output gate)")
        need(self.tie_word_embeddings is False, "tie_word_embeddings", "must be false (untied lm_head)")
        need(self.rope_theta > 0, "rope_theta", "must be > 0")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim, "rotary_dim",
             f"must be even and in (0, head_dim={self.head_dim}]")  # fmt: skip
        need(self.rotary_dim == _derived(lambda: int(self.head_dim * self.partial_rotary_factor)), "rotary_dim",
             f"must equal head_dim * partial_rotary_factor = {self.head_dim} * "
             f"{self.partial_rotary_factor}")  # fmt: skip
        need(self.sparse_score_type == "max", "sparse_score_type", "must be 'max'")
        need(self.sparse_num_index_heads == self.num_key_value_heads, "sparse_num_index_heads",
             f"must equal num_key_value_heads={self.num_key_value_heads} "
             "(index head g selects for KV head g)")  # fmt: skip
        need(self.sparse_index_dim == self.head_dim, "sparse_index_dim", f"must equal head_dim={self.head_dim}")
        need(_is_int(self.sparse_local_block) and self.sparse_local_block >= 1, "sparse_local_block",
             "must be an int >= 1 (the query's own block is always selected)")  # fmt: skip
        need(_is_int(self.sparse_init_block) and self.sparse_init_block >= 0, "sparse_init_block",
             "must be an int >= 0")  # fmt: skip
        if _is_int(self.sparse_init_block) and _is_int(self.sparse_local_block):
            need(self.sparse_init_block + self.sparse_local_block <= self.sparse_topk_blocks, "sparse_init_block",
                 f"sparse_init_block + sparse_local_block={self.sparse_local_block} must be <= "
                 f"sparse_topk_blocks={self.sparse_topk_blocks}")  # fmt: skip
        n = self.num_hidden_layers
        for key in ("moe_layer_freq", "sparse_attention_freq", "sparse_disable_index_value"):
            v = getattr(self, key)
            ok = isinstance(v, list) and len(v) == n and all(x in (0, 1) for x in v)
            need(ok, key, f"must be a list of {n} (num_hidden_layers) entries, each 0 or 1")
        if isinstance(self.sparse_attention_freq, list) and isinstance(self.sparse_disable_index_value, list):
            bad = [
                i
                for i, (s, dv) in enumerate(zip(self.sparse_attention_freq, self.sparse_disable_index_value))
                if s and not dv
            ]
            need(not bad, "sparse_disable_index_value",
                 "must be 1 on every sparse layer (index-value branch not implemented); "
                 f"0 on layers {bad}")  # fmt: skip
        if errs:
            raise ValueError("invalid M3 config:\n  " + "\n  ".join(errs))
        return self


def _is_int(v: Any) -> bool:
    """An int that is not a bool (JSON true / false are not counts)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _derived(compute: Callable[[], Any]) -> Any:
    """``compute()``, or None when the config values it combines cannot be (a string, NaN, a zero
    divisor, a result past the float range): the caller leaves the check to the key's own rule."""
    try:
        return compute()
    except (TypeError, ValueError, ArithmeticError):
        return None


def _finite_number(v: Any) -> bool:
    """An int or float (not a bool) that is finite as a float: a JSON int past the float range is not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _layer_list(types: Any, mapping: dict[str, int], key: str, errors: list[str]) -> list[int] | None:
    """Map transformers' per-layer type strings to 0/1 (None if absent)."""
    if types is None:
        return None
    if not isinstance(types, list):
        errors.append(f"{key}={types!r}: must be a list of {sorted(mapping)}")
        return None
    bad = [t for t in types if not isinstance(t, str) or t not in mapping]
    if bad:
        errors.append(f"{key} contains {sorted(set(map(str, bad)))}: allowed {sorted(mapping)}")
        return None
    return [mapping[t] for t in types]


def tiny_config(**overrides: Any) -> M3Config:
    """Spec §7 preset A ("tiny-generic"): every structural feature at CPU-test size.

    Layer 0: full attention + dense MLP; layers 1-3: sparse attention + MoE. Block 16, top-4
    blocks, so selection becomes sparse beyond 64 tokens. `overrides` replace fields; if only one of
    `rotary_dim` / `partial_rotary_factor` / `head_dim` is overridden the other is re-derived.
    Returns a validated config.
    """
    base = dict(
        vocab_size=1024,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=5000000.0,
        max_position_embeddings=4096,
        intermediate_size=32,
        shared_intermediate_size=32,
        dense_intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_layer_freq=[0, 1, 1, 1],
        sparse_index_dim=32,
        sparse_num_index_heads=2,
        sparse_topk_blocks=4,
        sparse_block_size=16,
        sparse_init_block=0,
        sparse_local_block=1,
        sparse_attention_freq=[0, 1, 1, 1],
        sparse_disable_index_value=[0, 1, 1, 1],
        num_mtp_modules=0,
    )
    base.update(overrides)
    if "rotary_dim" in overrides and "partial_rotary_factor" not in overrides:
        base["partial_rotary_factor"] = base["rotary_dim"] / base["head_dim"]
    elif "rotary_dim" not in overrides:
        base["rotary_dim"] = int(base["head_dim"] * base["partial_rotary_factor"])
    return M3Config(**base).validate()

"""Checkpoint I/O under the released tensor names (spec §2).

Governing idea: the *released text-only name* (`model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`,
no `language_model.` prefix) is the one currency. Every source naming (released VL with
`language_model.`, released text-only, transformers' text class, transformers' VL class) is
translated into (released name, tensor) pairs, and every released name resolves to a view of one
of our parameters; loading copies into that view in place. The weight-sync path uses the same
two functions (`iter_released_tensors`, `load_released_tensor`).

Naming map for transformers (spec §2.2b), per layer:
  self_attn.indexer.{q_proj,k_proj,q_norm,k_norm}  -> self_attn.index_{q_proj,k_proj,q_norm,k_norm}
  mlp.gate_up_proj [2I, H] (dense)                -> mlp.gate_proj (rows :I), mlp.up_proj (rows I:)
  mlp.gate.weight / mlp.gate.e_score_correction_bias -> block_sparse_moe.gate.weight / .e_score_correction_bias
  mlp.experts.gate_up_proj [E, 2I, H]             -> block_sparse_moe.experts.{e}.w1 (rows :I) / w3 (rows I:)
  mlp.experts.down_proj [E, H, I]                 -> block_sparse_moe.experts.{e}.w2
  mlp.shared_experts.{gate_up_proj, down_proj}    -> block_sparse_moe.shared_experts.{gate_proj + up_proj, down_proj}
`iter_transformers_text_tensors` runs the same map backwards, so `save_checkpoint(...,
layout="transformers-text")` writes what transformers' text class loads with no renaming.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch

from .atomic_file import write_atomic
from .configuration import CheckpointError, M3Config
from .model import M3ForCausalLM

LAYOUTS = ("released", "transformers-text")

__all__ = [
    "LAYOUTS",
    "CheckpointError",
    "checkpoint_files",
    "iter_released_tensors",
    "iter_transformers_text_tensors",
    "load_checkpoint",
    "load_hf_state_dict",
    "load_named_tensors",
    "load_released_tensor",
    "released_pairs",
    "released_view",
    "save_checkpoint",
    "text_tensor_name",
]

RELEASED_PREFIX = "language_model."
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w13|w2)$")
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_LAYER_RE = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
# transformers' VL class keeps these modules beside `model.language_model`.
_HF_VISION_ROOTS = {"vision_tower", "multi_modal_projector", "patch_merge_mlp", "visual"}
_HF_INDEXER = {
    "self_attn.indexer.q_proj.weight": "self_attn.index_q_proj.weight",
    "self_attn.indexer.k_proj.weight": "self_attn.index_k_proj.weight",
    "self_attn.indexer.q_norm.weight": "self_attn.index_q_norm.weight",
    "self_attn.indexer.k_norm.weight": "self_attn.index_k_norm.weight",
    "mlp.gate.weight": "block_sparse_moe.gate.weight",
    "mlp.gate.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias",
    "mlp.shared_experts.down_proj.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
_HF_GATE_UP = {
    "mlp.gate_up_proj.weight": "mlp.",
    "mlp.shared_experts.gate_up_proj.weight": "block_sparse_moe.shared_experts.",
}
_ROUTER_SUFFIXES = (
    ".block_sparse_moe.gate.weight",
    ".block_sparse_moe.e_score_correction_bias",
    ".mlp.gate.weight",  # transformers' names of the same two tensors
    ".mlp.gate.e_score_correction_bias",
)
# released suffix -> transformers suffix of the tensors that are renamed one to one
_TO_HF = {released: hf for hf, released in _HF_INDEXER.items()}
# released gate suffix -> (released up suffix, transformers' fused gate_up suffix)
_TO_HF_GATE_UP = {
    "mlp.gate_proj.weight": ("mlp.up_proj.weight", "mlp.gate_up_proj.weight"),
    "block_sparse_moe.shared_experts.gate_proj.weight": (
        "block_sparse_moe.shared_experts.up_proj.weight",
        "mlp.shared_experts.gate_up_proj.weight",
    ),
}
_TO_HF_UP = {up for up, _ in _TO_HF_GATE_UP.values()}
_TO_HF_EXPERTS = {
    "block_sparse_moe.experts.w13": "mlp.experts.gate_up_proj",  # [E, 2I, H], w1 rows then w3 rows
    "block_sparse_moe.experts.w2": "mlp.experts.down_proj",  # [E, H, I]
}


# ---------------------------------------------------------------------------- released names
def iter_released_tensors(model: M3ForCausalLM, prefix: str = RELEASED_PREFIX) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (released name, tensor) for every text-model tensor, in a fixed order.

    Order: parameter registration order, with each layer's stacked experts expanded expert by
    expert as w1, w2, w3. Tensors are detached VIEWS of the parameters (per-expert ones slice
    w13 [E, 2I, H] / w2 [E, H, I]): copying into them in place updates the model.
    `prefix` is prepended to every name ("language_model." = released VL checkpoint, "" = text-only).
    """
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(".experts.w2"):
            continue  # emitted together with w13
        if name.endswith(".experts.w13"):
            base = name[: -len(".w13")]
            w13, w2 = p.detach(), params[base + ".w2"].detach()
            inter = w2.shape[-1]
            first = _expert_range(model, base)[0]  # EP shard: local row i is global expert first + i
            for i in range(w13.shape[0]):
                e = first + i
                yield f"{prefix}{base}.{e}.w1.weight", w13[i, :inter]
                yield f"{prefix}{base}.{e}.w2.weight", w2[i]
                yield f"{prefix}{base}.{e}.w3.weight", w13[i, inter:]
            continue
        yield prefix + name, p.detach()


def released_view(model: M3ForCausalLM, name: str) -> torch.Tensor:
    """The parameter view a released name (with or without `language_model.`) refers to.

    Raises KeyError for a name that is not a tensor of this model.
    """
    name = name.removeprefix(RELEASED_PREFIX)
    m = _EXPERT_RE.match(name)
    try:
        if m:
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            first, end = _expert_range(model, base)
            if not first <= e < end:
                _raise_key(name)  # another EP rank's expert (or out of range)
            e -= first  # global expert id -> local row
            if which == "w2":
                w2 = model.get_parameter(base + ".w2").detach()
                return w2[e] if e < w2.shape[0] else _raise_key(name)
            w13 = model.get_parameter(base + ".w13").detach()
            if e >= w13.shape[0]:
                _raise_key(name)
            inter = w13.shape[1] // 2
            return w13[e, :inter] if which == "w1" else w13[e, inter:]
        if name.endswith((".w13", ".w2")):
            _raise_key(name)  # stacked names are internal, not released names
        return model.get_parameter(name).detach()
    except AttributeError:
        _raise_key(name)


def _expert_range(model: M3ForCausalLM, experts_path: str) -> tuple[int, int]:
    """Global expert ids [a, b) held by the StackedExperts at `experts_path` (EP shard, see
    m3_rollout.parallel.expert_sharding); (0, E) when the module is not sharded."""
    module = model.get_submodule(experts_path)
    return tuple(getattr(module, "expert_range", (0, module.w13.shape[0])))


def _raise_key(name: str):
    raise KeyError(f"{name!r} is not a released tensor name of this model")


def load_released_tensor(model: M3ForCausalLM, name: str, tensor: torch.Tensor) -> None:
    """Copy `tensor` in place into the parameter (view) named by released name `name`.

    No new storage: data_ptr of every parameter is unchanged. The value is cast to the
    parameter's dtype. Raises KeyError (unknown name) or ValueError (shape mismatch, non-float
    tensor).
    """
    dst = released_view(model, name)
    if tuple(tensor.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point dtype")
    with torch.no_grad():
        dst.copy_(tensor)


def iter_transformers_text_tensors(model: M3ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) under transformers' text-class names (`MiniMaxM3VLForCausalLM`, spec §2.2b).

    The module docstring's map, backwards: indexer and router tensors renamed; dense and
    shared-expert gate + up concatenated into `gate_up_proj` [2I, H] (gate rows first, new
    tensors); the stacked experts are already transformers' `mlp.experts.gate_up_proj` [E, 2I, H]
    and `mlp.experts.down_proj` [E, H, I] (views). Other tensors keep their released names.

    Raises:
        ValueError: `model` holds only an expert-parallel slice of some layer's experts.
    """
    params = dict(model.named_parameters())
    for name, p in params.items():
        m = _LAYER_RE.match(name)
        if not m:
            yield name, p.detach()
            continue
        layer, rest = m.groups()
        if rest in _TO_HF:
            yield layer + _TO_HF[rest], p.detach()
        elif rest in _TO_HF_GATE_UP:
            up, fused = _TO_HF_GATE_UP[rest]
            yield layer + fused, torch.cat([p.detach(), params[layer + up].detach()], dim=0)
        elif rest in _TO_HF_UP:
            continue  # written inside the fused tensor above
        elif rest in _TO_HF_EXPERTS:
            experts = name.rsplit(".", 1)[0]
            first, end = _expert_range(model, experts)
            if (first, end) != (0, model.config.num_local_experts):
                raise ValueError(
                    f"{experts} holds experts [{first}, {end}) of {model.config.num_local_experts}: "
                    "export a full model (expert_parallel_size=1), not one EP rank's slice"
                )
            yield layer + _TO_HF_EXPERTS[rest], p.detach()
        else:
            yield name, p.detach()


# ---------------------------------------------------------------------------- name translation
def text_tensor_name(name: str) -> str | None:
    """Released text-only-style name of a checkpoint key, or None if it is not a text tensor.

    Handles `language_model.` (released VL), `model.language_model.` (transformers VL) and bare
    names; returns None for vision keys (anything outside the language model) and MTP keys.
    """
    if ".mtp." in name or name.startswith("mtp."):
        return None  # MTP head: speculative decoding only (spec §2.4)
    if name.startswith(RELEASED_PREFIX):
        return name[len(RELEASED_PREFIX) :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model."):
        root = name.split(".", 2)[1]
        return None if root in _HF_VISION_ROOTS else name
    if name.startswith("lm_head."):
        return name
    return None  # vision tower / projector of the released VL checkpoint (spec §2.5)


def _split_hf(name: str, t: torch.Tensor, expected: dict[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """Translate one transformers-named layer tensor into released (name, tensor-view) pairs.

    Fused tensors are checked against the fused shape built from `expected`; a bad fused shape
    raises _FusedShapeError naming the transformers key. Names that need no translation pass
    through; a fused name with no counterpart in this model raises KeyError.
    """
    m = _LAYER_RE.match(name)
    if not m:
        return [(name, t)]
    layer, rest = m.groups()
    if rest in _HF_INDEXER:
        return [(layer + _HF_INDEXER[rest], t)]
    if rest in _HF_GATE_UP:
        base = layer + _HF_GATE_UP[rest]
        g, u = base + "gate_proj.weight", base + "up_proj.weight"
        if g not in expected:
            raise KeyError(name)
        want = (expected[g][0] + expected[u][0], *expected[g][1:])
        _check_fused(name, t, want, [g, u])
        i = expected[g][0]
        return [(g, t[:i]), (u, t[i:])]
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        base = layer + "block_sparse_moe.experts."
        w1 = base + "0.w1.weight"
        if w1 not in expected:
            raise KeyError(name)
        n_exp = sum(1 for k in expected if k.startswith(base) and k.endswith(".w1.weight"))
        if rest == "mlp.experts.down_proj":
            w2_names = [f"{base}{e}.w2.weight" for e in range(n_exp)]
            _check_fused(name, t, (n_exp, *expected[w2_names[0]]), w2_names)
            return [(f"{base}{e}.w2.weight", t[e]) for e in range(n_exp)]
        i, h = expected[w1]
        covers = [f"{base}{e}.{w}.weight" for e in range(n_exp) for w in ("w1", "w3")]
        _check_fused(name, t, (n_exp, 2 * i, h), covers)
        pairs = []
        for e in range(n_exp):
            pairs += [(f"{base}{e}.w1.weight", t[e, :i]), (f"{base}{e}.w3.weight", t[e, i:])]
        return pairs
    return [(name, t)]


class _FusedShapeError(ValueError):
    """A fused transformers tensor has the wrong shape; `covers` = the released names it holds."""

    def __init__(self, msg: str, covers: list[str]):
        super().__init__(msg)
        self.covers = covers


def _check_fused(name: str, t: torch.Tensor, want: tuple[int, ...], covers: list[str]) -> None:
    if tuple(t.shape) != tuple(want):
        raise _FusedShapeError(f"{name}: shape {tuple(t.shape)} != expected {tuple(want)}", covers)


def released_pairs(
    model: M3ForCausalLM, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(released text-only name, tensor) for (name, tensor) pairs in any naming of this model's tensors.

    Accepted namings: released VL (``language_model.``) and text-only names; transformers' text and
    VL names (fused ``gate_up_proj`` / stacked ``mlp.experts.*`` split into views, module
    docstring); and the model's own parameter names (``named_parameters``), whose stacked experts
    ``...experts.w13`` [E, 2I, H] / ``...experts.w2`` [E, H, I] become per-expert ``w1`` / ``w3`` /
    ``w2`` views. Vision and MTP keys are skipped. ``model`` must hold every expert (not an EP
    shard): its shapes decide the splits. Works on meta tensors (shape-only checks).

    Raises:
        KeyError: a name that no naming maps to a tensor of this model.
        ValueError: a fused or stacked tensor whose shape does not match this model (names it).
    """
    expected = {name: tuple(t.shape) for name, t in iter_released_tensors(model, prefix="")}
    for src_name, tensor in items:
        m = _STACKED_RE.match(src_name.removeprefix(RELEASED_PREFIX))
        if m:
            base, which = m.groups()
            w1 = expected.get(base + ".0.w1.weight")
            if w1 is None:
                raise KeyError(f"{src_name!r} is not a tensor of this model")
            n_exp = sum(1 for k in expected if k.startswith(base + ".") and k.endswith(".w1.weight"))
            inter, hidden = w1
            want = (n_exp, 2 * inter, hidden) if which == "w13" else (n_exp, hidden, inter)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{src_name}: shape {tuple(tensor.shape)} != expected {want}")
            for e in range(n_exp):
                if which == "w2":
                    yield f"{base}.{e}.w2.weight", tensor[e]
                else:
                    yield f"{base}.{e}.w1.weight", tensor[e, :inter]
                    yield f"{base}.{e}.w3.weight", tensor[e, inter:]
            continue
        name = text_tensor_name(src_name)
        if name is None:
            continue
        try:
            pairs = _split_hf(name, tensor, expected)
        except KeyError:
            raise KeyError(f"{src_name!r} is not a tensor of this model") from None
        for rname, t in pairs:
            if rname not in expected:
                raise KeyError(f"{src_name!r} is not a tensor of this model")
            yield rname, t


def load_named_tensors(model: M3ForCausalLM, items: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Load (name, tensor) pairs in any supported naming into `model`, in place.

    Accepts released VL names, released text-only names, and transformers' text/VL names (module
    docstring); skips vision and `.mtp.` keys. Every model tensor must be provided exactly once.
    Returns the skipped names. Raises ONE ValueError listing all missing, unexpected and
    mis-shaped tensors (the model is then partially loaded and should be discarded).
    """
    expected = {name: tuple(t.shape) for name, t in iter_released_tensors(model, prefix="")}
    loaded: set[str] = set()
    given_misshaped: set[str] = set()  # provided but unusable: reported once, not also as missing
    skipped: list[str] = []
    unexpected: list[str] = []
    misshaped: list[str] = []
    duplicated: list[str] = []
    for src_name, tensor in items:
        name = text_tensor_name(src_name)
        if name is None:
            skipped.append(src_name)
            continue
        try:
            pairs = _split_hf(name, tensor, expected)
        except KeyError:
            unexpected.append(src_name)
            continue
        except _FusedShapeError as e:
            misshaped.append(str(e))
            given_misshaped.update(e.covers)
            continue
        for rname, t in pairs:
            if rname not in expected:
                unexpected.append(src_name if rname == name else f"{src_name} (as {rname})")
                continue
            if tuple(t.shape) != expected[rname]:
                misshaped.append(f"{src_name}: shape {tuple(t.shape)} != expected {expected[rname]}")
                given_misshaped.add(rname)
                continue
            if rname in loaded:
                duplicated.append(f"{src_name} (as {rname})")
                continue
            try:
                load_released_tensor(model, rname, t)
            except ValueError as e:  # e.g. an integer tensor
                misshaped.append(f"{src_name}: {e}")
                given_misshaped.add(rname)
                continue
            loaded.add(rname)
    missing = [n for n in expected if n not in loaded and n not in given_misshaped]
    if missing or unexpected or misshaped or duplicated:
        parts = []
        for title, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", misshaped),
            ("given twice", duplicated),
        ):
            if names:
                parts.append(f"{len(names)} {title}:\n    " + "\n    ".join(names))
        raise ValueError("checkpoint does not match the model:\n  " + "\n  ".join(parts))
    return skipped


def load_hf_state_dict(model: M3ForCausalLM, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Load a transformers `MiniMaxM3VLForCausalLM` / VL state dict (or any supported naming).

    Same rules and errors as `load_named_tensors`; returns the skipped (vision / MTP) names.
    """
    return load_named_tensors(model, state_dict.items())


# ---------------------------------------------------------------------------- save / load files
def _save_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    # Router weight and bias are released in fp32 (spec §2.2); keep them there whatever the model dtype.
    return torch.float32 if name.endswith(_ROUTER_SUFFIXES) and t.dtype != torch.float64 else t.dtype


def save_checkpoint(
    model: M3ForCausalLM,
    config: M3Config,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 5 * 1024**3,
    layout: str = "released",
) -> list[str]:
    """Write config.json + safetensors in one of two layouts (`LAYOUTS`).

    - "released" (the default, every checkpoint the project writes): the released VL names
      (`language_model.…`, per-expert `w1/w2/w3`) and a VL-shaped config.json (`M3Config.to_dict`);
      vLLM and transformers' VL class load it.
    - "transformers-text": transformers' text-class names (`iter_transformers_text_tensors`) and a
      flat `minimax_m3_vl_text` config.json (`M3Config.to_transformers_text_dict`), which
      `AutoModelForCausalLM` loads as `MiniMaxM3VLForCausalLM` with no missing or unexpected keys.
      transformers has no MSA init blocks (spec §2.2b), so a config with `sparse_init_block > 0`
      is refused rather than written as a model that computes different logits there.

    This code loads both back (`load_checkpoint`). One `model.safetensors` when everything fits in
    `max_shard_bytes`, else `model-0000k-of-0000n.safetensors` shards (greedy, in iteration order)
    plus `model.safetensors.index.json`. Router gate weight and bias are stored fp32; other tensors
    in the model dtype. Every file is written under a temporary name then renamed; stale weight
    files of an earlier save in `out_dir` are removed afterwards. Returns the weight file names.

    Raises:
        ValueError: an unknown `layout`; "transformers-text" with `sparse_init_block > 0` or with
            an expert-parallel slice of the experts.
    """
    from safetensors.torch import save_file

    if layout == "released":
        tensors_iter, config_dict = iter_released_tensors(model, RELEASED_PREFIX), config.to_dict()
    elif layout == "transformers-text":
        if config.sparse_init_block > 0:
            raise ValueError(
                f"sparse_init_block={config.sparse_init_block}: transformers' minimax_m3_vl has no MSA init "
                "blocks (spec §2.2b), so its logits would differ from this model's; keep the released layout"
            )
        tensors_iter, config_dict = iter_transformers_text_tensors(model), config.to_transformers_text_dict()
    else:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)

    def write(fname: str, write_file) -> None:
        # 0644 like the checkpoint's other files: safetensors creates its files 0600, and a checkpoint
        # meant for other tools and users would be owner-only.
        write_atomic(os.path.join(out, fname), write_file, fsync=False, mode=0o644)

    entries = [(n, t, _save_dtype(n, t)) for n, t in tensors_iter]
    shards: list[list[tuple[str, torch.Tensor, torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry[1].numel() * torch.empty((), dtype=entry[2]).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(files, shards):
        # clone: safetensors refuses tensors that share storage (the per-expert views do).
        tensors = {name: t.to(dt).contiguous().clone() for name, t, dt in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        write(fname, lambda p, ts=tensors: save_file(ts, p, metadata={"format": "pt"}))
        weight_map.update({name: fname for name in tensors})
    write(CONFIG_NAME, lambda p: _write_json(p, config_dict))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write(INDEX_FILE, lambda p: _write_json(p, index))
    keep = set(files) | ({INDEX_FILE} if n > 1 else set())
    stale = [
        f
        for f in os.listdir(out)
        if f not in keep and (f in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f))
    ]
    for f in stale:
        os.remove(os.path.join(out, f))
    return files


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def checkpoint_files(path: str) -> list[str]:
    """Paths of the safetensors files of checkpoint directory `path`, in a fixed order.

    The shards named by `model.safetensors.index.json` (sorted, each once) when the index exists,
    else `model.safetensors`.

    Raises:
        FileNotFoundError: neither file is in `path`.
        CheckpointError: the index is not UTF-8 JSON, has no `weight_map` object of tensor name ->
            file name, or names a shard that is not in `path`.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except UnicodeDecodeError:
            raise CheckpointError(f"{index}: not UTF-8 text; re-save or re-download the checkpoint") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(
                f"{index}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                "re-save or re-download the checkpoint"
            ) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index}: no 'weight_map' object of tensor name -> shard file name; "
                f"re-save the checkpoint, or delete the index if the weights are one {SINGLE_FILE}"
            )
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"{index}: names shard files that do not exist: {', '.join(missing)}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every tensor of `files`, file by file, keys sorted.

    Each floating-point tensor is checked with `torch.isfinite(t).all()` as it is read: one pass
    over its elements and a temporary bool tensor of its element count (the largest single
    tensor, not the checkpoint, bounds the extra memory), cheap next to reading it from disk.

    Raises:
        CheckpointError: a file that is not a readable safetensors file (truncated, garbage, a
            Git LFS pointer), or a tensor holding NaN / Inf (named).
    """
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in sorted(f.keys()):
                    t = f.get_tensor(key)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad = int((~torch.isfinite(t)).sum())
                        raise CheckpointError(
                            f"{file}: tensor {key!r} holds {bad} non-finite values (NaN / Inf); the checkpoint "
                            "is corrupt or was saved after training diverged: load an earlier one"
                        )
                    yield key, t
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"{file}: not a readable safetensors file ({exc}); it is truncated or corrupt: re-save or "
                "re-download it"
            ) from None


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> M3ForCausalLM:
    """Build an M3ForCausalLM from a checkpoint directory and load its weights.

    Reads config.json (either shape, validated), builds the model on `meta` (no init cost),
    casts to `dtype` (router gate/bias stay >= fp32), materialises it on `device`, then loads
    `model.safetensors` or the shards listed in `model.safetensors.index.json`. Any supported
    naming is accepted (see `load_named_tensors`); vision and MTP tensors are skipped. Returns the
    model in eval mode.

    Raises:
        FileNotFoundError: no config.json, or no weight file in `path`.
        CheckpointError: an unreadable config.json, index or safetensors file, or a tensor with
            NaN / Inf values (the message starts with the file's path).
        ValueError: an invalid config; CheckpointError (a ValueError) naming the directory for
            tensors missing / unexpected / mis-shaped against its config.json (all listed).
    """
    p = os.fspath(path)
    config = M3Config.from_pretrained(p)
    files = checkpoint_files(p)
    with torch.device("meta"):
        model = M3ForCausalLM(config)
    model.cast_for_inference(dtype)
    model.to_empty(device=device)
    try:
        load_named_tensors(model, _iter_safetensors(files))
    except CheckpointError:
        raise
    except ValueError as exc:  # the weights do not fit config.json: say which checkpoint
        raise CheckpointError(f"{p}: the weights do not match its config.json: {exc}") from None
    return model.eval()

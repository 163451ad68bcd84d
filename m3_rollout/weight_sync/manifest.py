"""The weight-sync manifest: which tensors travel, in what order, shape and wire dtype (design.md §3).

Governing idea: both ends describe the model the same way, as the ordered list of
``(released name, shape, dtype)`` in the released checkpoint naming
(``language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`` with GLOBAL expert
ids), the order of ``m3_rollout.model.loading.iter_released_tensors`` on the unsharded model. The
trainer sends its list once (the handshake); every rollout rank compares it with the list it
builds from its own parameters and both sides fail with the list of differences.

Under expert parallelism a rank's ``StackedExperts`` holds only experts ``[a, b)`` (attribute
``expert_range``; design.md §3.5): its manifest still lists all E experts (shapes are per expert,
the same on every rank), but only owned ones resolve to a destination view (row ``e - a`` of
``w13`` / ``w2``; ``w1`` = gate rows ``:I``, ``w3`` = up rows ``I:``). Views are in-place aliases
of parameter storage, so copying into them never changes ``data_ptr``.

The per-update header (``encode_header`` / ``decode_header``) is an int64 tensor
``[MAGIC, version, flags, n, (index, dtype_code, ndim, *shape) * n]`` (flags: bit 0 include_frozen,
bit 1 replace, bit 2 a probe follows, bit 3 withdrawn) listing the manifest entries an update
carries, with the shapes the trainer holds *now*; receivers check it against
the handshake before trusting any bucket (wrong shape / missing tensor are caught here).
A withdrawn header (no entries) is all that travels of an update the trainer refused itself
before packing (a tensor outside the handshake, a non-float dtype): the receivers, already
waiting for the header, end that update at once instead of at their timeout, and the group
stays in step for the next one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from m3_rollout.model.loading import RELEASED_PREFIX, iter_released_tensors
from m3_rollout.model.numerics import compute_dtype

HEADER_MAGIC = 0x4D335753  # "M3WS"

# Wire dtype codes (header and manifest); bytes travel raw, so every dtype is sendable.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float64: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_ROUTER_SUFFIXES = (".block_sparse_moe.gate.weight", ".block_sparse_moe.e_score_correction_bias")
_INDEXER_KEYS = (".index_q_proj.", ".index_k_proj.", ".index_q_norm.", ".index_k_norm.")


class HandshakeError(RuntimeError):
    """The trainer's and a rollout rank's tensor lists differ; the message lists every difference."""


@dataclass(frozen=True)
class TensorSpec:
    """One manifest entry.

    Attributes:
        name: released checkpoint name (with the ``language_model.`` prefix by default).
        shape: tensor shape (per expert for expert weights).
        dtype: wire dtype == the rollout parameter dtype (router weight / bias: >= fp32).
        frozen: left out of updates unless the update asks for frozen tensors too.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    frozen: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def is_router_tensor(name: str) -> bool:
    """Router gate weight or e_score_correction_bias (kept >= fp32 on the wire, spec §2.2/§6)."""
    return name.endswith(_ROUTER_SUFFIXES)


def default_frozen(name: str, freeze_indexer: bool = True, freeze_router_bias: bool = True) -> bool:
    """Frozen by default in training (config ``policy.freeze``): the lightning indexer and the
    router bias get no gradient, so updates may leave them out."""
    return (freeze_indexer and any(k in name for k in _INDEXER_KEYS)) or (
        freeze_router_bias and name.endswith(".e_score_correction_bias")
    )


def wire_dtype(name: str, param_dtype: torch.dtype, generation_dtype: torch.dtype | None) -> torch.dtype:
    """Dtype a tensor travels in: the rollout's generation dtype, router tensors at >= fp32
    (the same rule as ``M3ForCausalLM.cast_for_inference``); None keeps the parameter dtype."""
    if generation_dtype is None:
        return param_dtype
    return compute_dtype(generation_dtype) if is_router_tensor(name) else generation_dtype


def sender_manifest(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    generation_dtype: torch.dtype | None = None,
    frozen: Callable[[str], bool] = default_frozen,
) -> list[TensorSpec]:
    """Trainer-side manifest from (released name, tensor) pairs in ``iter_released_tensors`` order."""
    return [
        TensorSpec(n, tuple(t.shape), wire_dtype(n, t.dtype, generation_dtype), bool(frozen(n)))
        for n, t in named_tensors
    ]


def _expert_range(experts: nn.Module, local_rows: int) -> tuple[int, int]:
    a, b = getattr(experts, "expert_range", (0, local_rows))
    if b - a != local_rows:
        raise ValueError(f"StackedExperts.expert_range={(a, b)} does not match its {local_rows} local rows")
    return int(a), int(b)


def receiver_layout(
    model: nn.Module, num_experts: int | None = None, prefix: str = RELEASED_PREFIX
) -> Iterator[tuple[TensorSpec, torch.Tensor | None]]:
    """Rollout-side (spec, destination view or None) for every released tensor, in manifest order.

    ``model`` is an ``M3ForCausalLM`` whose ``StackedExperts`` may hold a slice ``[a, b)`` of the
    E experts (``expert_range``); E = ``num_experts`` or ``model.config.num_local_experts``.
    Not-owned experts yield view None. ``frozen`` is False here (the sender decides).
    Raises ValueError when an expert slice is inconsistent with E.
    """
    if num_experts is None:
        num_experts = model.config.num_local_experts
    params = dict(model.named_parameters())
    if not any(n.endswith(".experts.w13") for n in params) or num_experts == 0:
        for name, t in iter_released_tensors(model, prefix):
            yield TensorSpec(name, tuple(t.shape), t.dtype), t
        return
    modules = dict(model.named_modules())
    for name, p in params.items():
        if name.endswith(".experts.w2"):
            continue  # emitted together with w13, expert by expert
        if not name.endswith(".experts.w13"):
            yield TensorSpec(prefix + name, tuple(p.shape), p.dtype), p.detach()
            continue
        base = name[: -len(".w13")]
        w13, w2 = p.detach(), params[base + ".w2"].detach()
        a, b = _expert_range(modules[base], w13.shape[0])
        if not 0 <= a <= b <= num_experts:
            raise ValueError(f"{base}: expert_range {(a, b)} outside [0, {num_experts})")
        inter = w2.shape[-1]
        gate_shape, down_shape = (inter, w13.shape[-1]), tuple(w2.shape[1:])
        for e in range(num_experts):
            own = a <= e < b
            r = e - a
            stem = f"{prefix}{base}.{e}"
            yield TensorSpec(stem + ".w1.weight", gate_shape, w13.dtype), w13[r, :inter] if own else None
            yield TensorSpec(stem + ".w2.weight", down_shape, w2.dtype), w2[r] if own else None
            yield TensorSpec(stem + ".w3.weight", gate_shape, w13.dtype), w13[r, inter:] if own else None


def diff_manifests(sent: list[TensorSpec], local: list[TensorSpec], limit: int = 50) -> list[str]:
    """Human-readable differences between the trainer's list and a rank's own list ([] = equal).

    Compares names (as sets and in order), shapes and dtypes; ``frozen`` is the sender's choice
    and not compared. At most ``limit`` lines plus a count of the rest.
    """
    out: list[str] = []
    sent_by = {s.name: s for s in sent}
    local_by = {s.name: s for s in local}
    out += [f"missing on trainer: {s.name} {list(s.shape)} {s.dtype}" for s in local if s.name not in sent_by]
    out += [f"unexpected from trainer: {s.name} {list(s.shape)} {s.dtype}" for s in sent if s.name not in local_by]
    for s in sent:
        mine = local_by.get(s.name)
        if mine is None:
            continue
        if s.shape != mine.shape:
            out.append(f"shape of {s.name}: trainer {list(s.shape)}, rollout {list(mine.shape)}")
        if s.dtype != mine.dtype:
            out.append(f"dtype of {s.name}: trainer {s.dtype}, rollout {mine.dtype}")
    if not out and [s.name for s in sent] != [s.name for s in local]:
        first = next(i for i, (x, y) in enumerate(zip(sent, local)) if x.name != y.name)
        out.append(f"order differs at entry {first}: trainer {sent[first].name}, rollout {local[first].name}")
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more"]
    return out


# ---------------------------------------------------------------------------- wire encodings
def manifest_to_bytes(specs: list[TensorSpec]) -> bytes:
    """JSON encoding of a manifest (handshake payload)."""
    rows = [[s.name, list(s.shape), DTYPE_CODES[s.dtype], int(s.frozen)] for s in specs]
    return json.dumps(rows, separators=(",", ":")).encode()


def manifest_from_bytes(data: bytes) -> list[TensorSpec]:
    """Inverse of ``manifest_to_bytes``."""
    return [TensorSpec(n, tuple(shape), CODE_DTYPES[code], bool(fr)) for n, shape, code, fr in json.loads(data)]


@dataclass(frozen=True)
class UpdateHeader:
    """What one update carries: ``entries`` = (manifest index, shape, dtype) in send order.

    ``replace``: the update re-sends the version the ranks hold (allowed only when asked for:
    versions otherwise only increase). ``probe``: a post-update probe (``probe.py``) follows.
    ``withdrawn``: the trainer refused this update before sending it; nothing follows."""

    version: int
    include_frozen: bool
    entries: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    replace: bool = False
    probe: bool = False
    withdrawn: bool = False


def encode_header(h: UpdateHeader) -> torch.Tensor:
    """int64 [4 + sum(3 + ndim)] tensor (module docstring)."""
    flags = int(h.include_frozen) | int(h.replace) << 1 | int(h.probe) << 2 | int(h.withdrawn) << 3
    vals = [HEADER_MAGIC, int(h.version), flags, len(h.entries)]
    for idx, shape, dtype in h.entries:
        vals += [idx, DTYPE_CODES[dtype], len(shape), *shape]
    return torch.tensor(vals, dtype=torch.int64)


def decode_header(t: torch.Tensor) -> UpdateHeader:
    """Inverse of ``encode_header``. Raises ValueError on a malformed header."""
    v = t.tolist()
    if len(v) < 4 or v[0] != HEADER_MAGIC:
        raise ValueError("weight-sync header: bad magic (sender and receiver out of step?)")
    entries, i = [], 4
    for _ in range(v[3]):
        idx, code, nd = v[i], v[i + 1], v[i + 2]
        if code not in CODE_DTYPES:
            raise ValueError(f"weight-sync header: unknown dtype code {code}")
        entries.append((idx, tuple(v[i + 3 : i + 3 + nd]), CODE_DTYPES[code]))
        i += 3 + nd
    if i != len(v):
        raise ValueError("weight-sync header: length does not match its entries")
    return UpdateHeader(v[1], bool(v[2] & 1), tuple(entries), bool(v[2] & 2), bool(v[2] & 4), bool(v[2] & 8))


def check_header(h: UpdateHeader, manifest: list[TensorSpec]) -> list[str]:
    """Problems of an update header against the handshake manifest ([] = fine).

    Each entry must name a manifest index once, with the handshake shape and dtype; every
    non-frozen tensor (every tensor when ``include_frozen``) must be present.
    """
    out: list[str] = []
    seen: set[int] = set()
    for idx, shape, dtype in h.entries:
        if not 0 <= idx < len(manifest):
            out.append(f"entry index {idx} outside the handshake list of {len(manifest)} tensors")
            continue
        s = manifest[idx]
        if idx in seen:
            out.append(f"{s.name} sent twice")
        seen.add(idx)
        if tuple(shape) != s.shape:
            out.append(f"shape of {s.name}: update {list(shape)}, handshake {list(s.shape)}")
        if dtype != s.dtype:
            out.append(f"dtype of {s.name}: update {dtype}, handshake {s.dtype}")
    for i, s in enumerate(manifest):
        if i not in seen and (h.include_frozen or not s.frozen):
            out.append(f"missing from update: {s.name}")
    return out

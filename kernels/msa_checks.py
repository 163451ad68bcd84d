"""Shared host-side checks and small helpers of the MSA Triton kernels (one place for both ops)."""

from __future__ import annotations

SM90_SMEM_BYTES = 232448  # shared memory one block may use on sm_90 (H100 / H200: 227 KB opt-in)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_pow2_knob(op: str, key: str, value, zero_ok: bool = False) -> None:
    """Raise ValueError naming ``op``'s prefill_config knob ``key`` unless ``value`` is an int power
    of two >= 1 (or 0 with ``zero_ok``: the knob's off value). Such knobs size ``tl.arange`` vectors."""
    if not isinstance(value, int) or value < (0 if zero_ok else 1) or value & (value - 1):
        off = " (0: off)" if zero_ok else ""
        raise ValueError(f"{op}: prefill_config {key}={value!r}; needs a power of two >= 1{off}")


def check_pow2_dim(name: str, value: int, lo: int = 16, hi: int = 256) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a power of two in [lo, hi].

    The kernels tile whole pages / head dims with ``tl.arange`` and ``tl.dot``, which need a power
    of two of at least 16.
    """
    if value < lo or value > hi or value & (value - 1):
        raise ValueError(
            f"MSA Triton kernels: {name}={value} is unsupported; it must be a power of two in "
            f"[{lo}, {hi}] (other sizes run on the PyTorch references of m3_rollout/engine/reference_ops.py)"
        )

"""Refit at memory speed: a copy plan of contiguous runs, executed as one fused pass per dtype pair.

Governing idea: an update moves the same (source, destination) pairs every time (the trainer's
parameters are updated in place, the rollout's are never re-pointed, design.md §3.6), so the
per-tensor work is done ONCE, when the plan is built: pairs are sorted by destination address and
merged into *runs* wherever the destination and the source both continue contiguously (the
experts' ``w1`` / ``w3`` rows of one stacked ``w13`` on both sides merge into one run; two models
of the same structure merge to about one run per parameter storage). Each update then runs:

- CUDA: ``runs_kernel`` (Triton), ONE launch per (source dtype, destination dtype, alignment)
  group over a table of fixed-size chunks ``(src offset, dst offset, length, run)`` built once
  and kept on the device. In the same pass it casts (round to nearest even), stores, and ORs a
  per-run non-finite flag (NaN / +-inf of the value *as stored*, so an fp32 value that overflows
  bf16 counts). Modes: copy + check (non-atomic), check only (atomic: validate before any write),
  copy only (atomic commit after a clean check). Offsets are element offsets from one anchor
  tensor of the group's dtype; when every run starts on 16 bytes they are stored in units of
  16 bytes (``SALIGN`` / ``DALIGN`` elements) so the compiler can prove 16-byte vector loads and
  stores. Chunk starts are multiples of ``CHUNK`` elements, so they keep that alignment.
- CPU (or CUDA without Triton): the same runs through torch (``aminmax`` flags, ``copy_``); the
  runs are few, so the loop is over storages, not tensors.

The tables hold raw addresses, so every launch first compares the runs' ``data_ptr``s with the
ones the tables were built from and rebuilds them when a storage moved (``engine/sleep.py`` frees
and regrows storages in place at a new address; the views follow, the tables would not).

The flags stay on the device; ``bad_runs()`` reads them (the one host sync of an update) and the
caller names the tensors of a flagged run with the slow per-tensor check (``direct.nonfinite``),
which only runs on failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton is a GPU-only accelerator here; without it (or on CPU) the torch path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with the project's torch builds
    triton = None

CHUNK = 16384  # elements per kernel program (8 tiles of 2048)
_TILE = 2048


@dataclass
class Run:
    """``numel`` contiguous elements: ``src`` and ``dst`` are 1-D views over them;
    ``members`` = the pair indices the run covers (in destination order)."""

    src: torch.Tensor
    dst: torch.Tensor
    members: list[int]


def build_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> list[Run]:
    """Merge the pairs ``dsts[i] <- srcs[i]`` (same numel; destinations contiguous) into runs.

    Pairs are sorted by (destination dtype, source dtype, destination address); consecutive pairs
    merge when both destination and source continue exactly where the previous ended (same
    storage). A non-contiguous source stays a run of its own, copied through torch.
    Raises ValueError for a pair whose element counts differ.
    """
    order = sorted(
        range(len(dsts)),
        key=lambda i: (str(dsts[i].dtype), str(srcs[i].dtype), dsts[i].data_ptr()),
    )
    runs: list[Run] = []
    prev = None  # (run, dst end ptr, src end ptr, dst storage ptr, src storage ptr)
    for i in order:
        d, s = dsts[i], srcs[i]
        if d.numel() != s.numel():
            raise ValueError(f"copy plan: pair {i} has {s.numel()} source and {d.numel()} destination elements")
        if d.numel() == 0:
            continue
        d_end = d.data_ptr() + d.numel() * d.element_size()
        contiguous = s.is_contiguous()
        s_end = s.data_ptr() + s.numel() * s.element_size() if contiguous else None
        d_st, s_st = d.untyped_storage().data_ptr(), s.untyped_storage().data_ptr()
        if (
            prev is not None
            and contiguous
            and prev[2] is not None
            and prev[0].dst.dtype == d.dtype
            and prev[0].src.dtype == s.dtype
            and prev[1] == d.data_ptr()
            and prev[2] == s.data_ptr()
            and prev[3] == d_st
            and prev[4] == s_st
        ):
            run = prev[0]
            n = run.dst.numel() + d.numel()
            run.dst = torch.as_strided(run.dst, (n,), (1,), run.dst.storage_offset())
            run.src = torch.as_strided(run.src, (n,), (1,), run.src.storage_offset())
            run.members.append(i)
        else:
            run = Run(s.reshape(-1), d.reshape(-1), [i]) if contiguous else Run(s, d.view(s.shape), [i])
            runs.append(run)
        prev = (run, d_end, s_end, d_st, s_st)
    return runs


if triton is not None:

    @triton.jit
    def runs_kernel(
        src,
        dst,
        table,
        flags,
        SALIGN: tl.constexpr,
        DALIGN: tl.constexpr,
        STORE: tl.constexpr,
        CHECK: tl.constexpr,
        DOWNCAST: tl.constexpr,
        CHUNK: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """One program = one chunk row of ``table`` (int64 [n_chunks, 4]: src offset / SALIGN,
        dst offset / DALIGN, length <= CHUNK, run index); offsets in elements from ``src`` /
        ``dst``. STORE: write the cast values; CHECK: flags[run] |= any non-finite cast value."""
        row = table + tl.program_id(0) * 4
        s0 = tl.load(row) * SALIGN  # the multiplication tells the compiler the 16-byte alignment
        d0 = tl.load(row + 1) * DALIGN
        n = tl.load(row + 2)
        bad = tl.zeros([TILE], dtype=tl.int32)
        for i in tl.static_range(0, CHUNK, TILE):
            offs = i + tl.arange(0, TILE)
            m = offs < n
            x = tl.load(src + s0 + offs, mask=m, other=0.0)
            if DOWNCAST:
                y = x.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
            else:
                y = x.to(dst.dtype.element_ty)
            if STORE:
                tl.store(dst + d0 + offs, y, mask=m)
            if CHECK:
                yf = y.to(tl.float32)
                bad = bad | ((yf != yf) | (yf == float("inf")) | (yf == -float("inf"))).to(tl.int32)
        if CHECK:
            tl.atomic_max(flags + tl.load(row + 3), tl.max(bad, axis=0))


@dataclass
class _Group:
    src_anchor: torch.Tensor
    dst_anchor: torch.Tensor
    table: torch.Tensor  # int64 [n_chunks, 4] on the device
    salign: int  # elements per 16 bytes of the source dtype (1: unaligned group)
    dalign: int
    downcast: bool


def _use_triton(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


class CopyPlan:
    """The fused refit of fixed pairs ``dsts[i] <- srcs[i]`` (cast to the destination dtype).

    Args:
        dsts: destination tensors (contiguous views of rollout parameters or of a stage).
        srcs: sources, same element counts, on the destinations' device (any float dtype).
        kernel: run the Triton kernel (None: on CUDA when triton is there; True on CPU only under
            ``TRITON_INTERPRET=1``, which the tests use).
    The plan keeps references to every tensor (their storage cannot be freed or reused while it
    lives). ``check`` / ``copy`` / ``copy_check`` launch the work without a host sync;
    ``bad_runs`` syncs once and returns the flagged runs. Raises ValueError when the pairs span
    devices.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], kernel: bool | None = None):
        devices = {t.device for t in dsts} | {t.device for t in srcs}
        if len(devices) > 1:
            raise ValueError(f"copy plan: tensors on several devices {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.n_pairs = len(dsts)
        self.runs = build_runs(dsts, srcs)
        self.flags = torch.zeros(max(len(self.runs), 1), dtype=torch.int32, device=self.device)
        self.nbytes = sum(r.dst.numel() * r.dst.element_size() for r in self.runs)
        if kernel and triton is None:
            raise ValueError("copy plan: kernel=True needs triton")
        self.triton = _use_triton(self.device) if kernel is None else bool(kernel)
        self._torch_runs = list(range(len(self.runs)))
        self._groups: list[_Group] = []
        if self.triton:
            self._build_groups()

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for r in self.runs for t in (r.src, r.dst)]

    def _build_groups(self) -> None:
        self._built_at = self._addresses()
        self._groups = []
        by_key: dict[tuple, list[int]] = {}
        torch_runs = []
        for k, r in enumerate(self.runs):
            if not r.src.is_contiguous():
                torch_runs.append(k)
                continue
            aligned = r.src.data_ptr() % 16 == 0 and r.dst.data_ptr() % 16 == 0
            by_key.setdefault((r.src.dtype, r.dst.dtype, aligned), []).append(k)
        self._torch_runs = torch_runs
        for (sdt, ddt, aligned), members in by_key.items():
            s_anchor, d_anchor = self.runs[members[0]].src, self.runs[members[0]].dst
            # every run of an aligned group starts on 16 bytes, so offsets from the anchor are
            # whole multiples of 16 bytes: stored divided, multiplied back in the kernel
            salign = 16 // sdt.itemsize if aligned else 1
            dalign = 16 // ddt.itemsize if aligned else 1
            rows = []
            for k in members:
                r = self.runs[k]
                s_off = (r.src.data_ptr() - s_anchor.data_ptr()) // r.src.element_size()
                d_off = (r.dst.data_ptr() - d_anchor.data_ptr()) // r.dst.element_size()
                n = r.dst.numel()
                starts = torch.arange(0, n, CHUNK, dtype=torch.int64)
                block = torch.stack(
                    [
                        (s_off + starts) // salign,
                        (d_off + starts) // dalign,
                        torch.clamp(n - starts, max=CHUNK),
                        torch.full_like(starts, k),
                    ],
                    dim=1,
                )
                rows.append(block)
            table = torch.cat(rows).to(self.device)
            # explicit round-to-nearest-even where Triton accepts a rounding mode (fp32 -> 16 bit)
            downcast = sdt == torch.float32 and ddt in (torch.bfloat16, torch.float16)
            self._groups.append(_Group(s_anchor, d_anchor, table, salign, dalign, downcast))

    # ------------------------------------------------------------------ execution
    def _launch(self, store: bool, check: bool) -> None:
        # The tables hold raw addresses. A storage that was freed and grown again in place (engine
        # sleep level 2 -> wake_up, engine/sleep.py) has a new one while every view follows it:
        # re-derive the tables then (~0.1 ms of data_ptr reads per update otherwise).
        if self._addresses() != self._built_at:
            self._build_groups()
        for g in self._groups:
            runs_kernel[(g.table.shape[0],)](
                g.src_anchor,
                g.dst_anchor,
                g.table,
                self.flags,
                SALIGN=g.salign,
                DALIGN=g.dalign,
                STORE=store,
                CHECK=check,
                DOWNCAST=g.downcast,
                CHUNK=CHUNK,
                TILE=_TILE,
            )
        for k in self._torch_runs:
            self._torch_run(k, store, check)

    def _torch_run(self, k: int, store: bool, check: bool) -> None:
        r = self.runs[k]
        if check:
            vals = r.src if r.src.dtype == r.dst.dtype else r.src.to(r.dst.dtype)
            lo, hi = torch.aminmax(vals)
            bad = ~(torch.isfinite(lo.float()) & torch.isfinite(hi.float()))
            self.flags[k : k + 1].copy_(torch.maximum(self.flags[k : k + 1], bad.to(torch.int32).reshape(1)))
        if store:
            r.dst.copy_(r.src)

    @torch.no_grad()
    def check(self) -> None:
        """Flag every run holding a value that is non-finite in the destination dtype (no write)."""
        self.flags.zero_()
        if self.triton:
            self._launch(store=False, check=True)
        else:
            for k in range(len(self.runs)):
                self._torch_run(k, store=False, check=True)

    @torch.no_grad()
    def copy(self) -> None:
        """Copy every run (cast to the destination dtype); flags untouched."""
        if self.triton:
            self._launch(store=True, check=False)
        else:
            for r in self.runs:
                r.dst.copy_(r.src)

    @torch.no_grad()
    def copy_check(self) -> None:
        """Copy and flag in one pass (the non-atomic refit: bytes land before the verdict)."""
        self.flags.zero_()
        if self.triton:
            self._launch(store=True, check=True)
        else:
            for k in range(len(self.runs)):
                self._torch_run(k, store=True, check=True)

    def bad_runs(self) -> list[int]:
        """Indices of the runs flagged by the last ``check`` / ``copy_check`` (one host sync)."""
        if not self.runs:
            return []
        return self.flags.nonzero().flatten().tolist()

    def bad_members(self) -> list[int]:
        """Pair indices of the flagged runs (every member of each; refine with ``direct.nonfinite``)."""
        return sorted(i for k in self.bad_runs() for i in self.runs[k].members)

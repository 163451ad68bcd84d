"""Refit at memory speed: a copy plan of contiguous runs, executed as one fused pass per dtype pair.

Governing idea: an update moves the same (source, destination) pairs every time (the trainer's
parameters are updated in place, the rollout's are never re-pointed, design.md §3.6), so ALL the
per-tensor work is done once, when the plan is built: pairs are sorted by destination address and
merged into *runs* wherever the destination and the source both continue contiguously (the
experts' ``w1`` / ``w3`` rows of one stacked ``w13`` on both sides merge into one run; two models
of the same structure merge to about one run per parameter storage), and the runs are cut into a
device table of fixed-size chunks. An update then costs O(dtype groups) kernel launches and no
Python work per tensor or per run:

- CUDA: ``runs_kernel`` (Triton), ONE launch per (source dtype, destination dtype, alignment)
  group over its table of chunks ``(src offset, dst offset, length, run)``. In the same pass it
  casts (round to nearest even), stores, and ORs a per-run non-finite flag (NaN / +-inf of the
  value *as stored*, so an fp32 value that overflows bf16 counts); a flagged chunk also sets the
  last flag, ``any``, so the verdict is one 4-byte read. Modes: copy + check, check only (validate
  before any write), copy only. Offsets are element offsets from one anchor tensor of the group's
  dtype; when every run starts on 16 bytes they are stored in units of 16 bytes (``SALIGN`` /
  ``DALIGN`` elements) so the compiler can prove 16-byte vector loads and stores, and a full chunk
  takes an unmasked path (a mask on a loaded length would split every access into scalar ones).
  The kernel variant (chunk size, warps, tiles, persistent grid, cache hint) is a ``KernelConfig``
  (``KERNELS``; ``scripts/bench_weight_sync.py --sweep-kernel`` times them on a GPU).
- CPU (or CUDA without Triton, or float64 narrowed to 16 bits, which Triton rounds twice): the
  same runs through torch (``aminmax`` flags, ``copy_``); the runs are few, so the loop is over
  storages, not tensors.

The tables hold raw addresses, fixed when the plan is built. A storage that is freed and grown
again *in place* (``engine/sleep.py``: level-2 sleep, then ``wake_up``) gets a new address while
every view follows it; whoever moves storages must call ``relocate()`` before the next launch
(the receiver does, when the engine's ``weight_storage_generation`` changed). Nothing is re-read
per update: walking every run's ``data_ptr`` cost more host time than the launches.

The flags stay on the device; ``any_bad()`` reads the ``any`` flag (the one host sync of an
update) and only when it is set does ``bad_runs()`` look further; the caller names the tensors of
a flagged run with the slow per-tensor check (``direct.nonfinite``), which only runs on failure.
A caller that runs many plans per update (the bucket pipeline: one plan per bucket) binds each
plan's flags to a slice of one buffer it zeroes once (``bind_flags``, ``launch``) and reads once;
built with ``merge=False`` (one run per pair) those flags name the pairs themselves, so a failure
is named from that one read, without the per-tensor check.

Launch cost: the bucket pipeline launches a plan per bucket, so the host time of a launch counts.
After a group's first launch through Triton's ``JITFunction`` (argument binding, specialization,
cache lookup: tens of microseconds of Python), the compiled kernel and the group's fixed arguments
are kept and later launches call the compiled kernel's launcher directly (``_FastLaunch``), as
Triton's own ``run`` ends up doing (without its launch-hook calls); while a Triton launch hook is
set (a profiler) every launch takes the full path.

Pairs across devices (``reads_across``: an EP worker on its own GPU reading the trainer's IPC
stage on another) never enter a plan: ``PeerCopy`` keeps their runs and copies them with torch at
every update (a peer copy), so no table holds another GPU's address and no source is snapshotted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .direct import nonfinite

try:  # Triton is a GPU-only accelerator here; without it (or on CPU) the torch path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with the project's torch builds
    triton = None


@dataclass(frozen=True)
class KernelConfig:
    """One variant of ``runs_kernel``.

    Attributes:
        block: elements per chunk (one table row, one program unless ``persistent``).
        num_warps: warps per program.
        tile: elements loaded per step inside a chunk (0 = ``block``: the whole chunk is loaded
            before anything is stored, the most bytes in flight per thread).
        fast: full chunks take an unmasked path (vector loads / stores); False masks every access.
        persistent: 0 = one program per chunk; k > 0 = k programs per SM looping over the chunks.
        evict_first: hint loads and stores to leave L2 first (the bytes are touched once).
    """

    block: int = 8192
    num_warps: int = 8
    tile: int = 0
    fast: bool = True
    persistent: int = 0
    evict_first: bool = False

    @property
    def tile_elems(self) -> int:
        return self.tile or self.block


# The variants ``--sweep-kernel`` times; "masked16k" is the kernel of 2026-12-02 (0.2x a flat copy).
KERNELS: dict[str, KernelConfig] = {
    "masked16k": KernelConfig(block=16384, num_warps=4, tile=2048, fast=False),
    "t2k16k-w4": KernelConfig(block=16384, num_warps=4, tile=2048),
    "b2k-w4": KernelConfig(block=2048, num_warps=4),
    "b4k-w4": KernelConfig(block=4096, num_warps=4),
    "b8k-w8": KernelConfig(block=8192, num_warps=8),
    "b16k-w8": KernelConfig(block=16384, num_warps=8),
    "b8k-w8-ef": KernelConfig(block=8192, num_warps=8, evict_first=True),
    "b8k-w8-p4": KernelConfig(block=8192, num_warps=8, persistent=4),
}
# Chosen by the sweep on an H200 (2026-12-02, docs/benchmarks.md "Copy-plan kernel sweep"): b2k-w4 was
# the fastest copy (0.97x a flat copy of the same 8 GB) and cast (1.01x); every vectorised variant
# was within 10 % of it, the old masked kernel at 0.30x.
DEFAULT_KERNEL = "b2k-w4"


@dataclass
class Run:
    """``numel`` contiguous elements: ``src`` and ``dst`` are 1-D views over them;
    ``members`` = the pair indices the run covers (in destination order)."""

    src: torch.Tensor
    dst: torch.Tensor
    members: list[int]


def build_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor], merge: bool = True) -> list[Run]:
    """Merge the pairs ``dsts[i] <- srcs[i]`` (same numel; destinations contiguous) into runs.

    Pairs are sorted by (destination dtype, source dtype, destination address); consecutive pairs
    merge when both destination and source continue exactly where the previous ended (same
    storage). A non-contiguous source stays a run of its own, copied through torch. ``merge=False``:
    every non-empty pair is a run of its own (a run's flag then names exactly one pair).
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
            merge
            and prev is not None
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


def keeps_finite(src: torch.dtype, dst: torch.dtype) -> bool:
    """A finite ``src`` value stays finite cast to ``dst`` (same dtype, or widening to fp32 / fp64)."""
    return src == dst or (dst in (torch.float32, torch.float64) and src.itemsize <= dst.itemsize)


if triton is not None:

    @triton.jit
    def _tile(
        src,
        dst,
        s0,
        d0,
        offs,
        n,
        STORE: tl.constexpr,
        CHECK: tl.constexpr,
        DOWNCAST: tl.constexpr,
        MASKED: tl.constexpr,
        EVICT: tl.constexpr,
    ):
        """Move ``src[s0 + offs]`` -> ``dst[d0 + offs]`` (masked to ``offs < n`` when MASKED);
        returns int32 scalar, 1 when a stored value is non-finite (CHECK), else 0."""
        if MASKED:
            m = offs < n
            x = tl.load(src + s0 + offs, mask=m, other=0.0, eviction_policy=EVICT)
        else:
            x = tl.load(src + s0 + offs, eviction_policy=EVICT)
        if DOWNCAST:
            y = x.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            y = x.to(dst.dtype.element_ty)
        if STORE:
            if MASKED:
                tl.store(dst + d0 + offs, y, mask=m, eviction_policy=EVICT)
            else:
                tl.store(dst + d0 + offs, y, eviction_policy=EVICT)
        bad = tl.full([], 0, tl.int32)
        if CHECK:
            yf = y.to(tl.float32)
            bad = tl.max(((yf != yf) | (yf == float("inf")) | (yf == -float("inf"))).to(tl.int32), axis=0)
        return bad

    @triton.jit
    def _chunk(
        src,
        dst,
        table,
        flags,
        c,
        n_runs,
        SALIGN: tl.constexpr,
        DALIGN: tl.constexpr,
        STORE: tl.constexpr,
        CHECK: tl.constexpr,
        DOWNCAST: tl.constexpr,
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
        MTILE: tl.constexpr,
        VEC: tl.constexpr,
        FAST: tl.constexpr,
        EVICT: tl.constexpr,
    ):
        """Chunk ``c`` of the table, then its flags. FAST: a full chunk unmasked; a short one (a
        run's tail) masked on its length rounded down to VEC elements (16 bytes: the mask stays
        constant over each vector, so the accesses stay vectors), then its last < VEC elements.
        Not FAST: every access masked on the length (scalar accesses: the kernel before tuning)."""
        row = table + c * 4
        s0 = tl.load(row) * SALIGN  # the multiplication tells the compiler the 16-byte alignment
        d0 = tl.load(row + 1) * DALIGN
        n = tl.load(row + 2)
        bad = tl.full([], 0, tl.int32)
        if FAST:
            if n == BLOCK:
                for i in tl.static_range(0, BLOCK, TILE):
                    full = i + tl.arange(0, TILE)
                    bad = bad | _tile(src, dst, s0, d0, full, n, STORE, CHECK, DOWNCAST, False, EVICT)
            else:
                nv = n // VEC * VEC
                for i in tl.static_range(0, BLOCK, MTILE):
                    vecs = i + tl.arange(0, MTILE)
                    bad = bad | _tile(src, dst, s0, d0, vecs, nv, STORE, CHECK, DOWNCAST, True, EVICT)
                rest = nv + tl.arange(0, VEC)
                bad = bad | _tile(src, dst, s0, d0, rest, n, STORE, CHECK, DOWNCAST, True, EVICT)
        else:
            for i in tl.static_range(0, BLOCK, TILE):
                offs = i + tl.arange(0, TILE)
                bad = bad | _tile(src, dst, s0, d0, offs, n, STORE, CHECK, DOWNCAST, True, EVICT)
        if CHECK:
            if bad > 0:  # atomics only where something is wrong (not one per chunk)
                tl.atomic_max(flags + tl.load(row + 3), bad)
                tl.atomic_max(flags + n_runs, bad)

    @triton.jit(do_not_specialize=["n_chunks", "n_runs", "n_programs"])
    def runs_kernel(
        src,
        dst,
        table,
        flags,
        n_chunks,
        n_runs,
        n_programs,
        SALIGN: tl.constexpr,
        DALIGN: tl.constexpr,
        STORE: tl.constexpr,
        CHECK: tl.constexpr,
        DOWNCAST: tl.constexpr,
        BLOCK: tl.constexpr,
        TILE: tl.constexpr,
        MTILE: tl.constexpr,
        VEC: tl.constexpr,
        FAST: tl.constexpr,
        PERSISTENT: tl.constexpr,
        EVICT: tl.constexpr,
    ):
        """``table``: int64 [n_chunks, 4] rows (src offset / SALIGN, dst offset / DALIGN, length
        <= BLOCK, run index), offsets in elements from ``src`` / ``dst``. STORE: write the cast
        values; CHECK: flags[run] and flags[n_runs] (= any) |= some cast value is non-finite.
        One program per chunk, or (PERSISTENT) ``n_programs`` programs striding over the chunks."""
        if PERSISTENT:
            c = tl.program_id(0)
            while c < n_chunks:
                _chunk(
                    src,
                    dst,
                    table,
                    flags,
                    c,
                    n_runs,
                    SALIGN,
                    DALIGN,
                    STORE,
                    CHECK,
                    DOWNCAST,
                    BLOCK,
                    TILE,
                    MTILE,
                    VEC,
                    FAST,
                    EVICT,
                )
                c += n_programs
        else:
            _chunk(
                src,
                dst,
                table,
                flags,
                tl.program_id(0),
                n_runs,
                SALIGN,
                DALIGN,
                STORE,
                CHECK,
                DOWNCAST,
                BLOCK,
                TILE,
                MTILE,
                VEC,
                FAST,
                EVICT,
            )


@dataclass
class _Group:
    src_anchor: torch.Tensor
    dst_anchor: torch.Tensor
    table: torch.Tensor  # int64 [n_chunks, 4] on the device
    salign: int  # elements per 16 bytes of the source dtype (1: unaligned group)
    dalign: int
    downcast: bool
    grid: int  # programs per launch
    fast: dict = field(default_factory=dict)  # (store, check) -> _FastLaunch, or None: the full path


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None) if triton is not None else None


def _fast_launch_device(device: torch.device) -> bool:
    """Whether launches on ``device`` may call the compiled kernel directly (a GPU; the
    interpreter's function has no compiled kernel)."""
    return device.type == "cuda"


def _raw_stream(index: int) -> int:
    """The current stream of device ``index`` as Triton's driver reads it (a raw handle)."""
    return torch._C._cuda_getCurrentRawStream(index)


class _FastLaunch:
    """A group's compiled kernel for one (store, check) mode with its fixed arguments: a launch is
    one call of the compiled kernel's launcher (no argument binding, specialization or cache
    lookup). Built from what ``JITFunction.run`` returned after a full launch; ``make`` returns
    None when that object does not look like Triton's ``CompiledKernel`` (another Triton, a stub)
    or when a launch hook is set."""

    def __init__(self, kernel, grid: int, args: tuple, device_index: int):
        self.kernel, self.grid, self.args, self.device_index = kernel, grid, args, device_index

    @staticmethod
    def make(kernel, grid: int, args: tuple, device: torch.device):
        if triton is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return None
        if kernel.function is None or not _FastLaunch.hooks_idle():
            return None
        return _FastLaunch(kernel, grid, args, device.index or 0)

    @staticmethod
    def hooks_idle() -> bool:
        """No Triton launch hook is set (a profiler's): the launcher may be called without them.
        Triton 3.6 keeps them as (empty) ``HookChain`` objects, older ones as None."""
        r = _RUNTIME
        if r is None:
            return False
        enter, leave = r.launch_enter_hook, r.launch_exit_hook
        return (enter is None or not getattr(enter, "calls", True)) and (
            leave is None or not getattr(leave, "calls", True)
        )

    def __call__(self) -> None:
        k = self.kernel
        # what JITFunction.run passes: grid, stream, function, packed metadata, launch metadata and
        # the two hooks (None: none set), then every kernel parameter in order
        k.run(
            self.grid, 1, 1, _raw_stream(self.device_index), k.function, k.packed_metadata, None, None, None, *self.args
        )


def _use_triton(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def _kernel_runs(r: Run) -> bool:
    """The kernel moves this run (else torch: a non-contiguous source, or fp64 narrowed to 16 bits)."""
    narrow64 = r.src.dtype == torch.float64 and r.dst.dtype.itemsize < 4
    return r.src.is_contiguous() and not narrow64


class CopyPlan:
    """The fused refit of fixed pairs ``dsts[i] <- srcs[i]`` (cast to the destination dtype).

    Args:
        dsts: destination tensors (contiguous views of rollout parameters or of a stage).
        srcs: sources, same element counts, on the destinations' device (any float dtype).
        kernel: run the Triton kernel (None: on CUDA when triton is there; True on CPU only under
            ``TRITON_INTERPRET=1``, which the tests use).
        config: the kernel variant, a ``KERNELS`` name or a ``KernelConfig`` (None: ``DEFAULT_KERNEL``).
        merge: merge adjacent pairs into runs (``build_runs``); False: one run (and one flag) per
            pair, so the flags name the pairs without a second look (the bucket pipeline's verdict).
    The plan keeps references to every tensor (their storage cannot be freed or reused while it
    lives). ``check`` / ``copy`` / ``copy_check`` launch the work without a host sync (``launch``:
    the same without zeroing the flags first); ``any_bad`` syncs once; ``relocate`` after a storage
    moved; ``bind_flags`` points the flags at a caller's buffer. ``same_dtype`` / ``keeps_finite``: every pair
    copies without a cast / without a cast that can overflow. Raises ValueError when the pairs
    span devices or for an unknown variant name.
    """

    def __init__(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        kernel: bool | None = None,
        config: str | KernelConfig | None = None,
        merge: bool = True,
    ):
        devices = {t.device for t in dsts} | {t.device for t in srcs}
        if len(devices) > 1:
            raise ValueError(f"copy plan: tensors on several devices {sorted(map(str, devices))}")
        name = DEFAULT_KERNEL if config is None else config
        if isinstance(name, str) and name not in KERNELS:
            raise ValueError(f"copy plan: unknown kernel variant {name!r}; one of {sorted(KERNELS)}")
        self.config = KERNELS[name] if isinstance(name, str) else name
        self.device = devices.pop() if devices else torch.device("cpu")
        self.n_pairs = len(dsts)
        self.runs = build_runs(dsts, srcs, merge)
        self.flags = torch.zeros(len(self.runs) + 1, dtype=torch.int32, device=self.device)  # [-1] = any
        self.nbytes = sum(r.dst.numel() * r.dst.element_size() for r in self.runs)
        self.keeps_finite = all(keeps_finite(r.src.dtype, r.dst.dtype) for r in self.runs)
        if kernel and triton is None:
            raise ValueError("copy plan: kernel=True needs triton")
        self.triton = _use_triton(self.device) if kernel is None else bool(kernel)
        self._torch_runs = list(range(len(self.runs)))
        self._groups: list[_Group] = []
        if self.triton:
            self.relocate()

    def relocate(self) -> None:
        """Re-derive the kernel tables from the tensors' current addresses (call after a storage
        of the plan was freed and grown again in place: engine sleep level 2 + ``wake_up``)."""
        if not self.triton:
            return
        cfg = self.config
        self._groups = []
        by_key: dict[tuple, list[int]] = {}
        torch_runs = []
        for k, r in enumerate(self.runs):
            if not _kernel_runs(r):
                torch_runs.append(k)
                continue
            aligned = r.src.data_ptr() % 16 == 0 and r.dst.data_ptr() % 16 == 0
            by_key.setdefault((r.src.dtype, r.dst.dtype, aligned), []).append(k)
        self._torch_runs = torch_runs
        programs = 0
        if cfg.persistent and self.device.type == "cuda":
            programs = torch.cuda.get_device_properties(self.device).multi_processor_count * cfg.persistent
        elif cfg.persistent:
            programs = 4 * cfg.persistent  # the interpreter: a few programs, each looping
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
                starts = torch.arange(0, n, cfg.block, dtype=torch.int64)
                block = torch.stack(
                    [
                        (s_off + starts) // salign,
                        (d_off + starts) // dalign,
                        torch.clamp(n - starts, max=cfg.block),
                        torch.full_like(starts, k),
                    ],
                    dim=1,
                )
                rows.append(block)
            table = torch.cat(rows).to(self.device)
            # explicit round-to-nearest-even where Triton accepts a rounding mode (fp32 -> 16 bit)
            downcast = sdt == torch.float32 and ddt in (torch.bfloat16, torch.float16)
            n_chunks = table.shape[0]
            grid = min(n_chunks, programs) if programs else n_chunks
            self._groups.append(_Group(s_anchor, d_anchor, table, salign, dalign, downcast, grid))

    def bind_flags(self, flags: torch.Tensor) -> None:
        """Write the flags into ``flags`` (int32 [len(runs) + 1] on the plan's device, e.g. a slice
        of one buffer shared by many plans) from now on. Raises ValueError for another size,
        dtype or device."""
        if flags.shape != self.flags.shape or flags.dtype != torch.int32 or flags.device != self.device:
            raise ValueError(
                f"copy plan: flags must be int32 {list(self.flags.shape)} on {self.device}, "
                f"not {flags.dtype} {list(flags.shape)} on {flags.device}"
            )
        self.flags = flags
        for g in self._groups:
            g.fast.clear()  # the fixed launch arguments hold the flags tensor

    # ------------------------------------------------------------------ execution
    def _launch(self, store: bool, check: bool) -> None:
        for g in self._groups:
            fast = g.fast.get((store, check), False)
            if fast and _FastLaunch.hooks_idle():
                fast()
                continue
            cfg = self.config
            args = (
                g.src_anchor,
                g.dst_anchor,
                g.table,
                self.flags,
                g.table.shape[0],
                len(self.runs),
                g.grid,
            )
            constexprs = dict(
                SALIGN=g.salign,
                DALIGN=g.dalign,
                STORE=store,
                CHECK=check,
                DOWNCAST=g.downcast,
                BLOCK=cfg.block,
                TILE=cfg.tile_elems,
                MTILE=min(cfg.tile_elems, cfg.num_warps * 32 * 8),
                VEC=min(g.salign, g.dalign),
                FAST=cfg.fast,
                PERSISTENT=cfg.persistent > 0,
                EVICT="evict_first" if cfg.evict_first else "",
            )
            kernel = runs_kernel[(g.grid,)](*args, **constexprs, num_warps=cfg.num_warps)
            if fast is False and _fast_launch_device(self.device):  # first launch of this mode: keep the kernel
                every = args + tuple(constexprs.values())  # the kernel's parameters in order
                g.fast[(store, check)] = _FastLaunch.make(kernel, g.grid, every, self.device)
        if self._torch_runs:
            with torch.no_grad():
                for k in self._torch_runs:
                    self._torch_run(k, store, check)

    def _torch_run(self, k: int, store: bool, check: bool) -> None:
        r = self.runs[k]
        if store:
            r.dst.copy_(r.src)
        if check:  # the values as stored: the destination once written, else the cast source
            vals = r.dst if store else r.src if r.src.dtype == r.dst.dtype else r.src.to(r.dst.dtype)
            lo, hi = torch.aminmax(vals)
            bad = (~(torch.isfinite(lo.float()) & torch.isfinite(hi.float()))).to(torch.int32).reshape(1)
            self.flags[k : k + 1].copy_(torch.maximum(self.flags[k : k + 1], bad))
            self.flags[-1:].copy_(torch.maximum(self.flags[-1:], bad))

    def check(self) -> None:
        """Flag every run holding a value that is non-finite in the destination dtype (no write)."""
        self.flags.zero_()
        self.launch(store=False, check=True)

    def copy(self) -> None:
        """Copy every run (cast to the destination dtype); flags untouched."""
        self.launch(store=True, check=False)

    def copy_check(self) -> None:
        """Copy and flag in one pass (bytes land before the verdict: a stage, a cast copy)."""
        self.flags.zero_()
        self.launch(store=True, check=True)

    def launch(self, store: bool, check: bool) -> None:
        """Issue the pass on the current stream: ``store`` the cast values, ``check`` OR the flags
        of runs holding a non-finite stored value into ``flags`` (not zeroed first: the caller
        zeroed them, e.g. one buffer for many plans). No host sync."""
        if self.triton:
            self._launch(store, check)
            return
        with torch.no_grad():
            if check:
                for k in range(len(self.runs)):
                    self._torch_run(k, store, check)
            else:
                for r in self.runs:
                    r.dst.copy_(r.src)

    def any_bad(self) -> bool:
        """Whether the last ``check`` / ``copy_check`` flagged anything (one host sync, 4 bytes)."""
        return bool(self.flags[-1].item())

    def bad_runs(self) -> list[int]:
        """Indices of the runs flagged by the last ``check`` / ``copy_check`` (one host sync when
        none is; a second, and a ``nonzero``, only on failure)."""
        if not self.runs or not self.any_bad():
            return []
        return self.flags[:-1].nonzero().flatten().tolist()

    def bad_members(self) -> list[int]:
        """Pair indices of the flagged runs (every member of each; refine with ``direct.nonfinite``)."""
        return sorted(i for k in self.bad_runs() for i in self.runs[k].members)


def reads_across(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the pair ``dst <- src`` crosses devices (an EP worker on cuda:1 reading the trainer's
    IPC stage on cuda:0): such a pair goes to a ``PeerCopy``, never into a ``CopyPlan``. A function
    of its own so the CPU tests can send pairs of one device down the cross-device path."""
    return src.device != dst.device


class PeerCopy:
    """Fixed pairs ``dsts[i] <- srcs[i]`` whose source lies on another device than its destination,
    copied by torch at every call, so every update reads the source's CURRENT bytes.

    Governing idea: a source on another GPU (the trainer's stage, opened by CUDA IPC, read by an EP
    worker on its own GPU) must neither be snapshotted into the cached plan (a copy made once would
    be served again at every later update) nor be handed to the fused kernel (its tables hold raw
    addresses of one device; ``CopyPlan`` refuses pairs that span devices). So the plan keeps only
    the runs (adjacent pairs merged as ``build_runs`` does, once) and ``copy()`` issues one
    ``Tensor.copy_`` per run: a peer copy between GPUs (cast to the destination dtype), which torch
    orders after the current streams of both devices and before later work on the destination's
    stream; no host sync. The caller waits for both devices before the source may be rewritten.

    ``nonfinite()`` is the check pass for these pairs where no producer flagged them (the per-tensor
    check ``direct.nonfinite`` per source device; one host sync per device). The IPC refit does not
    need it: its fill pass sends the flagged positions. Raises ValueError for a pair whose element
    counts differ.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        self.dsts, self.srcs = list(dsts), list(srcs)
        self.n_pairs = len(self.dsts)
        self.runs = build_runs(self.dsts, self.srcs)
        self.nbytes = sum(r.dst.numel() * r.dst.element_size() for r in self.runs)

    @torch.no_grad()
    def copy(self) -> None:
        """Copy every run from the sources as they are now (cast to the destination dtype)."""
        for r in self.runs:
            r.dst.copy_(r.src)

    def nonfinite(self) -> list[int]:
        """Pair indices whose source, cast to its destination dtype, holds a NaN / +-inf."""
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self.srcs):
            by_device.setdefault(s.device, []).append(i)
        bad = []
        for members in by_device.values():
            hits = nonfinite([self.srcs[i] for i in members], [self.dsts[i].dtype for i in members])
            bad += [members[j] for j in hits]
        return sorted(bad)

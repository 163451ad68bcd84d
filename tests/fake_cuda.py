"""Run the bucket pipeline's CUDA branches on a CPU: fake streams and events, the copy plan on its
kernel path (Triton's interpreter under TRITON_INTERPRET=1, or a stub that counts launches) or on
its torch path; and count the host synchronizations an update would make on a GPU (``HostSyncs``).

``fake_pipeline(monkeypatch, kernel=...)`` makes ``weight_sync.ring.pipelined`` true for every
device, so the rings get a side stream, the loopback channel a transfer stream, every step its
events and stream switches, exactly as on a GPU, and the copy plans launch ``runs_kernel``. The
fakes order nothing (the host runs every step in program order, which is a valid schedule of
what the events allow) and count what they are asked: ``FakeCuda.calls`` (stream / event /
switch operations) and ``FakeCuda.launches``. Tensors stay on the CPU.

``HostSyncs`` simulates the device / host split those CPU tensors stand for, so a test can count
what would synchronize a GPU's host (see its docstring).
"""

from __future__ import annotations

import collections
import itertools
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from m3_rollout.weight_sync import copy_plan, receiver, ring, sender, unpack


class FakeCuda:
    """What the fakes were asked, by operation name."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.launches = 0


class _Stream:
    _ids = itertools.count(1)

    def __init__(self, owner: FakeCuda, device=None, priority: int = 0, stream_id: int | None = None):
        self.owner = owner
        self.stream_id = next(self._ids) if stream_id is None else stream_id
        self.device_index, self.device_type = 0, 1

    def wait_event(self, event) -> None:
        self.owner.calls["wait_event"] += 1

    def wait_stream(self, stream) -> None:
        self.owner.calls["wait_stream"] += 1

    def synchronize(self) -> None:
        self.owner.calls["stream_synchronize"] += 1

    def record_event(self, event=None):
        self.owner.calls["record"] += 1
        return event if event is not None else _Event(self.owner)


class _Event:
    def __init__(self, owner: FakeCuda, *args, **kwargs):
        self.owner = owner
        owner.calls["event_created"] += 1

    def record(self, stream=None) -> None:
        self.owner.calls["record"] += 1

    def wait(self, stream=None) -> None:
        self.owner.calls["wait_event"] += 1

    def synchronize(self) -> None:
        self.owner.calls["event_synchronize"] += 1


class _Kernel:
    """Stands in for ``runs_kernel``: counts launches, moves nothing."""

    def __init__(self, owner: FakeCuda):
        self.owner = owner

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.owner.launches += 1

        return launch


def fake_pipeline(monkeypatch, kernel: str = "interpreter") -> FakeCuda:
    """Patch the pipeline onto its CUDA branches with fake streams and events (module docstring).

    ``kernel``: "interpreter" runs the copy plans' Triton kernel (TRITON_INTERPRET=1 must be set:
    fp32 / fp16 only), "stub" counts launches without moving bytes (host-cost profiles), "torch"
    leaves the copy plans on their torch path (what CUDA without Triton runs; any float dtype, and
    every byte moves through aten ops, which ``HostSyncs`` can follow)."""
    fake = FakeCuda()
    current = _Stream(fake, stream_id=0)
    state = {"stream": (0, 0, 1)}

    def set_stream(stream_id, device_index, device_type):
        fake.calls["switch"] += 1
        state["stream"] = (stream_id, device_index, device_type)

    for module in (ring, sender, unpack):
        monkeypatch.setattr(module, "pipelined", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream(fake))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(fake))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: state["stream"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", set_stream, raising=False)
    if kernel == "torch":
        return fake
    monkeypatch.setattr(copy_plan, "_use_triton", lambda device: True)
    if kernel == "stub":
        monkeypatch.setattr(copy_plan, "runs_kernel", _Kernel(fake))
    elif kernel != "interpreter":
        raise ValueError(f"fake_pipeline: kernel={kernel!r}")
    return fake


_aten = torch.ops.aten


class HostSyncs(TorchDispatchMode):
    """Counts the host synchronizations a GPU would make, on CPU tensors standing for device memory.

    Memory model: every tensor is device memory except host memory, which is
    - the receiver's stage (``WeightReceiver._stage_for``: pinned host memory on a GPU),
    - what ``unpack.read_verdict`` returns (the update's sanctioned read, counted as one sync),
    - the result of an aten op whose tensor inputs are all host memory (followed through every op
      while the mode is active; a view shares its base's storage, so its kind).
    A synchronization (what ``torch.cuda.set_sync_debug_mode`` reports, and a little more):
    ``item`` / ``bool`` / ``int`` / ``float`` / indexing by a device tensor (``_local_scalar_dense``),
    ``nonzero`` of a device tensor (its size is read on the host), a blocking ``copy_`` between
    device and host memory (either way), ``tolist`` / ``numpy`` / ``cpu`` / ``.to("cpu")`` of a
    device tensor, a ``read_verdict``, and the fake streams' / events' ``synchronize``
    (``fake``'s counters). Reads of host memory count nothing.

    Use: ``syncs = HostSyncs(monkeypatch, fake)``, then ``with syncs: ...`` per update (the count
    and ``sites`` restart at each entry); ``syncs.count``, ``syncs.sites`` (what synchronized and
    the innermost project frames that asked). The patches of the tensor methods stay inert
    outside the block.
    """

    def __init__(self, monkeypatch, fake: FakeCuda | None = None):
        super().__init__()
        self.fake = fake
        self.sites: list[str] = []
        self._host: dict[int, torch.UntypedStorage] = {}  # data_ptr -> storage (held: no address reuse)
        self._on = False
        self._fake_base = 0
        real_read, real_stage = unpack.read_verdict, receiver.WeightReceiver._stage_for

        def read_verdict(t):
            self._sync("read_verdict")
            with self._paused():
                out = real_read(t).clone()
            return self.host(out)

        def stage_for(rx, nbytes):
            return self.host(real_stage(rx, nbytes))

        monkeypatch.setattr(unpack, "read_verdict", read_verdict)
        monkeypatch.setattr(receiver.WeightReceiver, "_stage_for", stage_for)
        for name in ("tolist", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, self._reading(name, getattr(torch.Tensor, name)))
        real_to = torch.Tensor.to

        def to(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if self._on and isinstance(target, str) and target.startswith("cpu") and not self.is_host(t):
                self._sync(".to('cpu')")
                with self._paused():
                    return self.host(real_to(t, *args, **kwargs).clone())
            return real_to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)

    # ---------------------------------------------------------------- memory kinds
    def host(self, t: torch.Tensor) -> torch.Tensor:
        """Mark ``t``'s storage as host memory; returns ``t``."""
        st = t.untyped_storage()
        self._host[st.data_ptr()] = st
        return t

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._host or t.numel() == 0

    # ---------------------------------------------------------------- counting
    @property
    def count(self) -> int:
        fake = 0
        if self.fake is not None:
            fake = self.fake.calls["stream_synchronize"] + self.fake.calls["event_synchronize"] - self._fake_base
        return len(self.sites) + fake

    def _sync(self, what: str) -> None:
        if not self._on:
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "m3_rollout" in f.filename][-3:]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
        self.sites.append(f"{what} at {where or '(test code)'}")

    def _paused(self):
        mode = self

        class _Paused:
            def __enter__(self):
                self.was, mode._on = mode._on, False

            def __exit__(self, *exc):
                mode._on = self.was

        return _Paused()

    def _reading(self, name: str, real):
        def method(t, *args, **kwargs):
            if self._on and not self.is_host(t):
                self._sync(f"Tensor.{name}")
                if name == "cpu":
                    with self._paused():
                        return self.host(real(t, *args, **kwargs).clone())
            return real(t, *args, **kwargs)

        return method

    def __enter__(self):
        self.sites = []
        self._fake_base = 0
        if self.fake is not None:
            self._fake_base = self.fake.calls["stream_synchronize"] + self.fake.calls["event_synchronize"]
        self._on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._on:
            return func(*args, **kwargs)
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_device = [t for t in tensors if not self.is_host(t)]
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if blocking and self.is_host(dst) != self.is_host(src):
                self._sync("blocking copy_ " + ("to the host" if self.is_host(dst) else "to the device"))
            return func(*args, **kwargs)
        if on_device and func in (_aten._local_scalar_dense.default, _aten.nonzero.default):
            self._sync(str(func.overloadpacket.__name__))
        out = func(*args, **kwargs)
        if tensors and not on_device:  # computed from host memory only: host memory
            ids = {id(t) for t in tensors}
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and id(o) not in ids:
                    self.host(o)
        return out

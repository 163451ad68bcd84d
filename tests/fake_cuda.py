"""Run the bucket pipeline's CUDA branches on a CPU: fake streams and events, the copy plan on its
kernel path (Triton's interpreter under TRITON_INTERPRET=1, or a stub that counts launches).

``fake_pipeline(monkeypatch, kernel=...)`` makes ``weight_sync.ring.pipelined`` true for every
device, so the rings get a side stream, the loopback channel a transfer stream, every step its
events and stream switches, exactly as on a GPU, and the copy plans launch ``runs_kernel``. The
fakes order nothing (the host runs every step in program order, which is a valid schedule of
what the events allow) and count what they are asked: ``FakeCuda.calls`` (stream / event /
switch operations) and ``FakeCuda.launches``. Tensors stay on the CPU.
"""

from __future__ import annotations

import collections
import itertools

import torch

from m3_rollout.weight_sync import copy_plan, ring, sender, unpack


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
    fp32 / fp16 only), "stub" counts launches without moving bytes (host-cost profiles)."""
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
    monkeypatch.setattr(copy_plan, "_use_triton", lambda device: True)
    if kernel == "stub":
        monkeypatch.setattr(copy_plan, "runs_kernel", _Kernel(fake))
    elif kernel != "interpreter":
        raise ValueError(f"fake_pipeline: kernel={kernel!r}")
    return fake

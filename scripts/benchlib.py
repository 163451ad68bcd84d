"""Shared bits of the benchmark scripts: the machine line every figure in docs/benchmarks.md carries."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine(device: str = "cpu") -> str:
    """"NVIDIA H200" (or "2x NVIDIA H200") on CUDA; the CPU model and core count otherwise."""
    if device == "cuda":
        import torch

        n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        return name if n == 1 else f"{n}x {name}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"

"""Shared bits of the benchmark scripts: the machine line every figure in docs/benchmarks.md carries,
and the random-weight M3 model the engine benchmarks time."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def run_date() -> str:
    """Today's date from the machine's clock, ISO format (the date a benchmark figure was measured)."""
    return datetime.date.today().isoformat()


def machine(device: str = "cpu") -> str:
    """ "NVIDIA H200" (or "2x NVIDIA H200") on CUDA; the CPU model and core count otherwise."""
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


GIB = 2**30
GPU_RESERVE = 3 * GIB  # per GPU, beyond a benchmark's own estimate: CUDA context, NCCL buffers, allocator slack


def gpu_shortfalls(need: list[int], free: list[int]) -> list[str]:
    """ "GPU i: X GiB free, needs ~Y GiB" for each GPU i whose estimate ``need[i]`` (bytes, reserve
    included) exceeds its ``free[i]`` bytes; [] when all fit."""
    return [
        f"GPU {i}: {f / GIB:.1f} GiB free, needs ~{n / GIB:.1f} GiB"
        for i, (n, f) in enumerate(zip(need, free))
        if n > f
    ]


#: The released model's layer shapes in a small slice (layer 0 dense, then MSA + MoE layers).
REAL_SLICE = Path(__file__).resolve().parent.parent / "configs" / "bench" / "m3_slice_real.json"


def bench_config(path: str | Path, **overrides):
    """``M3Config`` from a benchmark config JSON (configs/bench/*.json; either config shape), keys
    starting with "_" (comments) dropped, then ``overrides`` set (e.g. another layer count). Raises
    what ``M3Config.from_dict`` raises on bad keys."""
    import json

    from m3_rollout.model import M3Config

    raw = json.loads(Path(path).read_text())
    return M3Config.from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")}, **overrides})


def random_model(cfg, device: str, dtype):
    """M3ForCausalLM(cfg) with random weights made on ``device`` (normal std 0.02 for matrices, 0.05
    for vectors, seed 0), cast with ``cast_for_inference(dtype)`` and in eval mode."""
    import torch

    from m3_rollout.model import M3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = M3ForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
    return model.cast_for_inference(dtype).eval()


def emit_section(
    title: str, notes: str, rows: list[str], write: bool, device: str = "cuda", path: str | Path = "docs/benchmarks.md"
) -> None:
    """Print a benchmark's markdown section -- "## {title}, {date of the run}, {machine}", the notes,
    the table ``rows`` -- and, when ``write``, append it to ``path`` after a blank line."""
    text = f"## {title}, {run_date()}, {machine(device)}\n\n{notes}\n\n" + "\n".join(rows) + "\n"
    print(text)
    if write:
        with open(path, "a") as f:
            f.write("\n" + text)

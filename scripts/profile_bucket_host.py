"""Host cost per bucket of the bucketed weight-sync pipeline, measured on a CPU.

    python scripts/profile_bucket_host.py                 # both paths, both atomic modes
    python scripts/profile_bucket_host.py --bucket-kb 4 --repeats 7

The loopback pipeline (``ColocatedChannel(direct=False)``: pack, stand-in transfer, unpack, one
verdict read) runs many small buckets (default 4 KB: the per-byte work is negligible, so the time
is the per-bucket host work), one warm-up update, then ``--repeats`` timed updates:
  host path       the CPU path as is (torch copies, no streams);
  CUDA branches   the GPU code path on the CPU (``tests/fake_cuda.py``): side / transfer streams,
                  slot events and stream switches faked at zero cost, the copy kernel replaced by
                  a stub that launches nothing: what remains is the Python and torch-dispatch work
                  the host does per bucket on a GPU, minus the real cost of the CUDA calls and
                  Triton launches (counted and printed per bucket).
Printed: µs per bucket (median update / buckets; min: the fastest update, for a loaded machine),
torch calls per bucket (TorchFunctionMode), fake CUDA operations and kernel launches per bucket.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # fake_cuda

from m3_rollout.model import M3ForCausalLM, tiny_config  # noqa: E402
from m3_rollout.weight_sync import ColocatedChannel, ReleasedTensors, WeightReceiver, WeightSender  # noqa: E402


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def profile(atomic: bool, bucket_kb: float, repeats: int) -> dict:
    """One receiver, fp32 tiny model, loopback buckets of ``bucket_kb``. Returns {"buckets",
    "us_per_bucket", "torch_calls_per_bucket"}."""
    torch.manual_seed(1)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    torch.manual_seed(0)
    rx = WeightReceiver(M3ForCausalLM(tiny_config()).float().eval(), atomic=atomic, version=0)
    source = ReleasedTensors(trainer)
    sender = WeightSender(lambda: source, ColocatedChannel([rx]), bucket_kb / 1024)
    sender.update(1, include_frozen=True)  # layout, passes, ring, stage
    times = []
    for v in range(2, 2 + repeats):
        t0 = time.perf_counter()
        sender.update(v, include_frozen=True)
        times.append(time.perf_counter() - t0)
    n = sender.stats["buckets"]
    with _Calls() as calls:
        sender.update(2 + repeats, include_frozen=True)
    return {
        "buckets": n,
        "us_per_bucket": statistics.median(times) / n * 1e6,
        "us_per_bucket_min": min(times) / n * 1e6,
        "torch_calls_per_bucket": calls.n / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket-kb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", default="host,cuda", help="host, cuda (the CUDA branches with fakes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for path in args.paths.split(","):
        for atomic in (False, True):
            with _patched(path) as fake:
                r = profile(atomic, args.bucket_kb, args.repeats)
                extra = ""
                if fake is not None:
                    ops = {k: round(v / r["buckets"] / (args.repeats + 2), 2) for k, v in sorted(fake.calls.items())}
                    extra = f"; fake CUDA ops per bucket {ops}, launches per bucket "
                    extra += f"{fake.launches / r['buckets'] / (args.repeats + 2):.2f}"
            print(
                f"{path:5s} atomic={str(atomic).lower():5s}: {r['buckets']} buckets of {args.bucket_kb:g} KB, "
                f"{r['us_per_bucket']:.1f} us per bucket (min {r['us_per_bucket_min']:.1f}), "
                f"{r['torch_calls_per_bucket']:.1f} torch calls per bucket" + extra
            )


class _patched:
    """``fake_pipeline`` for the CUDA branches (stub kernel), nothing for the host path."""

    def __init__(self, path: str):
        self.path = path
        self.mp = None

    def __enter__(self):
        if self.path == "host":
            return None
        import pytest
        from fake_cuda import fake_pipeline

        self.mp = pytest.MonkeyPatch()
        return fake_pipeline(self.mp, kernel="stub")

    def __exit__(self, *exc):
        if self.mp is not None:
            self.mp.undo()


if __name__ == "__main__":
    main()

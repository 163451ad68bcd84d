"""Time GRPO steps on GPUs: a job's per-step split (the GPU main job or --config), or one real-shape step.

    python scripts/bench_grpo_step.py [--seeds 42 43] [--steps N] [key=value ...]
    python scripts/bench_grpo_step.py --real-shapes [--layers 3] [--experts 24]
    python scripts/bench_grpo_step.py --device cpu --tiny [--real-shapes] --doc /tmp/bench.md   (CPU test)
    python scripts/bench_grpo_step.py --config configs/grpo_h200_x2.yaml --seeds 42 --steps 40 --doc OUT.md

Main job (default): runs ``python -m m3_rollout.grpo --config configs/grpo_h200.yaml`` once per seed
in a subprocess and reads its ``metrics.jsonl``: per-step wall time split into generation, logprob
recomputation, training, refit and sleep/wake (whichever of those timing keys the step metrics
carry; a missing one is reported as "-"), generated tokens/s and the run's learning curve (held-out
accuracy at every validation). Step 1 (CUDA graph capture, kernel compilation) is left out of the
medians. ``--tiny`` runs the same config with the random tiny checkpoint and a few prompts (CPU test).
``--config`` runs another job config the same way (e.g. configs/grpo_h200_x2.yaml: the trainer on
one GPU, EP=2 rollout workers on two others); ``--device`` overrides its ``cluster.device`` (default:
the config's own).

``--real-shapes``: one process builds a random-weight M3 at the released model's layer shapes
(hidden 6144, 64 query / 4 KV heads of 128, experts of width 3072 top-4, MSA block 128 / top-16)
with ``--layers`` layers (layer 0 dense, the others sparse attention + MoE) of ``--experts`` experts
and a 32768-token vocabulary, and trains it the way the GPU main job does: the fp32 model goes into
the job's trainer, ``m3_trainers.step.build_policy`` on ``configs/grpo_h200.yaml`` (``Policy``:
fp32 masters + AdamW, forward and backward in a bf16 compute copy refreshed by one fused cast after
every optimizer step, ``weight_sync.cast_copy.CastCopy``), the job's loss
(``build_loss_fn(cfg.loss_fn)``) and the job's receiver settings (``cfg.weight_sync``). A step:
generation in the in-process engine (bf16), sleep (level 1), logprob recomputation
(``Policy.get_logprobs``), training (``Policy.train_step`` on a ``TrainBatch`` of the generated
ids: loss mask over the generated tokens, rollout logprobs = the engine's sampled-token logprobs,
advantages drawn once from a fixed seed), wake-up, refit from ``Policy.named_released_tensors()``
(the job's call): the refit sends the attested bf16 compute copy and the receiver validates from the
cast's flags instead of re-reading the bytes (its verdict, "attested" / "checked", is reported). It
times one step after one warm-up step, the refit against a raw flat device copy of the same bytes
(the update's wire bytes) in the same run, and peak memory per phase
(``torch.cuda.max_memory_allocated``).

Memory (why 24 experts by default): the trainer holds 16 + 4 B/param (fp32 master, fp32 gradient,
two AdamW moments; bf16 compute copy and its bf16 gradients), plus, at the optimizer step, one
4 B/param temporary of the default (foreach) AdamW while the bf16 gradients are already freed.
3 layers x 24 experts are 3.79 B parameters: 75.8 GB of trainer state (what 3 x 32 experts took at
16 B/param before the compute copy) + 7.6 GB of rollout weights + the KV cache, so the training
peak stays near the 112-121 GB measured at 3 x 32 experts with the earlier autocast trainer. At
3 x 32 experts (4.70 B parameters: 93.9 GB of trainer state) the estimate is that peak + 18.8 GB,
131-140 GB of the H200's ~150 GB (139.8 GiB), too little room for allocator fragmentation to count
on (``--experts 32`` to try). The full 128 experts do not fit even in one layer (7.4 B parameters x
22 B, trainer 20 + rollout 2: 163 GB).

Figures go to ``docs/benchmarks.md`` (or ``--doc``) with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/grpo_h200.yaml"

#: (label, metric-key pattern) of the step phases, matched against the keys of a step's row
#: (NeMo RL's ``timing/train/`` names, docs/metrics.md).
PHASES = (
    ("generation", r"timing/train/generation"),
    ("logprob recomputation", r"timing/train/policy_and_reference_logprobs"),
    ("training", r"timing/train/policy_training"),
    ("refit", r"timing/train/prepare_for_generation/transfer_and_update_weights"),
    ("sleep", r"timing/train/finish_generation"),
    ("wake", r"timing/train/prepare_for_generation/wake_up"),
)
STEP = "timing/train/total_step_time"

#: Overrides of ``--tiny``: the random tiny checkpoint, a few prompts, CPU-sized engine.
TINY_OVERRIDES = (
    "policy.model_name=builtin:tiny-random",
    "policy.precision=float32",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_period=1",
    "grpo.num_val_prompts=4",
    "policy.train_global_batch_size=4",
    "policy.train_micro_batch_size=4",
    "policy.generation.max_new_tokens=16",
    "policy.generation.max_num_seqs=8",
    "policy.generation.kv_cache_memory_gb=0",
    "policy.generation.enable_cuda_graphs=false",
    "env.num_tool_workers=1",
)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def step_split(rows: list[dict], skip_first: bool = True) -> dict:
    """Median seconds of each phase over the train rows of one run's ``metrics.jsonl``.

    Args:
        rows: the ``metrics.jsonl`` records with ``timing/train/total_step_time`` (one per GRPO step).
        skip_first: leave step 1 out (start-up work) when there are later steps.

    Returns:
        {"phases": {label: median seconds or None when no key matched}, "keys": {label: matched
        keys}, "step": median step seconds, "other": median of step - sum of the phases,
        "tokens_per_s": median generated tokens/s, "steps": number of steps used}.
    """
    used = rows[1:] if skip_first and len(rows) > 1 else rows
    out: dict = {"phases": {}, "keys": {}, "steps": len(used)}
    others = [r[STEP] for r in used]
    for label, pattern in PHASES:
        keys = sorted({k for r in used for k in r if re.fullmatch(pattern, k)})
        out["keys"][label] = keys
        if not keys:
            out["phases"][label] = None
            continue
        per_step = [sum(float(r.get(k, 0.0)) for k in keys) for r in used]
        out["phases"][label] = statistics.median(per_step)
        others = [o - p for o, p in zip(others, per_step)]
    out["step"] = statistics.median(r[STEP] for r in used)
    out["other"] = statistics.median(others)
    out["tokens_per_s"] = statistics.median(r.get("performance/generation_tokens_per_s", 0.0) for r in used)
    return out


def run_main_job(
    seed: int, device: str | None, steps: int | None, tiny: bool, overrides: list[str], config: str = CONFIG
) -> dict:
    """One GRPO run of ``config`` in a subprocess (``cluster.device`` overridden unless ``device`` is
    None); returns its summary, metrics rows and wall time."""
    log_dir = Path(tempfile.mkdtemp(prefix="m3bench-grpo-"))
    cmd = [
        sys.executable,
        "-m",
        "m3_rollout.grpo",
        "--config",
        config,
        f"grpo.seed={seed}",
        *([f"cluster.device={device}"] if device is not None else []),
        f"logger.log_dir={log_dir}",
        "logger.wandb.mode=disabled",
        "logger.progress_bar=false",
        "checkpointing.enabled=false",
        *(TINY_OVERRIDES if tiny else ()),
        *([f"grpo.max_num_steps={steps}"] if steps is not None else []),
        *overrides,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "seed": seed,
        "summary": json.loads((log_dir / "summary.json").read_text()),
        "train": [r for r in rows if STEP in r],
        "val": [(r["step"], r["validation/accuracy"]) for r in rows if "validation/accuracy" in r],
        "wall_s": wall,
    }


def main_job_section(
    runs: list[dict], device: str | None, tiny: bool, overrides: list[str], config: str = CONFIG
) -> list[str]:
    """Markdown lines of the main-job figures (one split row and one learning curve per seed)."""
    what = "tiny CPU check (builtin:tiny-random)" if tiny else "builtin:m3-gpu-small"
    where = machine("cpu" if device == "cpu" else "cuda")
    given = [f"cluster.device={device}"] if device is not None else []
    lines = [
        f"\n## GRPO step split, GPU main job (bench_grpo_step.py), {datetime.date.today()}, {where}\n",
        f"`python -m m3_rollout.grpo --config {config}` ({what}); overrides: {' '.join(given + overrides) or 'none'}. "
        "Medians over the steps after step 1, seconds; '-' = the step metrics have no such timing key.\n",
        "| seed | steps | step | " + " | ".join(label for label, _ in PHASES) + " | other | generated tok/s |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    for r in runs:
        s = step_split(r["train"])
        cells = " | ".join(fmt(s["phases"][label]) for label, _ in PHASES)
        lines.append(
            f"| {r['seed']} | {s['steps']} | {fmt(s['step'])} | {cells} | {fmt(s['other'])} | "
            f"{fmt(s['tokens_per_s'], ',.0f')} |"
        )
    lines += [
        "",
        "| seed | checkpoint build (s) | GRPO loop (s) | wall (s) | learning curve (step: held-out accuracy) |",
    ]
    lines.append("|---|---|---|---|---|")
    for r in runs:
        sm = r["summary"]
        build = fmt(sm.get("build_seconds"), ".0f") if sm.get("built_now") else "cached"
        curve = ", ".join(f"{step}: {acc:.3f}" for step, acc in r["val"])
        lines.append(f"| {r['seed']} | {build} | {fmt(sm.get('grpo_seconds'), '.1f')} | {r['wall_s']:.0f} | {curve} |")
    keys = step_split(runs[0]["train"])["keys"]
    lines.append(
        "\nTiming keys read: "
        + "; ".join(f"{label}: {', '.join(k) if k else '-'}" for label, k in keys.items())
        + ". Other = step time outside those phases (batching, advantages, logging, validation)."
    )
    return lines


# ---- real shapes ---------------------------------------------------------------------------------

BUILD = "build (Policy: fp32 masters + bf16 copy; rollout bf16)"
REAL_SHAPES = "hidden 6144, 64 q / 4 KV heads x 128, experts 3072 wide top-4, MSA block 128 / top-16"


def real_shapes_config(layers: int, experts: int, tiny: bool):
    """M3Config at the released layer shapes (or a CPU-sized one with ``tiny``): layer 0 dense,
    layers 1.. MSA sparse attention + MoE."""
    from m3_rollout.model import tiny_config

    flags = [0] + [1] * (layers - 1)
    if tiny:
        return tiny_config(
            num_hidden_layers=layers,
            num_local_experts=experts,
            moe_layer_freq=flags,
            sparse_attention_freq=flags,
            sparse_disable_index_value=flags,
            vocab_size=256,
            max_position_embeddings=256,
        )
    return tiny_config(
        vocab_size=32768,
        hidden_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        partial_rotary_factor=0.5,
        max_position_embeddings=8192,
        intermediate_size=3072,
        shared_intermediate_size=3072,
        dense_intermediate_size=12288,
        num_local_experts=experts,
        num_experts_per_tok=4,
        moe_layer_freq=flags,
        sparse_index_dim=128,
        sparse_num_index_heads=4,
        sparse_topk_blocks=16,
        sparse_block_size=128,
        sparse_local_block=1,
        sparse_attention_freq=flags,
        sparse_disable_index_value=flags,
    )


class PhaseClock:
    """Wall time (device-synchronised) and peak device memory of named phases."""

    def __init__(self, device):
        import torch

        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float | None] = {}

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def run(self, name: str, fn):
        """``fn()`` timed as phase ``name``; returns its result."""
        self.sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        self.seconds[name] = time.perf_counter() - t0
        self.peak_gb[name] = self.torch.cuda.max_memory_allocated(self.device) / 1e9 if self.cuda else None
        return out


def real_shapes(args) -> list[str]:
    """One timed GRPO-shaped step at real layer shapes through the GPU main job's trainer and refit
    (module docstring); returns the markdown lines.

    Raises:
        ValueError: the refit was rejected (from ``NativeBackend.update_weights``).
    """
    import torch

    from m3_rollout.config import load_config
    from m3_rollout.engine.interface import GenerationRequest, SamplingParams
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.model import M3ForCausalLM
    from m3_rollout.model.loading import iter_released_tensors
    from m3_rollout.service.factory import attach_local_weight_sync
    from m3_trainers.batch import TrainBatch
    from m3_trainers.step import build_loss_fn, build_policy, total_optimizer_steps

    job = load_config(CONFIG, [f"cluster.device={args.device}"])  # the GPU main job's trainer settings
    device = torch.device(args.device)
    temperature = job.policy.generation.temperature
    cfg = real_shapes_config(args.layers, args.experts, args.tiny)
    b, p_len, g_len = (2, 24, 8) if args.tiny else (args.batch, args.prompt_len, args.gen_len)
    micro = min(b, 2 if args.tiny else args.micro_batch)
    clock = PhaseClock(device)
    torch.manual_seed(0)

    def build():
        with torch.device(device):
            trainer = M3ForCausalLM(cfg)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.normal_(0, 0.02) if p.ndim >= 2 else p.zero_()
        # the job's Policy: fp32 masters + AdamW, bf16 compute copy (precision bfloat16)
        policy = build_policy(job, trainer, total_optimizer_steps(job, job.grpo.max_num_steps))
        with torch.device(device):
            rollout = M3ForCausalLM(cfg).cast_for_inference(torch.bfloat16).eval()
        return policy, rollout

    policy, rollout = clock.run(BUILD, build)
    loss_fn = build_loss_fn(job.loss_fn)
    n_params = sum(p.numel() for p in policy.model.parameters())
    pages = b * -(-(p_len + g_len) // cfg.sparse_block_size) + 8
    backend = NativeBackend(
        rollout,
        [],
        max_model_len=p_len + g_len,
        max_num_seqs=b,
        num_pages=pages,
        enable_cuda_graphs=device.type == "cuda",
    )
    # the job's receiver (its weight_sync section: atomic, in-flight policy; its freeze policy)
    sync = attach_local_weight_sync(backend, job.weight_sync, job.policy.freeze)
    rollout_bytes = sum(t.numel() * t.element_size() for _, t in iter_released_tensors(backend.model))
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (b, p_len), generator=gen).tolist()
    advantages = torch.randn(b, generator=torch.Generator().manual_seed(2))  # one draw, both steps
    version = 0
    verdicts: dict[str, str] = {}

    def refit(phase: str) -> None:
        nonlocal version
        version += 1
        backend.update_weights(version, policy.named_released_tensors())  # as the job refits
        verdicts[phase] = sync.receiver.last_verdict

    def generate():
        params = SamplingParams(max_new_tokens=g_len, temperature=temperature, seed=version)
        return backend.generate([GenerationRequest(f"r{i}", ids, params) for i, ids in enumerate(prompts)])

    def train_batch(outs) -> TrainBatch:
        """Host batch of the generated rows: loss mask and rollout logprobs on the generated tokens."""
        ids = torch.zeros(b, p_len + g_len, dtype=torch.long)
        mask = torch.zeros(b, p_len + g_len)
        rollout_lp = torch.zeros(b, p_len + g_len)
        for i, o in enumerate(outs):
            n = p_len + len(o.output_ids)
            ids[i, :n] = torch.tensor(o.prompt_ids + o.output_ids)
            mask[i, p_len:n] = 1.0
            rollout_lp[i, p_len:n] = torch.tensor(o.logprobs)
        lengths = torch.tensor([p_len + len(o.output_ids) for o in outs])
        return TrainBatch(ids, mask, rollout_lp, advantages, lengths)

    def sleep_wake(phase: str) -> None:
        # NOTE: engine sleep / wake arrive with the backends' sleep() / wake_up(); absent = "-".
        if hasattr(backend, "sleep"):
            clock.run(phase, backend.sleep if phase == "sleep" else backend.wake_up)

    clock.run("initial refit", lambda: refit("initial refit"))
    for _ in range(2):  # step 1 warms up (CUDA graphs, autotuning, AdamW states); step 2 is reported
        batch = train_batch(clock.run("generation", generate))
        sleep_wake("sleep")
        prev = clock.run("logprob recomputation", lambda: policy.get_logprobs(batch, temperature, micro))
        metrics = clock.run(
            "training",
            lambda: policy.train_step(batch, loss_fn, temperature, micro, prev, prev_on_current_weights=True),
        )
        sleep_wake("wake")
        clock.run("refit", lambda: refit("refit"))
    refit_bytes = sync.sender.stats["bytes"]  # the update's wire bytes (frozen tensors went with the first only)

    # Raw flat copy of the refit's bytes, same device, same run: the ceiling a refit can reach.
    n = refit_bytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst.copy_(src)
    clock.run("raw flat copy", lambda: dst.copy_(src))
    del src, dst
    gbps = {k: refit_bytes / 1e9 / clock.seconds[k] for k in ("refit", "raw flat copy")}

    tokens = b * g_len
    total = f" of {torch.cuda.get_device_properties(device).total_memory / 1e9:.1f} GB" if device.type == "cuda" else ""
    lines = [
        f"\n## GRPO step at real M3 layer shapes (bench_grpo_step.py --real-shapes), {datetime.date.today()}, "
        f"{machine(args.device)}\n",
        f"Random weights; {'tiny CPU shapes' if args.tiny else REAL_SHAPES}; {cfg.num_hidden_layers} layers "
        f"(layer 0 dense, then sparse attention + MoE) x {cfg.num_local_experts} experts, "
        f"vocab {cfg.vocab_size}: {n_params / 1e6:,.1f} M parameters = {n_params * 20 / 1e9:.2f} GB trainer "
        f"(fp32 master + grad + AdamW 16 B/param, bf16 compute copy + its grads 4 B/param) + "
        f"{rollout_bytes / 1e9:.2f} GB rollout weights. The GPU main job's trainer ({CONFIG}: "
        f"build_policy, precision {job.policy.precision}, build_loss_fn, weight_sync atomic="
        f"{str(job.weight_sync.atomic).lower()}); batch {b} x ({p_len} prompt + {g_len} generated) tokens, "
        f"micro-batch {micro}, rollout logprobs from the engine, advantages random (fixed seed). "
        "Second step of two (the first warms up); seconds after a device synchronize; "
        f"peak memory = max_memory_allocated{total}.\n",
        "| phase | seconds | peak memory (GB) |",
        "|---|---|---|",
    ]
    phases = (BUILD, "initial refit", "generation", "sleep", "logprob recomputation", "training", "wake")
    for name in (*phases, "refit", "raw flat copy"):
        lines.append(f"| {name} | {fmt(clock.seconds.get(name), '.4g')} | {fmt(clock.peak_gb.get(name), '.1f')} |")
    lines += [
        "",
        f"Generated tokens/s: {tokens / clock.seconds['generation']:,.0f} ({tokens} tokens). "
        f"Refit {gbps['refit']:.3g} GB/s vs raw flat copy {gbps['raw flat copy']:.3g} GB/s of the same "
        f"{refit_bytes / 1e9:.2f} GB: {gbps['refit'] / gbps['raw flat copy']:.2f}x "
        "(bytes written to the rollout weights per second; the refit sends the attested bf16 compute copy). "
        f"Refit verdict: {verdicts['refit']} (initial refit: {verdicts['initial refit']}).",
        f"Trainer (second step): token_mult_prob_error {metrics['token_mult_prob_error']:.4g}, "
        f"grad_norm {metrics['grad_norm']:.3g}, {metrics['train_tflops_per_s']:.3g} TFLOP/s counted, "
        f"skipped_step {metrics['skipped_step']}.",
    ]
    backend.shutdown()
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    """Command line; returns the markdown lines it wrote (or would write with ``--no-write``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cluster.device (default: the config's; real shapes: cuda)")
    ap.add_argument("--config", default=CONFIG, help=f"main job: the job config (default {CONFIG})")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batches (tests)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43], help="main job: one run per seed")
    ap.add_argument("--steps", type=int, default=None, help="main job: grpo.max_num_steps (default: the config's)")
    ap.add_argument("--real-shapes", action="store_true", help="one step at real M3 layer shapes, random weights")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument(
        "--experts", type=int, default=24, help="real shapes: experts per MoE layer (24: memory, see the description)"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("overrides", nargs="*", help="main job: key=value overrides")
    args = ap.parse_args(argv)
    if args.real_shapes:
        if args.config != CONFIG:
            ap.error(f"--real-shapes uses the trainer settings of {CONFIG}; --config is for the main job")
        args.device = args.device or "cuda"
        lines = real_shapes(args)
    else:
        runs = [run_main_job(s, args.device, args.steps, args.tiny, args.overrides, args.config) for s in args.seeds]
        lines = main_job_section(runs, args.device, args.tiny, args.overrides, args.config)
    print("\n".join(lines))
    if not args.no_write:
        doc = Path(args.doc)
        if not doc.exists():
            doc.write_text("# Benchmarks\n")
        with doc.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    os.chdir(ROOT)
    main()

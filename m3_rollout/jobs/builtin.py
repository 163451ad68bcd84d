"""The embedded checkpoints: M3s built here and warm-started on a calculator task.

``resolve_model("builtin:tiny-calculator")`` returns a checkpoint directory (config.json,
safetensors, tokenizer files, chat template) from the cache, building it on first use. The cache
key is a hash of the builder's full spec (model sizes, tokenizer, template, task, warm-start knobs,
the device it is trained on and a builder version), so changing any of them builds a new
checkpoint instead of reusing a stale one.

Presets: ``tiny-calculator`` (~0.95 M parameters, short template, single-step task; the CPU main
job), ``tiny-random`` (same, random weights; smoke runs) and ``m3-gpu-small`` (~165 M parameters,
MSA block 64 / top-4 blocks, the full M3 chat template with the tool list, the multi-step task of
``multistep.py``; the GPU job ``configs/grpo_h200.yaml``).

Cache root: ``$M3_ROLLOUT_CACHE`` or ``~/.cache/m3_rollout``. Beside each checkpoint directory
``<name>-<key>``: ``<name>-<key>.lock``, held by the process that builds it (``build_lock``: a second
process waits, then uses the build), and while a build runs ``<name>-<key>.partial``, its saved
warm-start progress (``m3_trainers.warm_start_progress``): a build stopped midway (Ctrl-C, killed)
is continued from there by the next one and gives the same checkpoint; a finished build removes it
once the checkpoint is on the disk (its files, and the rename that puts it in place, fsynced), so a
power cut at that moment leaves one of the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from m3_rollout.chat.template import BUILTIN_CHAT_DEFAULTS, ChatFormat, load_template, render, write_chat_defaults
from m3_rollout.chat.tokenizer import save_tokenizer, train_tokenizer
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.jobs.build_lock import WaitInterrupted, build_lock
from m3_rollout.model import M3ForCausalLM, save_checkpoint, tiny_config
from m3_rollout.model.atomic_file import write_dir_atomic
from m3_rollout.model.configuration import CheckpointError, M3Config, read_config_json
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.rollout.data import PromptSource
from m3_rollout.rollout.environments.calculator import ArithmeticTask, CalculatorEnvironment, tool_steps
from m3_rollout.rollout.environments.multistep import MultiStepArithmeticTask
from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
from m3_rollout.weight_sync import LocalWeightSync
from m3_trainers.warm_start import WarmStartConfig, warm_start
from m3_trainers.warm_start_progress import ProgressStore, saved_step

BUILDER_VERSION = 1
BUILTIN_PREFIX = "builtin:"
BUILTIN_NAMES = ("tiny-calculator", "tiny-random", "m3-gpu-small")
#: Task generators a spec names (``TinyCheckpointSpec.task_name``).
TASKS = {"calculator": ArithmeticTask, "multistep": MultiStepArithmeticTask}


def default_device() -> str:
    """The device a build trains on when the caller names none: "cuda" when available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class TinyCheckpointSpec:
    """Everything that determines the built checkpoint (hashed into the cache key).

    Attributes:
        model_overrides: changes to spec §7 preset A (``tiny_config``). Local blocks = 2 (variant
            A2) so the answer turn always sees the tool result in the previous block while the
            indexer stays frozen at its random initialisation.
        tokenizer_vocab_size / tokenizer_corpus: BPE size and number of rendered episodes it is
            trained on.
        task: the task generator's knobs (``TASKS[task_name]`` fields).
        val_seed, num_val: the held-out set (same as GRPO's default ``grpo.seed`` / size).
        warm_start: SFT knobs; ``None`` = random weights (the smoke checkpoint).
        template: packaged chat template ("m3_short" or "m3_full", ``chat.template.load_template``).
        task_name: key of ``TASKS``.
        eval_max_turns / eval_max_total_len / eval_max_new_tokens: the warm start's held-out
            rollouts (model turns incl. tool calls, tokens per trajectory, tokens per turn).
        device: what the warm start trains on ("cpu", "cuda", ...); set by :func:`resolve_model`.
        expected_steps: the progress bar's total, so it shows an ETA: about the highest SFT step a
            build of this spec reaches (measured builds; the build itself stops when the held-out
            accuracy enters its window, wherever that is). An estimate for display only, so not
            part of the cache key.
        save_progress_every: SFT steps between two saves of the warm start's progress (it also
            saves after every evaluation) into the ``.partial`` directory a later build resumes
            from; 0: no saves (the build starts over when stopped). How the build is saved, not
            what it builds, so not part of the cache key.
    """

    model_overrides: dict = field(default_factory=lambda: {"sparse_local_block": 2, "max_position_embeddings": 512})
    tokenizer_vocab_size: int = 1024
    tokenizer_corpus: int = 3000
    task: dict = field(default_factory=lambda: dataclasses.asdict(ArithmeticTask()))
    val_seed: int = 42
    num_val: int = 256
    gen_dtype: str = "bfloat16"
    warm_start: WarmStartConfig | None = field(default_factory=WarmStartConfig)
    init_seed: int = 0
    builder_version: int = BUILDER_VERSION
    template: str = "m3_short"
    task_name: str = "calculator"
    eval_max_turns: int = 2
    eval_max_total_len: int = 192
    eval_max_new_tokens: int = 48
    device: str = "cpu"
    # tiny-calculator on the CPU: its 262-step build evaluated up to step 300 (README).
    expected_steps: int = 300
    # NOTE: 10 for the CPU presets: a save of tiny-calculator (model + AdamW moments, 11 MB, fsynced)
    # takes ~0.06 s on 2 loaded cores against 0.5-1 s for an idle step and 9-31 s for a loaded one,
    # under 1% of the time between saves, while a Ctrl-C loses at most 10 steps (~5 min loaded).
    save_progress_every: int = 10

    def key(self) -> str:
        """16 hex digits of the spec's hash. Fields added after builder version 1 (``LATER_FIELDS``)
        count only when they differ from their default, so checkpoints built before they existed
        keep their key; the warm start's ``max_seconds`` counts as ``KEY_MAX_SECONDS``."""
        spec = dataclasses.asdict(self)
        del spec["expected_steps"]  # the progress bar's estimate, not what is built
        del spec["save_progress_every"]  # how the build is saved, not what it builds
        for f in dataclasses.fields(self):
            if f.name in LATER_FIELDS and spec[f.name] == f.default:
                del spec[f.name]
        if spec.get("warm_start"):  # the time cap is a safety net, not part of what is built (below)
            spec["warm_start"]["max_seconds"] = KEY_MAX_SECONDS
        blob = json.dumps(spec, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def make_task(self) -> ArithmeticTask | MultiStepArithmeticTask:
        """The task generator of ``task_name`` with ``task``'s knobs."""
        return TASKS[self.task_name](**self.task)


LATER_FIELDS = ("template", "task_name", "eval_max_turns", "eval_max_total_len", "eval_max_new_tokens", "device")
# The warm start's wall-clock cap enters the key at its builder-version-1 value whatever it is now:
# the steps trained follow the step schedule alone, so a build the cap does not stop is the same
# under any cap (900 s until 2026-12-03, then 90 min; a capped build is flagged by its report).
KEY_MAX_SECONDS = 900.0


def gpu_small_spec() -> TinyCheckpointSpec:
    """``m3-gpu-small``: a 165 M-parameter M3 (64 M active per token) for one GPU.

    8 layers: layer 0 full attention + dense MLP (2048), layers 1-7 MSA sparse attention + MoE
    (16 experts of 512, top-4, one shared expert of 512); hidden 768, 8 query / 2 KV heads of 128
    (index heads = KV heads, index dim = head dim, RoPE on half the channels), block 64, top-4
    blocks, 1 local block. Rendered with the full M3 template (system block with the thinking
    instructions, developer block with the tool list): prompts are 185-232 tokens, perfect 2- and
    3-call episodes 281-378, so every episode with a second call runs past top-k x block = 256
    tokens and the sparse layers select. Warm start (on the build's device) to held-out accuracy
    in [0.2, 0.4] on the multi-step task: batch 32, lr 2e-3, evaluated every 50 steps, capped at
    300 s.

    Why these knobs (H200, 2026-12-02, docs/benchmarks.md "GRPO on the GPU"): SFT on this task
    learns in a sudden transition, not gradually — the loss sits at 0.43-0.65 and held-out
    accuracy at 0.000 for ~350 steps, then the model learns to copy the operands and carry the
    results and accuracy jumps (0.08 at step 400, 0.67 at step 450). The earlier knobs (batch 64,
    lr 1e-3, a 150 s cap at ~0.5 s per step) stopped at step 125, long before it, which is why GRPO
    had nothing to work with (held-out accuracy 0.000 throughout). Batch 32 halves the step time
    and lr 2e-3 brings the transition forward; on the H200 the build takes ~290 s (the first
    evaluation includes ~25 s of Triton compilation), over the 3-minute goal, and the window search
    backs off to a snapshot at 0.28 held-out accuracy. Tiny CPU models on the same task show the
    same transition at step 300-400 (lr 3e-3, batch 32).
    """
    model = {
        "hidden_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "intermediate_size": 512,
        "shared_intermediate_size": 512,
        "dense_intermediate_size": 2048,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "moe_layer_freq": [0] + [1] * 7,
        "sparse_attention_freq": [0] + [1] * 7,
        "sparse_disable_index_value": [0] + [1] * 7,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 2,
        "sparse_block_size": 64,
        "sparse_topk_blocks": 4,
        "sparse_local_block": 1,
        "max_position_embeddings": 1024,
    }
    ws = WarmStartConfig(
        batch_size=32,
        lr=2e-3,
        warmup_steps=30,
        max_steps=4000,
        max_seconds=300.0,
        eval_every=50,
        target_low=0.2,
        target_high=0.4,
    )
    return TinyCheckpointSpec(
        model_overrides=model,
        task=dataclasses.asdict(MultiStepArithmeticTask()),
        warm_start=ws,
        template="m3_full",
        task_name="multistep",
        eval_max_turns=4,
        eval_max_total_len=512,
        eval_max_new_tokens=48,
        expected_steps=600,  # H200 builds: 427-750 SFT steps
        # NOTE: no saves: its state with the AdamW moments is ~2 GB, a save of it (and of a snapshot
        # at most evaluations) would cost several seconds per 16 s of training in a ~5-min build.
        save_progress_every=0,
    )


def builtin_spec(name: str, device: str = "cpu") -> TinyCheckpointSpec:
    """Spec of a built-in checkpoint name (one of ``BUILTIN_NAMES``) trained on ``device``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "tiny-calculator":
        spec = TinyCheckpointSpec()
    elif name == "tiny-random":
        spec = TinyCheckpointSpec(warm_start=None, tokenizer_corpus=500)
    elif name == "m3-gpu-small":
        spec = gpu_small_spec()
    else:
        raise ValueError(
            f"unknown built-in checkpoint {name!r}; choose one of "
            f"{[BUILTIN_PREFIX + n for n in BUILTIN_NAMES]} or give a checkpoint directory path"
        )
    # NOTE: random weights do not depend on the device (initialised on the CPU), so neither does the key.
    return spec if spec.warm_start is None else dataclasses.replace(spec, device=torch.device(device).type)


def cache_root() -> Path:
    return Path(os.environ.get("M3_ROLLOUT_CACHE", Path.home() / ".cache" / "m3_rollout"))


def check_model_name(model_name: str, device: str | None = None) -> TinyCheckpointSpec | None:
    """The build spec of a ``builtin:`` name (trained on ``device``, default :func:`default_device`),
    or None for a checkpoint directory that exists.

    Raises:
        FileNotFoundError: a path that is not a checkpoint directory (with config.json).
        ValueError: an unknown ``builtin:`` name.
        CheckpointError: a config.json that is not a JSON object (``read_config_json``: named, so
            no later reader, e.g. transformers' tokenizer loader, blames another file), or whose
            values ``M3Config`` refuses (every bad key listed, on one line).
    """
    if model_name.startswith(BUILTIN_PREFIX):
        return builtin_spec(model_name[len(BUILTIN_PREFIX) :], device or default_device())
    path = Path(model_name).expanduser()
    accepted = (
        f"give a checkpoint directory (one holding config.json) or one of "
        f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)}"
    )
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {accepted}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file, not a checkpoint directory; {accepted}")
    if not (path / "config.json").is_file():
        if (path / "policy" / "config.json").is_file():  # a GRPO job's checkpoints/step_N directory
            accepted = f"a GRPO checkpoint's loadable model is its policy/ folder: give {path / 'policy'}"
        raise FileNotFoundError(f"{path}: the directory has no config.json; {accepted}")
    data = read_config_json(path)
    try:
        M3Config.from_dict(data)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as exc:  # the values, checked before transformers reads them
        problems = "; ".join(line.strip() for line in str(exc).splitlines()[1:]) or str(exc)
        raise CheckpointError(
            f"{path / 'config.json'}: invalid M3 config values: {problems} (docs/m3_spec.md §1.2 lists the keys)"
        ) from None
    return None


def resolve_model(model_name: str, progress: bool = True, device: str | None = None) -> tuple[Path, dict]:
    """Checkpoint directory for ``policy.model_name``; a ``builtin:`` checkpoint that is not cached
    yet is built, its warm start on ``device`` (default :func:`default_device`).

    One process builds a checkpoint at a time (``build_lock``): another one that needs the same
    checkpoint meanwhile prints ``waiting for another process building NAME (pid P)...``, waits, and
    then uses the checkpoint the first built (or, if that build stopped, goes on with it from its
    saved progress).

    Returns:
        (directory, info) where info has "built" (bool: built by this call), "build_seconds", "key"
        and the build report when one exists. A build whose warm start ended outside its accuracy
        window prints :func:`warm_start_warning` to stderr here, so every command that uses it
        (grpo, export, serve, dump) says so.

    Raises:
        FileNotFoundError: a path that is not a checkpoint directory (with config.json).
        ValueError: an unknown ``builtin:`` name; a CheckpointError for an unreadable config.json.
        SystemExit(130): Ctrl-C during a build or while waiting for another process's, after a
            one-line message on stderr (no traceback) that says what of the build is kept.
    """
    spec = check_model_name(model_name, device)
    if spec is None:
        return Path(model_name).expanduser(), {"built": False}
    name = model_name[len(BUILTIN_PREFIX) :]
    out = cache_root() / f"{name}-{spec.key()}"
    partial = partial_dir(out)
    info = None
    if not (out / "build_report.json").is_file():
        try:
            with build_lock(out.with_name(out.name + ".lock"), model_name):
                if not (out / "build_report.json").is_file():  # else: built while this process waited
                    report = build_checkpoint(spec, out, progress=progress, partial=partial)
                    info = {"built": True, "key": spec.key(), **report}
        except WaitInterrupted as exc:
            holder = f" (pid {exc.holder})" if exc.holder is not None else ""
            print(
                f"interrupted: stopped waiting (Ctrl-C) for another process building {model_name}{holder}; "
                "this run built nothing of it, and that build goes on",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(130) from None
        except KeyboardInterrupt:
            print(interrupted_line(model_name, partial, spec.key()), file=sys.stderr, flush=True)
            raise SystemExit(130) from None
    if info is None:
        info = {"built": False, "key": spec.key(), **json.loads((out / "build_report.json").read_text())}
    warning = warm_start_warning(out, info)
    if warning:
        print(warning, file=sys.stderr)
    return out, info


def partial_dir(out_dir: Path) -> Path:
    """Where a build of ``out_dir`` keeps its warm-start progress until it is finished."""
    return Path(out_dir).with_name(Path(out_dir).name + ".partial")


def interrupted_line(model_name: str, partial: Path, key: str) -> str:
    """The ``interrupted:`` line of a build stopped by Ctrl-C: what of it is kept, where the next run
    of the same build continues."""
    step = saved_step(partial, {"key": key})
    if step is None:
        return (
            f"interrupted: the build of {model_name} stopped (Ctrl-C) and nothing of it was kept; "
            "rerunning starts the build again from the beginning"
        )
    return (
        f"interrupted: the build of {model_name} stopped (Ctrl-C); its warm start up to SFT step {step} "
        f"(weights, optimizer, data position, evaluations) is kept in {partial}; rerunning continues the "
        f"build from step {step}"
    )


def warm_start_warning(model_dir: Path, info: dict) -> str | None:
    """A warning when a built checkpoint's warm start stopped outside its accuracy window, else None.

    That happens when the build hit its step cap (``max_steps``) or the wall-clock safety cap
    ``max_seconds`` of the preset's warm-start spec (a heavily loaded machine; ``time_capped`` in
    the report): the GRPO run then starts lower (or higher) than the README's figures. The build
    stays cached (a cached directory is never replaced under a job that may be using it), so the
    warning is given on every run that uses it, with how to rebuild. It names the last step
    trained and the step of the snapshot kept (the one closest to the window); fields missing from
    an older report read "?".
    """
    if info.get("in_window", True):
        return None
    spec = (info.get("spec") or {}).get("warm_start") or {}

    def num(key: str, src: dict, fmt: str) -> str:
        v = src.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "?"

    history = info.get("history") or []
    last = history[-1][0] if history else info.get("warm_start_steps", "?")
    if info.get("time_capped"):
        cause = (
            f"the build's wall-clock safety cap ({num('max_seconds', spec, '.0f')} s, part of the builtin "
            f"preset) ended it before its step schedule did: a loaded machine"
        )
        where = " on a less loaded machine"
    else:
        cause, where = "its step cap was reached", ""
    return (
        f"WARNING: the checkpoint's warm start ran {last} steps in {num('build_seconds', info, '.0f')} s "
        f"and kept step {info.get('warm_start_steps', '?')} (held-out accuracy "
        f"{num('heldout_accuracy', info, '.3f')}), outside its window [{spec.get('target_low', '?')}, "
        f"{spec.get('target_high', '?')}] ({cause}); GRPO starts from it, so accuracies (and rewards) "
        f"will differ from the README's; to rebuild, delete {model_dir} and run again{where}."
    )


def corpus_texts(template: str, task: ArithmeticTask, env: CalculatorEnvironment, count: int) -> list[str]:
    """Rendered full episodes (prompt, one call + tool turn per step, answer) for tokenizer training."""
    texts = []
    for rec in task.records(seed=12345, count=count):
        messages, _ = env.reset(rec)
        convo = list(messages)
        for expression, result in tool_steps(rec):
            call = {
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
            }
            convo += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": result}]
        convo.append({"role": "assistant", "content": rec["answer"]})
        texts.append(render(template, convo, tools=env.tool_schemas(), thinking_mode="disabled"))
    return texts


def build_checkpoint(
    spec: TinyCheckpointSpec, out_dir: Path, progress: bool = True, partial: Path | None = None
) -> dict:
    """Build a checkpoint directory for ``spec`` (tokenizer, model, optional warm start).

    Written to a temporary directory and renamed, so an interrupted build never looks complete;
    the directory's files are fsynced before the rename and its parent directory after it.
    The warm start saves its progress into ``partial`` (default :func:`partial_dir` of
    ``out_dir``) after every evaluation and every ``spec.save_progress_every`` SFT steps; a build
    that finds progress there saved for the same cache key and tokenizer goes on from it and
    gives the same checkpoint (bitwise on the CPU) as a build never stopped. The finished build
    removes ``partial``, only after that last fsync. The caller keeps two processes from building
    into the same directories (:func:`resolve_model` holds ``build_lock``).

    Returns:
        the build report (also saved as build_report.json): seconds, parameters, warm-start
        history and final held-out accuracy.
    """
    t0 = time.perf_counter()
    task = spec.make_task()
    env = CalculatorEnvironment()
    template = load_template(spec.template)
    if progress:  # the steps below print nothing for a while on a slow machine
        print(f"building {out_dir.name}: training its tokenizer ...", file=sys.stderr, flush=True)
    tokenizer = train_tokenizer(corpus_texts(template, task, env, spec.tokenizer_corpus), spec.tokenizer_vocab_size)
    tokenizer.chat_template = template
    store, resume = None, None
    if spec.warm_start is not None and spec.save_progress_every > 0:
        # The tokenizer's hash too: progress is only valid for the token ids it was trained on.
        tok_hash = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
        store = ProgressStore(partial or partial_dir(out_dir), {"key": spec.key(), "tokenizer": tok_hash})
        resume = store.load()
        if store.discarded and progress:
            print(f"building {out_dir.name}: {store.discarded}", file=sys.stderr, flush=True)
    chat = ChatFormat(tokenizer, thinking_mode="disabled")
    ids = lambda s: tokenizer.convert_tokens_to_ids(s)  # noqa: E731
    config = tiny_config(
        vocab_size=len(tokenizer),
        bos_token_id=ids("]~!b["),
        eos_token_id=chat.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec.model_overrides,
    )
    config.validate()
    torch.manual_seed(spec.init_seed)
    model = M3ForCausalLM(config).float()
    _init_weights(model)
    report: dict = {"parameters": sum(p.numel() for p in model.parameters())}

    if spec.warm_start is not None:
        device = torch.device(spec.device)
        model.to(device)
        source = PromptSource(task, seed=spec.val_seed, num_val=spec.num_val)
        exclude = {r["messages"][-1]["content"] for r in source.val}
        gen_model = M3ForCausalLM(config).float().to(device)
        gen_model.load_state_dict(model.state_dict())
        gen_model.cast_for_inference(getattr(torch, spec.gen_dtype))
        settings = RolloutSettings(
            n=1,
            max_turns=spec.eval_max_turns,
            max_total_len=spec.eval_max_total_len,
            max_new_tokens=spec.eval_max_new_tokens,
            seed=spec.val_seed,
        )
        # Room for every held-out prompt at full length at once (also on CUDA, where the engine
        # would otherwise take a fraction of the free memory that GRPO needs afterwards).
        pages = spec.num_val * -(-settings.max_total_len // config.sparse_block_size)
        backend = NativeBackend(
            gen_model,
            chat.stop_token_ids,
            max_model_len=settings.max_total_len,
            max_num_seqs=spec.num_val,
            num_pages=pages,
            # On CUDA the held-out rollouts decode through CUDA graphs with a large prefill budget
            # (measured on an H200: 0.5 s per evaluation instead of 2.3 s eager).
            **({"enable_cuda_graphs": True, "max_num_batched_tokens": 16384} if device.type == "cuda" else {}),
        )
        backend.weight_sync = LocalWeightSync(backend.engine)

        def evaluate(m: M3ForCausalLM) -> float:
            backend.update_weights(backend.weight_version + 1, iter_released_tensors(m))
            trajs, _ = run_group_rollouts(backend, chat, env, source.val, settings)
            return sum(t.reward for t in trajs) / len(trajs)

        ws = spec.warm_start
        # The total is an estimate (the build stops when the accuracy enters the window), so the
        # bar shows an ETA; a build that runs past it extends it to its next evaluation. bar.n is
        # set, never updated, so tqdm's rate is steps / elapsed: evaluation time included.
        bar = tqdm(
            total=min(spec.expected_steps, ws.max_steps),
            desc=f"building M3 on {device.type} (SFT warm start to held-out accuracy in "
            f"[{ws.target_low}, {ws.target_high}])",
            disable=not progress,
            unit="step",
            initial=resume.step if resume is not None else 0,  # its rate counts this run's steps only
        )

        def on_progress(step: int, acc: float | None, loss: float | None) -> None:
            if step > bar.total:
                bar.total = min(ws.max_steps, -(-step // ws.eval_every) * ws.eval_every)
            bar.n = step
            post = {
                **({"loss": f"{loss:.3f}"} if loss is not None else {}),
                **({"heldout_acc": f"{acc:.3f}"} if acc is not None else {}),
            }
            bar.set_postfix(post, refresh=False)
            bar.refresh()  # one redraw per step (set_postfix would draw a second: two lines each in a log)
            if acc is not None and progress:  # one line per evaluation: the curve survives in a log file
                what = "untrained model" if loss is None else f"loss {loss:.3f}"
                bar.write(
                    f"warm start: step {step}, {what}, held-out accuracy {acc:.3f}, {bar.format_dict['elapsed']:.0f} s"
                )

        if progress and resume is None:
            bar.write(
                f"warm start: step 0 first evaluates the untrained model on {spec.num_val} held-out prompts "
                f"(minutes on a loaded CPU), then SFT steps, about {bar.total} expected (the bar's total, an "
                "estimate: the build stops when the accuracy enters the window); one line per evaluation"
            )
        elif resume is not None:
            last, acc = resume.history[-1]
            if progress:
                bar.write(
                    f"warm start: resuming at step {resume.step} from the progress an interrupted build saved in "
                    f"{store.dir} (last evaluation: step {last}, held-out accuracy {acc:.3f}); one line per "
                    "evaluation"
                )
            report["resumed_at_step"] = resume.step
        try:
            result = warm_start(
                model,
                chat,
                task,
                env,
                evaluate,
                ws,
                exclude=exclude,
                progress=on_progress,
                resume=resume,
                save=store.save if store else None,
                save_every=spec.save_progress_every,
            )
        finally:
            bar.close()
            env.close()
            del backend, gen_model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        model.cpu()
        report.update(
            warm_start_steps=result.steps,
            heldout_accuracy=result.accuracy,
            in_window=result.in_window,
            time_capped=result.time_capped,
            warm_start_seconds=round(result.seconds, 1),
            step_seconds=round(result.step_seconds, 4),
            eval_seconds=round(result.eval_seconds, 2),
            history=result.history,
        )
    report["build_seconds"] = round(time.perf_counter() - t0, 1)
    report["spec"] = dataclasses.asdict(spec)

    # NOTE: the checkpoint and its rename on the disk (write_dir_atomic) before the progress goes:
    # a power cut between the two must not lose both.
    with write_dir_atomic(out_dir) as tmp:
        save_checkpoint(model, config, tmp)
        save_tokenizer(tokenizer, tmp, template)
        write_chat_defaults(tmp, BUILTIN_CHAT_DEFAULTS)  # the mode its prompts were rendered in
        (tmp / "build_report.json").write_text(json.dumps(report, indent=1))
    if store is not None:
        store.remove()
    return report


def _init_weights(model: M3ForCausalLM, std: float = 0.02) -> None:
    """GPT-style init: N(0, std) matrices, zero Gemma norm weights (scale 1), zero router bias."""
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()

"""The command line behind ``python -m m3_rollout.dump {generate,inspect,show,replay}``.

  generate --config CFG [key=value ...] [--dir DIR] [--steps N]
      roll out N steps with the config's checkpoint, no training, one shard per step
  inspect DIR
      per-step table: reward, accuracy, lengths, truncation, tool calls, mismatch, shard size
  show DIR --step S --group G
      one GRPO group's trajectories laid out by turn (reasoning, text, tool calls, tool results)
  replay DIR --config CFG [key=value ...] [--checkpoint PATH] [--train] [--save DIR]
         [--lr-steps {dumped,replayed}]
      re-score the stored trajectories with the checkpoint (policy.model_name, or --checkpoint)
      and report the mismatch against the stored rollout logprobs; with --train, then run GRPO
      steps on the dumped trajectories without generating, and save the result with --save.
      Each dumped step trains at the run's LR for it: step s at GRPO step s of a schedule over
      grpo.max_num_steps of the config given (the dump stores no config: pass the run's);
      --lr-steps replayed schedules over the replayed steps alone instead

Bad shards (truncated, foreign, other schema version) are reported by file on stderr; the other
shards are still used. Exit status 2 for bad arguments or an unusable directory; 130 for a Ctrl-C
while it loads or works, with one line saying what was left (generate: the steps dumped so far,
each shard whole; replay: --save and --json are written only at the end, whole or not at all).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# NOTE: nothing that takes seconds to load at module level (omegaconf, pyarrow, torch): every
# entry of the dump command (``python -m m3_rollout.dump``, ``python -m m3_rollout.jobs.dump_cli``,
# ``m3-rollout dump``) imports this module first, and a Ctrl-C is handled only from ``main`` on.
from m3_rollout.jobs.interrupt import run_entry


def _load_cfg(args, training: bool = True):
    """The config of ``--config`` and the overrides (``load_config``; ``training`` False for a
    subcommand that trains nothing); exits 2 with ``error: ...`` when it is refused."""
    from m3_rollout.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides, training=training)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _errors(lines: list[str]) -> None:
    for ln in lines:
        print(ln, file=sys.stderr)


def cmd_generate(args) -> int:
    from m3_rollout.jobs.dump_generate import generate_dumps

    cfg = _load_cfg(args, training=False)  # one sample per prompt is fine to dump (no advantage to learn from)
    generate_dumps(cfg, out_dir=args.dir, num_steps=args.steps)
    return 0


def cmd_inspect(args) -> int:
    from m3_rollout.dump.report import inspect_lines, print_lines

    lines, errors = inspect_lines(args.dir)
    print_lines(lines, use_rich=not args.plain)
    _errors(errors)
    return 0


def cmd_show(args) -> int:
    from m3_rollout.dump.report import print_lines, show_lines

    try:
        lines, errors = show_lines(args.dir, args.step, args.group)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_lines(lines, use_rich=not args.plain)
    _errors(errors)
    return 0


def cmd_replay(args) -> int:
    saved: list[Path] = []  # the trained checkpoint once --save wrote it
    try:
        return _replay(args, saved)
    except KeyboardInterrupt:  # main's run_entry prints the line and exits 130
        raise KeyboardInterrupt(interrupted_replay(args, saved)) from None


def interrupted_replay(args, saved: list[Path]) -> str:
    """What a replay stopped by Ctrl-C left behind, as the end of the ``interrupted:`` line. It
    writes only at the end, each output whole or not at all: ``--save``'s checkpoint (a temporary
    directory renamed, removed when stopped) and then ``--json`` (``write_atomic``: a temporary file
    fsynced and renamed)."""
    if saved:
        unwritten = f"; --json {args.json} was not written" if args.json else ""
        return f"the offline-trained checkpoint {saved[0]} is complete{unwritten}"
    outputs = " and ".join(f"--{k} {v}" for k, v in (("save", args.save), ("json", args.json)) if v)
    return "nothing was written" + (f" ({outputs}: written only at the end)" if outputs else "")


def _replay(args, saved: list[Path]) -> int:
    import torch

    from m3_rollout.config import ConfigError
    from m3_rollout.dump.reader import read_dump
    from m3_rollout.dump.replay import rescore
    from m3_rollout.dump.report import format_table, print_lines
    from m3_rollout.jobs.builtin import check_model_name, resolve_model
    from m3_rollout.jobs.replay import make_scorer
    from m3_rollout.model import load_checkpoint
    from m3_rollout.model.atomic_file import write_atomic

    cfg = _load_cfg(args)
    read = read_dump(args.dir, steps=args.steps)
    _errors([f"skipped {e}" for e in read.errors])
    schedule = None
    if args.train:  # a step past the schedule is refused before the (long) re-scoring
        from m3_rollout.jobs.replay import schedule_indices

        schedule = schedule_indices(set(read.table.column("step").to_pylist()), cfg, args.lr_steps)
    name = args.checkpoint or cfg.policy.model_name
    try:  # a path that is no checkpoint or an unknown builtin: name, as `error: ...` (exit 2)
        check_model_name(name)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--checkpoint: {exc}" if args.checkpoint else f"policy.model_name={name!r}: {exc}") from None
    model_dir, _ = resolve_model(name, progress=cfg.logger.progress_bar)
    model = load_checkpoint(model_dir, dtype=getattr(torch, args.dtype))
    longest = max(len(x) for x in read.table.column("token_ids").to_pylist())
    scorer, why = make_scorer(
        model, max(longest, cfg.policy.max_total_sequence_length), cfg.policy.train_micro_batch_size
    )
    print(
        f"re-scoring {read.table.num_rows} trajectories from {len(read.shards)} shard(s) with {model_dir} "
        f"({args.dtype}) via {why}"
    )
    stats, _ = rescore(read, scorer)
    rows = [
        [
            str(s.step),
            str(s.rows),
            str(s.tokens),
            f"{s.mean_abs_diff:.3e}",
            f"{s.max_abs_diff:.3e}",
            f"{s.token_mult_prob_error:.6f}",
        ]
        for s in stats
    ]
    print_lines(
        format_table(["step", "rows", "sampled tok", "mean |dlp|", "max |dlp|", "token_mult_prob_error"], rows),
        use_rich=not args.plain,
    )
    result = {"checkpoint": str(model_dir), "scorer": scorer.name, "rescore": [vars(s) for s in stats]}
    if args.train:
        result["train"] = _train(args, cfg, read, model_dir, schedule[1], saved)
    if args.json:  # a stopped write (or a power cut) leaves no partial JSON
        text = json.dumps(result, indent=1)
        write_atomic(args.json, lambda p: Path(p).write_text(text))
    return 0


def _train(args, cfg, read, model_dir, schedule_steps: int, saved: list[Path]) -> list[dict]:
    """Offline GRPO on ``read`` (``train_offline``) with an LR schedule over ``schedule_steps`` GRPO
    steps (``schedule_indices``); prints one line per step and, on stderr, a warning for steps whose
    LR differs from the one the run logged in the dump (``--lr-steps dumped`` only). A saved
    checkpoint's path is appended to ``saved`` (what a Ctrl-C reports as left behind)."""
    from transformers import AutoTokenizer

    from m3_rollout.jobs.grpo import save_final
    from m3_rollout.jobs.replay import lr_differences, train_offline
    from m3_trainers.step import (
        build_loss_fn,
        build_policy,
        load_trainer_model,
        total_optimizer_steps,
        truncated_sampling_warning,
    )

    # NOTE: the optimizer and LR schedule as the GRPO loop builds them: over grpo.max_num_steps
    # (--lr-steps dumped) or the replayed steps (--lr-steps replayed).
    model = load_trainer_model(cfg, model_dir)
    policy = build_policy(cfg, model, total_optimizer_steps(cfg, schedule_steps))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    warning = truncated_sampling_warning(cfg)
    if warning:
        print(warning, file=sys.stderr)

    def log(step, m):
        print(
            f"[offline] step {step}: {m['rows']} trajectories, reward {m['reward']:.3f}, "
            f"loss {m['loss']:+.4f}, token_mult_prob_error {m['token_mult_prob_error']:.4f}"
        )

    history = train_offline(
        read,
        cfg,
        policy,
        build_loss_fn(cfg.loss_fn),
        pad_id=tokenizer.pad_token_id or 0,
        recompute_advantages=args.recompute_advantages,
        log=log,
        lr_steps=args.lr_steps,
    )
    differ = lr_differences(read, history) if args.lr_steps == "dumped" else []  # "replayed" differs on purpose
    if differ:
        print(
            f"[warn] {len(differ)} replayed step(s) trained at another LR than the run logged (the config's "
            f"grpo.max_num_steps, batch sizes, policy.optimizer.lr or policy.scheduler.* differ from the run's?): "
            + "; ".join(differ[:3]),
            file=sys.stderr,
        )
    if args.save:
        out = save_final(policy, Path(model_dir), Path(args.save), max(h["step"] for h in history))
        saved.append(out)
        print(f"saved offline-trained checkpoint to {out}")
    return history


def build_parser(prog: str = "m3-rollout dump") -> argparse.ArgumentParser:
    """The dump command line's parser; prog: the command ``--help`` names (its subcommands' usage
    lines start with it)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="roll out and dump without training")
    g.add_argument("--config", default="configs/grpo_bf16_ep.yaml")
    g.add_argument("--dir", help="dump directory (default rollout_dump.dir)")
    g.add_argument("--steps", type=int, help="steps to roll out (default grpo.max_num_steps)")
    g.add_argument("overrides", nargs="*", help="key=value config overrides")
    g.set_defaults(fn=cmd_generate)
    i = sub.add_parser("inspect", help="per-step table")
    i.add_argument("dir")
    i.add_argument("--plain", action="store_true", help="plain print instead of rich")
    i.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("show", help="one group's trajectories by turn")
    s.add_argument("dir")
    s.add_argument("--step", type=int, required=True)
    s.add_argument("--group", type=int, required=True)
    s.add_argument("--plain", action="store_true")
    s.set_defaults(fn=cmd_show)
    r = sub.add_parser("replay", help="re-score with a checkpoint; --train for offline GRPO")
    r.add_argument("dir")
    r.add_argument(
        "--config",
        default="configs/grpo_bf16_ep.yaml",
        help="the config the dump was generated with (its policy.model_name is the default checkpoint); "
        "default: configs/grpo_bf16_ep.yaml",
    )
    r.add_argument("--checkpoint", help="checkpoint dir or builtin: name (default policy.model_name)")
    r.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    r.add_argument("--steps", type=int, nargs="*", help="only these steps")
    r.add_argument("--train", action="store_true", help="run GRPO steps on the dump after re-scoring")
    r.add_argument("--recompute-advantages", action="store_true", help="recompute advantages from rewards")
    r.add_argument(
        "--lr-steps",
        choices=["dumped", "replayed"],
        default="dumped",
        help="with --train, the LR schedule: dumped (default) = each step at its own GRPO step number over "
        "grpo.max_num_steps, the run's LRs; replayed = the replayed steps as a run of their own, the schedule "
        "over them alone",
    )
    r.add_argument("--save", help="with --train: directory for the trained checkpoint")
    r.add_argument("--json", help="write the re-scoring (and training) results to this JSON file")
    r.add_argument("--plain", action="store_true")
    r.add_argument("overrides", nargs="*", help="key=value config overrides")
    r.set_defaults(fn=cmd_replay)
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "m3-rollout dump") -> argparse.Namespace:
    """The command line; key=value overrides may also follow the options (`replay DIR --config
    CFG k=v`, as the usage reads: argparse takes the positionals in one run, so later ones come
    back unparsed and are added here). Exits 2 (argparse) for anything else left over. prog: as
    :func:`build_parser`."""
    parser = build_parser(prog)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    return args


def main(argv: list[str] | None = None, prog: str = "m3-rollout dump", what: str | None = None) -> int:
    """Run one dump subcommand; returns the exit status (2 with ``error: ...`` on stderr for a dump
    or config error). prog: the command ``--help`` names (``python -m m3_rollout.dump`` passes its
    own); what: the command a Ctrl-C's line names (default prog).

    Raises:
        SystemExit(130): Ctrl-C while it loads or works, after one ``interrupted:`` line on stderr
            (while it works, the line says what was left behind; ``m3_rollout.jobs.interrupt``).
        SystemExit(2): a bad or missing argument (argparse); SystemExit(0) after ``--help``.
    """
    return run_entry(_load, what or prog)(argv, prog)


def _load():
    """The imports every subcommand needs (omegaconf, pyarrow: seconds on a busy machine), then the
    function that parses the command line and runs the subcommand."""
    from m3_rollout.config import ConfigError
    from m3_rollout.dump.reader import DumpError

    def run(argv: list[str] | None, prog: str) -> int:
        args = parse_args(argv, prog)
        try:
            return args.fn(args)
        except (DumpError, ConfigError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m m3_rollout.jobs.dump_cli", what="the dump command"))

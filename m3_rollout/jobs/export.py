"""``m3-rollout export --model DIR|builtin:NAME --out DIR [--format F] [--dtype D]``: a checkpoint for other tools.

Which class loads which layout (docs/checkpoints.md has the table):

- ``--format released`` (default; what every checkpoint this project writes looks like): the
  released VL names (``language_model.…``, per-expert ``w1/w2/w3``) and a VL-shaped config.json.
  vLLM loads it; in transformers only the VL class ``MiniMaxM3SparseForConditionalGeneration``
  does, and it builds a randomly initialised vision tower beside the language model.
- ``--format transformers-text``: a text-only checkpoint in transformers' own layout
  (``model_type: minimax_m3_vl_text``, fused ``gate_up_proj`` tensors, indexer under
  ``self_attn.indexer``), which ``AutoModelForCausalLM`` loads as ``MiniMaxM3VLForCausalLM`` with
  no missing or unexpected keys and the same logits (spec §2.2b lists where transformers' M3
  differs from the spec; a model using MSA init blocks is refused).

The tokenizer files and chat template of the source are copied next to the weights, so
``AutoTokenizer`` and ``apply_chat_template`` work on the exported directory; so is
``chat_template_kwargs.json`` (the template kwargs the checkpoint's prompts were rendered with,
e.g. ``{"thinking_mode": "disabled"}`` for the builtin models), which ``m3-rollout serve`` applies
by default. transformers does not read that file: the command prints the kwargs to pass to
``apply_chat_template``. Exit status 2 for a bad argument or an unusable checkpoint, naming it; 130
for a Ctrl-C, with one line saying what is left in ``--out`` (a directory the export created or
found empty is removed or emptied again, so no partial export passes for a checkpoint).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from m3_rollout.chat.template import (
    BUILTIN_CHAT_DEFAULTS,
    CHAT_DEFAULTS_FILE,
    read_chat_defaults,
    write_chat_defaults,
)
from m3_rollout.model.loading import LAYOUTS, load_checkpoint, save_checkpoint

#: Files copied from the source checkpoint when present (tokenizer, chat template and its default
#: kwargs, generation defaults).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    CHAT_DEFAULTS_FILE,
    "generation_config.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(
    model_dir: str | Path, out_dir: str | Path, layout: str = "released", dtype: torch.dtype = torch.float32
) -> list[str]:
    """Load the checkpoint in ``model_dir`` and write it to ``out_dir`` in ``layout`` (``LAYOUTS``).

    Weights are cast to ``dtype`` (router gate and bias stay fp32, spec §2.2); files listed in
    ``SIDE_FILES`` are copied as they are. Returns the sorted file names in ``out_dir`` afterwards.

    Raises:
        ValueError: ``out_dir`` is ``model_dir``; an unknown layout; a model that the layout cannot
            represent (``save_checkpoint``); or a checkpoint whose tensors do not match its config.
        FileNotFoundError: no config.json or weight file in ``model_dir``.
        CheckpointError: an unreadable config, index or weight file (named).
    """
    src, out = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the source checkpoint itself; give a new directory")
    if layout not in LAYOUTS:
        raise ValueError(f"format {layout!r}: expected one of {LAYOUTS}")
    model = load_checkpoint(src, dtype=dtype)
    save_checkpoint(model, model.config, out, layout=layout)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return sorted(p.name for p in out.iterdir())


def parse_args(argv: Sequence[str] | None = None, prog: str = "m3-rollout export") -> argparse.Namespace:
    """The export's command line. prog: the command ``--help`` and errors name.

    Raises:
        SystemExit(2): a bad or missing option (argparse); SystemExit(0) after ``--help``.
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.replace("``", "'"),  # the docstring's RST literals as plain quotes on a terminal
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="checkpoint directory or builtin:NAME (built on first use)")
    p.add_argument("--out", required=True, help="directory to write (created; earlier weight files there replaced)")
    p.add_argument("--format", choices=LAYOUTS, default="released", help="tensor and config layout (default released)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (default float32)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "m3-rollout export") -> int:
    """Command line of the export; returns the exit status (0, or 2 with ``error: ...`` on stderr).
    prog: the command ``--help`` names (``python -m m3_rollout.export`` passes its own)."""
    from m3_rollout.jobs.builtin import resolve_model
    from m3_rollout.jobs.outputs import writable_dir

    args = parse_args(argv, prog)
    out = Path(args.out).expanduser()
    before = _entries(out)
    try:
        try:
            model_dir, _ = resolve_model(args.model)
            kwargs = read_chat_defaults(model_dir)  # checked before anything is written (ChatFileError)
            writable_dir(out, "--out")  # a file there, or no permission (ConfigError)
            files = export_checkpoint(model_dir, args.out, args.format, DTYPES[args.dtype])
            if not kwargs and args.model.startswith("builtin:"):  # a build from before the file: serve's default
                kwargs = dict(BUILTIN_CHAT_DEFAULTS)
                write_chat_defaults(args.out, kwargs)
                files = sorted(p.name for p in out.iterdir())
        except KeyboardInterrupt:  # m3_rollout.cli.load_entry prints the line and exits 130
            raise KeyboardInterrupt(interrupted_export(out, before)) from None
    except (FileNotFoundError, ValueError) as exc:  # CheckpointError, ChatFileError, ConfigError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loader = "AutoModelForCausalLM" if args.format == "transformers-text" else "vLLM / the project's load_checkpoint"
    print(f"wrote {args.out} ({args.format}, {args.dtype}; load with {loader}): {', '.join(files)}")
    if kwargs:
        print(
            f"the checkpoint's prompts were rendered with {kwargs} ({CHAT_DEFAULTS_FILE}; m3-rollout serve "
            f"applies it): with transformers, tokenizer.apply_chat_template(messages, add_generation_prompt=True, "
            f"**{kwargs!r}) renders the prompt serve does"
        )
    return 0


def _entries(out: Path) -> dict[str, tuple[int, int]] | None:
    """``out``'s entries as {name: (size, mtime_ns)}; None when ``out`` is not a directory."""
    if not out.is_dir():
        return None
    return {p.name: (st.st_size, st.st_mtime_ns) for p in out.iterdir() for st in [p.lstat()]}


def interrupted_export(out: Path, before: dict[str, tuple[int, int]] | None) -> str:
    """What an export stopped by Ctrl-C left in ``out``, as the end of the ``interrupted:`` line.

    Each file is written whole (tmp + rename) but a stopped export has only some of them, which
    with config.json present could pass for a checkpoint: an ``out`` the export made (``before``
    None) or found empty (``{}``) is removed or emptied again; one that held files is left as it
    is, and the sentence says whether the export changed it (then: do not load it).
    """
    if before is None and not out.is_dir():
        return f"nothing was written to --out {out}"
    if before is None:  # made by the export: removed with whatever of the export is in it
        shutil.rmtree(out)
        return f"nothing of the export was kept (--out {out}, which it created, was removed)"
    if not before:  # empty before: emptied again
        for p in out.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        return f"nothing of the export was kept (--out {out} was emptied again)"
    if _entries(out) == before:
        return f"--out {out} was not changed"
    return (
        f"--out {out} holds a partial export among the files it held before (the weights, config.json and "
        "tokenizer files may not belong together): do not load it; rerun the export to complete it"
    )

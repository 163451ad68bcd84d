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
``apply_chat_template``.

``--out`` is new, empty, or an earlier export (it holds only files an export writes; anything else
is refused, since the export replaces the directory whole). The export is written into a new
directory beside ``--out`` and renamed into its place at the end, so ``--out`` holds either what
it held before or the whole new export, never a mix (the export is fsynced before the rename and
the parent directory after it, so a power cut keeps that too). Exit status 2 for a bad argument or an
unusable checkpoint, naming it; 130 for a Ctrl-C, with one line saying whether ``--out`` was
changed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from m3_rollout.chat.template import (
    BUILTIN_CHAT_DEFAULTS,
    CHAT_DEFAULTS_FILE,
    read_chat_defaults,
    write_chat_defaults,
)
from m3_rollout.config import ConfigError
from m3_rollout.model.atomic_file import fsync_dir, fsync_tree
from m3_rollout.model.loading import (
    CONFIG_NAME,
    INDEX_FILE,
    LAYOUTS,
    SINGLE_FILE,
    load_checkpoint,
    save_checkpoint,
)

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
#: The names of the files an export writes (weights, config, the copied ``SIDE_FILES``).
EXPORT_FILES = re.compile(
    "|".join(re.escape(n) for n in (CONFIG_NAME, SINGLE_FILE, INDEX_FILE, *SIDE_FILES))
    + r"|model-\d{5}-of-\d{5}\.safetensors"
)


def export_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    layout: str = "released",
    dtype: torch.dtype = torch.float32,
    chat_defaults: dict | None = None,
) -> list[str]:
    """Load the checkpoint in ``model_dir`` and write it to ``out_dir`` in ``layout`` (``LAYOUTS``).

    Weights are cast to ``dtype`` (router gate and bias stay fp32, spec §2.2); files listed in
    ``SIDE_FILES`` are copied as they are; ``chat_defaults`` (when given) is written as
    ``CHAT_DEFAULTS_FILE`` where the source has none. Everything is written into a new directory
    beside ``out_dir`` that then replaces it (``replace_dir``): stopped or failed at any point
    before that (a Ctrl-C, a full disk), ``out_dir`` keeps what it held. The new directory's
    files and directories are fsynced before the rename, the parent directory after it. Returns the sorted file
    names in ``out_dir`` afterwards.

    Raises:
        ValueError: ``out_dir`` is ``model_dir``; an unknown layout; a model that the layout cannot
            represent (``save_checkpoint``); or a checkpoint whose tensors do not match its config.
        ConfigError (a ValueError): ``out_dir`` cannot take the export (``check_out_dir``).
        FileNotFoundError: no config.json or weight file in ``model_dir``.
        CheckpointError: an unreadable config, index or weight file (named).
    """
    src, out = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the source checkpoint itself; give a new directory")
    if layout not in LAYOUTS:
        raise ValueError(f"format {layout!r}: expected one of {LAYOUTS}")
    check_out_dir(out)
    target = out.resolve()  # a symlinked --out: the directory it points at is replaced
    staging = _staging_dir(out, target)
    try:
        model = load_checkpoint(src, dtype=dtype)
        save_checkpoint(model, model.config, staging, layout=layout)
        for name in SIDE_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, staging / name)
        if chat_defaults and not (staging / CHAT_DEFAULTS_FILE).exists():
            write_chat_defaults(staging, chat_defaults)
        if target.is_dir():
            shutil.copymode(target, staging)
        fsync_tree(staging)  # on the disk before the rename puts it in place
        replace_dir(staging, target)
        fsync_dir(target.parent)  # the rename (and the removal of the earlier export)
    finally:
        if staging.exists():  # not renamed into place: nothing of the export is kept
            shutil.rmtree(staging)
    return sorted(p.name for p in target.iterdir())


def check_out_dir(out: Path) -> None:
    """Check that the export may replace ``out``: it is a new path, or a directory that holds only
    files an export writes (``EXPORT_FILES``: empty, or an earlier export) and is no mount point.

    Raises:
        ConfigError: naming ``--out`` and what stands in the way.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={str(out)!r}: a file, not a directory; give a new or existing directory")
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if not EXPORT_FILES.fullmatch(p.name) or p.is_dir())
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ConfigError(
            f"--out={str(out)!r}: holds {', '.join(foreign[:3])}{more}, which an export does not write; the "
            "export replaces the whole directory, so give a new or empty directory, or an earlier export's"
        )
    if os.path.ismount(out.resolve()):
        raise ConfigError(f"--out={str(out)!r}: a mount point, which cannot be replaced; give a directory inside it")


def _staging_dir(out: Path, target: Path) -> Path:
    """A new, empty directory beside ``target`` (hidden, named after it) to write the export into.

    Raises:
        ConfigError: the parent directory cannot be created or written.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        os.chmod(staging, 0o755)  # mkdtemp makes 0700; an export is shared like any output
    except OSError as exc:
        raise ConfigError(
            f"--out={str(out)!r}: cannot write in {target.parent} ({type(exc).__name__}: {exc.strerror or exc}); "
            "give a writable directory"
        ) from None
    return staging


def replace_dir(new: Path, out: Path) -> None:
    """Put the directory ``new`` at ``out`` (both in one parent directory, so each step is a
    rename): one rename when ``out`` does not exist; else ``out`` is renamed aside, ``new`` renamed
    in and the old one removed. Stopped between the two renames (an error, a Ctrl-C), the old one is
    renamed back: ``out`` holds either what it held or all of ``new``.

    Raises:
        OSError: a rename failed (``out`` is as it was).
    """
    old = new.with_name(f"{new.name}.old")
    try:
        if out.exists():
            os.rename(out, old)
        os.rename(new, out)
    finally:
        if old.exists() and not out.exists():  # stopped between the renames: the old one back
            os.rename(old, out)
        elif old.exists() and not new.exists():  # new is in place: the old one goes
            shutil.rmtree(old)


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
    p.add_argument(
        "--out",
        required=True,
        help="directory to write: new, empty, or an earlier export, which the new one replaces whole at the end",
    )
    p.add_argument("--format", choices=LAYOUTS, default="released", help="tensor and config layout (default released)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (default float32)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "m3-rollout export") -> int:
    """Command line of the export; returns the exit status (0, or 2 with ``error: ...`` on stderr).
    prog: the command ``--help`` names (``python -m m3_rollout.export`` passes its own)."""
    from m3_rollout.jobs.builtin import resolve_model

    args = parse_args(argv, prog)
    out = Path(args.out).expanduser()
    before = _identity(out)
    try:
        try:
            model_dir, _ = resolve_model(args.model)
            kwargs = read_chat_defaults(model_dir)  # checked before anything is written (ChatFileError)
            if not kwargs and args.model.startswith("builtin:"):  # a build from before the file: serve's default
                kwargs = dict(BUILTIN_CHAT_DEFAULTS)
            files = export_checkpoint(model_dir, out, args.format, DTYPES[args.dtype], chat_defaults=kwargs)
        except KeyboardInterrupt:  # run_entry (m3_rollout.cli.load_entry) prints the line and exits 130
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


def _identity(out: Path) -> tuple[int, int] | None:
    """``out``'s (device, inode), which the export's final rename changes; None when there is none."""
    try:
        st = out.resolve().stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def interrupted_export(out: Path, before: tuple[int, int] | None) -> str:
    """What an export stopped by Ctrl-C left in ``out``, as the end of the ``interrupted:`` line;
    ``before``: ``out``'s ``_identity`` when the export started. The export reaches ``out`` only by
    its final rename (``replace_dir``), so ``out`` holds what it held or the whole export."""
    now = _identity(out)
    if now == before:
        return f"--out {out} was not changed" if before else f"nothing was written (--out {out} was not created)"
    return f"the export in --out {out} is complete (the Ctrl-C came after its last step)"

"""``python -m m3_rollout.serve --model DIR|builtin:NAME [...]``: the rollout server's entry point.

Thin: resolves ``builtin:NAME`` to the embedded checkpoint (built on first use) and hands over to
``m3_rollout.server.cli``; run with ``--help`` for the options.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from m3_rollout.jobs.builtin import BUILTIN_PREFIX, resolve_model
    from m3_rollout.server.cli import default_template_kwargs, parse_args, serve

    args = parse_args(argv)
    try:  # the flag first: a bad value stops before a builtin build
        default_template_kwargs(args.default_chat_template_kwargs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir, _ = resolve_model(args.model)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    try:
        builtin = args.model.startswith(BUILTIN_PREFIX)
        kwargs = default_template_kwargs(args.default_chat_template_kwargs, builtin, model_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serve(args, model_dir, kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

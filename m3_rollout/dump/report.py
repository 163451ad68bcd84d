"""Human views of a dump: ``inspect`` (one line per step) and ``show`` (one group, turn by turn).

Governing idea: both views are pure functions from rows to text lines, so tests check the text;
the CLI only prints them. Per-step statistics are computed from the rows themselves; the
train/inference mismatch (``token_mult_prob_error``) comes from the step's logged metrics in the
shard metadata, or from ``replay score`` when a run did not log it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from m3_rollout.dump.reader import DumpRead, read_dump
from m3_rollout.rollout.trajectory import FINISH_ERROR

_STAT_COLUMNS = ["step", "group_id", "reward", "loss_mask", "token_ids", "finish_reason", "tool_calls"]


@dataclass
class StepStats:
    """Per-step summary.

    Attributes: rows / groups counts; errors = rows whose generation failed (finish_reason
    "error"); reward_mean and accuracy = fraction of rewards > 0.5, both over the other rows (a
    failed row's reward 0 is a placeholder; ``train/reward`` is defined the same way);
    gen_tokens_mean / total_tokens_mean / total_tokens_max in tokens; truncated = fraction with
    finish_reason "length"; tool_call_rate = fraction with at least one tool call; mismatch =
    logged ``token_mult_prob_error`` (None if the shard has none); size_bytes of the shard.
    """

    step: int
    rows: int
    groups: int
    errors: int
    reward_mean: float
    accuracy: float
    gen_tokens_mean: float
    total_tokens_mean: float
    total_tokens_max: int
    truncated: float
    tool_call_rate: float
    mismatch: float | None
    size_bytes: int


def step_stats(read: DumpRead) -> list[StepStats]:
    """One :class:`StepStats` per good shard of ``read`` (needs the columns in ``_STAT_COLUMNS``)."""
    cols = {c: read.table.column(c).to_pylist() for c in _STAT_COLUMNS}
    by_step: dict[int, list[int]] = {}
    for i, s in enumerate(cols["step"]):
        by_step.setdefault(s, []).append(i)
    out = []
    for info in read.shards:
        idx = by_step.get(info.step, [])
        n = max(len(idx), 1)
        rewards = [cols["reward"][i] for i in idx if cols["finish_reason"][i] != FINISH_ERROR]
        totals = [len(cols["token_ids"][i]) for i in idx]
        out.append(
            StepStats(
                step=info.step,
                rows=len(idx),
                groups=len({cols["group_id"][i] for i in idx}),
                errors=len(idx) - len(rewards),
                reward_mean=sum(rewards) / max(len(rewards), 1),
                accuracy=sum(r > 0.5 for r in rewards) / max(len(rewards), 1),
                gen_tokens_mean=sum(sum(cols["loss_mask"][i]) for i in idx) / n,
                total_tokens_mean=sum(totals) / n,
                total_tokens_max=max(totals, default=0),
                truncated=sum(cols["finish_reason"][i] == "length" for i in idx) / n,
                tool_call_rate=sum(bool(json.loads(cols["tool_calls"][i])) for i in idx) / n,
                mismatch=info.step_metrics.get("token_mult_prob_error"),
                size_bytes=info.size_bytes,
            )
        )
    return out


_HEADER = [
    "step",
    "rows",
    "groups",
    "errors",
    "reward",
    "accuracy",
    "gen tok",
    "total tok",
    "max tok",
    "truncated",
    "tool calls",
    "mismatch",
    "size",
]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def stats_rows(stats: list[StepStats]) -> list[list[str]]:
    return [
        [
            str(s.step),
            str(s.rows),
            str(s.groups),
            str(s.errors),
            f"{s.reward_mean:.3f}",
            f"{s.accuracy:.3f}",
            f"{s.gen_tokens_mean:.1f}",
            f"{s.total_tokens_mean:.1f}",
            str(s.total_tokens_max),
            f"{s.truncated:.3f}",
            f"{s.tool_call_rate:.3f}",
            "-" if s.mismatch is None else f"{s.mismatch:.4f}",
            _size(s.size_bytes),
        ]
        for s in stats
    ]


def format_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Plain fixed-width table lines (first column left-aligned, the rest right-aligned)."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def inspect_lines(directory) -> tuple[list[str], list[str]]:
    """(table lines, error lines) for ``inspect DIR``."""
    read = read_dump(directory, columns=_STAT_COLUMNS)
    run_ids = sorted({s.run_id for s in read.shards})
    lines = [f"{directory}: {len(read.shards)} shard(s), run {', '.join(run_ids)}"]
    lines += format_table(_HEADER, stats_rows(step_stats(read)))
    return lines, [f"skipped {e}" for e in read.errors]


def _indent(text: str | None, prefix: str = "      ") -> str:
    if text is None:
        return prefix + "(none)"
    return "\n".join(prefix + ln for ln in (text.splitlines() or [""]))


def _item(row: dict, column: str, k: int):
    """Item k of a per-turn list column (None when the column is null)."""
    values = row.get(column)
    return values[k] if values is not None and k < len(values) else None


def _format_call(c: dict) -> str:
    flags = [f for f in ("truncated",) if c.get(f)] + ([f"error: {c['error']}"] if c.get("error") else [])
    fn = c.get("function", c)
    return f"{fn.get('name')}({fn.get('arguments', '')})" + (f" [{', '.join(flags)}]" if flags else "")


# per-turn bool column -> the flag ``show`` puts after the turn's token span when it is set
_TURN_FLAGS = {
    "turn_truncated": "truncated",
    "turn_masked": "masked",
    "turn_parse_truncated": "ended inside a tool call",
}


def _turn_lines(r: dict, k: int) -> list[str]:
    start, end = r["turn_token_start"][k], r["turn_token_end"][k]
    flags = [flag for column, flag in _TURN_FLAGS.items() if _item(r, column, k)]
    fin = _item(r, "turn_finish_reasons", k)
    out = [
        f"  turn {k + 1}"
        + (f" [{fin}]" if fin else "")
        + f" tokens {start}..{end}"
        + (f" ({', '.join(flags)})" if flags else "")
    ]
    reasoning = _item(r, "turn_reasoning", k)
    if reasoning:
        out += ["    reasoning:", _indent(reasoning)]
    if r.get("turn_content") is not None:
        out += ["    content:", _indent(_item(r, "turn_content", k))]
    else:  # no parse records: the raw turn text
        out += ["    text:", _indent(_item(r, "turn_texts", k))]
    calls_json = _item(r, "turn_tool_calls", k)
    if calls_json is not None:
        out += [f"    tool call: {_format_call(c)}" for c in json.loads(calls_json)]
    elif k == 0 and json.loads(r["tool_calls"]):
        out += [f"    tool call (turn unknown): {_format_call(c)}" for c in json.loads(r["tool_calls"])]
    if _item(r, "turn_parse_errors", k):
        out.append(f"    parse error: {_item(r, 'turn_parse_errors', k)}")
    results = _item(r, "turn_tool_results", k)
    if results:
        out += ["    tool results:"] + [_indent(x) for x in results]
    elif _item(r, "tool_turn_texts", k):
        out += ["    tool turn:", _indent(_item(r, "tool_turn_texts", k))]
    return out


def show_lines(directory, step: int, group: int) -> tuple[list[str], list[str]]:
    """(lines, error lines) for ``show DIR --step S --group G``.

    Raises:
        DumpDirError: no shard for ``step``. ValueError: no group ``group`` in that step.
    """
    read = read_dump(directory, steps=[step])
    rows = [r for r in read.table.to_pylist() if r["group_id"] == group]
    if not rows:
        groups = sorted(set(read.table.column("group_id").to_pylist()))
        raise ValueError(f"step {step} has no group {group}; groups are {groups}")
    rows.sort(key=lambda r: r["sample_index"])
    r0 = rows[0]
    out = [
        f"step {step} · group {group} · {len(rows)} sample(s) · run {r0['run_id']}",
        f"sampling {r0['sampling_params']}",
        f"prompt ({r0['prompt_len']} tokens):",
        _indent(r0["prompt_text"], "  "),
    ]
    for r in rows:
        adv = "-" if r["advantage"] is None else f"{r['advantage']:+.3f}"
        out.append(
            f"── sample {r['sample_index']} · reward {r['reward']:.3f} · advantage {adv} · finish "
            f"{r['finish_reason']} · {sum(r['loss_mask'])} trained / {len(r['token_ids'])} tokens ──"
        )
        for k in range(len(r["turn_token_start"])):
            out += _turn_lines(r, k)
        if r["routed_experts_shape"]:
            out.append(f"  routed experts: {r['routed_experts_shape']} (int16, zstd {len(r['routed_experts'])} bytes)")
        if r.get("block_selection_index"):
            own = sum(len(b) for b in r["block_selection"] or [])
            shared = sum(1 for s, _ in r["block_selection_index"] if s != r["sample_index"])
            out.append(
                f"  block selection: {len(r['block_selection_index'])} segments ({shared} stored with another "
                f"sample), {own} bytes coded in this row"
            )
        info = json.loads(r["env_info"])
        if info:
            out.append(f"  env info: {json.dumps(info)}")
    return out, [f"skipped {e}" for e in read.errors]


def print_lines(lines: list[str], use_rich: bool = True) -> None:
    """Print lines; with rich available, tables keep their plain layout (no markup parsing)."""
    try:
        if not use_rich:
            raise ImportError
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        for ln in lines:
            console.print(ln, markup=False)
    except ImportError:
        for ln in lines:
            print(ln)

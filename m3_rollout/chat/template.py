"""Conversations -> token ids for rollouts: the single place that applies M3's chat template.

Governing idea (token-in, token-out): a rollout's token stream is built from pieces — prompt,
the model's own output, tool/user turns appended after its eos — and the pieces must add up to
exactly what the chat template renders for the whole conversation. So every piece is *derived
from the template* (render with and without the new messages, take the difference) rather than
written by hand; the template is the one definition of the format and no marker is spelled twice.

Every piece boundary falls right after a special token (`[e~[`, `</mm:think>`, `<mm:think>`) or
right after "]~b]ai\n" in front of one, where the tokenizer splits anyway, so tokenizing the
pieces separately gives the same ids as tokenizing the whole rendered string.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

from m3_rollout.chat.markers import THINKING_MODES

__all__ = [
    "BUILTIN_CHAT_DEFAULTS",
    "CHAT_DEFAULTS_FILE",
    "ChatFileError",
    "ChatFormat",
    "check_template",
    "load_template",
    "normalize_messages",
    "read_chat_defaults",
    "render",
    "write_chat_defaults",
]

TEMPLATE_NAMES = ("m3_full", "m3_short")
# A checkpoint's default chat-template kwargs: the rendering its prompts were trained in (the
# builtin builds and the GRPO job's checkpoints write it; a released M3 checkpoint has none).
CHAT_DEFAULTS_FILE = "chat_template_kwargs.json"
# the chat-template kwargs of a builtin checkpoint built before CHAT_DEFAULTS_FILE existed (its
# prompts were rendered without thinking)
BUILTIN_CHAT_DEFAULTS = {"thinking_mode": "disabled"}


class ChatFileError(ValueError):
    """A tokenizer or chat-template file cannot be used. The message starts with the file (and,
    for a template, the line) and says what to do."""


def check_template(chat_template: str, origin: str) -> None:
    """Compile `chat_template` as transformers does, so a syntax error is reported where it is.

    Args:
        chat_template: template source.
        origin: where it came from, for the message: a file path, or e.g. "tokenizer_config.json's
            chat_template" (then the line counts inside that string).

    Raises:
        ChatFileError: "<origin>:<line>: chat template syntax error: <what>; ..." for a template
            that does not compile (an error at render time, e.g. `raise_exception`, is not one).
    """
    try:
        # NOTE: an empty conversation through transformers' own environment: the same
        # extensions and compile cache as `render`, without reaching into transformers' internals.
        render_jinja_template(conversations=[[]], chat_template=chat_template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatFileError(
            f"{origin}:{exc.lineno}: chat template syntax error: {exc.message}; fix that line of the template"
        ) from None
    except Exception:  # the template compiled; it just does not render an empty conversation
        pass


def load_template(name: str = "m3_full") -> str:
    """Source text of a packaged template: "m3_full" (spec §5.2) or "m3_short" (compact).

    Raises:
        ValueError: unknown `name`.
        ChatFileError: the packaged file has a syntax error (file and line named).
    """
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown template {name!r}; expected one of {TEMPLATE_NAMES}")
    file = resources.files("m3_rollout.chat").joinpath("templates", f"{name}.jinja")
    source = file.read_text("utf-8")
    check_template(source, str(file))
    return source


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages -> the shape M3's chat templates take; the one place that does it.

    Use it before any rendering of a conversation with tool calls, ours (`render`, `ChatFormat`)
    or transformers' own on an exported checkpoint's tokenizer:

        tokenizer.apply_chat_template(normalize_messages(messages), tools=tools, tokenize=False)

    Returns a deep copy (the input is not changed) where:

    - keys whose value is None are dropped (OpenAI clients send `content=None` next to tool calls;
      transformers' `apply_chat_template` does the same);
    - each tool call's `arguments`, a JSON string in the OpenAI shape, is decoded into the dict
      the templates need (Jinja has no `fromjson`, and the templates' `to_xml` walks the
      structure: nested objects and arrays are kept as they are). An empty string is `{}`; a dict
      passes unchanged. Both the `{"id", "type", "function": {"name", "arguments"}}` and the flat
      `{"name", "arguments"}` forms are accepted.

    Raises:
        ValueError: a tool call whose arguments are not valid JSON, do not decode to an object,
            or are neither a string nor a dict; the message names the call
            (`messages[i].tool_calls[j]`, its id and function name) and shows the arguments.
    """
    out = []
    for i, message in enumerate(messages):
        message = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        for j, call in enumerate(message.get("tool_calls") or ()):
            fn = call["function"] if "function" in call else call
            args = fn.get("arguments")
            if args is None or isinstance(args, dict):
                continue
            where = f"messages[{i}].tool_calls[{j}] (id {call.get('id')!r}, function {fn.get('name')!r})"
            if not isinstance(args, str):
                raise ValueError(
                    f"{where}: arguments must be a JSON object string or a dict, got {type(args).__name__} {args!r}"
                )
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: arguments are not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                    f"{args!r}; send one JSON object, e.g. '{{\"expression\": \"1+2\"}}'"
                ) from None
            if not isinstance(parsed, dict):
                raise ValueError(
                    f"{where}: arguments must decode to a JSON object (named parameters), got "
                    f"{type(parsed).__name__} from {args!r}"
                )
            fn["arguments"] = parsed
        out.append(message)
    return out


def render(
    chat_template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    thinking_mode: str | None = None,
) -> str:
    """Render `messages` with a chat template, as `tokenizer.apply_chat_template(..., tokenize=False)`.

    Uses transformers' own Jinja environment (sandbox, trim_blocks/lstrip_blocks, its `tojson`),
    so the output matches what any transformers-based server renders from the saved tokenizer.
    `thinking_mode=None` leaves the variable undefined (the templates then act as "adaptive").
    """
    if thinking_mode is not None and thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    kwargs = {} if thinking_mode is None else {"thinking_mode": thinking_mode}
    rendered, _ = render_jinja_template(
        conversations=[normalize_messages(messages)],
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return rendered[0]


class ChatFormat:
    """Token-level view of the chat template for one tokenizer and one thinking mode.

    Args:
        tokenizer: a transformers tokenizer whose vocabulary holds M3's markers.
        thinking_mode: "enabled" | "disabled" | "adaptive"; applies to every render, including
            the generation prompts inside `tool_turn_ids` / `user_turn_ids`.
        chat_template: template source; defaults to `tokenizer.chat_template`.

    Raises:
        ValueError: unknown thinking mode, no chat template, or no eos token.
        ChatFileError: the template does not compile (its line is named; load the tokenizer with
            `tokenizer.load_tokenizer` to have the file named too).
    """

    def __init__(self, tokenizer, thinking_mode: str = "disabled", chat_template: str | None = None):
        if thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
        origin = "the chat_template argument" if chat_template is not None else "the tokenizer's chat_template"
        chat_template = chat_template if chat_template is not None else tokenizer.chat_template
        if not chat_template:
            raise ValueError("no chat template: pass chat_template= or use a tokenizer that has one")
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has no eos token")
        check_template(chat_template, origin)
        self.tokenizer = tokenizer
        self.thinking_mode = thinking_mode
        self.chat_template = chat_template
        self.eos_token: str = tokenizer.eos_token
        self.eos_token_id: int = tokenizer.convert_tokens_to_ids(self.eos_token)
        # Only the end-of-message marker stops generation: tool calls end with it too.
        self.stop_token_ids: list[int] = [self.eos_token_id]

    # --- strings -------------------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The template's text for `messages` under this format's thinking mode."""
        return render(self.chat_template, messages, tools, add_generation_prompt, self.thinking_mode)

    def _delta(self, before: list[dict], after: list[dict]) -> str:
        """Text that appending `after` to `before` adds, continuing right after `before`'s eos.

        `before` is rendered without and `before + after` with the generation prompt; the shared
        prefix is checked, and the "\n" that the template puts after `before`'s eos is included
        because the model stopped at the eos and never wrote it.
        """
        base = self.render(before, add_generation_prompt=False)
        full = self.render(before + after, add_generation_prompt=True)
        end = self.eos_token + "\n"
        assert base.endswith(end), f"template must end each turn with eos + newline, got {base[-20:]!r}"
        assert full.startswith(base), "template renders earlier turns differently once later ones follow"
        return full[len(base) - 1 :]

    # --- ids -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; markers are in the text, so no special tokens are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` with every marker kept (the tool and reasoning parsers need them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of the conversation plus the generation prompt: the model continues from here."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def assistant_ids(
        self,
        content: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
    ) -> list[int]:
        """Ids of an assistant turn as the model emits it after the generation prompt, eos included.

        Equals the template's rendering of that assistant message minus the generation prompt it
        starts with and the "\n" after its eos (used to build SFT demonstrations and to check
        rollouts). `tool_calls` as in OpenAI messages (arguments as dict or JSON string).

        `reasoning`: text of the think span. In "enabled" mode the prompt already opened it, so a
        missing reasoning means an empty span ("</mm:think>" comes first); in "disabled" mode
        reasoning is rejected, because the prompt has already closed the span.

        Raises:
            ValueError: the message cannot follow this mode's generation prompt.
        """
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if reasoning is None and self.thinking_mode == "enabled":
            reasoning = ""
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        context = [{"role": "user", "content": "."}]
        prompt = self.render(context, add_generation_prompt=True)
        full = self.render(context + [message], add_generation_prompt=False)
        if not full.startswith(prompt):
            raise ValueError(
                f"this assistant message cannot follow the {self.thinking_mode!r} generation prompt "
                f"(reasoning={reasoning!r})"
            )
        turn = full[len(prompt) :]
        assert turn.endswith(self.eos_token + "\n"), f"assistant turn must end with eos + newline: {turn[-20:]!r}"
        return self.encode(turn[:-1])

    def tool_turn_ids(self, tool_results: list[str]) -> list[int]:
        """Ids to append after the model's eos when tools answered.

        "\n" + one tool turn holding `tool_results` in order + the next generation prompt.
        """
        if not tool_results:
            raise ValueError("tool_turn_ids needs at least one result")
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        after = [{"role": "tool", "content": text} for text in tool_results]
        return self.encode(self._delta(before, after))

    def user_turn_ids(self, text: str) -> list[int]:
        """Ids to append after the model's eos for a follow-up user turn (+ generation prompt)."""
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        return self.encode(self._delta(before, [{"role": "user", "content": text}]))


def write_chat_defaults(model_dir, kwargs: dict) -> None:
    """Write ``kwargs`` (e.g. ``{"thinking_mode": "disabled"}``) as ``model_dir``'s
    ``CHAT_DEFAULTS_FILE``: the chat-template kwargs its training rendered prompts with, which a
    server applies under every request's own. Raises ValueError for an unknown thinking mode."""
    from pathlib import Path

    mode = kwargs.get("thinking_mode")
    if mode is not None and mode not in THINKING_MODES:
        raise ValueError(f"chat defaults: thinking_mode must be one of {THINKING_MODES}, got {mode!r}")
    (Path(model_dir) / CHAT_DEFAULTS_FILE).write_text(json.dumps(kwargs, indent=1) + "\n")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_chat_defaults(model_dir) -> dict:
    """``model_dir``'s ``CHAT_DEFAULTS_FILE`` as a dict, or {} when it has none. Raises
    ChatFileError naming the file when it is not a UTF-8 JSON object (NaN / Infinity refused) with a
    known thinking mode, or is not a file."""
    from pathlib import Path

    path = Path(model_dir) / CHAT_DEFAULTS_FILE
    if not path.exists():
        return {}
    if not path.is_file():
        raise ChatFileError(f"{path}: not a file; remove it or put the JSON object there")
    try:
        kwargs = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise ChatFileError(f"{path}: not UTF-8 ({exc}); delete it or fix it") from None
    except ValueError as exc:  # JSONDecodeError, NaN / Infinity
        raise ChatFileError(f"{path}: not JSON ({exc}); delete it or fix it") from None
    mode = kwargs.get("thinking_mode") if isinstance(kwargs, dict) else None
    if not isinstance(kwargs, dict) or (mode is not None and mode not in THINKING_MODES):
        raise ChatFileError(
            f"{path}: must be a JSON object whose thinking_mode is one of {THINKING_MODES}; delete it or fix it"
        )
    return kwargs

"""The marker strings of MiniMax-M3's chat format (spec §5.1), in one place.

Governing idea: code refers to markers by *string* and looks token ids up in the tokenizer, so
nothing depends on a particular vocabulary. The Jinja templates spell the same strings out
literally (a template cannot import Python); tests render them and check they agree with these.
"""

BOS = "]~!b["  # begin of conversation; HF bos_token
ROLE = "]~b]"  # role-turn prefix, followed by the role name and "\n"
EOS = "[e~["  # end of message; the generation stop token
THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"
# Prefixed to every tool-call tag. NOTE: a *non-special* added token, so it survives
# decode(skip_special_tokens=True) and the tool parser still sees it (spec §5.4).
NS = "]<]minimax[>["
TOOL_CALL_OPEN = NS + "<tool_call>"  # opens the tool-call block (spec §5.3)
# Not an M3 marker: our trained tokenizers need a padding token for batched tensors.
PAD = "<pad>"

# Special tokens: single vocab entries, stripped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = (PAD, BOS, ROLE, EOS, THINK_OPEN, THINK_CLOSE)
THINKING_MODES = ("enabled", "disabled", "adaptive")

"""MiniMax-M3's chat layer: markers, tokenizer, chat templates and output parsers.

- `markers`: the marker strings (`]~!b[`, `]~b]`, `[e~[`, `<mm:think>`, `</mm:think>`, `]<]minimax[>[`).
- `tokenizer`: train/save small byte-level BPE tokenizers that speak those markers; `TokenBytes`,
  a token's raw bytes (OpenAI logprobs' `bytes`).
- `templates/`: the Jinja chat templates (`m3_full.jinja`, `m3_short.jinja`).
- `template`: `ChatFormat`, conversations -> token ids for rollouts (token-in, token-out).
- `reasoning_parser`: split `<mm:think>` reasoning from the answer.
- `tool_parser`: parse `]<]minimax[>[` XML tool calls into OpenAI tool calls (streaming and whole
  text), built on `tool_scanner` (block-level terminals), `tool_elements` (an invoke body's
  element tree) and `tool_arguments` (typing the values by the tool's JSON schema).

Modules are imported directly (no re-exports here) so the parsers stay free of transformers.
"""

"""Small byte-level BPE tokenizers that speak MiniMax-M3's chat markers, for CPU tests and toy RL;
and `TokenBytes`, a token's raw bytes under any such tokenizer (OpenAI logprobs' `bytes`).

Governing idea: a tokenizer trained here must behave like M3's on everything the chat layer
relies on — every marker is one token, `decode(encode(s)) == s` for any text, and the namespace
marker survives `skip_special_tokens=True` — so the templates, `ChatFormat` and the parsers can be
tested end to end without the 200k-entry real vocabulary. Token ids are never fixed: they depend
on training and are always looked up by string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from m3_rollout.chat.markers import BOS, EOS, NS, PAD, SPECIAL_TOKENS
from m3_rollout.chat.template import ChatFileError, check_template

__all__ = ["TokenBytes", "is_byte_level", "load_tokenizer", "save_tokenizer", "train_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a transformers fast tokenizer.

    Args:
        texts: training corpus (any iterable of strings; consumed once).
        vocab_size: upper bound on the total vocabulary, markers included. The BPE may stop short
            of it when the corpus has too few distinct merges.

    Returns:
        A `PreTrainedTokenizerFast` with
        - special tokens `<pad>` (pad), `]~!b[` (bos), `]~b]`, `[e~[` (eos), `<mm:think>`,
          `</mm:think>`: single tokens, dropped by `decode(skip_special_tokens=True)`;
        - `]<]minimax[>[` as a single *non-special* added token (kept by that decode);
        - no automatic bos/eos on `encode` (the chat template writes every marker itself).

    Raises:
        ValueError: if `vocab_size` cannot hold the 256 byte symbols plus the markers.
    """
    n_markers = len(SPECIAL_TOKENS) + 1  # + the non-special namespace marker
    min_size = 256 + n_markers
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is below {min_size} (256 bytes + {n_markers} markers)")

    tok = Tokenizer(models.BPE())
    # NOTE: digits are isolated *before* the byte-level mapping, so no merge can ever span digits
    # and every number is tokenized digit by digit (as M3's own tokenizer does).
    # add_prefix_space=False keeps decode(encode(s)) == s: nothing is inserted before the text.
    # NOTE: use_regex=False — no GPT-2 word split, so merges may span spaces and punctuation.
    # Our corpora are small and repetitive (templated prompts), and whole-phrase merges keep toy
    # sequences short (a one-tool prompt of the short template is ~46 tokens instead of ~70).
    # The real M3 tokenizer does split words; that changes token counts, not any invariant the
    # chat layer relies on (markers are single tokens, exact round trip, digit-by-digit numbers).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # leave room for the namespace marker added below
        special_tokens=list(SPECIAL_TOKENS),
        # Seed with all 256 byte symbols so any input (any script, any byte) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Added after training so the trainer does not turn it into a special token.
    # normalized=False: matched against the raw text, byte for byte.
    tok.add_tokens([AddedToken(NS, special=False, normalized=False, single_word=False)])

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # The unnamed specials, so transformers lists them in all_special_tokens (v5 only lists
        # named ones otherwise) and sanitize_control_tokens / skip_special_tokens know them.
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
        # Cleanup would rewrite " ." -> "." and similar, breaking the exact round trip.
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok: transformers.PreTrainedTokenizerBase, out_dir: str | os.PathLike, chat_template: str) -> None:
    """Write `tok` with `chat_template` so `AutoTokenizer.from_pretrained(out_dir)` restores both.

    Files written (by transformers 5.x `save_pretrained`): `tokenizer.json`,
    `tokenizer_config.json` (bos/eos/pad, cleanup off) and `chat_template.jinja`.

    NOTE: sets `tok.chat_template = chat_template` on the object passed in, so the in-memory
    tokenizer and the saved one render identically.
    """
    tok.chat_template = chat_template
    tok.save_pretrained(os.fspath(out_dir))


def load_tokenizer(model_dir: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(model_dir)`, with errors that name the file at fault.

    The directory must hold `tokenizer.json` (M3's tokenizers are fast tokenizers); its chat
    template (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`) is compiled
    once here, so a syntax error is reported with its file and line before any rollout starts.

    Raises:
        ChatFileError: `tokenizer.json` is missing or not a tokenizers file, another tokenizer
            file is unusable, or the chat template has a syntax error (file and line named).
    """
    d = os.fspath(model_dir)
    tokenizer_file = os.path.join(d, TOKENIZER_FILE)
    if not os.path.isfile(tokenizer_file):
        raise ChatFileError(
            f"{tokenizer_file}: missing; save the tokenizer into the model directory (save_tokenizer) "
            "or copy tokenizer.json, tokenizer_config.json and chat_template.jinja from the source model"
        )
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d)
    except Exception as exc:
        # Diagnose only on failure, so a good tokenizer.json is parsed once.
        try:
            Tokenizer.from_file(tokenizer_file)
        except Exception as parse_exc:
            raise ChatFileError(
                f"{tokenizer_file}: not a readable tokenizers file ({' '.join(str(parse_exc).split())[:200]}); "
                "it is truncated or corrupt: re-save or re-copy it"
            ) from None
        raise ChatFileError(
            f"{d}: transformers cannot load the tokenizer ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
            "check tokenizer_config.json and special_tokens_map.json there"
        ) from None
    if isinstance(tok.chat_template, str):  # (a dict of named templates is not checked)
        template_file = os.path.join(d, TEMPLATE_FILE)
        origin = (
            template_file
            if os.path.isfile(template_file)
            else f"{os.path.join(d, 'tokenizer_config.json')}'s chat_template"
        )
        check_template(tok.chat_template, origin)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map, the alphabet byte-level BPE vocabularies are spelt in: the
    188 printable Latin-1 bytes stand for themselves, the other 68 (controls, space, DEL, NBSP,
    soft hyphen, ...) for U+0100 onwards in byte order (``tokenizers``' ByteLevel and
    ``transformers``' ``bytes_to_unicode`` use the same map)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


#: A byte-level BPE vocabulary entry's character -> the byte it stands for (inverse of GPT-2's map).
BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def is_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` (a transformers fast tokenizer) is a byte-level BPE: its decoder is
    ``tokenizers``' ByteLevel (alone, or the only kind in a Sequence), so each vocabulary entry
    spells its bytes in GPT-2's byte alphabet (``BYTE_DECODER``). False for a slow tokenizer or
    any other decoder (SentencePiece-style byte fallback, WordPiece, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())  # the decoder's own JSON (small), as in tokenizer.json
    kinds = [d.get("type") for d in state["decoders"]] if state.get("type") == "Sequence" else [state.get("type")]
    return bool(kinds) and all(k == "ByteLevel" for k in kinds)


class TokenBytes:
    """Token id -> the token's raw bytes, what OpenAI's ``logprobs`` ``bytes`` field carries: the
    bytes of consecutive tokens join into the text, also where a token holds only part of a
    multi-byte character (decoding such a token alone gives U+FFFD instead).

    - Byte-level BPE (:func:`is_byte_level`: ours from :func:`train_tokenizer`, M3's): the
      vocabulary entry's characters mapped back through ``BYTE_DECODER``.
    - Added tokens (the markers, special or not): their content's UTF-8 (they are matched as
      text, not spelt in the byte alphabet).
    - Any other tokenizer, or an entry with a character outside the byte alphabet: the UTF-8 of
      the token decoded alone (markers kept, no cleanup), so a partial character gives the bytes
      of U+FFFD there. An id the tokenizer does not know (a model vocabulary padded past it): b"".

    The added tokens are read once, here: tokens added to ``tokenizer`` later are not seen as such.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.added = {i: t.content.encode("utf-8") for i, t in tokenizer.added_tokens_decoder.items()}

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id]
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(c in BYTE_DECODER for c in piece):
                return bytes(BYTE_DECODER[c] for c in piece)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.encode("utf-8")

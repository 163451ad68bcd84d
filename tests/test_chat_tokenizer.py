"""train_tokenizer / save_tokenizer: markers, digits, exact round trip, saved-dir reload; TokenBytes."""

import os
import pathlib
import re

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from m3_rollout.chat import markers
from m3_rollout.chat.template import ChatFileError, ChatFormat, load_template, render
from m3_rollout.chat.tokenizer import (
    BYTE_DECODER,
    TokenBytes,
    is_byte_level,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

SPECIALS = ["]~!b[", "]~b]", "[e~[", "<mm:think>", "</mm:think>", "<pad>"]
NS = "]<]minimax[>["
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


def _corpus():
    template = load_template("m3_full")
    texts = []
    for i in range(30):
        call = {"name": "lookup", "arguments": {"word": f"w{i}", "n": i * 7919}}
        messages = [
            {"role": "user", "content": f"Define word number {i * 31}, please."},
            {"role": "assistant", "content": "Sure.", "tool_calls": [call]},
            {"role": "tool", "content": f"meaning {i} of 2024"},
        ]
        for mode in ("enabled", "disabled", "adaptive"):
            texts.append(render(template, messages, TOOLS, add_generation_prompt=True, thinking_mode=mode))
    # Repeated numbers: merges across digits would be learnt here if they were allowed.
    texts += ["In 2024 and 2025, 12345 people paid 99.99 each; 1000000 total.\n" * 20] * 5
    return texts


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(_corpus(), vocab_size=1000)


def _pieces(tok, text):
    return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]


def test_digits_are_one_per_token(tok):
    pieces = _pieces(tok, "year 2024, code 1234567890 and 12345 / 99.99")
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == list("2024123456789012345" + "9999")


def test_markers_are_single_tokens_and_ids_are_looked_up(tok):
    for marker in SPECIALS + [NS]:
        marker_id = tok.convert_tokens_to_ids(marker)
        assert tok.encode(marker, add_special_tokens=False) == [marker_id]
        # Also inside running text, with no spaces around it.
        assert marker_id in tok.encode("abc" + marker + "def 12", add_special_tokens=False)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("]~!b[", "[e~[", "<pad>")
    assert tok.eos_token_id == tok.convert_tokens_to_ids("[e~[")
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<pad>")
    assert len(set(tok.convert_tokens_to_ids(SPECIALS + [NS]))) == 7
    assert len(tok) <= 1000
    # encode adds nothing by itself: the template writes every marker.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_namespace_marker_is_not_special(tok):
    assert set(SPECIALS) <= set(tok.all_special_tokens)
    assert NS not in tok.all_special_tokens
    text = "]~!b[]~b]ai\n<mm:think>r</mm:think>" + NS + "<tool_call>\n" + NS + "</tool_call>[e~[<pad>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "ai\nr" + NS + "<tool_call>\n" + NS + "</tool_call>"


@pytest.mark.parametrize(
    "text",
    [
        "",
        " leading space",
        "trailing  spaces  \n\n",
        "tabs\tand\r\nwindows newlines\n",
        "x = 3.14159 , y=2e10 ; 007 ?",
        "unicode: héllo wörld, 你好, emoji 🙂, zero\u200bwidth",
        "]~!b[]~b]user\nHi[e~[\n]~b]ai\n<mm:think> x </mm:think>" + NS + "<a>1" + NS + "</a>[e~[",
        "markers glued" + NS + NS + "[e~[[e~[<mm:think></mm:think>",
        "partial markers ]~b ]<]mini [e~ <mm:thin",
    ],
)
def test_exact_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


MULTIBYTE = "</mm:think>héllo 日本語 🙂" + NS + "<x>ß€" + NS + "</x>[e~["


def test_token_bytes_join_into_the_texts_utf8(tok):
    """Logprobs' `bytes` gave each token's decoded text, U+FFFD for a token holding part of a
    multi-byte character; the tokens' own bytes join into the text's UTF-8, markers included."""
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert "\ufffd" in [tok.decode([i]) for i in ids]  # the characters are split over tokens
    token_bytes = TokenBytes(tok)
    assert token_bytes.byte_level
    assert b"".join(token_bytes(i) for i in ids) == MULTIBYTE.encode("utf-8")
    assert token_bytes(tok.convert_tokens_to_ids(NS)) == NS.encode()
    assert token_bytes(len(tok) + 5) == b""  # past the tokenizer (a padded model vocabulary)


def test_token_bytes_of_an_added_token_are_its_texts_utf8():
    """An added token is matched as text, not spelt in the byte alphabet: "é" of "<｜é｜>" is not
    the byte 0xE9."""
    tok = train_tokenizer(["abc abc"], vocab_size=300)
    tok.add_tokens(["<｜é｜>"])
    tid = tok.convert_tokens_to_ids("<｜é｜>")
    assert TokenBytes(tok)(tid) == "<｜é｜>".encode()


def test_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert BYTE_DECODER == {c: b for b, c in bytes_to_unicode().items()}
    assert set(BYTE_DECODER) == set(pre_tokenizers.ByteLevel.alphabet())


def test_token_bytes_of_a_tokenizer_that_is_not_byte_level_are_its_decoded_texts():
    word = Tokenizer(models.WordLevel({"héllo": 0, "wörld": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word, unk_token="[UNK]")
    assert not is_byte_level(tok)
    token_bytes = TokenBytes(tok)
    assert [token_bytes(i) for i in tok.encode("héllo wörld", add_special_tokens=False)] == [
        "héllo".encode(),
        "wörld".encode(),
    ]


def test_too_small_vocab_rejected():
    with pytest.raises(ValueError):
        train_tokenizer(["abc"], vocab_size=200)


def test_saved_dir_loads_with_chat_template(tok, tmp_path):
    template = load_template("m3_full")
    save_tokenizer(tok, tmp_path, template)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(tmp_path))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == template
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("]~!b[", "[e~[", "<pad>")
    assert NS not in loaded.all_special_tokens

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Define 42."},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "lookup", "arguments": {"word": "42"}}]},
        {"role": "tool", "content": "a number"},
    ]
    for mode in ("enabled", "disabled", "adaptive"):
        fmt = ChatFormat(tok, thinking_mode=mode)
        expected = fmt.render(messages, TOOLS, add_generation_prompt=True)
        got = loaded.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, thinking_mode=mode
        )
        assert got == expected
        ids = loaded.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, thinking_mode=mode, return_dict=False
        )
        assert ids == fmt.prompt_ids(messages, TOOLS)


def test_no_token_id_hard_coded_in_chat_package():
    # The real vocabulary's ids (spec §5.1) must never appear: ids are looked up by string.
    package = pathlib.Path(markers.__file__).parent
    sources = [p.read_text() for p in package.rglob("*") if p.suffix in (".py", ".jinja")]
    for known_id in ("200034", "200019", "200020", "200059", "200060", "200025", "200026"):
        assert not any(known_id in s for s in sources), known_id


# --- files that cannot be used are named -------------------------------------------------------


def test_load_tokenizer_round_trips_a_saved_dir(tok, tmp_path):
    save_tokenizer(tok, tmp_path, load_template("m3_short"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == load_template("m3_short")
    assert loaded.encode("]~b]ai\n12") == tok.encode("]~b]ai\n12")


def test_missing_or_corrupt_tokenizer_json_is_named(tok, tmp_path):
    save_tokenizer(tok, tmp_path, load_template("m3_short"))
    path = tmp_path / "tokenizer.json"
    path.write_text(path.read_text()[:500])  # cut off mid-file
    with pytest.raises(ChatFileError, match="^" + re.escape(str(path)) + ": not a readable tokenizers file"):
        load_tokenizer(tmp_path)
    path.unlink()
    with pytest.raises(ChatFileError, match="^" + re.escape(str(path)) + ": missing; save the tokenizer"):
        load_tokenizer(tmp_path)


def test_chat_template_syntax_error_names_file_and_line(tok, tmp_path):
    broken = load_template("m3_short").replace("{%- endif -%}", "{%- endfi -%}", 1)
    line = broken[: broken.index("endfi")].count("\n") + 1
    save_tokenizer(tok, tmp_path, broken)
    path = tmp_path / "chat_template.jinja"
    with pytest.raises(ChatFileError, match="^" + re.escape(f"{path}:{line}: chat template syntax error")):
        load_tokenizer(tmp_path)
    with pytest.raises(ChatFileError, match=f"^the chat_template argument:{line}: "):
        ChatFormat(tok, "disabled", chat_template=broken)

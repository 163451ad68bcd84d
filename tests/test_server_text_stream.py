"""The server's TextStream: incremental text equals the whole decode cut at the first stop string
(before it, or after it with ``include_stop``), in work linear in the output (a 200 KB stop
string, thousands of pushes) and holding back only the tail that may still begin a stop string."""

import random

import pytest
from server_util import tiny_tokenizer  # tests/ on sys.path

from m3_rollout.engine.stop_strings import complete_text, contains_stop_string
from m3_rollout.server.openai_api import StopMatcher, TextStream


class CountingStr(str):
    """A str that counts character lookups (``s[k]``): the stop-string scan's unit of work."""

    lookups = 0

    def __getitem__(self, key):
        CountingStr.lookups += 1
        return str.__getitem__(self, key)


def _reference(decode, ids, stop_ids, stops, include_stop=False) -> str:
    ids = ids[:-1] if ids and ids[-1] in stop_ids else ids
    text = decode(ids)
    searched = complete_text(text)  # the engine's rule: no stop string ends in a trailing U+FFFD
    if include_stop:  # up to the end of the first stop string to complete
        ends = [i + len(s) for s in stops if (i := searched.find(s)) >= 0]
        return text[: min(ends)] if ends else text
    cuts = [i for i in (searched.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _push_in_random_pieces(ts: TextStream, ids: list[int], rng: random.Random) -> str:
    """The text ``ts`` releases for ``ids`` pushed in pieces of 1-4 ids (sizes from ``rng``), then finished."""
    out, i = "", 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out += ts.push(ids[i : i + k])
        i += k
    return out + ts.finish()


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_the_whole_decode_cut_at_the_first_stop(tok, seed, include_stop):

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    rng = random.Random(seed)
    # Byte-level tokens (multi-byte characters split over several ids) and ordinary ones.
    pool = tok.encode("é ü 12 * 34 = 408 — naïve café ✓ It is 408.", add_special_tokens=False) + list(range(3, 300))
    ids = [rng.choice(pool) for _ in range(120)]
    whole = decode(ids)
    stops = (whole[len(whole) // 2 : len(whole) // 2 + 3], "zzq") if seed % 2 else ("zzq",)
    stop_id = {ids[-1]} if seed % 3 == 0 else set()
    ts = TextStream(decode, stop_id, stops, include_stop=include_stop)
    out = _push_in_random_pieces(ts, ids, rng)
    assert out == _reference(decode, ids, stop_id, stops, include_stop)
    if seed % 2:  # the stop string is in the text: kept (include_stop) or cut off
        assert out.endswith(stops[0]) == include_stop and ts.stop_string == stops[0]


def test_a_200kb_stop_string_costs_linear_work_and_holds_back_only_its_prefix():
    stop = CountingStr("ab" * 100_000 + "!")  # 200 KB
    decoded = {"n": 0}

    def decode(ids):
        decoded["n"] += len(ids)
        return "".join("ab" if t == 1 else "x" for t in ids)

    CountingStr.lookups = 0
    ts = TextStream(decode, set(), (stop,))
    build = CountingStr.lookups
    assert build <= 4 * len(stop)  # the failure table: linear in the stop string
    released = ts.push([2])  # "x" can begin no stop string: released at once
    assert released == "x" and ts.held_chars == 0
    pushes = 3000
    for _ in range(pushes):  # "abab...": every character may still begin the stop string
        assert ts.push([1]) == ""
    assert ts.held_chars == 2 * pushes  # held back: exactly the prefix of the stop string seen so far
    assert ts.push([2]) == "ab" * pushes + "x" and ts.held_chars == 0  # mismatch: all of it released
    for _ in range(pushes):
        ts.push([1, 2])
    assert ts.finish() == "" and not ts.stopped
    chars = 1 + 2 * pushes + 1 + 3 * pushes
    # Work: a few lookups per character of text, and each id decoded at most three times (as new,
    # then twice as the next push's left context), not a scan of the 200 KB stop string or of the
    # whole output per push.
    assert CountingStr.lookups - build <= 4 * chars
    assert decoded["n"] <= 3 * (1 + pushes + 1 + 2 * pushes)


def test_the_stop_string_ends_the_text_even_when_it_begins_in_held_text():
    ts = TextStream(lambda ids: "".join(chr(t) for t in ids), set(), ("</answer>", "wer"))
    got = ts.push([ord(c) for c in "42 </ans"])
    assert got == "42 " and ts.held_chars == len("</ans")
    got += ts.push([ord(c) for c in "wer> more"])
    assert got == "42 " and ts.stopped  # "</answer>" starts before "wer": the earliest start wins
    assert ts.push([ord("x")]) == "" and ts.finish() == ""


def test_include_stop_keeps_the_first_stop_string_to_complete_and_holds_nothing_back():
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string that completed
    first (of two ending together, the longer); text that may begin a stop string is not held."""

    def chars(text):
        return [ord(c) for c in text]

    ts = TextStream(lambda ids: "".join(chr(t) for t in ids), set(), ("</answer>", "wer"), include_stop=True)
    assert ts.push(chars("42 </ans")) == "42 </ans" and ts.held_chars == 0
    assert ts.push(chars("wer> more")) == "wer" and ts.stop_string == "wer"  # "wer" completes before "</answer>"
    assert ts.push(chars("x")) == "" and ts.finish() == ""
    ts = TextStream(lambda ids: "".join(chr(t) for t in ids), set(), ("bc", "abc"), include_stop=True)
    assert ts.push(chars("xab")) + ts.push(chars("cd")) == "xabc" and ts.stop_string == "abc"
    ts = TextStream(lambda ids: "".join(chr(t) for t in ids), {0}, ("zz",), include_stop=True)
    assert ts.push(chars("no stop") + [0]) + ts.finish() == "no stop"  # the stop token is still not text


def test_stop_matcher_reports_the_first_occurrence_across_pieces():
    m = StopMatcher("aab")
    assert m.feed("xaa") == -1 and m.matched == 2
    assert m.feed("aab") == 3  # "xaa" + "aab": the occurrence ends at the last character
    m = StopMatcher("abab")
    assert m.feed("ababab") == 4


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop", ["a\ufffd", "\ufffd"])
def test_a_trailing_u_fffd_released_at_finish_matches_no_stop_string_as_in_the_engine(stop, include_stop):
    """finish releases a last U+FFFD (an incomplete character) as text; a stop string ending in it
    matched there, while the engine (stop_strings.complete_text) never matches it: the server cut
    or stopped a text the engine had not. Once text follows, both match."""
    pieces = {1: "a", 2: "\ufffd", 3: "b"}

    def decode(ids):
        return "".join(pieces[t] for t in ids)

    ids = [3, 1, 2]
    ts = TextStream(decode, set(), (stop,), include_stop=include_stop)
    out = ts.push(ids[:2]) + ts.push(ids[2:])  # the U+FFFD waits for the ids that may complete it
    out += ts.finish()
    assert out == "ba\ufffd" and ts.stop_string is None and ts.stop_reason is None
    assert not contains_stop_string(decode, ids, 0, 0, (stop,))  # the engine's check agrees
    ids.append(3)  # text after the U+FFFD: a complete (invalid) character, which both match
    ts = TextStream(decode, set(), (stop,), include_stop=include_stop)
    out = ts.push(ids) + ts.finish()
    assert contains_stop_string(decode, ids, 0, 0, (stop,))
    assert out == ("ba\ufffd" if include_stop else "b" + "a\ufffd"[: 2 - len(stop)]) and ts.stop_string == stop


def _without_spans(decode, ids, hidden, text) -> str:
    """``text`` (a prefix of ``decode(ids)``) without the characters of the ``hidden`` ids."""
    keep, pos = [], 0
    for k, t in enumerate(ids):
        after = len(decode(ids[: k + 1]))
        if t not in hidden:
            keep.append((pos, after))
        pos = after
    return "".join(text[a : min(b, len(text))] for a, b in keep if a < len(text))


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_hidden_ids_are_left_out_of_the_text_and_nothing_else_changes(tok, seed, include_stop):
    """``hidden_ids`` (the end-of-message id of an ``ignore_eos`` sample): its marker is not text,
    however the ids are split into pushes; the stop strings still match the text with the marker
    (as the engine's check does), and a marker's text written by ordinary ids stays."""

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    eos = tok.convert_tokens_to_ids(tok.eos_token)
    marker = decode([eos])
    literal = tok.encode(marker[:-1], add_special_tokens=False) + tok.encode(marker[-1], add_special_tokens=False)
    assert eos not in literal and decode(literal) == marker
    rng = random.Random(seed)
    pool = tok.encode("é ü 12 * 34 = 408 — naïve café ✓ It is 408.", add_special_tokens=False) + list(range(3, 300))
    ids = [rng.choice(pool) for _ in range(100)]
    for _ in range(8):  # the marker, and now and then the marker's text in ordinary ids
        at = rng.randrange(len(ids))
        ids[at:at] = [eos] * rng.randint(1, 2) if rng.random() < 0.8 else literal
    whole = decode(ids)
    i = whole.index(marker)
    # a stop string over a marker (seed % 3 == 1), or one that only begins like the marker's end
    # (held back over the hidden span, then released), or none to find
    stops = {0: ("zzq",), 1: (whole[max(i - 2, 0) : i + len(marker) + 1],), 2: (marker[1:] + "zzq",)}[seed % 3]
    ts = TextStream(decode, set(), stops, include_stop=include_stop, hidden_ids={eos})
    out = _push_in_random_pieces(ts, ids, rng)
    assert out == _without_spans(decode, ids, {eos}, _reference(decode, ids, set(), stops, include_stop))
    assert (ts.stop_string is not None) == (seed % 3 == 1)


def test_a_hidden_marker_is_left_out_even_when_it_is_released_in_two_pieces():
    def decode(ids):
        return "".join("<E>" if t == 0 else chr(t) for t in ids)

    def chars(text):
        return [ord(c) for c in text]

    ts = TextStream(decode, set(), ("E>q",), hidden_ids={0})
    assert ts.push(chars("ab") + [0]) == "ab"  # "<" of the marker released, "E>" held: it may begin "E>q"
    assert ts.push(chars("c<E>")) == "c<"  # the marker's text from ordinary ids is text
    assert ts.push([0, 0]) + ts.push(chars("d")) + ts.finish() == "E>d"
    ts = TextStream(decode, set(), ("b<E>c",), hidden_ids={0})  # matched with the marker, as the engine does
    assert ts.push(chars("ab") + [0] + chars("cd")) + ts.finish() == "a" and ts.stop_string == "b<E>c"
    ts = TextStream(decode, set(), ("b<E>c",), include_stop=True, hidden_ids={0})
    assert ts.push(chars("ab") + [0] + chars("cd")) + ts.finish() == "abc" and ts.stop_string == "b<E>c"


@pytest.mark.parametrize("pushes", [1, 7])
def test_hidden_ids_cost_work_linear_in_the_output(tok, pushes):
    """An ignore_eos sample may write its end-of-message token thousands of times (a model that
    has answered repeats it up to max_tokens), and a non-streamed answer is one push: each hidden
    id's span was found by decoding every id before it in the push, quadratic work (seconds for
    4000 ids, minutes for 32K, on the server's event loop). Each id is decoded a few times now."""
    decoded = {"n": 0}

    def decode(ids):
        decoded["n"] += len(ids)
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    eos = tok.convert_tokens_to_ids(tok.eos_token)
    answer = tok.encode("It is 408 ✓.", add_special_tokens=False)
    ids = answer + [eos] * 1500 + tok.encode(" é", add_special_tokens=False) + [eos, answer[0]] * 500
    ts = TextStream(decode, set(), ("zzq",), hidden_ids={eos})
    step = -(-len(ids) // pushes)
    out = "".join(ts.push(ids[k : k + step]) for k in range(0, len(ids), step)) + ts.finish()
    assert decoded["n"] <= 10 * len(ids)  # was ~1500 * 2500 ids (each push's ids up to each hidden one)
    assert out == decode(answer) + " é" + decode([answer[0]]) * 500

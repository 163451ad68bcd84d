"""Stop strings checked on a tail window of the output (engine/stop_strings.py): step by step the
same answer as searching the whole decoded output, with the project's byte-level BPE (multi-byte
characters split over ids, markers, U+FFFD), and decoded ids per step bounded by the window, not
growing with the output."""

import random

import pytest
import torch
from server_util import tiny_tokenizer  # tests/ on sys.path
from test_engine_async import _drive  # tests/ on sys.path: run requests to the end, pages freed
from test_engine_core import _model

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.stop_strings import WINDOW_MARGIN, contains_stop_string, stop_window


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte value -> the id of the one-byte token (so a character can be split over ids)."""
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in _byte_chars().items()}
    assert len(set(ids.values())) == 256 and tok.unk_token_id not in ids.values()
    return ids


def _first_stop(check, steps):
    """The first check point (a token count) where ``check(prev, k)`` is True, else None."""
    prev = 0
    for k in steps:
        if check(prev, k):
            return k
        prev = k
    return None


def _complete(text: str) -> str:
    """The text a stop string is matched in: a last U+FFFD (maybe a character still cut) held back."""
    return text[:-1] if text.endswith("\ufffd") else text


def _assert_same_first_stop(decode, prompt, ids, stops, steps):
    want = _first_stop(lambda prev, k: any(s in _complete(decode(ids[:k])) for s in stops), steps)
    got = _first_stop(
        lambda prev, k: contains_stop_string(decode, prompt + ids[:k], len(prompt), prev, stops),
        steps,
    )
    assert got == want, (stops, want, got)
    return want


TEXT = "It is 408 — naïve café ✓ 😀 日本語 x é ü <tool> ]~b] [e~[ ]<]minimax[>[ a  b\n"


@pytest.mark.parametrize("seed", range(24))
def test_window_check_gives_the_whole_text_check_first_stop(tok, decode, byte_ids, seed):
    rng = random.Random(seed)
    ordinary = tok.encode(TEXT, add_special_tokens=False)
    ids: list[int] = []
    while len(ids) < 160:  # ordinary tokens, random ids (markers included) and characters split into bytes
        r = rng.random()
        if r < 0.4:
            ids += ordinary[rng.randrange(len(ordinary)) :][: rng.randint(1, 6)]
        elif r < 0.6:
            ids.append(rng.randrange(len(tok)))
        else:
            ids += [byte_ids[b] for b in rng.choice(TEXT).encode()]
    whole = decode(ids)
    prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 5))]
    # Step sizes: one token (plain decode), or several (forks, multi-token steps).
    sizes = [1] * len(ids) if seed % 2 == 0 else [rng.randint(1, 5) for _ in ids]
    steps = [k for k in (sum(sizes[: i + 1]) for i in range(len(sizes))) if k <= len(ids)] + [len(ids)]
    steps = sorted(set(steps))
    late = whole[len(whole) * 3 // 4 :]
    cases = (
        [
            (late[i : i + rng.randint(1, 4)],)  # short, late: the window is far from the output's start
            for i in rng.sample(range(len(late) - 4), 4)
        ]
        + [
            (late[-40:],),  # spans many tokens
            (" " + late[-3:].lstrip(),),  # leading space
            (rng.choice("éü✓😀日"),),  # one multi-byte character
            ("\ufffd",),  # what a cut character decodes to
            ("zzzq", "\ufffd" + late[-2:]),  # never / only where the decode has U+FFFD
            ("]~b]", "[e~["),  # marker texts
            (late[-2:], late[-30:], "never there"),  # several lengths: the longest sets the window
        ]
    )
    found = 0
    for stops in cases:
        stops = tuple(s for s in stops if s)
        found += _assert_same_first_stop(decode, prompt, ids, stops, steps) is not None
    assert found >= 5  # most cases do stop, some late in the output


def test_a_window_starting_inside_a_character_makes_no_false_stop(decode, byte_ids):
    """Output "éa" * 60 with "é" split into its two bytes, checked every 3 tokens: the whole text
    never holds U+FFFD, but some windows start on the continuation byte and decode to one."""
    unit = [byte_ids[0xC3], byte_ids[0xA9], byte_ids[ord("a")]]
    ids = unit * 60
    starts = []

    def recording(window_ids):
        text = decode(window_ids)
        starts.append(text[:1])
        return text

    for length in (1, 2, 3):  # one of the three aligns the window start with the continuation byte
        stops = ("\ufffd", "z" * length)
        steps = list(range(3, len(ids) + 1, 3))
        assert _assert_same_first_stop(recording, [], ids, stops, steps) is None
    assert "\ufffd" in starts  # the U+FFFD case was exercised and rejected on the whole text
    # A one-byte step ends inside "é": the decode ends in U+FFFD, but the character is not complete
    # yet (its next byte completes it): no stop there (it used to stop at the first token).
    assert _assert_same_first_stop(decode, [], ids, ("\ufffd",), range(1, len(ids) + 1)) is None


def test_a_complete_invalid_byte_sequence_still_matches_a_stop_string_holding_u_fffd(decode, byte_ids):
    """Review finding: the check matched the partial decode, so a stop string holding U+FFFD fired
    on a character whose bytes were still coming. The last U+FFFD is held back; a U+FFFD the text
    really has (a lone continuation byte, a lead byte followed by ASCII) matches once text follows."""
    a, lead, cont = byte_ids[ord("a")], byte_ids[0xC3], byte_ids[0xA9]
    every = lambda ids: range(1, len(ids) + 1)  # noqa: E731 - one-token steps
    # "a", C3 (cut: held back), then "a": C3 followed by ASCII is a complete invalid sequence
    ids = [a, lead, a, a]
    assert decode(ids[:2]).endswith("\ufffd") and decode(ids[:3]) == "a\ufffda"
    assert _assert_same_first_stop(decode, [], ids, ("\ufffd",), every(ids)) == 3
    assert contains_stop_string(decode, ids[:2], 0, 1, ("\ufffd",)) is False  # held back
    assert contains_stop_string(decode, ids[:3], 0, 2, ("\ufffd",)) is True
    # a lone continuation byte, then a cut lead byte: the first U+FFFD is complete, the second held
    ids = [a, cont, lead]
    assert decode(ids) == "a\ufffd\ufffd"
    assert contains_stop_string(decode, ids, 0, 2, ("a\ufffd",)) is True
    assert contains_stop_string(decode, ids, 0, 2, ("\ufffd\ufffd",)) is False
    assert contains_stop_string(decode, ids + [a], 0, 3, ("\ufffd\ufffd",)) is True
    # the window path (a long output): the same answers, confirmed on the whole text
    pre = [a] * 80
    assert contains_stop_string(decode, pre + [lead], 0, 80, ("\ufffd",)) is False
    assert contains_stop_string(decode, pre + [lead, a], 0, 81, ("\ufffd",)) is True
    assert contains_stop_string(decode, pre + [lead, cont], 0, 81, ("\ufffd",)) is False  # "é"


def test_stop_window_counts_new_tokens_and_four_bytes_per_character():
    assert stop_window(1, 3) == 1 + 12 + WINDOW_MARGIN
    assert stop_window(5, 3) - stop_window(1, 3) == 4
    assert stop_window(1, 10) - stop_window(1, 3) == 28


# ---- engine level ------------------------------------------------------------------------------
V = 96
MODEL = _model()  # the engine-core tests' random tiny M3 (max position 256)


def _detok(ids):
    return " ".join(map(str, ids)) + " "


def _engine(detokenize):
    cfg = EngineConfig(eos_token_ids=(), max_model_len=256, max_num_seqs=8, async_scheduling=False)
    return LLMEngine(MODEL, cfg, detokenize=detokenize)


def _prompt(n, seed):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_engine_decodes_a_bounded_window_per_step_and_stops_where_the_whole_text_does():
    decoded = {"ids": 0, "calls": 0, "max": 0}

    def counting(ids):
        decoded["ids"] += len(ids)
        decoded["calls"] += 1
        decoded["max"] = max(decoded["max"], len(ids))
        return _detok(ids)

    n, new = 2, 120
    prompt = _prompt(8, 0)

    def req(stops):
        p = SamplingParams(n=n, seed=5, max_new_tokens=new, stop_token_ids=(), stop_strings=stops)
        return GenerationRequest("r", prompt, p)

    # Never found (no eos either): every sample (the forked one included) runs to the length and
    # each check decodes one window, so the total is linear in the generated tokens. The
    # whole-output decode was quadratic: the sum over steps of the output length, 2 * 120 * 121 / 2
    # = 14520 ids here, against a bound of 240 * 29 = 6960.
    stops = ("zz zz",)
    ref = _drive(_engine(counting), [req(stops)])
    assert [len(o.output_ids) for o in ref.values()] == [new] * n
    assert decoded["calls"] == n * new  # one check per appended token
    assert decoded["max"] == stop_window(1, len(stops[0]))
    assert decoded["ids"] <= n * new * stop_window(1, len(stops[0]))
    # Found late in the output: each sample stops at the first token whose text completes a stop
    # string in its whole output (sample 0's tokens 90-91; the other sample where it has one).
    long = ref[("r", 0)].output_ids
    stops = (f" {long[90]} {long[91]} ", "zz zz")
    stopped = _drive(_engine(counting), [req(stops)])
    assert stopped[("r", 0)].finish_reason == "stop"
    for key, o in stopped.items():
        full = ref[key].output_ids
        k = next((k for k in range(1, len(full) + 1) if any(s in _detok(full[:k]) for s in stops)), None)
        assert o.output_ids == (full[:k] if k else full), key
        assert o.finish_reason == ("stop" if k else "length")


def test_engine_holds_back_a_character_cut_mid_generation():
    """The engine with a byte-level ``detokenize`` whose token 7 is the byte 0xC3 (a two-byte
    character's lead), forced by ``logit_bias``: after one token the decode ends in a cut character
    (U+FFFD), which no longer ends the sample on a stop string holding U+FFFD; after two, the first
    0xC3 is followed by another lead byte: a complete invalid sequence, a U+FFFD the text has."""
    lead = 7

    def byte_decode(ids):
        return b"".join(b"\xc3" if t == lead else bytes([ord("a") + t % 26]) for t in ids).decode(
            "utf-8", errors="replace"
        )

    def run(stops, max_new):
        p = SamplingParams(
            temperature=0.0, max_new_tokens=max_new, stop_token_ids=(), stop_strings=stops, logit_bias=((lead, 100.0),)
        )
        return _drive(_engine(byte_decode), [GenerationRequest("r", _prompt(6, 1), p)])[("r", 0)]

    one = run(("\ufffd",), 1)
    assert (one.output_ids, one.finish_reason) == ([lead], "length")  # it stopped on the cut character
    more = run(("\ufffd",), 6)
    assert (more.output_ids, more.finish_reason) == ([lead, lead], "stop")
    assert run(("\ufffd\ufffd",), 6).output_ids == [lead] * 3  # the third token completes the second

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


def _assert_same_first_stop(decode, prompt, ids, stops, steps):
    want = _first_stop(lambda prev, k: any(s in decode(ids[:k]) for s in stops), steps)
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
    # A one-byte step ends inside "é": the whole text ends in U+FFFD, so the check stops there.
    assert _assert_same_first_stop(decode, [], ids, ("\ufffd",), range(1, len(ids) + 1)) == 1


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

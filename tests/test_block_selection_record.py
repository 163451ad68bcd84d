"""Block-selection record (engine side): SampleOutput.block_selection equals the block choice of a
plain (non-paged) forward for every position the engine ran, however the tokens reached the pages
(chunked prefill, group forks, prefix-cache hits of a later turn, preemption by recompute, async
scheduling, the staged decode path); the coded segment round-trips; the kernels write the record.

Tiny model with page (= block) size 4 and top-3 blocks: selection is sparse beyond 12 tokens. CPU, fp32.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment, canonical_rows

PS, K = 4, 3


def _model(seed=0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=96, max_position_embeddings=512, sparse_block_size=PS, sparse_topk_blocks=K)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim >= 2 else 0.1)
    return m.eval()


def plain_selection(model: M3ForCausalLM, tokens: list[int]) -> np.ndarray:
    """int16 [L, S, G, K]: every sparse layer's block choice for each token by one plain forward."""
    with torch.no_grad():
        model(torch.tensor([tokens]))
    sel = [a.last_selected_blocks[0].permute(1, 0, 2) for a in model.sparse_attention_layers()]  # [L, G, K] each
    return torch.stack(sel, dim=1).to(torch.int16).numpy()


def _backend(model, **kw) -> NativeBackend:
    args = dict(max_model_len=256, max_num_seqs=8, num_pages=64, max_num_batched_tokens=16)
    args.update(kw)
    return NativeBackend(model, (95,), record_block_selection=True, **args)


def _check(model, out, start=0):
    """The output's record covers [start, prompt + output - 1) and equals the plain forward's choice."""
    tokens = list(out.prompt_ids) + list(out.output_ids)
    rec = out.block_selection
    assert isinstance(rec, SelectionRecord) and rec.segments[0].start == start
    assert rec.end == len(tokens) - 1  # the last sampled token was never run
    got = rec.dense(rec.end)[start:]
    np.testing.assert_array_equal(got, plain_selection(model, tokens)[start : rec.end])


def _prompt(n, seed):
    return torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_record_of_a_forked_group_in_chunks_equals_plain_forward(async_scheduling):
    m = _model()
    be = _backend(m, async_scheduling=async_scheduling)  # a 41-token prompt in chunks of 16
    outs = be.generate([GenerationRequest("g", _prompt(41, 1), SamplingParams(n=3, max_new_tokens=12, seed=3))])
    for o in outs:  # samples 1, 2 forked from the leader: shared full pages, copied partial page
        _check(m, o)
        assert o.block_selection.dims == (3, 2, K)
    # the group's prompt is one segment object, each sample adds only its own tokens
    assert outs[1].block_selection.segments[0] is outs[0].block_selection.segments[0]
    assert outs[0].block_selection.segments[0].end == 41


def test_next_turn_records_only_new_tokens_and_reads_cached_pages():
    m = _model(1)
    be = _backend(m)
    first = be.generate([GenerationRequest("t1", _prompt(30, 2), SamplingParams(n=1, max_new_tokens=9, seed=1))])[0]
    _check(m, first)
    covered = first.block_selection.end
    ctx = first.prompt_ids + first.output_ids + [7, 8, 9, 10, 11]  # the bridge of a tool turn
    hits = be.metrics()["prefix_cache_hit_tokens"]
    nxt = be.generate(
        [GenerationRequest("t2", ctx, SamplingParams(n=1, max_new_tokens=6, seed=1), block_selection_from=covered)]
    )[0]
    assert be.metrics()["prefix_cache_hit_tokens"] - hits >= 32  # positions up to the last full page were cached
    _check(m, nxt, start=covered)  # the last token of turn 1 and the bridge: computed now; the rest: not resent
    whole = first.block_selection.then(nxt.block_selection)
    np.testing.assert_array_equal(whole.dense(whole.end), plain_selection(m, ctx + nxt.output_ids)[: whole.end])


def test_record_survives_preemption_by_recompute():
    m = _model(2)
    # 18 pages of 4 tokens for 3 growing samples of ~40 tokens: the newest ones get preempted
    be = _backend(m, num_pages=18, enable_prefix_caching=False, max_num_batched_tokens=64, max_model_len=64)
    reqs = [
        GenerationRequest(f"r{i}", _prompt(14 + i, 10 + i), SamplingParams(max_new_tokens=30, seed=i)) for i in range(3)
    ]
    outs = be.generate(reqs)
    assert be.metrics()["num_preemptions"] > 0
    for o in outs:
        _check(m, o)


def test_staged_decode_path_writes_the_record():
    m = _model(3)
    be = _backend(m, enable_cuda_graphs="eager", cuda_graph_batch_sizes=(1, 2, 4))
    outs = be.generate([GenerationRequest("g", _prompt(20, 4), SamplingParams(n=2, max_new_tokens=16, seed=2))])
    assert be.engine.stats.graph_steps > 0
    for o in outs:
        _check(m, o)


def test_recording_off_leaves_no_record():
    be = NativeBackend(_model(), (95,), max_model_len=64, num_pages=16)
    out = be.generate([GenerationRequest("g", _prompt(20, 5), SamplingParams(max_new_tokens=3))])[0]
    assert out.block_selection is None and be.engine.selection is None


def test_bad_record_start_is_a_request_error():
    be = _backend(_model())
    out = be.generate([GenerationRequest("g", [1, 2, 3], SamplingParams(max_new_tokens=2), block_selection_from=9)])[0]
    assert out.finish_reason == "error" and "block_selection_from" in out.error


# ---- the record format ------------------------------------------------------------------------
def _rows(n, seed, dims=(5, 4, 16), nb=300):
    g = np.random.default_rng(seed)
    rows = np.sort(g.choice(nb, size=(n, *dims)), axis=-1).astype(np.int16)  # a few repeats; fine for the codec
    rows[: n // 3, :, :, -4:] = -1  # early tokens: fewer candidates than K
    return g.permuted(rows, axis=-1)  # any order within a row


def test_coded_segment_round_trips_the_sets():
    rows = _rows(50, 0)
    seg = SelectionSegment.from_rows(7, rows)
    back = SelectionSegment.from_bytes(seg.to_bytes())
    assert (back.start, back.length, back.dims) == (7, 50, (5, 4, 16))
    np.testing.assert_array_equal(back.rows, canonical_rows(rows))  # ascending, -1 last
    assert (canonical_rows(rows)[: 50 // 3, ..., -4:] == -1).all()
    again = pickle.loads(pickle.dumps(seg))  # what an EP worker sends: the coded form
    np.testing.assert_array_equal(again.rows, canonical_rows(rows))
    with pytest.raises(ValueError, match="MSB1"):
        SelectionSegment.from_bytes(b"nope" + bytes(20))


def test_record_dense_and_sharing_survive_pickling():
    a = SelectionSegment.from_rows(0, _rows(10, 1))
    b = SelectionSegment.from_rows(12, _rows(4, 2))
    rec = SelectionRecord([a, b])
    d = rec.dense(14)
    assert (d[10:12] == -1).all() and rec.end == 16
    np.testing.assert_array_equal(d[:10], a.rows)
    other = SelectionRecord([a, SelectionSegment.from_rows(10, _rows(3, 3))])
    x, y = pickle.loads(pickle.dumps([rec, other]))  # one pickle: the shared prompt segment stays one object
    assert x.segments[0] is y.segments[0]
    with pytest.raises(ValueError, match="overlap"):
        SelectionRecord([b, a])

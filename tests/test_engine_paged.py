"""Paged forward path == plain model forward (fp32), for every way a sequence can reach the pages.

Tiny config with page (= sparse block) size 4 and top-3 blocks: selection is sparse beyond 12
tokens, so "short" sequences (<= 12) run dense-equivalent and "long" ones (30-45) really select.
"""

import pytest
import torch

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.interface import SamplingParams
from m3_rollout.engine.model_runner import prepare_inputs
from m3_rollout.engine.ops import paged_ops_for
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.engine.sequence import Sequence
from m3_rollout.model import M3ForCausalLM, tiny_config

PS = 4
TOL = 2e-5  # fp32 max |logits difference|; measured ~1e-6
OPS = paged_ops_for("cpu", torch.float32)  # the engine's CPU table (PyTorch references)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=96, max_position_embeddings=256, sparse_block_size=PS, sparse_topk_blocks=3)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim >= 2 else 0.1)
    return m.eval()


class Harness:
    """Runs sequences through forward_paged with a BlockManager, like the engine does."""

    def __init__(self, model, num_pages=64, prefix=True):
        self.model = model
        self.kv = PagedKVCache(model.config, num_pages, torch.float32)
        self.bm = BlockManager(num_pages, PS, enable_prefix_caching=prefix)
        self._n = 0

    def seq(self, tokens):
        self._n += 1
        s = Sequence(self._n, f"r{self._n}", self._n, 0, SamplingParams(), tokens, frozenset(), 10**6)
        self.bm.admit(s)
        return s

    @torch.no_grad()
    def step(self, rows, decode_query_len=1, num_decodes=None):
        """rows: list of (seq, num_tokens). Returns logits of every query token, per row."""
        for s, n in rows:
            assert self.bm.ensure(s, n)
        chunks = [s.token_ids[s.num_computed : s.num_computed + n] for s, n in rows]
        if num_decodes is None:
            num_decodes = sum(1 for _, n in rows if n == decode_query_len) if decode_query_len == 1 else 0
        inp = prepare_inputs(
            chunks,
            [s.num_computed for s, _ in rows],
            [list(s.block_table) for s, _ in rows],
            PS,
            num_decodes,
            decode_query_len=decode_query_len,
        )
        logits = self.model.forward_paged(inp.input_ids, inp.meta, self.kv, OPS)  # all tokens
        out, start = [], 0
        for s, n in rows:
            out.append(logits[start : start + n])
            start += n
            s.num_computed += n
            self.bm.register_full_pages(s)
        return out


def _plain(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]  # [L, V]


def _check(model, seq, got, start):
    want = _plain(model, seq.token_ids)[start : start + got.shape[0]]
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("length", [9, 37])
def test_one_pass_prefill_and_token_by_token_decode(length):
    m = _model()
    h = Harness(m)
    toks = torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    a = h.seq(toks)
    (got,) = h.step([(a, length)])
    _check(m, a, got, 0)
    b = h.seq(toks[:3])
    h.step([(b, 3)])
    for i in range(3, length):  # decode one by one, sequence grows through page edges
        b.token_ids.append(toks[i])
        (got,) = h.step([(b, 1)])
        _check(m, b, got, i)


@pytest.mark.parametrize("chunks", [[3, 5, 1, 7, 14], [4, 8, 4, 20], [1, 1, 2, 32]])
def test_chunked_prefill_edges_inside_and_at_pages(chunks):
    m = _model()
    h = Harness(m)
    toks = torch.randint(0, 96, (sum(chunks),), generator=torch.Generator().manual_seed(1)).tolist()
    s = h.seq(toks)
    start = 0
    for n in chunks:
        (got,) = h.step([(s, n)])
        _check(m, s, got, start)
        start += n


def test_mixed_batch_decodes_and_prefills_of_different_lengths():
    m = _model()
    h = Harness(m)
    g = torch.Generator().manual_seed(2)
    seqs = [h.seq(torch.randint(0, 96, (n,), generator=g).tolist()) for n in (11, 30, 5, 41)]
    h.step([(seqs[0], 10), (seqs[1], 29), (seqs[2], 2), (seqs[3], 17)])
    # Now rows 0 and 1 decode (1 token), rows 2 and 3 continue prefill chunks.
    outs = h.step([(seqs[0], 1), (seqs[1], 1), (seqs[2], 3), (seqs[3], 24)])
    for s, got in zip(seqs, outs):
        _check(m, s, got, s.num_computed - got.shape[0])


@pytest.mark.parametrize("length", [10, 34])
def test_prefix_cache_hit_equals_plain_forward(length):
    m = _model()
    h = Harness(m)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (length,), generator=g).tolist()
    a = h.seq(prompt + [7, 8, 9])
    h.step([(a, a.num_tokens)])
    h.bm.free_seq(a)  # pages stay cached
    b = h.seq(prompt + [1, 2])  # shares the full pages of `prompt`
    assert b.num_computed == (length // PS) * PS > 0 and h.bm.hit_tokens == b.num_computed
    (got,) = h.step([(b, b.num_tokens - b.num_computed)])
    _check(m, b, got, b.num_computed - got.shape[0])


@pytest.mark.parametrize("length", [8, 33])
def test_multi_token_decode_queries_speculative_verify_shape(length):
    m = _model()
    h = Harness(m)
    g = torch.Generator().manual_seed(4)
    seqs = [h.seq(torch.randint(0, 96, (length + k,), generator=g).tolist()) for k in (0, 5)]
    h.step([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.token_ids += torch.randint(0, 96, (3,), generator=g).tolist()
    outs = h.step([(s, 3) for s in seqs], decode_query_len=3, num_decodes=2)
    for s, got in zip(seqs, outs):
        _check(m, s, got, s.num_tokens - 3)


def test_recompute_after_preemption_equals_plain_forward():
    m = _model()
    h = Harness(m, prefix=False)
    g = torch.Generator().manual_seed(5)
    s = h.seq(torch.randint(0, 96, (30,), generator=g).tolist())
    h.step([(s, 30)])
    h.bm.free_seq(s)  # preempted: pages gone, other data overwrites them
    other = h.seq(torch.randint(0, 96, (60,), generator=g).tolist())
    h.step([(other, 60)])
    h.bm.free_seq(other)
    h.bm.admit(s)
    s.token_ids.append(5)
    (got,) = h.step([(s, 31)])
    _check(m, s, got, 0)


def test_empty_step_runs_every_layer():
    m = _model()
    h = Harness(m)
    inp = prepare_inputs([], [], [], PS, 0)
    with torch.no_grad():
        out = m.forward_paged(inp.input_ids, inp.meta, h.kv, OPS)
    assert out.shape == (0, 96)
    # Every MoE layer ran (EP lockstep needs its collectives once per step), on zero tokens.
    assert all(moe.last_topk_ids is not None and moe.last_topk_ids.shape[0] == 0 for moe in m.moe_layers())

"""FP8 (e4m3) index-key cache: format, quantization kernels and the score kernels that read it, on CPU.

The format and its PyTorch reference are ``m3_kernels.paged_layout`` (quantize_index_keys,
FP8IndexCache); the Triton kernels (kernels/msa_fp8.py helpers, the fused write kernel, the decode
and prefill index-score kernels) run under the Triton interpreter, which loads, converts and
multiplies fp8 exactly (its own float -> fp8 rounding is not used: the kernels round in integer
arithmetic). Tiny preset shapes as tests/test_kernels_msa*.py (8 q heads / 2 KV heads / d 32 /
block 16 / top-k 4). fp32 queries (the interpreter mishandles bf16).
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.fused_interpret import interpreted_fused_layers
from m3_kernels.msa_interpret import interpreted_kernels, interpreted_module
from m3_kernels.msa_synthetic import make_paged_batch
from m3_kernels.paged_layout import FP8IndexCache, dequantize_index_keys, e4m3_pow2_scales, quantize_index_keys
from m3_rollout.engine.reference_ops import index_topk_ref, paged_attention_ref
from m3_rollout.model.attention import write_paged_kv

mi, _, md = interpreted_kernels()  # sets TRITON_INTERPRET=1
f8 = interpreted_module("m3_kernels.msa_fp8")
st = interpreted_module("m3_kernels.msa_score_topk")
fl = interpreted_fused_layers()

PS, G, NH, D, K = 16, 2, 8, 32, 4
SCALE = D**-0.5


def _fp8_batch(rows, nd, quantize_queries, seed=0, **kw):
    b = make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=torch.float32, seed=seed, **kw
    )
    return b, FP8IndexCache(*quantize_index_keys(b.ik), quantize_queries)


def test_round_trip_error_bound_and_scales():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen) * torch.logspace(-6, 6, 512)[:, None]
    x[0] = 0.0
    codes, scales = quantize_index_keys(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (512,)
    back = dequantize_index_keys(codes, scales)
    # e4m3 keeps 3 mantissa bits: half an ulp is <= 2**-4 of |x| (normal codes), 2**-10 s below 2**-6 s
    bound = torch.maximum(x.abs() * 2**-4, scales[:, None] * 2**-10)
    assert ((back - x).abs() <= bound).all()
    assert (back - x).abs().max() > 0  # lossy: the comparison is not vacuous
    assert torch.equal(back[0], x[0])  # an all-zero key stays zero
    assert torch.equal(torch.log2(scales).round().exp2(), scales)  # powers of two
    ratio = x[1:].abs().amax(-1) / scales[1:]
    assert (ratio > 128).all() and (ratio <= 256).all()  # largest code in (128, 256]
    assert e4m3_pow2_scales(torch.tensor([1.0, 256.0, 257.0])).tolist() == [2.0**-8, 1.0, 2.0]


def test_kernel_quantization_equals_reference_bitwise():
    # Ties to even at both ends of e4m3 (normal 2.125 -> 2.0, 2.375 -> 2.5; subnormal 1.5 * 2**-9 -> 2**-8),
    # values just above a tie, signed zeros, and rows spanning 1e-6 .. 1e6. (A NaN key's codes are checked
    # on the GPU, tests/gpu/test_msa_gpu.py: the interpreter converts a NaN float to the fp8 value 384.)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=gen) * torch.logspace(-6, 6, 16)[:, None]
    x[0, :9] = torch.tensor([256.0, 2.125, 2.375, -2.125, 1.5 * 2**-9, 2.5 * 2**-9, 2**-10 * 1.001, 0.0, -0.0])
    x[0, 9:] = 0.0  # row 0: amax 256 -> scale 1, the codes are the values themselves
    codes, scales = f8.quantize_rows(x)  # quantize_rows_e4m3 on each row
    want_c, want_s = quantize_index_keys(x)
    assert torch.equal(scales, want_s)
    assert scales[0] == 1.0
    assert codes[0, :7].float().tolist() == [256.0, 2.0, 2.5, -2.0, 2**-8, 2**-8, 2**-9]
    assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8))


def test_fused_write_kernel_quantizes_as_reference():
    # The fused norm + RoPE + cache-write kernel stores the same codes and scales as the PyTorch path.
    from m3_rollout.model.norm import gemma_rms_norm
    from m3_rollout.model.rope import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(2)
    nh, g, d, di, r, ps, pages, t = 4, 2, 16, 16, 8, 4, 5, 6
    width = nh * d + 2 * g * d + (g + 1) * di
    qkv = torch.randn(t, width, generator=gen) * 2
    slot = torch.tensor([2, 9, -1, 11, 17, 0])
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 6, 7, 19, 3]), r, 10000.0)
    w = [torch.randn(n, generator=gen) * 0.3 for n in (d, d, di, di)]
    kc, vc = torch.zeros(pages + 1, g, ps, d), torch.zeros(pages + 1, g, ps, d)
    cache = FP8IndexCache(torch.zeros(pages + 1, ps, di, dtype=torch.float8_e4m3fn), torch.zeros(pages + 1, ps))
    ref = FP8IndexCache(cache.keys.clone(), cache.scales.clone())
    kw = dict(index_q_norm_w=w[2], index_k_norm_w=w[3], num_index_heads=g, index_dim=di, index_cache=cache)
    fl.qkv_norm_rope_write(qkv, cos, sin, slot, w[0], w[1], nh, g, d, kc, vc, 1e-6, **kw)
    ik = apply_rope(gemma_rms_norm(qkv[:, -di:], w[3], 1e-6), cos, sin)  # [T, di]
    write_paged_kv(slot, torch.zeros(t, g, d), torch.zeros(t, g, d), ik, kc.clone(), vc.clone(), ref)
    assert torch.equal(cache.scales, ref.scales) and ref.scales.count_nonzero() == t
    assert torch.equal(cache.keys.view(torch.uint8), ref.keys.view(torch.uint8))


@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_index_topk_on_fp8_cache_matches_reference(quantize_queries, monkeypatch):
    # Decode rows (split-K score kernel), a prefill row (tiled score kernel; 4-5 candidate blocks per
    # token: the order of the scored ones counts); selection equal to the reference's on the same
    # quantized keys (and queries).
    b, cache = _fp8_batch([(40, 1), (300, 1), (56, 12)], 2, quantize_queries)
    got = mi.index_topk(b.iq, cache, b.meta, K)
    want = index_topk_ref(b.iq, cache, b.meta, K)
    assert torch.equal(got, want)
    # the scores themselves: the reference's block maxima on the dequantized keys (fp32 order only)
    keys = dequantize_index_keys(cache.keys, cache.scales)
    iq = dequantize_index_keys(*quantize_index_keys(b.iq)) if quantize_queries else b.iq
    scores = mi.index_block_scores(b.iq, cache, b.meta)
    page = b.meta.block_tables[1, :19].long()
    ref = torch.einsum("gd,bpd->gbp", iq[1], keys[page]).amax(-1)  # position 300 = block 18, offset 12
    ref[:, 18] = torch.einsum("gd,pd->gp", iq[1], keys[page[18], :13]).amax(-1)
    torch.testing.assert_close(scores[1, :, :19], ref, atol=1e-5, rtol=0)
    # the GPU's prefill loop (causal split, two key sub-tiles, page ids as vectors, store tiles of 4 or 1
    # blocks, key sub-tiles by pointer loads or a tensor descriptor): every causal score keeps its bits
    causal = torch.arange(scores.shape[2]).view(1, 1, -1) <= (b.meta.positions // PS).view(-1, 1, 1)
    causal = causal.expand_as(scores)
    boxes = []  # the prefill launch's tensor descriptors: [ps / nsub, di] boxes over the [P * ps, di] keys

    def spy(t, block_shape, *args, **kw):
        boxes.append((tuple(t.shape), list(block_shape)))
        return from_tensor(t, block_shape, *args, **kw)

    from_tensor = mi.TensorDescriptor.from_tensor
    monkeypatch.setattr(mi.TensorDescriptor, "from_tensor", spy)
    quantized = []  # the rows quantize_rows was given: once per qpre prefill launch, never for decode rows

    def quantize_spy(x):
        quantized.append(tuple(x.shape))
        return quantize_rows(x)

    quantize_rows = mi.quantize_rows
    monkeypatch.setattr(mi, "quantize_rows", quantize_spy)
    # qpre: the query rows quantized by msa_fp8.quantize_rows before the launch (ignored for bf16 queries)
    for store_b, pvc, tma, nsub, qpre in (
        (4, 2, False, 2, False),
        (1, 0, False, 2, False),
        (4, 2, True, 2, False),
        (2, 0, True, 1, False),
        (4, 2, True, 4, True),
        (1, 0, False, 1, True),
    ):
        cfg = {"split_causal": True, "nsub": nsub, "block_m": 4, "pvc": pvc, "store_b": store_b, "tma": tma}
        cfg["qpre"] = qpre
        n, nq = len(boxes), len(quantized)
        assert torch.equal(mi.index_block_scores(b.iq, cache, b.meta, cfg)[causal], scores[causal])
        assert boxes[n:] == ([((cache.keys.shape[0] * PS, D), [PS // nsub, D])] if tma else [])
        assert quantized[nq:] == ([tuple(b.iq.shape)] if qpre and quantize_queries else [])


def test_quantize_rows_kernel_equals_the_reference():
    """msa_fp8.quantize_rows (the prefill's query rows quantized before the score launch): codes and
    scales bit for bit those of paged_layout.quantize_index_keys, for a [T, G, di] tensor, a strided
    view (heads 0 and 2 of 4) and rows past the kernel's first program; a zero row, and a NaN (its
    row's scale and other codes)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 4, 32, generator=gen) * torch.logspace(-5, 5, 37)[:, None, None]
    x[3] = 0.0
    x[5, 1, 7] = float("nan")
    for rows in (x, x[:, ::2]):
        codes, scales = f8.quantize_rows(rows)
        want_c, want_s = quantize_index_keys(rows)
        assert codes.shape == rows.shape and scales.shape == rows.shape[:-1] and codes.is_contiguous()
        # a NaN's own code is left out: the interpreter converts NaN to a finite e4m3 code (0x7c)
        nan = rows.isnan()
        assert torch.equal(codes.view(torch.uint8)[~nan], want_c.view(torch.uint8)[~nan])
        assert torch.equal(scales, want_s)
    assert f8.quantize_rows(x[:0])[0].shape == (0, 4, 32)


def test_prefill_score_config_per_index_format_and_query_dtype():
    """The CUDA prefill score launch's defaults (prefill_score_config): FP8 keys with 16-bit queries read
    their keys through TMA in 64-token tiles (one 128-key sub-tile with FP8 queries); bf16 keys and
    fp32 queries (IEEE dots; no TMA whatever the keys) keep pointer loads, two sub-tiles and 32 tokens;
    FP8 queries from 16-bit rows are quantized before the launch (qpre);
    more than 4 heads halve the tile (the old bf16 rule: 16 tokens past 128 rows)."""
    keys = torch.zeros(4, 128, 128)
    fp8 = FP8IndexCache(*quantize_index_keys(keys), False)
    fp8q = FP8IndexCache(*quantize_index_keys(keys), True)
    iq = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    want = {
        (torch.bfloat16, "bf16"): (False, 2, 32),
        (torch.bfloat16, "fp8"): (True, 2, 64),
        (torch.bfloat16, "fp8q"): (True, 1, 64),
        (torch.float32, "fp8"): (False, 2, 32),
        (torch.float32, "fp8q"): (False, 2, 32),
    }
    for (dtype, fmt), (tma, nsub, bm) in want.items():
        cache = {"bf16": keys.to(dtype), "fp8": fp8, "fp8q": fp8q}[fmt]
        cfg = mi.prefill_score_config(iq.to(dtype), cache)
        assert (cfg["tma"], cfg["nsub"], cfg["block_m"]) == (tma, nsub, bm), (dtype, fmt)
        assert cfg["store_b"] == mi.PREFILL_SCORE_STORE_B[fmt] and cfg["maxnreg"] == 128
        # FP8 queries from 16-bit rows: quantized before the launch (fp32 rows take the bf16 entry: off)
        assert cfg["qpre"] == (dtype == torch.bfloat16 and fmt == "fp8q"), (dtype, fmt)
    assert mi.prefill_score_config(torch.zeros(1, 8, 128, dtype=torch.bfloat16), keys.bfloat16())["block_m"] == 16
    assert mi.prefill_score_config(torch.zeros(1, 8, 128, dtype=torch.bfloat16), fp8q)["block_m"] == 32


@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_fused_decode_on_fp8_cache_matches_reference(quantize_queries, monkeypatch):
    b, cache = _fp8_batch([(40, 1), (300, 1), (63, 1)], 3, quantize_queries, seed=4)
    sel = index_topk_ref(b.iq, cache, b.meta, K)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    ids = torch.full((3, G, K), -7, dtype=torch.int32)
    got = md.msa_decode(b.q, b.iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)  # scores + in-register top-k
    assert torch.equal(ids, sel)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # the long-context routes (block table wider than MAX_FUSED_BLOCKS): the default (LONG_DECODE_PATH) and
    # the other one (score kernel with a top-k per program / index_topk's split-K scores, merged in K2)
    monkeypatch.setattr(md, "MAX_FUSED_BLOCKS", 8)
    for path in (None, "score_topk" if md.LONG_DECODE_PATH == "index_topk" else "index_topk"):
        ids.fill_(-7)
        got = md.msa_decode(b.q, b.iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids, decode_path=path)
        assert torch.equal(ids, sel), path
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_score_topk_on_fp8_cache_several_programs_and_lengths(quantize_queries):
    # FP8 keys (and queries) through the score kernel with a top-k per program: rows of 700 / 40 (fewer
    # blocks than k) / 300 tokens, 1, 44 and 5 programs per row, forced init + local blocks; the
    # selection equals the reference's on the dequantized keys (and queries). The lists are merged in
    # PyTorch (candidate_block_ids), the last ones also in the attention kernel (the kernel merge of
    # every split count: tests/test_kernels_msa_score_topk.py; it reads the lists' int64 keys only).
    b, cache = _fp8_batch([(700, 1), (40, 1), (300, 1)], 3, quantize_queries, seed=8)
    sel = index_topk_ref(b.iq, cache, b.meta, K, 1, 2)
    for splits in (1, 44, 5):
        cand, bps = st.decode_score_topk(b.iq, cache, b.meta, 3, K, 1, 2, splits=splits)
        assert torch.equal(st.candidate_block_ids(cand, bps, b.meta.positions, PS, K), sel), splits
    ids = torch.full((3, G, K), -7, dtype=torch.int32)
    got = md.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, cands=(cand, bps), ids_out=ids)
    assert torch.equal(ids, sel)
    torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)


def test_fp8_selection_close_to_full_precision():
    # Quantization changes block maxima by ~2**-4 relative at most, so most selections survive it (the
    # benchmark measures the match rate at real shapes; here a sanity floor on random data).
    b, cache = _fp8_batch([(700, 1), (500, 1)], 2, False, seed=6)
    full = index_topk_ref(b.iq, b.ik, b.meta, K)
    fp8 = mi.index_topk(b.iq, cache, b.meta, K)
    match = sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(full.view(-1, K), fp8.view(-1, K), strict=True))
    assert match / full.numel() >= 0.75


def test_fp8_cache_rejects_wrong_scale_dtype():
    b, cache = _fp8_batch([(40, 1)], 1, False)
    bad = FP8IndexCache(cache.keys, cache.scales.half())
    with pytest.raises(ValueError, match="FP8 index cache"):
        mi.index_topk(b.iq, bad, b.meta, K)


def test_index_format_names_each_cache_kind():
    """The per-format launch tables (decode score configs, launch chaining) are keyed by index_format."""
    from m3_kernels import msa_fused_decode, msa_index_topk
    from m3_kernels.msa_fp8 import index_format

    b, cache = _fp8_batch([(40, 1)], 1, False)
    got = [index_format(b.ik), index_format(cache), index_format(FP8IndexCache(cache.keys, cache.scales, True))]
    assert got == ["bf16", "fp8", "fp8q"]
    for fmt in got:
        assert fmt in msa_index_topk.DECODE_SCORE_CONFIGS
        chain, k2 = msa_fused_decode.index_topk_chain(fmt)
        assert (f"{chain}+k2" if k2 else chain) == msa_fused_decode.INDEX_TOPK_PDL[fmt]
    with pytest.raises(ValueError, match=r"INDEX_TOPK_PDL\['fp9'\] = None; set it to one of"):
        msa_fused_decode.index_topk_chain("fp9")
    table = dict(msa_fused_decode.INDEX_TOPK_PDL, bf16="start+K2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(msa_fused_decode, "INDEX_TOPK_PDL", table)
        with pytest.raises(ValueError, match=r"INDEX_TOPK_PDL\['bf16'\] = 'start\+K2'"):
            msa_fused_decode.index_topk_chain("bf16")


def test_engine_with_fp8_index_keys_on_cpu():
    # The engine's page pool with FP8 index keys (PyTorch write path + reference ops on CPU): page bytes,
    # layer views, fork copies and the scored logprobs: equal to the bf16-cache engine while every block
    # is selected (<= K x B = 12 tokens), close after (selection on the dequantized keys).
    from m3_rollout.engine.config import EngineConfig
    from m3_rollout.engine.engine import LLMEngine
    from m3_rollout.engine.paged_cache import PagedKVCache, page_bytes
    from m3_rollout.model import M3ForCausalLM, tiny_config

    cfg = tiny_config(vocab_size=96, max_position_embeddings=256, sparse_block_size=4, sparse_topk_blocks=3)
    torch.manual_seed(0)
    model = M3ForCausalLM(cfg).float().eval()
    n_sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    assert page_bytes(cfg, torch.float32) - page_bytes(cfg, torch.float32, "fp8_e4m3") == n_sparse * 4 * (
        cfg.sparse_index_dim * 4 - cfg.sparse_index_dim - 4
    )
    kv = PagedKVCache(cfg, 4, torch.float32, index_cache_dtype="fp8_e4m3")
    layer = next(iter(kv.sparse_slot))
    view = kv.layer(layer)[2]
    assert isinstance(view, FP8IndexCache) and view.keys.dtype == torch.float8_e4m3fn
    kv.index_scale[:, 1] = 2.0
    kv.copy_page(1, 3)
    assert (kv.index_scale[:, 3] == 2.0).all() and len(kv.tensors()) == 4
    with pytest.raises(ValueError, match="index_cache_dtype"):
        EngineConfig(max_model_len=64, index_cache_dtype="fp8").validate()

    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    lp = {}
    for dt in ("bfloat16", "fp8_e4m3"):
        eng = LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=2, num_pages=24, index_cache_dtype=dt))
        lp[dt] = eng.score(ids)
    d = (lp["bfloat16"] - lp["fp8_e4m3"]).abs()
    assert d[:13].max() < 1e-5  # dense-equivalent positions: the index keys choose nothing
    assert 0 < d.max() < 0.5

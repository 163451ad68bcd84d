"""FP8 (e4m3) index-key cache on a CUDA GPU at real M3 shapes (64 q heads / 4 KV heads / d 128 /
block 128 / top-k 16), and an engine run of the 300M bench model with FP8 index keys. Skipped without CUDA.

Tolerances (stated):
- quantization: the fused write kernel's codes and scales equal ``paged_layout.quantize_index_keys``
  bit for bit (power-of-two scales, integer rounding: no tolerance), NaN keys included.
- selection on the FP8 cache: the kernels' scores are fp32 sums of exact products (bf16 x e4m3, or
  e4m3 x e4m3) times exact powers of two, so kernel and reference (on the dequantized keys) differ
  by summation order, and with FP8 queries by the e4m3 tensor-core dot's accumulation, which keeps
  fewer mantissa bits than fp32 (about 14, DeepSeek-V3 technical report, section 3.3.2): identical
  selections except near-ties whose block scores differ by < 1e-3 (the rule of
  tests/gpu/test_msa_gpu.py), with FP8 queries by < twice the kernel's largest measured score error
  (itself <= 2**-9 of the largest |score|).
- attention output: <= 2e-2 max abs vs the fp32-softmax reference on the same selection (bf16, as
  test_msa_gpu.py).
- engine: greedy decoding (top_k = 1) of the 300M model (8 layers, random weights) after a
  3000-token prompt (past K x B = 2048, so the FP8 keys can change block choices), bf16 vs FP8 index
  keys. The tokens must agree for the first FIRST_EQUAL steps, or, from the first step where they
  differ, the FP8 engine's raw logprobs of the two candidates must be within NEAR_TIE (a near-tie of a
  random-weight model flipped by the ~2**-4 relative key error); the number of differing steps is printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

from m3_kernels import fused_layers, msa_fp8, msa_fused_decode, msa_index_topk  # noqa: E402
from m3_kernels.msa_synthetic import make_paged_batch  # noqa: E402
from m3_kernels.paged_layout import FP8IndexCache, dequantize_index_keys, quantize_index_keys  # noqa: E402
from m3_rollout.engine.reference_ops import (  # noqa: E402
    gather_index_keys,
    index_topk_ref,
    pad_queries,
    paged_attention_ref,
    token_rows,
)
from m3_rollout.model.indexer import block_scores  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PS, G, NH, D, K = 128, 4, 64, 128, 16
SCALE = D**-0.5
MIXED = ([(999, 1), (2047, 1), (8999, 1), (0, 2500), (4096, 300)], 3)
FIRST_EQUAL, NEAR_TIE, STEPS = 8, 0.1, 32


def _paged(spec, seed=0, **kw):
    """A random bf16 paged batch at real M3 shapes (rows, decode rows) = spec."""
    return make_paged_batch(
        *spec, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=torch.bfloat16, device="cuda",
        seed=seed, **kw,
    )  # fmt: skip


def _equal_on_causal_blocks(meta, got, want) -> bool:
    """Block scores [T, G, NBP] bitwise equal on every (token, head)'s causal blocks (the rest is scratch)."""
    nb = (meta.positions.long() // PS + 1)[:, None, None]  # causal blocks per token
    causal = torch.arange(got.shape[2], device="cuda")[None, None, :] < nb
    return torch.equal(torch.where(causal, got, 0.0), torch.where(causal, want, 0.0))


def _batch(spec, quantize_queries, seed=0):
    b = _paged(spec, seed)
    return b, FP8IndexCache(*quantize_index_keys(b.ik), quantize_queries)


def _check_selection(b, cache, got, want):
    """Equal, except near-ties whose reference scores (dequantized keys / queries) differ by < 1e-3:
    under 1 % of the (token, head) selections may differ as sets, and any slot whose block differs
    (a set change or an order flip) must hold a near-tie. With FP8 queries and keys the block scores
    are coarse and near-ties common: on MIXED, 171 of 11,212 prefill selections flip the order of two
    near-tied blocks and 6 differ as sets (H200, 2026-12-03; the attention reads the set)."""
    if torch.equal(got, want):
        return
    iq = dequantize_index_keys(*quantize_index_keys(b.iq)) if cache.quantize_queries else b.iq
    q, pos = pad_queries(iq, b.meta)
    scores = block_scores(q, gather_index_keys(cache, b.meta, torch.float32), pos, PS)  # [R, G, Sq, nb]
    row, off = token_rows(b.meta)
    s = scores.permute(0, 2, 1, 3)[row, off]  # [T, G, nb]
    width = 1e-3
    if cache.quantize_queries:  # near-tie width from the kernel's own score error (module docstring)
        ks = msa_index_topk.index_block_scores(b.iq, cache, b.meta)  # [T, G, NBP]
        nb = min(s.shape[-1], ks.shape[-1])
        sv, ks = s[..., :nb], ks[..., :nb]
        ok = sv.isfinite() & (torch.arange(nb, device=s.device) <= (b.meta.positions // PS)[:, None, None])
        err, top = (ks - sv)[ok].abs().max().item(), sv[ok].abs().max().item()
        print(f"fp8 x fp8 block scores: max abs error {err:.2e} at max |score| {top:.2f}")
        assert err <= 2.0**-9 * top
        width = max(width, 2 * err)
    bad = (got != want).any(-1)
    bad_set = (got.sort(-1).values != want.sort(-1).values).any(-1)
    assert bad_set.float().mean() < 0.01, f"{int(bad_set.sum())} of {bad_set.numel()} selections differ as sets"
    sg, sw = s.gather(-1, got.long().clamp_min(0)), s.gather(-1, want.long().clamp_min(0))
    assert (sg.sort(-1).values - sw.sort(-1).values)[bad].abs().max() < width
    flip = (got != want) & ~bad_set[..., None]  # order-only rows: slot by slot
    if flip.any():
        assert (sg - sw)[flip].abs().max() < width


def test_fused_write_kernel_codes_equal_reference_real_shapes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, pages, di, r = 300, 8, 128, 64
    width = NH * D + 2 * G * D + (G + 1) * di
    qkv = (torch.randn(t, width, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    qkv[7, -di + 3] = float("nan")  # a NaN index key: NaN code, the row's other codes as the reference
    slot = torch.randperm(pages * PS, generator=gen, device="cuda")[:t]
    from m3_rollout.model.rope import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(t, device="cuda"), r, 10000.0)
    w = [(torch.randn(n, generator=gen, device="cuda") * 0.3).to(torch.bfloat16) for n in (D, D, di, di)]
    kc = torch.zeros(pages + 1, G, PS, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    cache = FP8IndexCache(
        torch.zeros(pages + 1, PS, di, dtype=torch.float8_e4m3fn, device="cuda"),
        torch.zeros(pages + 1, PS, device="cuda"),
    )
    bf16 = torch.zeros(pages + 1, PS, di, dtype=torch.bfloat16, device="cuda")
    for ic in (cache, bf16):
        kw = dict(index_q_norm_w=w[2], index_k_norm_w=w[3], num_index_heads=G, index_dim=di, index_cache=ic)
        fused_layers.qkv_norm_rope_write(qkv, cos, sin, slot, w[0], w[1], NH, G, D, kc, vc, 1e-6, **kw)
    page, off = slot // PS, slot % PS
    codes, scales = quantize_index_keys(bf16[page, off])  # the bf16 path's keys [T, di], quantized by the reference
    assert torch.equal(cache.scales[page, off], scales)
    got = cache.keys[page, off]  # [T, di]
    assert got[7, 3].float().isnan()
    same = got.view(torch.uint8) == codes.view(torch.uint8)
    same[7, 3] = True  # NaN bit patterns may differ
    assert same.all()


@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_fp8_index_topk_and_decode_real_shapes(quantize_queries):
    b, cache = _batch(MIXED, quantize_queries)
    want = index_topk_ref(b.iq, cache, b.meta, K)
    _check_selection(b, cache, msa_index_topk.index_topk(b.iq, cache, b.meta, K), want)  # decode + prefill rows
    ids = torch.empty(3, G, K, dtype=torch.int32, device="cuda")
    out = msa_fused_decode.msa_attention(b.q, b.iq, b.k, b.v, cache, b.meta, SCALE, K)
    msa_fused_decode.msa_decode(b.q, b.iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)
    _check_selection(b, cache, torch.cat([ids, want[3:]]), want)
    ref = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, torch.cat([ids, want[3:]]))
    err = (out[:3].float() - ref[:3].float()).abs().max().item()
    print(f"fp8 index keys ({'fp8' if quantize_queries else 'bf16'} queries): decode max abs err {err:.3e}")
    assert err <= 2e-2


@pytest.mark.parametrize("long_path", ["index_topk", "score_topk"])
@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_fp8_msa_attention_cuda_graph_replay(quantize_queries, long_path, monkeypatch):
    # As test_msa_gpu.py: capture the sparse-layer decode call, advance every row in place, replay
    # twice; equal to a fresh eager call. Wide table (long_path: the default index_topk, and
    # score_topk) and short table (rank route).
    monkeypatch.setattr(msa_fused_decode, "LONG_DECODE_PATH", long_path)
    for (spec, seed), path in zip(
        ((([(6000, 1), (3000, 1), (70000, 1)], 3), 2), (([(6000, 1), (3000, 1), (7000, 1)], 3), 5)), (long_path, "rank")
    ):
        b, cache = _batch(spec, quantize_queries, seed)
        m = b.meta
        assert msa_fused_decode.select_decode_path(m.block_tables.shape[1]) == path

        def step(b=b, cache=cache, m=m):
            return msa_fused_decode.msa_attention(b.q, b.iq, b.k, b.v, cache, m, SCALE, K)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = step()
        for x in (m.positions, m.seq_lens, m.context_lens):
            x.add_(10)
        graph.replay()
        graph.replay()
        torch.testing.assert_close(out_g, step(), rtol=0, atol=0)


def _bench_model():
    from m3_rollout.model import M3Config, M3ForCausalLM

    raw = json.loads((ROOT / "configs/bench/m3_bench_300m.json").read_text())
    cfg = M3Config.from_dict({k: v for k, v in raw.items() if not k.startswith("_")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = M3ForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
    return m.cast_for_inference(torch.bfloat16).eval()


def test_engine_fp8_index_keys_greedy_tokens():
    from m3_rollout.engine.config import EngineConfig
    from m3_rollout.engine.engine import LLMEngine
    from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams

    model = _bench_model()
    prompt = torch.randint(3, 32000, (3000,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(seed=1, max_new_tokens=STEPS, top_k=1, logprobs_mode="raw")
    runs = {}
    for dtype in ("bfloat16", "fp8_e4m3"):
        eng = LLMEngine(
            model,
            EngineConfig(
                max_model_len=4096, max_num_seqs=4, num_pages=64, max_num_batched_tokens=1024, index_cache_dtype=dtype
            ),
        )
        eng.add_request(GenerationRequest("g", prompt, params))
        while eng.has_unfinished():
            for o in eng.step():
                if isinstance(o, SampleOutput):
                    runs[dtype] = (o.output_ids, eng)
    a, b = runs["bfloat16"][0], runs["fp8_e4m3"][0]
    assert len(a) == len(b) == STEPS
    diff = [i for i in range(STEPS) if a[i] != b[i]]
    print(f"engine bf16 vs fp8 index keys: {len(diff)} of {STEPS} greedy tokens differ (first at {diff[:1]})")
    if not diff or diff[0] >= FIRST_EQUAL:
        return
    i = diff[0]  # why: a near-tie under the FP8 engine between its own token and the bf16 engine's
    fp8 = runs["fp8_e4m3"][1]
    own = fp8.score(prompt + b[: i + 1], positions=[len(prompt) + i])[0].item()
    other = fp8.score(prompt + a[: i + 1], positions=[len(prompt) + i])[0].item()
    print(f"step {i}: fp8 engine logprob of its token {own:.4f}, of the bf16 engine's token {other:.4f}")
    assert own - other < NEAR_TIE


@pytest.mark.parametrize("quantize_queries", [False, True], ids=["bf16_q", "fp8_q"])
def test_fp8_score_topk_decode_real_shapes(quantize_queries, monkeypatch):
    # The long-context decode path on FP8 keys: rows of 300K / 40K / 3K / 130 tokens in one launch;
    # selection vs the reference on the dequantized keys and vs index_topk on the same cache (near-tie
    # rule; equality printed), output vs the reference on the path's own selection.
    monkeypatch.setattr(msa_fused_decode, "LONG_DECODE_PATH", "score_topk")  # not the default yet (bench_msa)
    b, cache = _batch(([(300000, 1), (40000, 1), (3000, 1), (130, 1)], 4), quantize_queries, seed=7)
    assert msa_fused_decode.select_decode_path(b.meta.block_tables.shape[1]) == "score_topk"
    want = index_topk_ref(b.iq, cache, b.meta, K)
    tri = msa_index_topk.index_topk(b.iq, cache, b.meta, K)
    ids = torch.full((4, G, K), -7, dtype=torch.int32, device="cuda")
    out = msa_fused_decode.msa_decode(b.q, b.iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)
    print(f"fp8 score_topk: ids == index_topk {torch.equal(ids, tri)}, == reference {torch.equal(ids, want)}")
    _check_selection(b, cache, ids, want)
    _check_selection(b, cache, ids, tri)
    ref = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, ids)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"  max abs err {err:.3e}")
    assert err <= 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8q"])
@pytest.mark.parametrize(
    "spec",
    [
        ([(300000, 1), (40000, 1), (3000, 1), (130, 1)], 4),
        ([(200000, 4), (5000, 4)], 2),
        ([(3000 + 7 * i, 1) for i in range(300)], 300),  # one split: bf16 264 // 300, fp8q 528 // 300
        ([(100, 1), (20, 1)], 2),  # one-page table: one split
    ],
    ids=["rows", "verify_q4", "rows_past_programs", "one_page"],
)
def test_decode_scores_tma_equal_pointer_loads(fmt, spec, monkeypatch):
    # The decode score launch on CUDA reads keys through TMA with the format's DECODE_SCORE_CONFIGS
    # split; the block maxima must be the bits of the pointer-load launch (same dot per block, same
    # max), on every causal block of every (token, head), rows of different lengths and 4-token rows;
    # one split per row (more rows than the format's programs, a one-page table) too.
    b = _paged(spec)
    cache = b.ik if fmt == "bf16" else FP8IndexCache(*quantize_index_keys(b.ik), fmt == "fp8q")
    assert msa_index_topk.decode_score_config(b.iq, cache)["tma"]
    got = msa_index_topk.index_block_scores(b.iq, cache, b.meta)
    monkeypatch.setattr(msa_index_topk, "DECODE_SCORE_TMA", False)
    assert msa_index_topk.decode_score_config(b.iq, cache) == {}
    want = msa_index_topk.index_block_scores(b.iq, cache, b.meta)
    assert _equal_on_causal_blocks(b.meta, got, want)


def test_prefill_chunk_past_2_31_scores_selects_like_a_small_chunk():
    # A 72K-token prefill chunk at the end of a 1M-token row: T x G x NBP = 72K x 4 x 8192 > 2**31
    # scratch scores (int64 offsets in the score and top-k kernels). Its last 16 tokens must select
    # what a 16-token chunk at the same positions selects (per-row math, same kernels).
    total, n = 1 << 20, 72 * 1024
    b = _paged(([(total - n, n)], 0), spare_pages=0)
    m = b.meta
    assert n * G * m.block_tables.shape[1] > 2**31
    big = msa_index_topk.index_topk(b.iq, b.ik, m, K)
    t0 = n - 16
    small_meta = type(m)(
        m.positions[t0:],
        m.slot_mapping[t0:],
        m.block_tables,
        m.context_lens + t0,
        m.seq_lens,
        torch.tensor([0, 16], dtype=m.query_start_loc.dtype, device="cuda"),
        0,
        1,
        16,
        m.max_seq_len,
    )
    small = msa_index_topk.index_topk(b.iq[t0:], b.ik, small_meta, K)
    assert torch.equal(big[t0:], small)
    assert (big[:, :, 0] >= 0).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8q"])
def test_prefill_scores_tma_and_tile_keep_the_pointer_loads_bits(fmt):
    # The prefill score launch on CUDA takes its key reads and tile from PREFILL_SCORE_FORMAT (FP8 keys:
    # TMA, 64-token tiles). Every causal block maximum must be the bits of the pointer-load launch with
    # the old 32-token tile and two key sub-tiles (the same dot per block, the same max): rows that start
    # mid-block after cached context, a row shorter than one tile. bf16 keys (pointer loads by default)
    # through TMA as well.
    b = _paged(([(0, 3000), (1000, 700), (130, 77)], 0), seed=3)
    cache = b.ik if fmt == "bf16" else FP8IndexCache(*quantize_index_keys(b.ik), fmt == "fp8q")
    per_fmt = msa_index_topk.PREFILL_SCORE_FORMAT[fmt]
    assert per_fmt["tma"] == (fmt != "bf16")
    got = msa_index_topk.index_block_scores(b.iq, cache, b.meta)
    want = msa_index_topk.index_block_scores(
        b.iq, cache, b.meta, {"tma": False, "block_m": 32, "nsub": 2, "qpre": False}
    )
    assert _equal_on_causal_blocks(b.meta, got, want)
    if fmt == "bf16":
        tma = msa_index_topk.index_block_scores(b.iq, cache, b.meta, {"tma": True})
        assert _equal_on_causal_blocks(b.meta, tma, want)


@pytest.mark.parametrize("nsub", [1, 2, 4])
def test_prefill_scores_of_prequantized_queries_keep_the_bits(nsub):
    # FP8 keys with quantized queries: the query rows quantized by msa_fp8.quantize_rows before the score
    # launch ("qpre": codes loaded, so the dot reads them from shared memory) must give every causal
    # block maximum the bits of quantizing them inside the kernel, at any key sub-tile count; the
    # quantization itself the bits of the PyTorch reference at real shapes.
    b = _paged(([(0, 3000), (1000, 700), (130, 77)], 0), seed=5)
    cache = FP8IndexCache(*quantize_index_keys(b.ik), True)
    want = msa_index_topk.index_block_scores(b.iq, cache, b.meta, {"qpre": False, "nsub": 1})
    got = msa_index_topk.index_block_scores(b.iq, cache, b.meta, {"qpre": True, "nsub": nsub})
    assert _equal_on_causal_blocks(b.meta, got, want)
    codes, scales = msa_fp8.quantize_rows(b.iq)
    want_c, want_s = quantize_index_keys(b.iq)
    assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8)) and torch.equal(scales, want_s)

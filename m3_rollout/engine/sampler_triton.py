"""Fused keyed Gumbel-max sampler (temperature only) in two Triton kernels (chunks, then a merge).

Governing idea: ``sampler.sample_rows`` without top-k / top-p is ~25 elementwise kernels over
[N, V] int64 / float64 tensors (the counter-based hash of every (row, token), two logs, the
argmax, two log-softmaxes). This kernel streams each row's logits once and does all of it in
registers (a grid of rows x vocabulary chunks, then one merge program per row), with the same
arithmetic in the same order, so it picks the same tokens:
- key = splitmix64 chain of (seed, sample id, position); bits = splitmix64(key ^ splitmix64(v))
  (int64 wrap-around arithmetic, logical shifts), u = ((bits >>> 11) + 0.5) / 2^53 in fp64;
- x = fp32(logit) / fp32(temperature) with IEEE rounding (``div_rn``, as torch's ``/``);
- token = first argmax of fp64(x) - log(-log(u)) (fp64 ``log`` of libdevice, as torch's CUDA log);
- logprob = x[token] - logsumexp(x) ("processed") or the same on fp32(logit) ("raw"), fp32 with
  per-chunk max / sum merged exactly (summation order differs from torch's log_softmax: ~1e-7
  relative); ties between chunks go to the lowest token id, as torch's argmax.

Outputs go where the decode graph wants them: ``out[0, r]`` token id, ``out[1, r]`` the logprob
as float64 bits (int64), ``last_tokens[r]`` the id again (the next step's device-side input).
Capturable (fixed grid, no host syncs). CUDA, or the Triton interpreter (TRITON_INTERPRET=1) in tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_rollout.engine.sampler import GOLDEN, MIX1, MIX2, POS_MUL, SAMPLE_MUL

try:  # libdevice's fp64 log (the CUDA math library's, which torch's CUDA ``log`` calls)
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - older Triton layouts
    _libdevice = None


@triton.jit
def _srl(x, n: tl.constexpr):
    """Logical right shift of int64."""
    return (x.to(tl.uint64, bitcast=True) >> n).to(tl.int64, bitcast=True)


@triton.jit
def _splitmix64(x, GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr):
    x = x + GOLDEN
    x = (x ^ _srl(x, 30)) * MIX1
    x = (x ^ _srl(x, 27)) * MIX2
    return x ^ _srl(x, 31)


@triton.jit
def _log64(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return _libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _div32(a, b, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _keyed_gumbel_chunk_kernel(
    logits_ptr,
    stride_l,
    vhash_ptr,
    temp_ptr,
    seed_ptr,
    sid_ptr,
    pos_ptr,
    part_ptr,
    V: tl.constexpr,
    NC: tl.constexpr,
    BLOCK: tl.constexpr,
    GOLDEN: tl.constexpr,
    MIX1: tl.constexpr,
    MIX2: tl.constexpr,
    SAMPLE_MUL: tl.constexpr,
    POS_MUL: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Program (row r, chunk c) over tokens [c*BLOCK, (c+1)*BLOCK): its best Gumbel score and
    token, that token's processed / raw logit, and the chunk's max / sum-exp of both (fp64 [8])."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    seed = tl.load(seed_ptr + r)
    sid = tl.load(sid_ptr + r)
    pos = tl.load(pos_ptr + r)
    key = _splitmix64(seed, GOLDEN, MIX1, MIX2)
    key = _splitmix64(key ^ (sid * SAMPLE_MUL), GOLDEN, MIX1, MIX2)
    key = _splitmix64(key ^ (pos * POS_MUL), GOLDEN, MIX1, MIX2)
    t32 = tl.load(temp_ptr + r).to(tl.float32)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    logit = tl.load(logits_ptr + r * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    vh = tl.load(vhash_ptr + offs, mask=ok, other=0)
    bits = _splitmix64(key ^ vh, GOLDEN, MIX1, MIX2)
    u = (_srl(bits, 11).to(tl.float64) + 0.5) / 9007199254740992.0
    x = _div32(logit, t32, USE_LIBDEVICE)
    g = -_log64(-_log64(u, USE_LIBDEVICE), USE_LIBDEVICE)
    score = tl.where(ok, x.to(tl.float64) + g, float("-inf"))
    best = tl.max(score, 0)
    arg = tl.argmax(score, 0)  # first of equal maxima
    hit = offs == c * BLOCK + arg
    best_x = tl.sum(tl.where(hit, x, 0.0), 0)
    best_l = tl.sum(tl.where(hit, logit, 0.0), 0)
    m_x = tl.max(tl.where(ok, x, float("-inf")), 0)
    s_x = tl.sum(tl.where(ok, tl.exp(x - m_x), 0.0), 0)
    m_l = tl.max(logit, 0)
    s_l = tl.sum(tl.where(ok, tl.exp(logit - m_l), 0.0), 0)
    base = part_ptr + (r * NC + c) * 8
    tl.store(base + 0, best)
    tl.store(base + 1, (c * BLOCK + arg).to(tl.float64))
    tl.store(base + 2, best_x.to(tl.float64))
    tl.store(base + 3, best_l.to(tl.float64))
    tl.store(base + 4, m_x.to(tl.float64))
    tl.store(base + 5, s_x.to(tl.float64))
    tl.store(base + 6, m_l.to(tl.float64))
    tl.store(base + 7, s_l.to(tl.float64))


@triton.jit
def _keyed_gumbel_combine_kernel(part_ptr, raw_ptr, out_ptr, last_ptr, n_rows, NC: tl.constexpr, NC_P2: tl.constexpr):
    """Row r: the first chunk with the best score gives the token; logsumexps merge exactly."""
    r = tl.program_id(0)
    c = tl.arange(0, NC_P2)
    ok = c < NC
    base = part_ptr + (r * NC + c) * 8
    score = tl.load(base + 0, mask=ok, other=float("-inf"))
    k = tl.argmax(score, 0)  # tie -> the lowest chunk, i.e. the lowest token id
    hit = c == k
    tok = tl.sum(tl.where(hit, tl.load(base + 1, mask=ok, other=0.0), 0.0), 0).to(tl.int64)
    best_x = tl.sum(tl.where(hit, tl.load(base + 2, mask=ok, other=0.0), 0.0), 0).to(tl.float32)
    best_l = tl.sum(tl.where(hit, tl.load(base + 3, mask=ok, other=0.0), 0.0), 0).to(tl.float32)
    m_x = tl.load(base + 4, mask=ok, other=float("-inf")).to(tl.float32)
    s_x = tl.load(base + 5, mask=ok, other=0.0).to(tl.float32)
    m_l = tl.load(base + 6, mask=ok, other=float("-inf")).to(tl.float32)
    s_l = tl.load(base + 7, mask=ok, other=0.0).to(tl.float32)
    mx = tl.max(m_x, 0)
    ml = tl.max(m_l, 0)
    lse_x = mx + tl.log(tl.sum(tl.where(ok, s_x * tl.exp(m_x - mx), 0.0), 0))
    lse_l = ml + tl.log(tl.sum(tl.where(ok, s_l * tl.exp(m_l - ml), 0.0), 0))
    raw = tl.load(raw_ptr + r)
    lp = tl.where(raw != 0, best_l - lse_l, best_x - lse_x)
    tl.store(out_ptr + r, tok)
    tl.store(out_ptr + n_rows + r, lp.to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(last_ptr + r, tok)


def keyed_gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    sample_ids: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    vocab_hash: torch.Tensor,
    out: torch.Tensor,
    last_tokens: torch.Tensor,
    block: int = 1024,
) -> None:
    """Sample every row of ``logits`` (temperature only) into ``out`` / ``last_tokens``.

    Two launches: chunks of ``block`` tokens per program (grid rows x ceil(V / block)), then one
    program per row merging its chunks (scratch fp64 [N, chunks, 8]).

    Args:
        logits: [N, V] any float dtype, rows contiguous. temperature: float64 [N] > 0.
        seeds, sample_ids, positions: int64 [N] (the sampler's keys). raw: int64 / bool [N],
            nonzero = raw logprob. vocab_hash: int64 [V] (``sampler.vocab_hash``).
        out: int64 [2 * N]: ids, then logprobs as float64 bits. last_tokens: int64 [>= N].
    Same tokens as ``sampler.sample_rows`` with no top-k / top-p (see the module docstring).
    """
    n, v = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("keyed_gumbel_sample: logits rows must be contiguous")
    use_libdevice = logits.is_cuda and _libdevice is not None
    nc = triton.cdiv(v, block)
    part = torch.empty((n, nc, 8), dtype=torch.float64, device=logits.device)
    _keyed_gumbel_chunk_kernel[(n, nc)](
        logits,
        logits.stride(0),
        vocab_hash,
        temperature,
        seeds,
        sample_ids,
        positions,
        part,
        V=v,
        NC=nc,
        BLOCK=block,
        GOLDEN=GOLDEN,
        MIX1=MIX1,
        MIX2=MIX2,
        SAMPLE_MUL=SAMPLE_MUL,
        POS_MUL=POS_MUL,
        USE_LIBDEVICE=use_libdevice,
        num_warps=4,
    )
    _keyed_gumbel_combine_kernel[(n,)](
        part, raw, out, last_tokens, n, NC=nc, NC_P2=triton.next_power_of_2(nc), num_warps=1
    )


@triton.jit
def _decode_prologue_kernel(
    host_ptr, src_ptr, st_ctx_ptr, st_seq_ptr, last_ptr, ids_ptr, ctx_ptr, seq_ptr, s, BLOCK: tl.constexpr
):
    """Rows i < s of a staged decode step: input id (host id, or ``last_tokens[token_src]`` when the
    id is still on the device) and the int32 context / sequence lengths (decode_graph.DecodeStage)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < s
    host = tl.load(host_ptr + i, mask=ok, other=0)
    src = tl.load(src_ptr + i, mask=ok, other=-1)
    dev = tl.load(last_ptr + tl.maximum(src, 0), mask=ok & (src >= 0), other=0)
    tl.store(ids_ptr + i, tl.where(src >= 0, dev, host), mask=ok)
    tl.store(ctx_ptr + i, tl.load(st_ctx_ptr + i, mask=ok, other=0).to(tl.int32), mask=ok)
    tl.store(seq_ptr + i, tl.load(st_seq_ptr + i, mask=ok, other=1).to(tl.int32), mask=ok)


def decode_prologue(
    host_ids: torch.Tensor,
    token_src: torch.Tensor,
    staged_context_lens: torch.Tensor,
    staged_seq_lens: torch.Tensor,
    last_tokens: torch.Tensor,
    input_ids: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """One launch for the decode graph's input prologue (see ``decode_graph.CudaGraphDecode._forward``).

    host_ids, token_src, staged_context_lens, staged_seq_lens: int64 [s] contiguous staged fields
    (``decode_graph.DecodeStage``); writes input_ids int64 [>= s] (``last_tokens[token_src]`` where
    token_src >= 0, else host_ids) and context_lens / seq_lens int32 [>= s]."""
    s = host_ids.shape[0]
    block = 128
    _decode_prologue_kernel[(triton.cdiv(s, block),)](
        host_ids,
        token_src,
        staged_context_lens,
        staged_seq_lens,
        last_tokens,
        input_ids,
        context_lens,
        seq_lens,
        s,
        BLOCK=block,
        num_warps=1,
    )

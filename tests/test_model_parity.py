"""Parity of m3_rollout.model against transformers' MiniMaxM3VLForCausalLM (the oracle), spec §2.2b.

The oracle is built from our tiny config (spec §7 preset A) via `to_dict()['text_config']` with
eager attention and eager experts, and its weights are randomised so every feature matters
(non-zero Gemma norm weights, a router bias that changes expert choice, gate/up pre-activations
beyond the ±7 clamps). The same weights go into our model through the transformers-name loader.

float64: transformers downcasts to fp32 in three places even in a float64 model (RMSNorm's
`.float()`, the router's `router_logits.float()`, eager attention's `softmax(dtype=float32)`);
for the float64 comparison those three are patched to keep the input dtype (same math). Its
indexer also scores in fp32, which only matters for near-ties (selected blocks are compared).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3_rollout.model import M3ForCausalLM, load_checkpoint, load_hf_state_dict, save_checkpoint, tiny_config
from m3_rollout.model import attention as attn_mod
from m3_rollout.model import moe as moe_mod
from m3_rollout.model import norm as norm_mod

hfm = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig  # noqa: E402

LENGTHS = (40, 64, 65, 200, 700)  # preset A: K*B = 64, sparse beyond
FP64_TOL = 1e-9
# Measured max |logits diff| in fp32 over LENGTHS: 0.0 (identical op order on this CPU build);
# the tolerance leaves room for other BLAS builds (logits are O(5)).
FP32_TOL = 1e-4


# ------------------------------------------------------------------ oracle fp64 patches
def _hf_rmsnorm_forward(self, x):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * (1.0 + self.weight.to(cdt))).type_as(x)


def _hf_router_forward(self, hidden_states):
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h.to(self.weight.dtype), self.weight)
    s = torch.sigmoid(logits)
    _, idx = torch.topk(s + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
    w = s.gather(1, idx)
    return logits, w / w.sum(dim=-1, keepdim=True), idx


def _hf_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = hfm.repeat_kv(key, module.num_key_value_groups)
    value = hfm.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _patch_hf_fp64(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(hfm.MiniMaxM3VLRMSNorm, "forward", _hf_rmsnorm_forward)
    mp.setattr(hfm.MiniMaxM3VLTopKRouter, "forward", _hf_router_forward)
    mp.setattr(hfm, "eager_attention_forward", _hf_eager_attention)


# ------------------------------------------------------------------ recording helpers
def _record_hf_blocks(mp: pytest.MonkeyPatch, out: list) -> None:
    orig = hfm.MiniMaxM3VLIndexer.forward

    def forward(self, *args, **kwargs):
        sel = orig(self, *args, **kwargs)
        out.append(sel)
        return sel

    mp.setattr(hfm.MiniMaxM3VLIndexer, "forward", forward)


def _record_our_blocks(mp: pytest.MonkeyPatch, out: list) -> None:
    orig = attn_mod.select_blocks

    def select(*args, **kwargs):
        sel = orig(*args, **kwargs)
        out.append(sel)
        return sel

    mp.setattr(attn_mod, "select_blocks", select)


def _block_sets(sel: torch.Tensor, nb: int) -> torch.Tensor:
    """[B, G, S, K] ids (-1 = none) -> bool [B, G, S, nb]: the selected set per (head, token)."""
    hot = torch.zeros(*sel.shape[:-1], nb + 1, dtype=torch.bool)
    hot.scatter_(-1, sel.masked_fill(sel < 0, nb), True)
    return hot[..., :nb]


# ------------------------------------------------------------------ fixtures
def _randomise_hf(model, seed: int) -> None:
    """Weights under which every M3 feature changes the logits (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("e_score_correction_bias"):
                std = 0.5  # Gemma (1 + w) matters; bias flips expert choices
            elif "gate_up_proj" in name:
                std = 0.3  # pre-activations ~N(0, 4^2): the ±7 clamps fire
            elif "down_proj" in name:
                std = 0.02  # keep the residual stream O(1) despite large activations
            elif "embed_tokens" in name:
                std = 1.0
            else:
                std = 0.1
            t.copy_(torch.randn(t.shape, generator=g) * std)


@pytest.fixture(scope="module")
def pair():
    """(our model, oracle, config), same random weights, float32."""
    cfg = tiny_config()
    tc = cfg.to_dict()["text_config"]
    tc.update(bos_token_id=None, eos_token_id=None)  # real ids are outside the tiny vocab
    hc = MiniMaxM3VLTextConfig(**tc)
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    hf = hfm.MiniMaxM3VLForCausalLM(hc).eval()
    _randomise_hf(hf, seed=1)
    ours = M3ForCausalLM(cfg).eval()
    skipped = load_hf_state_dict(ours, hf.state_dict())
    assert skipped == []
    return ours, hf, cfg


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(2)
    return {s: torch.randint(0, 1024, (1, s), generator=g) for s in LENGTHS}


@pytest.fixture(scope="module")
def reference(pair, inputs):
    """Oracle logits and selected blocks: {dtype: {S: (logits, [per sparse layer blocks])}}."""
    _, hf, _ = pair
    ref = {}
    for dt in (torch.float64, torch.float32):
        hf.to(dt)
        ref[dt] = {}
        with pytest.MonkeyPatch.context() as mp:
            if dt == torch.float64:
                _patch_hf_fp64(mp)
            for s, ids in inputs.items():
                blocks: list = []
                with pytest.MonkeyPatch.context() as mp2:
                    _record_hf_blocks(mp2, blocks)
                    with torch.no_grad():
                        logits = hf(ids, use_cache=False).logits
                ref[dt][s] = (logits, blocks)
    hf.float()
    return ref


def _ours(model, ids, dtype, mp=None, blocks=None):
    model.to(dtype)
    with pytest.MonkeyPatch.context() as m:
        if blocks is not None:
            _record_our_blocks(m, blocks)
        with torch.no_grad():
            out = model(ids)
    model.float()
    return out


# ------------------------------------------------------------------ tests
def test_features_are_exercised(pair, inputs):
    """The random weights make the router bias change top-k and the SwiGLU clamps fire."""
    ours, _, cfg = pair
    moe_inputs, acts = [], []
    hooks = [m.register_forward_pre_hook(lambda mod, a: moe_inputs.append((mod, a[0]))) for m in ours.moe_layers()]
    orig = moe_mod.swiglu_oai

    def recording(gate, up, *a, **k):
        acts.append((gate.detach(), up.detach()))
        return orig(gate, up, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_mod, "swiglu_oai", recording)
        with torch.no_grad():
            ours(inputs[200])
    for h in hooks:
        h.remove()
    changed = 0
    for mod, x in moe_inputs:
        logits = F.linear(x.reshape(-1, cfg.hidden_size).float(), mod.gate.weight)
        _, with_bias = moe_mod.route(logits, mod.e_score_correction_bias, cfg.num_experts_per_tok, 1.0)
        _, without = moe_mod.route(logits, None, cfg.num_experts_per_tok, 1.0)
        changed += int((with_bias.sort(-1).values != without.sort(-1).values).any(-1).sum())
    assert changed > 50, f"router bias changed the top-k of only {changed} tokens"
    gate = torch.cat([g.flatten() for g, _ in acts])
    up = torch.cat([u.flatten() for _, u in acts])
    assert (gate > 7).float().mean() > 0.01 and (gate < -7).float().mean() > 0.01
    assert (up > 7).float().mean() > 0.01 and (up < -7).float().mean() > 0.01


@pytest.mark.parametrize("s", LENGTHS)
def test_fp64_logits_and_blocks_match(pair, inputs, reference, s):
    ours, _, cfg = pair
    ref_logits, ref_blocks = reference[torch.float64][s]
    blocks: list = []
    out = _ours(ours, inputs[s], torch.float64, blocks=blocks)
    assert out.dtype == torch.float64
    diff = (out - ref_logits).abs().max().item()
    assert diff < FP64_TOL, f"S={s}: max |diff| {diff:.3e}"
    assert len(blocks) == len(ref_blocks) == sum(cfg.sparse_attention_freq)
    nb = -(-s // cfg.sparse_block_size)
    for layer, (a, b) in enumerate(zip(blocks, ref_blocks)):
        assert torch.equal(_block_sets(a, nb), _block_sets(b, nb)), f"S={s} sparse layer {layer}: selections differ"
    if s > cfg.sparse_topk_blocks * cfg.sparse_block_size:
        # genuinely sparse: some (head, token) keeps exactly K of more than K candidate blocks
        assert (blocks[0] >= 0).sum(-1).max() == cfg.sparse_topk_blocks


@pytest.mark.parametrize("s", LENGTHS)
def test_fp32_logits_match(pair, inputs, reference, s):
    """fp32 max |logits diff| vs the unpatched oracle: measured 0.0 at every length; tolerance FP32_TOL."""
    ours, _, _ = pair
    out = _ours(ours, inputs[s], torch.float32)
    diff = (out - reference[torch.float32][s][0]).abs().max().item()
    assert diff < FP32_TOL, f"S={s}: max |diff| {diff:.3e}"


def test_checkpoint_roundtrip_matches_hf_names(pair, inputs, tmp_path):
    """save_checkpoint (released VL names, sharded) -> load_checkpoint gives the logits of the
    transformers-name load, bit for bit."""
    ours, hf, cfg = pair
    files = save_checkpoint(ours, cfg, tmp_path, max_shard_bytes=400_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_checkpoint(tmp_path, dtype=torch.float64)
    ids = inputs[200]
    with torch.no_grad():
        a = loaded(ids)
        b = _ours(ours, ids, torch.float64)
    assert torch.equal(a, b)


def _patched_diff(pair, inputs, reference, patch) -> float:
    ours, _, _ = pair
    with pytest.MonkeyPatch.context() as mp:
        patch(mp, ours)
        out = _ours(ours, inputs[700], torch.float32)
    return (out - reference[torch.float32][700][0]).abs().max().item()


def _no_beta(mp, model):
    orig = moe_mod.swiglu_oai
    mp.setattr(moe_mod, "swiglu_oai", lambda g, u, alpha, limit, beta=1.0: orig(g, u, alpha, limit, 0.0))


def _no_local_forcing(mp, model):
    orig = attn_mod.select_blocks
    mp.setattr(attn_mod, "select_blocks", lambda s, q, k, b, init, local: orig(s, q, k, b, init, 0))


def _bias_in_weights(mp, model):
    def route(logits, bias, top_k, scaling):
        s = torch.sigmoid(logits) + bias
        ids = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :top_k]
        w = s.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * scaling, ids

    mp.setattr(moe_mod, "route", route)


def _rotate_all_channels(mp, model):
    mp.setattr(model.config, "rotary_dim", model.config.head_dim)


def _no_gemma_plus_one(mp, model):
    def norm(x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    mp.setattr(norm_mod, "gemma_rms_norm", norm)


@pytest.mark.parametrize(
    "patch", [_no_beta, _no_local_forcing, _bias_in_weights, _rotate_all_channels, _no_gemma_plus_one]
)
def test_mutation_breaks_parity(pair, inputs, reference, patch):
    """Each feature matters: breaking it makes the fp32 comparison fail by far more than FP32_TOL."""
    assert _patched_diff(pair, inputs, reference, lambda mp, m: None) < FP32_TOL
    diff = _patched_diff(pair, inputs, reference, patch)
    assert diff > 100 * FP32_TOL, f"{patch.__name__}: diff only {diff:.3e}"

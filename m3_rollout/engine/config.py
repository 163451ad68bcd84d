"""EngineConfig: the engine's sizes and switches, and how the KV page pool is sized from them.

Governing idea: one typed record the caller fills and :meth:`EngineConfig.validate` checks
before anything is allocated; the engine's other modules get their sizes from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_AUTO_KV_BYTES = 256 * 2**20  # cap of the automatic CPU page pool (pages are zero-filled up front)
# EngineConfig.invariant_sparse_attention's values and default: m3_kernels.invariant_attention's
# SPARSE_IMPLS and DEFAULT_SPARSE_IMPL (the kernels import triton, this module must not;
# tests/test_invariant_sparse_attention_config.py checks that they agree). The default is page
# partials: issue 24's 32K-prefill target met, GPU-checked on an H100 2026-12-05 (design.md §4.6).
INVARIANT_SPARSE_ATTENTIONS = ("union", "page_partials")
DEFAULT_INVARIANT_SPARSE_ATTENTION = "page_partials"


@dataclass
class EngineConfig:
    """Engine sizes and switches.

    Attributes:
        max_model_len: longest sequence (prompt + generated), tokens.
        max_num_seqs: most running samples per step.
        max_num_batched_tokens: per-step token budget (decodes + prefill chunks).
        kv_cache_memory_gb: the engine's cache memory in GiB: KV page pool + the MSA prefill
            scratch (``msa_prefill_scratch_mb``), the pool getting what the scratch leaves; 0 =
            automatic: on CUDA ``kv_cache_memory_fraction`` of the free device memory (scratch
            included the same way), elsewhere room for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, at most ``CPU_AUTO_KV_BYTES`` (the scratch, if any, on top).
        num_pages: explicit page count (overrides the memory budget; any scratch comes on top; tests).
        msa_prefill_scratch_mb: MiB bound of the sparse prefill's KV-major scratch (partial outputs
            of up to ``KV_CHUNK_TOKENS`` prefill tokens per pass; kernels/paged_layout.py), allocated
            once by the engine inside the memory budget above, only when the attention ops take one
            (the Triton kernels, CUDA), the model has sparse layers and a step's prefill can reach
            ``KV_MAJOR_MIN_TOKENS`` (``max_num_batched_tokens`` >= it). None = passes of
            min(KV_CHUNK_TOKENS, max_num_batched_tokens) tokens (the kernels' own default; 4160 MiB
            at M3 shapes in bf16); a number = passes of the largest multiple of
            ``KV_CHUNK_MIN_TOKENS`` tokens that fits (at most max_num_batched_tokens; other passes
            give the same output up to rounding, at another speed); 0 = no scratch, the KV-major path off
            (union-list tiles at every prefill length). A value below one ``KV_CHUNK_MIN_TOKENS``
            pass is refused at engine construction (``paged_cache.prefill_scratch_bytes``).
            Batch-invariant mode with ``invariant_sparse_attention="page_partials"``: the scratch
            is sized at every ``max_num_batched_tokens`` (that path runs at every length and also
            holds the decode partials); 0 there means buffers allocated per call.
        enable_prefix_caching: reuse full pages across requests (GRPO groups, multi-turn).
        enable_cuda_graphs: capture decode steps (forward + sampler) on CUDA (GPU-only; ignored elsewhere).
            "eager": the same staged decode path with the bodies run eagerly (any device; tests).
        async_scheduling: launch step N+1 before step N's sampled ids reach the host and process
            step N's outputs while the device runs N+1 (hides the host's per-step work behind the
            GPU; same tokens and logprobs as synchronous stepping). None = on for CUDA, off
            elsewhere (on the CPU nothing overlaps; outputs then come one ``step()`` later).
        fused_sampler: decode graphs sample with Triton kernels (``engine/sampler_triton.py``,
            same tokens as the PyTorch sampler) unless a row uses top-k / top-p, and build their
            inputs with one Triton launch; None = on CUDA.
        eos_token_ids: tokens that end every sample.
        index_cache_dtype: the sparse layers' index-key cache: "bfloat16" = the KV dtype (as K/V);
            "fp8_e4m3" = e4m3 codes with one power-of-two fp32 scale per token (kernels/paged_layout.py;
            ~half the bytes the long-context decode step reads; block choice on the dequantized keys).
        quantize_index_queries: with fp8_e4m3 index keys, the score kernels quantize the index queries
            the same way (fp8 x fp8 tensor-core dots) instead of keeping them in the activation dtype.
        batch_invariant: batch-invariant mode (design.md §4.6): the paged forward runs the fixed-order
            kernels of ``kernels/invariant_ops.py`` (``engine.ops.paged_ops_for(..., batch_invariant=True)``;
            no skinny GEMM, one MoE tile config, one router route, the invariant attention), the
            sampler's logprobs one fixed-order op in eager and graph steps and its top-k / top-p
            supports a function of the row alone (``sampler.process_logits``), so a token's logits and
            logprob do not depend on the rest of the batch; under EP the workers' engines get the flag
            and the expert combine gives the single-rank bits (``parallel/ep_moe.py``). The kernels:
            CUDA only (elsewhere a warning and the usual ops; the sampler part applies on any
            device); an ``ops`` table handed to the engine is used as given.
        invariant_sparse_attention: the sparse layers' attention in batch-invariant mode (one of
            ``INVARIANT_SPARSE_ATTENTIONS``; ignored without ``batch_invariant``): "page_partials"
            (default, ``DEFAULT_INVARIANT_SPARSE_ATTENTION``) = the KV-major per-page partials of
            ``kernels/invariant_page_partials.py`` (meets issue 24's long-prefill target, decode
            about 1 % slower; the ops table then takes the prefill scratch); "union" = the union
            walk of ``kernels/invariant_attention.py`` (other bits). Bound
            into the ops table when the engine builds it (``paged_ops_for``); the trainer's scorer
            must be built with the same choice (``jobs/invariant_scoring.py``), or its logprobs
            differ from the rollout's.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_cache_memory_gb: float = 0.0
    kv_cache_memory_fraction: float = 0.8
    num_pages: int | None = None
    msa_prefill_scratch_mb: float | None = None
    enable_prefix_caching: bool = True
    enable_cuda_graphs: bool | str = False
    # Padded decode batch sizes captured (default 1, 2, 4, 8, 16, 32, 64, 128, 256 and
    # max_num_seqs, each capped at max_num_seqs); fewer sizes = faster start.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    async_scheduling: bool | None = None
    fused_sampler: bool | None = None
    # Routing record (design.md §2.3): SampleOutput.routed_experts = expert ids of every MoE layer for
    # every token, kept per KV page (m3_rollout/parallel/routing_record.py).
    record_routing: bool = False
    # Block-selection record (design.md §2.3): SampleOutput.block_selection = every sparse layer's
    # selected KV blocks per token and KV head (m3_rollout/engine/selection_cache.py).
    record_block_selection: bool = False
    eos_token_ids: tuple[int, ...] = ()
    index_cache_dtype: str = "bfloat16"
    quantize_index_queries: bool = False
    batch_invariant: bool = False
    invariant_sparse_attention: str = DEFAULT_INVARIANT_SPARSE_ATTENTION

    def validate(self) -> EngineConfig:
        """Raises ValueError naming the bad field."""
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.kv_cache_memory_gb < 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gb={self.kv_cache_memory_gb}: must be >= 0 (0 = auto)")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction={self.kv_cache_memory_fraction}: in (0, 1]")
        scratch = self.msa_prefill_scratch_mb
        number = isinstance(scratch, (int, float)) and not isinstance(scratch, bool)
        if scratch is not None and not (number and 0 <= scratch < float("inf")):
            raise ValueError(
                f"EngineConfig.msa_prefill_scratch_mb={scratch!r}: must be None (auto) or a finite MiB >= 0 (a number)"
            )
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"EngineConfig.batch_invariant={self.batch_invariant!r}: must be True or False")
        if self.invariant_sparse_attention not in INVARIANT_SPARSE_ATTENTIONS:
            raise ValueError(
                f"EngineConfig.invariant_sparse_attention={self.invariant_sparse_attention!r}: "
                f"one of {INVARIANT_SPARSE_ATTENTIONS}"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages}: must be >= 1")
        if self.index_cache_dtype not in ("bfloat16", "fp8_e4m3"):
            raise ValueError(f"EngineConfig.index_cache_dtype={self.index_cache_dtype!r}: use 'bfloat16' or 'fp8_e4m3'")
        if self.quantize_index_queries and self.index_cache_dtype != "fp8_e4m3":
            raise ValueError("EngineConfig.quantize_index_queries=True needs index_cache_dtype='fp8_e4m3'")
        return self

    def resolve_num_pages(
        self, page_size: int, bytes_per_page: int, device: torch.device, reserved_bytes: int = 0
    ) -> int:
        """KV pages to allocate: ``num_pages``, else the memory budget (GiB, or a fraction of the
        free CUDA memory) less ``reserved_bytes`` (the MSA prefill scratch) divided by
        ``bytes_per_page`` (0 or less when the reserve takes it all), else (CPU) room for
        ``max_num_seqs`` full-length sequences capped at ``CPU_AUTO_KV_BYTES`` but never below one
        sequence."""
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_cache_memory_gb > 0:
            return int((self.kv_cache_memory_gb * 2**30 - reserved_bytes) // bytes_per_page)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int((free * self.kv_cache_memory_fraction - reserved_bytes) // bytes_per_page)
        want = self.max_num_seqs * -(-self.max_model_len // page_size)
        floor = -(-self.max_model_len // page_size)  # one full-length sequence
        return max(floor, min(want, CPU_AUTO_KV_BYTES // bytes_per_page))

"""Expert-parallel routed experts: all-to-all dispatch -> local grouped experts -> all-to-all combine.

Governing idea (design.md §3.5 "Expert-parallel model representation", §4.5): under EP size
P, rank r holds the routed experts [a, b) = [r·E/P, (r+1)·E/P) of every MoE layer as an ordinary
``StackedExperts`` whose rows are the local slice (``expert_range = (a, b)``). ``M3MoE.forward``
is unchanged: the router runs on every rank over that rank's own tokens, the shared expert is
added locally, and only the call ``self.experts(x, ids, weights)`` becomes distributed:

1. the T·K (token, slot) pairs are sorted by global expert id (stable, as ``grouped_experts``
   does); since rank r owns a contiguous id range, this also groups them by destination rank;
2. counts exchange: ``all_to_all_single`` of the per-expert counts [P·E_local] (E_local per peer),
   so every rank knows how many rows it receives from each peer for each of its local experts;
3. dispatch: ``all_to_all_single`` of the token rows [T·K, H] with those split sizes (on the fused
   path each row carries its pair's routing weight as fp32 bits in 16 extra columns, so the
   weights travel in the same collective);
4. the received rows run through the local experts: on the engine's paged path the table's fused
   MoE (``PagedOps.fused_experts``, K = 1, weighted by the received routing weight inside its down
   GEMM, as the single-rank op weights each slot); otherwise ``StackedExperts``' reference
   ``grouped_experts`` (one GEMM pair per local expert) with weight 1;
5. combine: the reverse ``all_to_all_single`` brings each pair's expert output home. Fused path:
   the pairs are put back in (token, slot) layout and each token sums its K slots in slot order
   k = 0..K-1 in fp32 from zero, then rounds once to x.dtype: the fused op's own combine
   (``m3_kernels.fused_moe.moe_combine``). Reference path: weighted and summed per token as
   ``grouped_experts`` does (y in x.dtype -> weight dtype, × w, -> x.dtype, index_add in expert
   order).

So on the fused path a token's routed output is computed with the single-rank fused op's roundings
(each slot's expert output = round(fp32 accumulator × fp32 weight) to x.dtype, the K slots summed
in slot order in fp32): with the batch-invariant table (``kernels/invariant_ops.py``, whose rows
do not depend on the other rows of the GEMM) EP=P gives the bits of EP=1, whatever the batch or
the other ranks' tokens (design.md §4.6). With the fast table, and on the reference path, EP=P
equals EP=1 up to the GEMMs seeing different row batches. Every rank must call every MoE layer
once per model forward, with T = 0 tokens if it has none (the engine's ``step(force_forward=True)``);
otherwise its peers' collectives wait until the group timeout.

Shape legend: T tokens on this rank, K experts per token, H hidden, E experts, P EP size,
E_local = E / P, N rows received for the local experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from m3_rollout.model.configuration import M3Config
from m3_rollout.model.moe import StackedExperts, grouped_experts
from m3_rollout.model.paged_ops import needs_autograd


@dataclass
class EPStats:
    """Per-step EP metrics of one rank, summed over the MoE layers of the forwards since ``reset``.

    Attributes:
        tokens_per_expert: [n_moe_layers, E_local] int64, (token, slot) pairs each LOCAL expert
            processed (from all ranks): load balance of this rank's experts. Concatenating the
            ranks' rows gives the group's [n_moe_layers, E] load.
        sent_per_rank: [P] int64, pairs this rank dispatched to each rank.
        dispatch_s / expert_s / combine_s: wall seconds in counts exchange + token all-to-all,
            in the local experts, in the reverse all-to-all + weighted sum (synchronised on CUDA
            only when ``timing`` is on).
        forwards: MoE-layer calls counted (eager calls: a CUDA-graph replay runs no Python).

    At EP size 1 (one rank holds every expert, e.g. the worker beside the trainer) the counts of
    ``tokens_per_expert`` accumulate on the device (:meth:`count_local`: no host copy, so a decode
    step can be captured in a CUDA graph, and its replays count too) and join the host counters
    at :meth:`snapshot`.
    """

    n_moe_layers: int
    num_local_experts: int
    world_size: int
    timing: bool = True
    tokens_per_expert: torch.Tensor = field(init=False)
    sent_per_rank: torch.Tensor = field(init=False)
    dispatch_s: float = 0.0
    expert_s: float = 0.0
    combine_s: float = 0.0
    forwards: int = 0
    _device_counts: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset()

    def count_local(self, layer_slot: int, ids: torch.Tensor) -> None:
        """Add the (token, slot) pairs of ``ids`` (int64 [T, K] expert ids < ``num_local_experts``)
        to layer ``layer_slot``'s counts on the ids' device, with no host sync. The device counter
        is made (zeroed) at the first call outside a CUDA-graph capture; a capture that comes
        before any eager call is not counted (zeroing inside it would re-zero at every replay).
        Ids on another device than the counter's move its counts into the host counters first."""
        capturing = ids.is_cuda and torch.cuda.is_current_stream_capturing()
        acc = self._device_counts
        if acc is None or acc.device != ids.device:
            if capturing:
                return
            if acc is not None:  # another device: keep what the old counter holds
                self.tokens_per_expert += acc.cpu()
            acc = self._device_counts = torch.zeros(
                self.n_moe_layers, self.num_local_experts, dtype=torch.int64, device=ids.device
            )
        flat = ids.reshape(-1)
        acc[layer_slot].scatter_add_(0, flat, torch.ones_like(flat))
        if not capturing:
            self.forwards += 1

    def reset(self) -> None:
        """Zero every counter (the device counter in place: captured graphs keep adding into it)."""
        if self._device_counts is not None:
            self._device_counts.zero_()
        self.tokens_per_expert = torch.zeros(self.n_moe_layers, self.num_local_experts, dtype=torch.int64)
        self.sent_per_rank = torch.zeros(self.world_size, dtype=torch.int64)
        self.dispatch_s = self.expert_s = self.combine_s = 0.0
        self.forwards = 0

    def snapshot(self, reset: bool = True) -> dict:
        """Plain-Python copy of the counters (lists / floats), optionally resetting them."""
        counts = self.tokens_per_expert
        if self._device_counts is not None:
            counts = counts + self._device_counts.cpu()
        out = {
            "tokens_per_expert": counts.tolist(),
            "sent_per_rank": self.sent_per_rank.tolist(),
            "dispatch_s": self.dispatch_s,
            "expert_s": self.expert_s,
            "combine_s": self.combine_s,
            "moe_forwards": self.forwards,
        }
        if reset:
            self.reset()
        return out


class EPExperts(StackedExperts):
    """The local slice of one MoE layer's routed experts plus the dispatch/combine around them.

    Args:
        config: model config (E = ``num_local_experts``, I, H, SwiGLU-OAI constants).
        expert_range: (a, b), the global expert ids this rank holds; b - a = E / P.
        group: the EP process group of P = E / (b - a) ranks (None when P = 1: plain grouped
            experts; a P > 1 shard without a group can be loaded and updated but not run).
        stats: shared :class:`EPStats` (one per model); ``layer_slot`` = this layer's row in it.

    Parameters ``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]`` (local row i = global expert a + i).
    """

    def __init__(
        self,
        config: M3Config,
        expert_range: tuple[int, int],
        group: dist.ProcessGroup | None = None,
        stats: EPStats | None = None,
        layer_slot: int = 0,
    ):
        torch.nn.Module.__init__(self)  # not StackedExperts.__init__: that would allocate all E experts
        self.alpha, self.limit, self.beta = config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta
        a, b = int(expert_range[0]), int(expert_range[1])
        e_local = b - a
        self.expert_range = (a, b)
        self.num_experts = config.num_local_experts
        if e_local < 1 or self.num_experts % e_local != 0 or a % e_local != 0 or b > self.num_experts:
            raise ValueError(
                f"expert_range={expert_range}: not an EP shard of E={self.num_experts} experts "
                "(need [r*E/P, (r+1)*E/P) with P dividing E)"
            )
        self.group = group
        self.world_size = self.num_experts // e_local  # P
        if group is not None and dist.get_world_size(group) != self.world_size:
            raise ValueError(
                f"expert_range={expert_range} implies EP size {self.world_size}, but the process "
                f"group has {dist.get_world_size(group)} ranks"
            )
        h, i = config.hidden_size, config.intermediate_size
        # Same layout and init as StackedExperts, at the local size (default device / dtype apply).
        self.w13 = torch.nn.Parameter(torch.empty(e_local, 2 * i, h))
        self.w2 = torch.nn.Parameter(torch.empty(e_local, h, i))
        torch.nn.init.normal_(self.w13, std=0.02)
        torch.nn.init.normal_(self.w2, std=0.02)
        self.stats = stats
        self.layer_slot = layer_slot

    def local_experts(
        self,
        x: torch.Tensor,
        local_ids: torch.Tensor,
        fused_experts: Callable[..., torch.Tensor] | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows x [N, H] through their local expert local_ids [N] (int64) -> [N, H] x.dtype.

        ``fused_experts`` given (``PagedOps.fused_experts``, no autograd; it takes GLOBAL ids and
        ``expert_range``): that op with K = 1 and the pairs' routing ``weights`` [N] (any float
        dtype, used in fp32; None = 1.0), so row n = round(W2 act(W13 x[n]) × weights[n]) to
        x.dtype, the bits the single-rank op gives that (token, slot) before its combine (its one-slot
        combine is exact). Otherwise ``grouped_experts`` on the local rows with weight 1 (exact:
        y -> fp32 -> ×1 -> x.dtype returns y unchanged); ``weights`` must then be None.
        """
        n = local_ids.shape[0]
        w = torch.ones(n, dtype=torch.float32, device=x.device) if weights is None else weights
        if fused_experts is not None and not needs_autograd(x, self.w13, self.w2):
            return fused_experts(
                x,
                (local_ids + self.expert_range[0])[:, None],
                w[:, None],
                self.w13,
                self.w2,
                alpha=self.alpha,
                limit=self.limit,
                beta=self.beta,
                expert_range=self.expert_range,
            )
        if weights is not None:
            raise ValueError("EPExperts.local_experts: routing weights are applied here on the fused path only")
        return grouped_experts(x, local_ids[:, None], w[:, None], self.w13, self.w2, self.act)

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        fused_experts: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, H], ids [T, K] int64 GLOBAL expert ids, weights [T, K] -> routed output [T, H] in x.dtype.

        T may be 0. fused_experts: the local experts' fast op (``StackedExperts.forward``).
        Collective: every rank of the group must call this the same number of times in the same
        layer order. Raises RuntimeError (from the backend) if a peer is gone or
        the group timeout passes.
        """
        if self.world_size == 1:
            out = super().forward(x, ids, weights, fused_experts)
            if self.stats is not None:
                self.stats.count_local(self.layer_slot, ids)
            return out
        if self.group is None:
            raise RuntimeError(
                f"EPExperts{self.expert_range}: an EP shard (P={self.world_size}) needs a process "
                "group to run; pass `group` when sharding"
            )
        p, e_local, h = self.world_size, self.num_experts // self.world_size, x.shape[-1]
        timing = self.stats is not None and self.stats.timing
        sync = (lambda: torch.cuda.synchronize(x.device)) if (timing and x.is_cuda) else (lambda: None)
        t0 = time.perf_counter()
        t, k = ids.shape
        # The fused path weights each pair where its expert runs and combines in slot order (module doc).
        fused = fused_experts is not None and not needs_autograd(x, self.w13, self.w2)
        flat = ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)  # [T*K], grouped by expert hence by rank
        token = order // k  # [T*K] source token of each sorted pair
        w_sorted = weights.reshape(-1)[order]  # [T*K]
        send_counts = torch.bincount(flat, minlength=self.num_experts)  # [E] = [P, E_local] row-major
        recv_counts = torch.empty_like(send_counts)  # [P, E_local]: row s = from rank s, per local expert
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.view(p, e_local).sum(1).tolist()  # NOTE: host sync (split sizes)
        recv_counts_host = recv_counts.view(p, e_local).cpu()
        recv_splits = recv_counts_host.sum(1).tolist()
        send = with_weight_columns(x[token], w_sorted) if fused else x[token]  # [T*K, H (+ C)]
        recv = x.new_empty(sum(recv_splits), send.shape[1])  # [N, H (+ C)]
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        recv_x, recv_w = split_weight_columns(recv, h) if fused else (recv, None)  # [N, H], fp32 [N]
        sync()
        t1 = time.perf_counter()
        # Received rows are ordered by source rank, then local expert: rebuild their local ids.
        local_ids = torch.repeat_interleave(
            torch.arange(e_local, device=x.device).repeat(p), recv_counts.view(-1)
        )  # [N]
        y = self.local_experts(recv_x, local_ids, fused_experts if fused else None, recv_w)  # [N, H]
        sync()
        t2 = time.perf_counter()
        back = x.new_empty(flat.shape[0], h)  # [T*K, H], aligned with `order`
        dist.all_to_all_single(back, y, send_splits, recv_splits, group=self.group)
        if fused:
            out = combine_slots(back, order, t, k)
        else:
            out = torch.zeros_like(x)
            out.index_add_(0, token, (back.to(w_sorted.dtype) * w_sorted[:, None]).to(x.dtype))
        sync()
        t3 = time.perf_counter()
        if self.stats is not None:
            s = self.stats
            s.tokens_per_expert[self.layer_slot] += recv_counts_host.sum(0)
            s.sent_per_rank += torch.tensor(send_splits, dtype=torch.int64)
            s.dispatch_s += t1 - t0
            s.expert_s += t2 - t1
            s.combine_s += t3 - t2
            s.forwards += 1
        return out


WEIGHT_COLUMNS = 16  # columns appended per dispatched row: the row stride keeps H's divisibility by 16


def with_weight_columns(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [M, H] (bf16 / fp16 / fp32) with weights [M] appended as fp32 bit patterns: [M, H + 16] in
    rows.dtype (the fp32 bits in the first 4 bytes of the 16 columns, then zeros), so one dispatch
    collective carries both, and the received rows' stride stays a multiple of 16 elements when H
    is (the kernels' aligned loads, TMA). Inverse: :func:`split_weight_columns`. Raises ValueError
    for 8-byte row dtypes."""
    if rows.element_size() > 4:
        raise ValueError(f"with_weight_columns: rows of {rows.dtype} cannot carry fp32 weight bits")
    bits = torch.zeros(
        rows.shape[0], WEIGHT_COLUMNS * rows.element_size() // 4, dtype=torch.float32, device=rows.device
    )
    bits[:, 0] = weights.reshape(-1)  # cast to fp32, as the fused op reads its weights
    return torch.cat([rows, bits.view(rows.dtype)], dim=1)


def split_weight_columns(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [N, H + C] from :func:`with_weight_columns` -> (rows [N, H], a view of packed;
    fp32 weights [N])."""
    return packed[:, :hidden], packed[:, hidden:].contiguous().view(torch.float32)[:, 0]


def combine_slots(back: torch.Tensor, order: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """The fused MoE's combine over weighted pair outputs that came home from the expert ranks.

    back: [T*K, H] (x.dtype), row i = the weighted expert output of pair order[i] = t*K + k
    (``order``: int64 [T*K], a permutation). Returns [T, H] in back.dtype: out[t] = round(sum over
    k = 0..K-1 in that order, in fp32 from 0.0, of back[pair t*K + k]) — one fp32 add per slot and
    one rounding, as ``m3_kernels.fused_moe.moe_combine`` does (elementwise IEEE adds, so the same
    bits on any device and for any T).
    """
    h = back.shape[1]
    rows = torch.empty_like(back).index_copy_(0, order, back).view(t, k, h)  # [T, K, H] slot layout
    acc = torch.zeros(t, h, dtype=torch.float32, device=back.device)  # [T, H]
    for j in range(k):
        acc += rows[:, j]  # upcast exactly, one fp32 rounding per slot
    return acc.to(back.dtype)

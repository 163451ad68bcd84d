"""Routing record: the expert ids every MoE layer chose for every token, kept per KV page.

Governing idea (design.md §2 step 3): the trainer replays routing for the whole
trajectory (prompt and tool-output tokens too), so the record must cover every token the engine
ran, including tokens whose K/V came from the prefix cache. The record therefore lives beside
the KV cache in the same paged layout: ``table[slot]`` with ``slot = page * page_size + offset``,
written through the step's ``slot_mapping`` right after each forward (from
``M3MoE.last_topk_ids``). A prefix-cache hit shares the pages, hence their routing; a fork's
partial-page copy copies it too (``copy_page``); preemption by recompute rewrites it.

A token never run through the model (the last sampled token of a sample) has no routing: its row
is -1 (the trainer's replay keeps its own router choice there; that token's routing affects no
logprob of the trajectory anyway).
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingCache:
    """Paged store of routed expert ids: ``table [num_pages * page_size, n_moe_layers, top_k]`` int16.

    Args:
        num_pages, page_size: the KV page pool's geometry (kernels/paged_layout.py).
        n_moe_layers, top_k: model geometry (``len(model.moe_layers())``, ``num_experts_per_tok``).
        device: where the forward's expert ids live (the table stays there; reads copy to host).
    Raises ValueError when E does not fit int16 (see :meth:`record`).
    """

    def __init__(
        self, num_pages: int, page_size: int, n_moe_layers: int, top_k: int, device: torch.device | str = "cpu"
    ):
        self.page_size = int(page_size)
        self.n_moe_layers, self.top_k = int(n_moe_layers), int(top_k)
        self.table = torch.full((num_pages * page_size, n_moe_layers, top_k), -1, dtype=torch.int16, device=device)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int) -> RoutingCache:
        """A cache sized for `model` (an ``M3ForCausalLM``) and the engine's page pool."""
        if model.config.num_local_experts > np.iinfo(np.int16).max:
            raise ValueError(f"num_local_experts={model.config.num_local_experts} does not fit the int16 record")
        return cls(
            num_pages,
            page_size,
            len(model.moe_layers()),
            model.config.num_experts_per_tok,
            device=next(model.parameters()).device,
        )

    def record(self, slot_mapping: torch.Tensor, model) -> None:
        """Store the last forward's expert ids at the step's slots.

        slot_mapping: [T] int64 (-1 = padding, skipped), the same tensor the forward wrote K/V
        with; model: the ``M3ForCausalLM`` whose MoE layers just ran on those T tokens
        (``last_topk_ids`` [>= T, K] each; rows past T are padding). Raises ValueError if a
        layer's ids have fewer than T rows.
        """
        moes = model.moe_layers()
        if not moes:
            return
        t = int(slot_mapping.shape[0])
        ids = [m.last_topk_ids for m in moes]
        if any(x is None or x.shape[0] < t for x in ids):
            raise ValueError(
                f"routing record: MoE expert ids do not cover the step's {t} tokens "
                f"(got {[None if x is None else tuple(x.shape) for x in ids]})"
            )
        if t == 0:
            return
        # NOTE: a CUDA-graph decode runs padded rows after the T real ones; keep the first T.
        stacked = torch.stack([x[:t] for x in ids], dim=1).to(
            device=self.table.device, dtype=torch.int16
        )  # [T, n_moe, K]
        slots = slot_mapping.to(self.table.device)
        keep = slots >= 0
        self.table[slots[keep]] = stacked[keep]

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src`'s records into page `dst` (the partial-page copy of a fork)."""
        ps = self.page_size
        self.table[dst * ps : (dst + 1) * ps] = self.table[src * ps : (src + 1) * ps]

    def gather(self, block_table: list[int], num_computed: int, length: int) -> np.ndarray:
        """The record of one sequence: int16 [length, n_moe_layers, top_k].

        block_table: the sequence's physical pages (logical page b -> page); num_computed: how
        many leading tokens have been run (their slots hold valid ids); rows from num_computed to
        `length` are -1. Raises ValueError when the pages do not cover num_computed tokens.
        """
        ps = self.page_size
        n = min(int(num_computed), int(length))
        if len(block_table) * ps < n:
            raise ValueError(f"routing record: {len(block_table)} pages cannot hold {n} computed tokens")
        out = np.full((length, self.n_moe_layers, self.top_k), -1, dtype=np.int16)
        if n > 0:
            pos = torch.arange(n)
            pages = torch.tensor(block_table, dtype=torch.int64)[pos // ps]
            slots = (pages * ps + pos % ps).to(self.table.device)
            out[:n] = self.table[slots].cpu().numpy()
        return out

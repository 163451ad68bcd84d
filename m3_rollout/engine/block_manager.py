"""KV page manager: which physical page belongs to whom, and the prefix cache (no tensors).

Governing idea: pages are reference-counted. A full page's content is identified by a chain
hash of (previous page's hash, its token ids), so two sequences whose token prefixes agree map
their leading full pages to the same physical pages. A page whose count drops to zero keeps its
hash and stays reusable ("cached") until it is evicted, least recently freed first, when a fresh
page is needed. Partial pages are never shared: a fork copies the parent's partial last page
(the engine runs the copy; this module only returns (src, dst) pairs).

Invariant (checked by :meth:`check`): every page is in exactly one of {in use (ref > 0),
free, cached-and-unreferenced}; the cached map points only at pages carrying that hash.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque

from m3_rollout.engine.sequence import Sequence


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """Hash of a full page given its predecessor's hash (None for the first page).

    A 128-bit BLAKE2b digest of (parent digest, token ids as int64): a collision would make a
    prefix hit reuse another prefix's K/V, so the hash must not be Python's (easily colliding,
    deterministic) ``hash`` of ints. Each page's own tokens are also compared exactly on a hit.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Page allocation, reference counts and the prefix cache.

    Args:
        num_pages: P pages in the pool; page_size: tokens per page.
        enable_prefix_caching: register full pages by chain hash and reuse them.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.page_key: list[tuple | None] = [None] * num_pages  # (parent hash, tokens) for exact match
        self.free: deque[int] = deque(range(num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self.cached: dict[bytes, int] = {}  # chain hash -> page
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0

    # ---- counts ------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now (free + cached-unreferenced)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation ----------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)  # least recently freed cached page
            h = self.page_hash[page]
            if h is not None and self.cached.get(h) == page:
                del self.cached[h]
            self.page_hash[page] = self.page_key[page] = None
        assert self.ref[page] == 0, f"page {page} taken while referenced"
        self.ref[page] = 1
        return page

    def _incref(self, page: int) -> None:
        if self.ref[page] == 0:
            self.evictable.pop(page, None)
        self.ref[page] += 1

    def _decref(self, page: int) -> None:
        self.ref[page] -= 1
        assert self.ref[page] >= 0, f"page {page} freed twice"
        if self.ref[page] == 0:
            if self.page_hash[page] is not None:
                self.evictable[page] = None  # most recently freed: evicted last
            else:
                self.free.append(page)

    def ensure(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` pages for tokens up to ``num_computed + num_new_tokens``.

        Returns False (allocating nothing) when not enough pages can be obtained.
        """
        need = self.pages_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def admit(self, seq: Sequence) -> None:
        """Start a (re)admitted sequence: reuse cached leading full pages of its tokens.

        At least the last token is always left to compute (its logits are needed), so at most
        ``(num_tokens - 1) // page_size`` pages are reused; none while its prompt logprobs are
        being scored (``Sequence.reads_prefix_cache``; its full pages are still registered for
        others). Sets ``num_computed``.
        """
        assert not seq.block_table and seq.num_computed == 0, f"{seq} admitted twice"
        seq.page_hashes = []
        seq.num_cached = 0
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return
        ps, toks = self.page_size, seq.token_ids
        parent = None
        self.query_tokens += seq.num_tokens
        for b in range((seq.num_tokens - 1) // ps):
            key = (parent, tuple(toks[b * ps : (b + 1) * ps]))
            h = chain_hash(*key)
            page = self.cached.get(h)
            if page is None or self.page_key[page] != key:
                break
            self._incref(page)
            seq.block_table.append(page)
            seq.page_hashes.append(h)
            parent = h
        seq.num_computed = seq.num_cached = len(seq.block_table) * ps
        self.hit_tokens += seq.num_computed

    def register_full_pages(self, seq: Sequence) -> None:
        """Hash the sequence's newly completed full pages (called after each forward)."""
        if not self.enable_prefix_caching or seq.page_hashes is None:
            return  # None: KV computed (partly) under weights older than the last cache reset
        ps, toks = self.page_size, seq.token_ids
        full = seq.num_computed // ps
        while len(seq.page_hashes) < full:
            b = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            key = (parent, tuple(toks[b * ps : (b + 1) * ps]))
            h = chain_hash(*key)
            seq.page_hashes.append(h)
            page = seq.block_table[b]
            if self.page_hash[page] is None and h not in self.cached:
                self.page_hash[page], self.page_key[page] = h, key
                self.cached[h] = page

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's pages (tail first, so a prefix's head pages stay cached longest)."""
        for page in reversed(seq.block_table):
            self._decref(page)
        seq.block_table = []
        seq.num_computed = 0
        seq.page_hashes = []
        seq.kv_stale = False  # no KV left: what it computes next is under the weights served then

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None | bool:
        """Share the parent's full pages with ``child`` and copy its partial last page.

        Returns (src, dst) page copy to run before the next forward, None if no copy is needed,
        or False when no page is available for the copy (nothing changed; the caller re-queues
        the child for a prefill that hits the prefix cache instead).
        """
        ps = self.page_size
        full = parent.num_computed // ps
        partial = parent.num_computed % ps != 0
        if partial and self.num_free_pages < 1:
            return False
        for page in parent.block_table[:full]:
            self._incref(page)
        child.block_table = parent.block_table[:full]
        child.page_hashes = None if parent.page_hashes is None else parent.page_hashes[:full]
        child.num_computed = parent.num_computed
        child.kv_stale = parent.kv_stale
        if not partial:
            return None
        dst = self._take()
        child.block_table.append(dst)
        return parent.block_table[full], dst

    def reset_prefix_cache(self, in_flight: list[Sequence] = ()) -> None:
        """Forget every hash: cached pages become plain free pages; pages in use stay.

        ``in_flight`` sequences keep their pages but never register pages again (their KV may
        mix weight versions, so it must not be reused by later requests).
        """
        for seq in in_flight:
            seq.page_hashes = None
        self.free.extend(self.evictable)  # C-level: this runs inside every weight update
        self.evictable.clear()
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        self.page_key = [None] * self.num_pages

    def reset(self) -> None:
        """Back to the fresh state (every page free in id order, nothing cached) once no sequence
        holds a page: the pages' contents are about to be dropped (engine sleep). The hit counters
        keep counting. Raises RuntimeError naming the pages still in use."""
        used = [p for p, r in enumerate(self.ref) if r]
        if used:
            raise RuntimeError(f"BlockManager.reset: {len(used)} pages still in use (first: {used[:8]})")
        self.free = deque(range(self.num_pages))
        self.evictable.clear()
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        self.page_key = [None] * self.num_pages

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def check(self) -> None:
        """Assert the page-state invariant (module docstring)."""
        in_use = sum(1 for r in self.ref if r > 0)
        assert in_use + len(self.free) + len(self.evictable) == self.num_pages, (
            in_use,
            len(self.free),
            len(self.evictable),
            self.num_pages,
        )
        for h, page in self.cached.items():
            assert self.page_hash[page] == h, f"cached hash of page {page} is stale"

"""Block manager and scheduler, driven by hand with no model (no tensors involved)."""

import pytest

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.interface import SamplingParams
from m3_rollout.engine.scheduler import Scheduler
from m3_rollout.engine.sequence import Sequence

PS = 4


def _seq(i, tokens, children=0):
    s = Sequence(i, f"r{i}", i, 0, SamplingParams(), tokens, frozenset(), 10**6)
    s.children = [
        Sequence(100 + i * 10 + j, f"r{i}", i, j + 1, SamplingParams(), tokens, frozenset(), 10**6)
        for j in range(children)
    ]
    return s


def _run(sched, plan, new_tokens=None):
    """Pretend the forward ran: advance computed counts, append a token to sampling rows."""
    for r in plan.rows:
        r.seq.num_computed += r.num_tokens
        sched.bm.register_full_pages(r.seq)
        if r.sample:
            r.seq.token_ids.append(new_tokens or 1)
    sched.bm.check()


def test_prefix_pages_shared_by_refcount_and_lru_eviction():
    bm = BlockManager(8, PS)
    a = _seq(1, list(range(10)))  # 2 full pages + 2 tokens
    bm.admit(a)
    assert a.num_computed == 0 and bm.ensure(a, 10) and len(a.block_table) == 3
    a.num_computed = 10
    bm.register_full_pages(a)
    b = _seq(2, list(range(9)) + [99])  # same first 2 pages
    bm.admit(b)
    assert b.block_table == a.block_table[:2] and b.num_computed == 8
    assert bm.ref[a.block_table[0]] == 2 and bm.hit_tokens == 8 and bm.query_tokens == 20
    # A different prefix reuses nothing (chain hash: the second page alone matches nothing).
    c = _seq(3, [7] + list(range(1, 10)))
    bm.admit(c)
    assert c.num_computed == 0
    bm.free_seq(b)
    bm.free_seq(a)
    # a's pages: the 2 hashed ones are cached (evictable), the partial one is plain free.
    assert len(bm.evictable) == 2 and bm.num_free_pages == 8
    # Taking all 8 pages evicts the cached ones last (LRU) and drops their hashes.
    d = _seq(4, list(range(50, 80)))
    bm.admit(d)
    assert bm.ensure(d, 30) and len(d.block_table) == 8 and not bm.cached
    assert not bm.ensure(_seq(5, [1]), 1)
    bm.check()


def test_fork_shares_full_pages_and_copies_partial_page():
    bm = BlockManager(8, PS)
    a = _seq(1, list(range(6)))
    bm.admit(a)
    bm.ensure(a, 6)
    a.num_computed = 6
    child = _seq(2, list(range(6)))
    src_dst = bm.fork(a, child)
    assert src_dst == (a.block_table[1], child.block_table[1]) and src_dst[0] != src_dst[1]
    assert child.block_table[0] == a.block_table[0] and bm.ref[a.block_table[0]] == 2
    assert child.num_computed == 6
    # At a page edge nothing is copied.
    e = _seq(3, list(range(8)))
    bm.admit(e)
    bm.ensure(e, 8)
    e.num_computed = 8
    assert bm.fork(e, _seq(4, list(range(8)))) is None
    bm.check()


def test_reset_prefix_cache_drops_reuse():
    bm = BlockManager(8, PS)
    a = _seq(1, list(range(9)))
    bm.admit(a)
    bm.ensure(a, 9)
    a.num_computed = 9
    bm.register_full_pages(a)
    bm.free_seq(a)
    bm.reset_prefix_cache()
    b = _seq(2, list(range(9)))
    bm.admit(b)
    assert b.num_computed == 0 and bm.num_free_pages == 8
    bm.check()


def test_budget_decode_first_and_chunked_prefill():
    bm = BlockManager(64, PS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    long_ = _seq(1, list(range(23)))
    sched.add(long_)
    plan = sched.schedule()
    assert [(r.seq.seq_id, r.num_tokens, r.sample) for r in plan.rows] == [(1, 10, False)]
    _run(sched, plan)
    short = _seq(2, [5, 6, 7])
    sched.add(short)
    plan = sched.schedule()  # the running prefill takes the whole budget; the newcomer waits
    assert [(r.seq.seq_id, r.num_tokens) for r in plan.rows] == [(1, 10)] and sched.waiting[0] is short
    _run(sched, plan)
    plan = sched.schedule()  # long: 3 tokens left -> samples; short: 3 tokens
    rows = [(r.seq.seq_id, r.num_tokens, r.sample) for r in plan.rows]
    assert (1, 3, True) in rows and plan.num_batched_tokens <= 10
    _run(sched, plan, new_tokens=9)
    plan = sched.schedule()
    # Decode rows (1 token) come first in the plan.
    assert plan.num_decodes >= 1 and all(r.num_tokens == 1 for r in plan.rows[: plan.num_decodes])


def test_preemption_by_recompute_frees_newest_and_requeues_it_first():
    bm = BlockManager(6, PS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(1, list(range(12))), _seq(2, list(range(20, 32)))  # 3 pages each: pool full
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert len(plan.rows) == 2 and bm.num_free_pages == 0
    _run(sched, plan)  # both sampled -> 13 tokens: each needs a 4th page to decode
    plan = sched.schedule()
    assert plan.preempted == [b] and sched.waiting[0] is b and b.num_computed == 0 and not b.block_table
    assert [r.seq for r in plan.rows] == [a] and sched.num_preemptions == 1
    _run(sched, plan)
    sched.remove(a)
    plan = sched.schedule()  # b comes back and recomputes all 13 tokens
    assert [(r.seq, r.num_tokens, r.sample) for r in plan.rows] == [(b, 13, True)]


def test_group_counts_as_n_rows_for_max_num_seqs():
    bm = BlockManager(64, PS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(_seq(1, [1, 2, 3], children=2))
    sched.add(_seq(2, [4, 5, 6], children=2))
    plan = sched.schedule()
    assert [r.seq.seq_id for r in plan.rows] == [1]  # 3 + 3 rows > 4: the second group waits


def test_sample_groups_split_n_at_max_num_seqs_and_wider_groups_are_refused():
    from m3_rollout.engine.requests import sample_groups

    assert sample_groups(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert sample_groups(3, 4) == [range(0, 3)]
    sched = Scheduler(BlockManager(16, PS, True), max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(AssertionError, match="max_num_seqs=4"):
        sched.add(_seq(1, [1, 2, 3], children=4))

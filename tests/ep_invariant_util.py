"""The EP batch-invariance check shared by tests/test_ep_invariant.py (CPU, gloo, Triton interpreter)
and tests/gpu/test_ep_invariant_gpu.py (CUDA, NCCL, compiled kernels). No side effects on import.

Each spawned rank builds the same seeded MoE layer, keeps an unsharded copy (EP=1) and shards
the other (``shard_experts``), then runs the EP layer's fused path (``M3MoE.forward_fused`` with
the batch-invariant table) over a schedule of row subsets of its own tokens while its peers run
theirs: its whole batch, one token alone, shuffled subsets, beside a peer with no tokens. A call
is "bad" when a token's routed output, shared output or expert ids differ in any bit from the
EP=1 layer's on that token in the rank's whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from mp_results import get_results, put_result

from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.parallel import EPGroupSpec, destroy_ep_group, free_port, init_ep_group, shard_experts


@dataclass(frozen=True)
class EPCase:
    """One EP invariance run: sizes (H hidden, I expert width, E experts, K per token), the
    activation dtype name, tokens per rank, and the device kind ("cpu": gloo + interpreter;
    "cuda": NCCL, rank r on cuda:r)."""

    dtype: str
    tokens: tuple[int, ...]
    hidden: int = 64
    inter: int = 32
    experts: int = 8
    top_k: int = 4
    device: str = "cpu"

    @property
    def world(self) -> int:
        return len(self.tokens)


def moe_model(case: EPCase, device: torch.device) -> M3ForCausalLM:
    """The seeded tiny M3 whose first MoE layer is tested (expert / shared weights N(0, 0.3), router
    N(0, 0.5): sharp routing, values large enough that rounding differences show), cast for
    inference to the case's dtype (router kept fp32)."""
    torch.manual_seed(0)
    cfg = tiny_config(
        hidden_size=case.hidden,
        intermediate_size=case.inter,
        shared_intermediate_size=case.inter,
        num_local_experts=case.experts,
        num_experts_per_tok=case.top_k,
    )
    model = M3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for moe in model.moe_layers():
            for p in (moe.experts.w13, moe.experts.w2, *moe.shared_experts.parameters()):
                p.normal_(0, 0.3)
            moe.gate.weight.normal_(0, 0.5)
    return model.to(device).cast_for_inference(getattr(torch, case.dtype))


def schedule(rank: int, t: int) -> list[tuple[str, list[int]]]:
    """(name, rows) of every call on this rank; call j of every rank runs at the same time."""
    g = torch.Generator().manual_seed(7 + rank)
    calls = [("batch", list(range(t)))]
    for i in range(3):  # rank 0's token i alone; the others run shuffled subsets
        calls.append(
            (f"alone{i}", [i]) if rank == 0 else (f"peer{i}", torch.randperm(t, generator=g)[: 2 + i].tolist())
        )
    for i in range(3):  # rank 1's token i alone; the others run their shuffled batch
        calls.append((f"alone{i}", [i]) if rank == 1 else (f"peer{i}", torch.randperm(t, generator=g).tolist()))
    calls.append(("shuffled", torch.randperm(t, generator=g).tolist()))
    calls.append(("empty", []) if rank == 1 else ("peer_empty", list(range(t))))
    return calls


def ep_invariant_rank(rank: int, spec: EPGroupSpec, results, case: EPCase) -> None:
    """Spawned rank body: runs ``schedule`` and reports {"rank", "bad": [call names], "sent" (pairs
    sent per rank in the batch call), "ref_alone_ok" (EP=1 itself: a token alone == batched),
    "unsorted_slots" (tokens whose K expert ids are not ascending), "max_abs"} or {"error"}."""
    try:
        torch.set_num_threads(1)
        dtype = getattr(torch, case.dtype)
        if case.device == "cuda":
            from m3_rollout.engine.ops import paged_ops_for

            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            ops = paged_ops_for(device, dtype, batch_invariant=True)
            dot = contextlib.nullcontext  # compiled kernels: nothing to patch
        else:
            from m3_kernels.msa_interpret import fixed_order_dot
            from m3_rollout.engine.ops import interpreted_paged_ops

            device = torch.device("cpu")
            ops = interpreted_paged_ops(batch_invariant=True)  # sets TRITON_INTERPRET=1 in this process
            dot = fixed_order_dot  # the interpreter's dot in a per-row order, as on the GPU
        group = init_ep_group(spec, rank, device)
        ref = moe_model(case, device)
        ep = copy.deepcopy(ref)
        stats = shard_experts(ep, rank, case.world, group)
        moe_ref, moe_ep = ref.moe_layers()[0], ep.moe_layers()[0]
        g = torch.Generator().manual_seed(100 + rank)
        t = case.tokens[rank]
        x = torch.randn(t, case.hidden, generator=g).to(device, dtype)

        def layer(moe, rows):
            xs = x[rows]
            routed, shared = moe.forward_fused(xs, xs.float(), ops)
            return routed, shared, moe.last_topk_ids

        out: dict = {"rank": rank, "bad": []}
        with torch.no_grad(), dot():
            r_ref, s_ref, ids_ref = layer(moe_ref, list(range(t)))  # EP=1, whole batch
            for name, rows in schedule(rank, t):
                stats.reset()
                r, s, ids = layer(moe_ep, rows)
                same = torch.equal(r, r_ref[rows]) and torch.equal(s, s_ref[rows]) and torch.equal(ids, ids_ref[rows])
                if not same:
                    out["bad"].append(name)
                if name == "batch":
                    out["sent"] = stats.sent_per_rank.tolist()
            alone = [layer(moe_ref, [i])[0] for i in range(min(3, t))]
            out["ref_alone_ok"] = all(torch.equal(a, r_ref[i : i + 1]) for i, a in enumerate(alone))
        out["unsorted_slots"] = int((ids_ref[:, 1:] < ids_ref[:, :-1]).any(-1).sum())
        out["max_abs"] = float(r_ref.abs().max())
        put_result(results, out)
    except Exception:  # noqa: BLE001 - report to the parent, which fails the test
        put_result(results, {"rank": rank, "error": traceback.format_exc()})
    finally:
        destroy_ep_group()


def run_ep_invariant(case: EPCase, timeout_s: float) -> list[dict]:
    """Spawn ``case.world`` ranks of :func:`ep_invariant_rank`; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    backend = "nccl" if case.device == "cuda" else "gloo"
    spec = EPGroupSpec(case.world, "127.0.0.1", free_port(), backend, timeout_s=timeout_s)
    procs = [
        ctx.Process(target=ep_invariant_rank, args=(r, spec, results, case), daemon=True) for r in range(case.world)
    ]
    for pr in procs:
        pr.start()
    try:
        got = get_results(results, case.world, timeout_s, "rank")
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    return [got[r] for r in range(case.world)]


def check_ep_invariant(outs: list[dict]) -> None:
    """The assertions on :func:`run_ep_invariant`'s results (module docstring)."""
    for o in outs:
        assert o["bad"] == [], o  # every call: routed, shared and expert ids bitwise those of EP=1
        assert o["ref_alone_ok"], o
        assert o["unsorted_slots"] > 0, o  # slot order != expert order for some tokens
        assert 0 < o["max_abs"] < 1e3, o
    assert outs[0]["sent"][1] > 0 and outs[1]["sent"][0] > 0, outs  # pairs crossed ranks both ways

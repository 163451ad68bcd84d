"""Batched KV-cache generator: the walking skeleton's native backend.

Governing idea: the simplest generator that is still a real one. All samples of a call run as
one batch over a contiguous per-row KV cache (``m3_rollout.model.KVCache``, slot == position):
one prefill over the right-padded prompts, then one decode step per token for every running row.
Finished rows are dropped from the batch (the cache rows are compacted) so the tail of a batch
costs only what is still running. Multi-turn continuations arrive as new requests whose prompt
holds the whole conversation so far; this backend re-prefills them (the paged engine of issue 3
reuses the cached pages instead).

Not here yet (issue 3): paged caches, prefix reuse, continuous batching, chunked prefill.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from m3_rollout.engine.interface import GenerationBackend, GenerationRequest, SampleOutput
from m3_rollout.engine.sampler import SamplingTensors, sample
from m3_rollout.model import KVCache, M3ForCausalLM
from m3_rollout.model.loading import iter_released_tensors, load_released_tensor


class _Row:
    """Host-side state of one running sample (no tensors)."""

    __slots__ = ("req", "sample_index", "prompt", "out", "lps", "finish", "error")

    def __init__(self, req: GenerationRequest, sample_index: int):
        self.req = req
        self.sample_index = sample_index
        self.prompt = list(req.prompt_ids)
        self.out: list[int] = []
        self.lps: list[float] = []
        self.finish: str | None = None
        self.error: str | None = None


class SimpleGenerationBackend(GenerationBackend):
    """Native backend over one in-process model.

    Args:
        model: an ``M3ForCausalLM`` already in the generation dtype (e.g. bf16 with an fp32
            router), in eval mode.
        eos_token_ids: tokens that always end a sample (the chat format's end-of-message).
        max_model_len: longest context (prompt + generated) a sample may reach; defaults to the
            model's ``max_position_embeddings``.
        max_num_seqs: most rows per batch; larger calls are split.
    """

    def __init__(self, model: M3ForCausalLM, eos_token_ids: Sequence[int], max_model_len: int | None = None,
                 max_num_seqs: int = 256):
        self.model = model.eval()
        self.config = model.config
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self._version = 0
        self._released = {name: (tuple(t.shape), t.dtype) for name, t in iter_released_tensors(model)}
        self.stats = {"generated_tokens": 0, "prefill_tokens": 0, "seconds": 0.0}

    # ---- weights -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a full set of released-name tensors into the model's existing storage.

        All-or-nothing for bad input: every name and shape is checked (and values must be finite)
        before the first copy; nothing is copied if anything is wrong.

        Raises:
            ValueError: listing missing / unexpected / mis-shaped / non-finite tensors.
        """
        incoming = dict(named_tensors)
        problems = [f"missing: {n}" for n in self._released if n not in incoming]
        problems += [f"unexpected: {n}" for n in incoming if n not in self._released]
        for name, t in incoming.items():
            if name in self._released and tuple(t.shape) != self._released[name][0]:
                problems.append(f"shape of {name}: got {tuple(t.shape)}, expected {self._released[name][0]}")
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                problems.append(f"non-finite values in {name}")
        if problems:
            raise ValueError("weight update rejected, weights unchanged (version "
                             f"{self._version}):\n  " + "\n  ".join(problems))
        with torch.no_grad():
            for name, t in incoming.items():
                load_released_tensor(self.model, name, t)
        self._version = int(version)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[SampleOutput]:
        rows: list[_Row] = []
        modes = {req.params.logprobs_mode for req in requests}
        if len(modes) > 1:
            raise ValueError(f"one generate() call must use one logprobs_mode, got {sorted(modes)}")
        for req in requests:
            req.params.validate()
            for j in range(req.params.n):
                rows.append(_Row(req, req.sample_index + j))
        runnable = []
        vocab = self.config.vocab_size
        for row in rows:
            if not row.prompt:
                row.finish, row.error = "error", "empty prompt"
            elif min(row.prompt) < 0 or max(row.prompt) >= vocab:
                row.finish, row.error = "error", f"token id outside the vocabulary [0, {vocab})"
            elif len(row.prompt) >= self.max_model_len:
                row.finish = "error"
                row.error = (f"prompt of {len(row.prompt)} tokens leaves no room under max_model_len="
                             f"{self.max_model_len}")
            else:
                runnable.append(row)
        t0 = time.perf_counter()
        for i in range(0, len(runnable), self.max_num_seqs):
            self._run_batch(runnable[i:i + self.max_num_seqs])
        self.stats["seconds"] += time.perf_counter() - t0
        return [SampleOutput(request_id=r.req.request_id, sample_index=r.sample_index, prompt_ids=r.prompt,
                             output_ids=r.out, logprobs=r.lps, finish_reason=r.finish or "length",
                             weight_version=self._version, error=r.error) for r in rows]

    @torch.no_grad()
    def _run_batch(self, rows: list[_Row]) -> None:
        device = next(self.model.parameters()).device
        n = len(rows)
        prompt_lens = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long)
        budgets = [min(r.req.params.max_new_tokens, self.max_model_len - len(r.prompt)) for r in rows]
        cache_len = max(len(r.prompt) + b for r, b in zip(rows, budgets))
        cache = KVCache(self.config, n, cache_len, dtype=self._dtype(), device=device)

        # Prefill: right-padded; pad tokens take the next positions and write only future slots.
        width = int(prompt_lens.max())
        ids = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r.prompt)] = torch.tensor(r.prompt)
        positions = torch.arange(width).expand(n, width)
        logits = self.model(ids.to(device), positions.to(device), cache)
        last = logits[torch.arange(n), (prompt_lens - 1).to(device)]  # [n, V], upcast by the sampler
        self.stats["prefill_tokens"] += int(prompt_lens.sum())

        params = SamplingTensors(
            temperature=torch.tensor([r.req.params.temperature for r in rows], dtype=torch.float64),
            top_k=torch.tensor([r.req.params.top_k for r in rows], dtype=torch.long),
            top_p=torch.tensor([r.req.params.top_p for r in rows], dtype=torch.float32),
            seeds=torch.tensor([r.req.params.seed for r in rows], dtype=torch.long),
            sample_ids=torch.tensor([r.sample_index for r in rows], dtype=torch.long),
        )
        stops = [set(r.req.params.stop_token_ids) | set(self.eos_token_ids) for r in rows]
        active = list(range(n))  # row indices (into `rows`) still running, in cache-row order
        pos = prompt_lens.clone()  # position the next sampled token occupies, per row
        while True:
            act = torch.tensor(active)
            sub = SamplingTensors(*(t[act] for t in (params.temperature, params.top_k, params.top_p,
                                                     params.seeds, params.sample_ids)))
            tokens, lps = sample(last.cpu(), sub, pos[act], rows[active[0]].req.params.logprobs_mode)
            still = []
            for k, i in enumerate(active):
                r, tok = rows[i], int(tokens[k])
                r.out.append(tok)
                r.lps.append(float(lps[k]))
                if tok in stops[i]:
                    r.finish = "stop"
                elif len(r.out) >= budgets[i]:
                    r.finish = "length"
                else:
                    still.append(k)
            self.stats["generated_tokens"] += len(active)
            if not still:
                return
            if len(still) < len(active):
                keep = torch.tensor(still)
                cache.select_rows(keep.to(device))
                tokens = tokens[keep]
                active = [active[k] for k in still]
            act = torch.tensor(active)
            step_pos = pos[act]
            logits = self.model(tokens[:, None].to(device), step_pos[:, None].to(device), cache)
            last = logits[:, -1]
            pos[act] += 1

    def _dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype


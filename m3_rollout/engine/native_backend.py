"""NativeBackend: the ``GenerationBackend`` over an in-process :class:`LLMEngine` (design.md §3).

Governing idea: callers never see steps. ``generate`` adds the requests and steps until they
are done; ``generate_async`` / ``stream`` go through the :class:`StepDriver` over the engine
(per-request queues, ONE driver task that steps the engine while anyone waits, so many asyncio
callers batch together; the EP service's ``generate_async`` is the same driver over its step
API). Requests get an internal unique id inside the engine (two callers may reuse a request id);
outputs carry the caller's id again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import torch

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationBackend, GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.engine.step_driver import StepDriver


class NativeBackend(GenerationBackend):
    """This project's engine behind the generation contract.

    Args:
        model: ``M3ForCausalLM`` in the generation dtype (e.g. bf16 with fp32 router), eval mode.
        eos_token_ids: tokens that always end a sample.
        max_model_len: longest context (prompt + generated); default the model's
            ``max_position_embeddings``.
        max_num_seqs: most running samples per step.
        detokenize: optional ``ids -> text`` (stop strings).
        **engine_kwargs: further :class:`EngineConfig` fields (kv_cache_memory_gb,
            max_num_batched_tokens, enable_prefix_caching, num_pages, enable_cuda_graphs,
            async_scheduling).
    """

    def __init__(
        self,
        model,
        eos_token_ids: Sequence[int],
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        detokenize: Callable[[list[int]], str] | None = None,
        **engine_kwargs,
    ):
        cfg = EngineConfig(
            max_model_len=int(max_model_len or model.config.max_position_embeddings),
            max_num_seqs=max_num_seqs,
            eos_token_ids=tuple(int(t) for t in eos_token_ids),
            **engine_kwargs,
        )
        self.engine = LLMEngine(model, cfg, detokenize)
        self.model = self.engine.model
        # The weight receiver (``update_weights``): attached by the job layer, which may import
        # m3_rollout.weight_sync (the engine may not).
        self.weight_sync = None
        self.step_driver = StepDriver(self.engine)  # internal ids, async callers' queues, the driver task

    # ---- weights -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def weight_writes(self) -> int:
        """The engine's weight-write count (:attr:`LLMEngine.weight_writes`)."""
        return self.engine.weight_writes

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a full set of released-name tensors into the model's existing storage, in place,
        through the attached weight receiver (``weight_sync``: the job layer attaches a
        ``m3_rollout.weight_sync.LocalWeightSync`` over ``self.engine``; every check, the version
        rule, ``weight_sync.atomic`` / ``in_flight`` and the probe live there, once for every
        backend). The receiver resets the prefix cache once and sets the version.

        Outputs finished while draining (``in_flight=drain``) go to their async callers; requests a
        failed update handed back are re-added here, where the refusal turns them into error
        records (one rank: nowhere else to place them).

        Raises:
            RuntimeError: no weight receiver attached, or the weights are offloaded (sleep level 2):
                wake up first.
            ValueError: the update was rejected (names the tensors / versions; see the receiver).
        """
        if self.weight_sync is None:
            raise RuntimeError(
                "NativeBackend.update_weights: no weight receiver attached; set backend.weight_sync = "
                "m3_rollout.weight_sync.LocalWeightSync(backend.engine, ...) (the job's stack builder does)"
            )
        if self.engine.weights_offloaded:
            raise RuntimeError(
                "update_weights: the engine sleeps at level 2 (weights offloaded to host memory); "
                "call wake_up() first, then update the weights"
            )
        policy = self.weight_sync.receiver.in_flight
        policy.last = None
        try:
            self.weight_sync.update_weights(version, named_tensors)
        finally:
            outcome = policy.last
            if outcome is not None:
                self.step_driver.deliver(outcome.outputs)
                for req in outcome.handed_back:
                    self.engine.add_request(req)

    def set_probe_reference(self, reference: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The trainer's probe scorer for ``weight_sync.probe`` (passed to the attached receiver)."""
        self.weight_sync.set_probe_reference(reference)

    # ---- control -------------------------------------------------------------------------
    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> dict:
        """See :meth:`LLMEngine.sleep` (refused while generate / generate_async callers are active)."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict:
        """See :meth:`LLMEngine.wake_up`."""
        return self.engine.wake_up()

    def abort(self, request_id: str) -> None:
        """Abort every sample of the caller's ``request_id`` (finish_reason "abort")."""
        self.step_driver.abort(request_id)

    def score(
        self, token_ids: Sequence[int], positions: Sequence[int] | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """See :meth:`LLMEngine.score`."""
        return self.engine.score(token_ids, positions, temperature)

    def metrics(self) -> dict:
        return self.engine.metrics()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[SampleOutput]:
        """Run all requests to completion; outputs ordered by request, then sample.

        Bad requests give error records (finish_reason "error"), the rest go on.
        Raises RuntimeError when called while paused or asleep, or while generate_async / stream
        callers are active.
        """
        self.engine.check_awake("generate")
        if self.engine.paused:
            raise RuntimeError("generate() while paused: call resume() first")
        self.step_driver.check_idle()
        iids = [self.step_driver.add(req) for req in requests]
        pos = {iid: i for i, iid in enumerate(iids)}
        results: list[list[SampleOutput]] = [[] for _ in requests]
        remaining = sum(len(r.output_indices()) for r in requests)
        while remaining:
            for out in self.engine.step():
                if isinstance(out, SampleOutput) and out.request_id in pos:
                    i = pos[out.request_id]
                    results[i].append(dataclasses.replace(out, request_id=requests[i].request_id))
                    remaining -= 1
        for req, iid in zip(requests, iids):
            self.step_driver.release(req.request_id, iid)
        return [o for outs in results for o in sorted(outs, key=lambda o: o.sample_index)]

    async def generate_async(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[SampleOutput]:
        """Yield each sample's :class:`SampleOutput` as it finishes (finish order); bad requests
        yield error records. Many concurrent callers share the engine's batches (one
        :class:`StepDriver`); closing the iterator early aborts the samples not yet out. An
        exception raised by an engine step is re-raised in every waiting caller (none is left
        hanging). Raises RuntimeError while the engine is asleep."""
        self.engine.check_awake("generate")
        async with contextlib.aclosing(self.step_driver.run(requests)) as outs:
            async for out in outs:
                yield out

    async def stream(self, request: GenerationRequest) -> AsyncIterator[SampleOutput | StreamDelta]:
        """Stream one request: :class:`StreamDelta` records as tokens arrive, then each sample's
        final :class:`SampleOutput`. Raises ValueError (naming the field) for a bad request,
        RuntimeError while the engine is asleep."""
        self.engine.check_request(request)
        async with contextlib.aclosing(self.step_driver.run([request], stream=True)) as outs:
            async for out in outs:
                yield out

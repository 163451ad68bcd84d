"""Clients of the rollout server: the trainer's control-plane client and a GenerationBackend over HTTP.

Governing idea: the trainer side needs two things from a server in another process. The control
plane (:class:`RolloutServerClient`): health, pause / resume, abort, prefix-cache reset, and the
weight-sync calls, which must run *while* the trainer's own side of the collective runs, so they
also come as ``start_*`` methods returning a future. And generation (:class:`HTTPBackend`):
the ``GenerationBackend`` contract over ``/generate`` (token-in/token-out), so group rollouts with
multi-turn tool use run unchanged against a server; its ``update_weights`` hosts the weight-sync
group in this process (rank 0) and pushes the tensors with a ``WeightSender``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import httpx
import numpy as np
import torch

from m3_rollout.engine.interface import (
    GenerationBackend,
    GenerationRequest,
    PositionLogprobs,
    SampleOutput,
    SamplingParams,
)
from m3_rollout.engine.requests import error_outputs
from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment
from m3_rollout.parallel.process_group import free_port
from m3_rollout.weight_sync import BroadcastChannel, WeightSender, WeightSyncGroup

from .metrics import parse_metrics
from .protocol import GENERATE_SAMPLING_KEYS, GENERATION_FAILED, WEIGHT_SYNC_NOT_JOINED, WEIGHT_UPDATE_REJECTED


class ServerError(RuntimeError):
    """A non-2xx answer: ``status`` and the server's OpenAI-shaped ``error`` dict (message, param, code)."""

    def __init__(self, status: int, error: dict):
        super().__init__(
            f"HTTP {status}: {error.get('message')}" + (f" (param {error['param']})" if error.get("param") else "")
        )
        self.status, self.error = status, error


def _raise_for(resp: httpx.Response) -> dict:
    if resp.status_code // 100 == 2:
        return resp.json()
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": resp.text}
    raise ServerError(resp.status_code, error)


def rejoin_needed(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's answer that it is not in the trainer's weight-sync group: a
    400 of code ``weight_sync_not_joined`` (none joined, or its EP group restarted since, so its new
    workers are not in the group): join again (``/init_weight_sync``), then resend the update."""
    return isinstance(exc, ServerError) and exc.status == 400 and exc.error.get("code") == WEIGHT_SYNC_NOT_JOINED


def ranks_finished_update(exc: BaseException) -> bool:
    """Whether ``exc``, the failure of an ``/update_weights`` call, says the server's ranks received
    the update to its end (a 400 of code ``weight_update_rejected``: they refused it), so the
    trainer's side of the collective ends too. Any other failure (its EP group restarted during the
    update: ``weight_sync_not_joined``; a refusal before the update began, e.g. a 409; the server
    unreachable) means they left it or never entered it."""
    return isinstance(exc, ServerError) and exc.error.get("code") == WEIGHT_UPDATE_REJECTED


def _on_thread(fn: Callable[[], object], name: str) -> concurrent.futures.Future:
    """Run ``fn()`` on a daemon thread of its own, on the caller's CUDA device, and return its
    future: a call the caller may stop waiting for (a weight-sync send whose peers are gone) must
    not hold a pool's worker, nor keep the process from exiting."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if device is not None:
                torch.cuda.set_device(device)
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def decode_routed_experts(obj: dict | None) -> np.ndarray | None:
    """The ``routed_experts`` JSON of /generate -> int16 array [L, n_moe_layers, top_k] (or None)."""
    if obj is None:
        return None
    return np.frombuffer(base64.b64decode(obj["data"]), dtype="<i2").reshape(obj["shape"]).astype(np.int16)


def decode_block_selection(indices: list[int] | None, table: list) -> SelectionRecord | None:
    """An output's ``block_selection`` indices into the response's decoded segment table
    (``SelectionSegment`` s; one object per distinct segment, so a group's samples share their
    prompt's) -> its ``SelectionRecord`` (or None)."""
    return None if indices is None else SelectionRecord([table[i] for i in indices])


class UnsupportedSamplingField(ValueError):
    """A ``SamplingParams`` field set to other than its default that ``/generate`` has no key for:
    sending the request without it would sample from another distribution than asked."""


def _logit_bias_object(pairs) -> dict[str, float]:
    """``SamplingParams.logit_bias`` pairs as ``/generate``'s object (token id as a string -> bias).

    The engine's own check comes first (``SamplingParams.validate``: pairs, distinct integer ids,
    finite biases in [-100, 100]), as a JSON object holds one bias per id and the server clamps
    biases to [-100, 100] (vLLM's rule): a value the engine refuses would otherwise be changed
    silently. Raises the engine's ValueError naming ``SamplingParams.logit_bias``.
    """
    return {str(t): b for t, b in SamplingParams(logit_bias=pairs).validate().logit_bias}


def _same(value):
    return value


#: Every ``SamplingParams`` field ``/generate`` takes (its ``sampling_params`` key:
#: ``protocol.GENERATE_SAMPLING_KEYS``): (JSON encoder, sent even at its default). The others go only
#: when they differ from the default, so a server older than them still takes the request; a field
#: missing here is refused when set (``request_body``), never dropped.
SAMPLING_PARAMS_WIRE: dict[str, tuple[Callable, bool]] = {
    "n": (_same, True),
    "temperature": (_same, True),
    "top_p": (_same, True),
    "top_k": (_same, True),
    "max_new_tokens": (_same, True),
    "stop_token_ids": (list, True),
    "seed": (_same, True),
    "logprobs_mode": (_same, True),
    "stop_strings": (list, True),
    "top_logprobs": (_same, False),
    "presence_penalty": (_same, False),
    "frequency_penalty": (_same, False),
    "repetition_penalty": (_same, False),
    "logit_bias": (_logit_bias_object, False),
    "prompt_logprobs": (_same, False),  # 0 asks too: each prompt token's own logprob and rank
    "ignore_eos": (_same, False),
}


def _is_default(value, default) -> bool:
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # e.g. an array: ambiguous truth value
        return False


def request_body(
    req: GenerationRequest, return_routed_experts: bool = False, return_block_selection: bool = False
) -> dict:
    """The /generate body of a GenerationRequest: same sample index, and every ``SamplingParams``
    field as ``SAMPLING_PARAMS_WIRE`` maps it (the optional ones only when set).

    Raises:
        UnsupportedSamplingField (a ValueError) naming a field set to other than its default
        that /generate has no key for; ValueError (the engine's message) for a ``logit_bias``
        the engine refuses (``_logit_bias_object``).
    """
    p = req.params
    sampling = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(p, f.name)
        if f.name not in SAMPLING_PARAMS_WIRE:
            if not _is_default(value, f.default):
                raise UnsupportedSamplingField(
                    f"SamplingParams.{f.name}={value!r:.80}: /generate has no such field, so an HTTPBackend "
                    f"request cannot carry it (leave it at its default, {f.default!r}, or use the in-process engine)"
                )
            continue
        encode, always = SAMPLING_PARAMS_WIRE[f.name]
        if always or not _is_default(value, f.default):
            sampling[GENERATE_SAMPLING_KEYS[f.name]] = encode(value)
    return {
        "input_ids": [int(t) for t in req.prompt_ids],
        "rid": req.request_id,
        "sample_index": req.sample_index,
        "return_routed_experts": return_routed_experts,
        "return_block_selection": return_block_selection,
        "block_selection_from": int(req.block_selection_from),
        "sampling_params": sampling,
    }


def decode_top_logprobs(rows: list | None) -> list[list[tuple[int, float]]] | None:
    """An output's ``top_logprobs`` JSON of /generate (per token [[id, logprob], ...]) -> the
    ``SampleOutput.top_logprobs`` lists of (int, float) tuples (None when absent)."""
    return None if rows is None else [[(int(t), float(v)) for t, v in row] for row in rows]


def decode_prefill_prompt_logprobs(rows: list | None) -> list[PositionLogprobs | None] | None:
    """An output's ``prefill_prompt_logprobs`` JSON of /generate ([null, [logprob or null for -inf,
    rank, [[id, logprob], ...]], ...]) -> the ``SampleOutput.prompt_logprobs`` entries the server's
    engine computed in its prefill (None when absent: not asked, or a server or backend that
    computes none)."""
    if rows is None:
        return None
    return [
        None
        if row is None
        else PositionLogprobs(
            float("-inf") if row[0] is None else float(row[0]), int(row[1]), [(int(t), float(v)) for t, v in row[2]]
        )
        for row in rows
    ]


def outputs_of(req: GenerationRequest, body: dict) -> list[SampleOutput]:
    """SampleOutputs (ordered by sample) of a /generate answer to ``req``."""
    table = [SelectionSegment.from_bytes(base64.b64decode(b)) for b in body.get("block_selection_segments", [])]
    return [
        SampleOutput(
            request_id=req.request_id,
            sample_index=o["sample_index"],
            prompt_ids=list(req.prompt_ids),
            output_ids=o["output_ids"],
            logprobs=o["logprobs"],
            finish_reason=o["finish_reason"],
            weight_version=o["weight_version"],
            error=o["error"],
            token_weight_versions=o["token_weight_versions"],
            token_weight_writes=[int(w) for w in o.get("token_weight_writes", [])],
            routed_experts=decode_routed_experts(o.get("routed_experts")),
            block_selection=decode_block_selection(o.get("block_selection"), table),
            top_logprobs=decode_top_logprobs(o.get("top_logprobs")),
            prompt_logprobs=decode_prefill_prompt_logprobs(o.get("prefill_prompt_logprobs")),
            prompt_weight_writes=[int(w) for w in o.get("prompt_weight_writes", [])],
        )
        for o in body["outputs"]
    ]


def _generation_failed(resp: httpx.Response) -> bool:
    """A 503 that carries an engine error record (weights invalid after a failed update or not held
    after an EP group restart, a request a failed EP group could not finish within its restarts),
    not a refusal of the server (paused, asleep, shutting down)."""
    if resp.status_code != 503:
        return False
    try:
        return resp.json()["error"]["code"] == GENERATION_FAILED
    except (ValueError, KeyError, TypeError):
        return False


class RolloutServerClient:
    """Synchronous client of one server's control plane and RL endpoints (httpx).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        api_key: sent as ``Authorization: Bearer`` when given.
        timeout_s: per-call limit (generation and weight updates may take long).
    Every method raises :class:`ServerError` for a non-2xx answer and ``httpx.HTTPError`` when the
    server cannot be reached.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="m3-server-client")

    def _get(self, path: str) -> dict:
        return _raise_for(self.http.get(path))

    def _post(self, path: str, body: dict | None = None) -> dict:
        return _raise_for(self.http.post(path, json=body or {}))

    def health(self) -> dict:
        """/health: ``paused`` (bool) and ``pause_mode`` ("abort" | "drain" | "keep", or None); an
        older server's ``paused`` (the mode or null, no ``pause_mode``) is read into that shape."""
        h = self._get("/health")
        if "pause_mode" not in h and not isinstance(h.get("paused"), bool):
            h["pause_mode"] = h.get("paused")
            h["paused"] = h["pause_mode"] is not None
        return h

    def weight_version(self) -> int:
        return int(self._get("/weight_version")["weight_version"])

    def metrics(self) -> dict[str, float]:
        """/metrics as {metric name: value} (first sample of each name)."""
        resp = self.http.get("/metrics")
        if resp.status_code != 200:
            _raise_for(resp)
        return parse_metrics(resp.text)

    def pause(self, mode: str = "keep") -> dict:
        """mode: "abort" (end running requests), "drain" (let them finish), "keep" (freeze them)."""
        return self._post("/pause", {"mode": mode})

    def resume(self) -> dict:
        return self._post("/resume")

    def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return self._post("/abort", {"rid": rid, "abort_all": abort_all})

    def reset_prefix_cache(self) -> dict:
        return self._post("/reset_prefix_cache")

    def generate(
        self, req: GenerationRequest, return_routed_experts: bool = False, return_block_selection: bool = False
    ) -> list[SampleOutput]:
        """Run one request through /generate; raises ServerError (400) for a bad request."""
        body = request_body(req, return_routed_experts, return_block_selection)
        return outputs_of(req, self._post("/generate", body))

    def tokenize(self, **body) -> list[int]:
        return self._post("/tokenize", body)["tokens"]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._post("/detokenize", {"tokens": list(tokens)})["prompt"]

    # ---- weight sync: each call runs beside the trainer's side of the collective --------------
    def init_weight_sync(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        bucket_size_mb: float = 512.0,
        atomic: bool = True,
    ) -> dict:
        """The server joins the group as ranks ``rank_offset ..`` (one per EP worker: ``/health``'s
        ``weight_sync_ranks``) and runs the handshake; blocks until
        the trainer (rank 0) did its part (``WeightSender.handshake``): call it with
        :meth:`start_init_weight_sync` or from another thread."""
        body = dict(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank_offset=rank_offset,
            backend=backend,
            timeout_s=timeout_s,
            bucket_size_mb=bucket_size_mb,
            atomic=atomic,
        )
        return self._post("/init_weight_sync", body)

    def update_weights(self, version: int | None = None, in_flight: str = "continue") -> dict:
        """The server receives one update (the trainer calls ``WeightSender.update`` meanwhile).
        in_flight: "continue" (running requests go on, later tokens on the new version), "drain",
        "abort". Raises ServerError 400 when the update was rejected, 409 while another runs."""
        return self._post("/update_weights", {"version": version, "in_flight": in_flight})

    def start_init_weight_sync(self, *args, **kwargs) -> concurrent.futures.Future:
        """:meth:`init_weight_sync` on a helper thread; returns its future."""
        return self._pool.submit(self.init_weight_sync, *args, **kwargs)

    def start_update_weights(self, *args, **kwargs) -> concurrent.futures.Future:
        """:meth:`update_weights` on a helper thread; returns its future."""
        return self._pool.submit(self.update_weights, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.http.close()


class HTTPBackend(GenerationBackend):
    """The generation contract over a rollout server's ``/generate`` (token-in/token-out).

    Outputs carry the same fields as the in-process engine's (output ids, logprobs, finish
    reason, weight version of every token, routed experts when ``return_routed_experts``, the
    sampler's top lists with ``SamplingParams.top_logprobs``, the prefill's prompt logprobs and their
    weight-write stamps with ``SamplingParams.prompt_logprobs``, each token's weight-write count in
    ``token_weight_writes``: the server engine's count, not this process's); every sampling field
    goes to the server (``request_body``). A request the server refuses (400), or whose
    ``logit_bias`` the engine would refuse, becomes the engine's own error records (``engine.
    requests.error_outputs``: one per sample, a single one when ``n`` is not a valid count);
    ``generate`` raises :class:`UnsupportedSamplingField` for a sampling field /generate cannot take.

    Args:
        base_url: the server, e.g. "http://127.0.0.1:8000".
        api_key: the server's API key, if it has one.
        timeout_s: limit of one HTTP call.
        max_concurrency: requests in flight at once (each is one HTTP call; the server batches them).
        return_routed_experts: ask for the routing record (server started with --record-routing).
        return_block_selection: ask for the block-selection record (server started with
            --record-block-selection); each request sends its ``block_selection_from``.
        weight_sync_host: address of this (trainer) process that the server can reach; the
            weight-sync group's TCPStore is hosted here.
        weight_sync_backend: "gloo" (CPU tensors) or "nccl".
        generation_dtype: the server's generation dtype; tensors are cast to it on the wire
            (None: sent in the trainer's dtypes, right for an fp32 server).
        bucket_size_mb, weight_sync_timeout_s: weight-sync bucket size and collective timeout.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        return_routed_experts: bool = False,
        return_block_selection: bool = False,
        weight_sync_host: str = "127.0.0.1",
        weight_sync_backend: str = "gloo",
        generation_dtype: torch.dtype | None = None,
        bucket_size_mb: float = 512.0,
        weight_sync_timeout_s: float = 120.0,
    ):
        self.client = RolloutServerClient(base_url, api_key, timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.max_concurrency, self.return_routed_experts = int(max_concurrency), return_routed_experts
        self.return_block_selection = return_block_selection
        self.ws_host, self.ws_backend = weight_sync_host, weight_sync_backend
        self.generation_dtype, self.bucket_size_mb = generation_dtype, bucket_size_mb
        self.ws_timeout_s = weight_sync_timeout_s
        self._sender: WeightSender | None = None
        self._frozen_sent = False  # the server's ranks accepted an update with the frozen tensors
        self._tensors: list[tuple[str, torch.Tensor]] = []

    # ---- generation ----------------------------------------------------------------------------
    async def _one(self, http: httpx.AsyncClient, sem: asyncio.Semaphore, req: GenerationRequest) -> list[SampleOutput]:
        try:
            body = request_body(req, self.return_routed_experts, self.return_block_selection)
        except UnsupportedSamplingField:
            raise
        except ValueError as exc:  # a logit_bias the engine refuses too: its error records, as in-process
            version = _raise_for(await http.get("/weight_version"))["weight_version"]
            return error_outputs(req, str(exc), version)
        async with sem:
            resp = await http.post("/generate", json=body)
        # the engine's error records (one per req.output_indices()), as in-process
        if resp.status_code == 400 or _generation_failed(resp):
            version = _raise_for(await http.get("/weight_version"))["weight_version"]
            return error_outputs(req, resp.json()["error"]["message"], version)
        return outputs_of(req, _raise_for(resp))

    def _async_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self.timeout_s, limits=limits)

    async def generate_async(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[SampleOutput]:
        """Yield each request's samples as that request completes (any order)."""
        sem = asyncio.Semaphore(self.max_concurrency)
        async with self._async_client() as http:
            tasks = [asyncio.ensure_future(self._one(http, sem, r)) for r in requests]
            try:
                for fut in asyncio.as_completed(tasks):
                    for out in await fut:
                        yield out
            finally:
                for t in tasks:
                    t.cancel()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[SampleOutput]:
        """Run all requests concurrently; outputs ordered by request, then sample. Raises
        ServerError for answers other than 2xx / 400, httpx.HTTPError when unreachable."""

        async def run():
            sem = asyncio.Semaphore(self.max_concurrency)
            async with self._async_client() as http:
                return await asyncio.gather(*(self._one(http, sem, r) for r in requests))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            per_request = asyncio.run(run())
        else:  # called from inside an event loop: run ours on a helper thread
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                per_request = pool.submit(asyncio.run, run()).result()
        return [o for outs in per_request for o in outs]

    # ---- weights and control -------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.client.weight_version()

    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push a full set of released-name tensors as ``version`` through the weight-sync group.

        The first call hosts the group here (rank 0, a free port on ``weight_sync_host``), has the
        server join it (one rank per EP worker, ``/health``'s ``weight_sync_ranks``) and runs the
        handshake; every call then sends the tensors while the server
        receives (``/update_weights``, in_flight "continue"). The server leaves the group when its
        EP worker group restarts: a call that finds it out (``/health``'s ``weight_sync_joined``)
        hosts a new group and has the server join it first, and one whose update the server
        answers so (:func:`rejoin_needed`: the restart came meanwhile) does that and resends once;
        that answer ends the send at once (:meth:`_send`), not the collective timeout. An answer
        that the server's ranks did not receive the update also leaves the group hosted here: the
        next call hosts a new one. The frozen tensors go with every update until the server
        accepted one (a new group's).
        Raises WeightUpdateError / ServerError when the update is rejected (weights unchanged).
        """
        self._tensors = [(n, t.detach()) for n, t in named_tensors]
        if self._sender is not None and not self.client.health().get("weight_sync_joined", True):
            self._leave_weight_sync()  # the server's EP group restarted: its workers are not in ours
        for retry in (False, True):
            if self._sender is None:
                self._join_weight_sync()
            try:
                self._send(version)
                return
            except ServerError as exc:
                if retry or not rejoin_needed(exc):
                    raise
                self._leave_weight_sync()  # the server left the group during this update: join again, resend

    def _join_weight_sync(self) -> None:
        """Host a new weight-sync group here (rank 0) and have the server join it; both run the handshake."""
        port = free_port(self.ws_host)
        world = 1 + self.client.health()["weight_sync_ranks"]  # the trainer + one rank per EP worker
        joined = self.client.start_init_weight_sync(
            self.ws_host, port, world, 1, self.ws_backend, self.ws_timeout_s, self.bucket_size_mb
        )
        try:
            group = WeightSyncGroup(self.ws_host, port, 0, world, self.ws_backend, self.ws_timeout_s)
            sender = WeightSender(
                lambda: self._tensors, BroadcastChannel(group), self.bucket_size_mb, self.generation_dtype
            )
            sender.handshake()
        finally:
            joined.result()
        self._sender = sender

    def _send(self, version: int) -> None:
        """One update over the joined group while the server receives it (``/update_weights``).

        NOTE: the server's answer, not the collective, tells how the update ended, as with the
        trainers of vLLM / SGLang servers (the update request's answer carries the outcome): the
        send runs on a thread of its own and this waits for whichever ends first. An answer that
        the server's ranks did not receive the update to its end (:func:`ranks_finished_update`:
        its EP group restarted during it, and the restarted workers are not in this group; a
        refusal before it began) ends the wait at once: the group hosted here is closed (an NCCL
        send is aborted; the sender's thread ends with its collective) and the server's error is
        raised. The send would otherwise wait for ranks that are gone until the collective timeout
        (``weight_sync_timeout_s``), and only then read the answer.
        Raises ServerError (the server's answer first), WeightUpdateError (the send's), or
        httpx.HTTPError."""
        received = self.client.start_update_weights(version)
        frozen_too = not self._frozen_sent
        sender = self._sender
        sent = _on_thread(lambda: sender.update(version, include_frozen=frozen_too), "m3-weight-send")
        concurrent.futures.wait([received, sent], return_when=concurrent.futures.FIRST_COMPLETED)
        if not sent.done() and received.exception() is not None and not ranks_finished_update(received.exception()):
            self._leave_weight_sync()  # nobody receives the rest of this send: stop it
            received.result()
        try:
            sent.result()
        finally:
            received.result()
        self._frozen_sent = True

    def _leave_weight_sync(self) -> None:
        """Close the group hosted here; the next update hosts a new one (frozen tensors included)."""
        if self._sender is not None:
            self._sender.channel.group.close()
            self._sender = None
        self._frozen_sent = False

    def pause(self) -> None:
        self.client.pause("keep")

    def resume(self) -> None:
        self.client.resume()

    def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        self._leave_weight_sync()
        self.client.close()

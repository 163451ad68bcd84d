"""The FastAPI application: OpenAI-compatible routes, the RL extensions and the control plane.

Routes (bodies in ``protocol.py``):
    GET  /v1/models                      the served model
    POST /v1/chat/completions            OpenAI chat (tools, reasoning, streaming, logprobs, n)
    POST /v1/completions                 OpenAI completions (text or token ids)
    POST /generate                       token-in/token-out: ids + sampling params -> ids, logprobs,
                                         finish reason, per-token weight versions and weight-write
                                         counts, routed experts,
                                         the sampler's top logprobs (``sampling_params.top_logprobs``),
                                         prompt logprobs (``sampling_params.prompt_logprobs``;
                                         the prefill's exactly too: ``prefill_prompt_logprobs``,
                                         ``prompt_weight_writes``)
    POST /tokenize, /detokenize          text or chat messages <-> ids
    POST /init_weight_sync               join the trainer's weight-sync group (+ handshake)
    POST /update_weights                 receive one update (in_flight: continue | drain | abort)
    POST /pause, /resume                 pause (abort | drain | keep) and resume generation
    POST /abort                          abort a request by id (or all)
    POST /reset_prefix_cache             drop reusable KV pages
    GET  /weight_version, /health, /metrics   /health: status, weight_version, paused (bool),
                                         pause_mode (its mode or null), updating, running,
                                         weight_sync_ranks, weight_sync_joined
Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``), an unexpected
exception out of a route too (500, type ``server_error``, its message; the ASGI server logs its
traceback); with an API key every route needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from m3_rollout.chat.template import render
from m3_rollout.engine.interface import FINISH_ERROR, GenerationRequest, SampleOutput, SamplingParams, StreamDelta

from .control import Controller
from .metrics import CONTENT_TYPE, render_metrics
from .openai_api import (
    GENERATE_FIELDS,
    OpenAIServing,
    ServedModel,
    check_prompt_length,
    check_prompt_logprobs,
    check_token_ids,
    engine_error,
    logit_bias_pairs,
    thinking_mode_of,
)
from .protocol import (
    AbortRequest,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    GenerateSamplingParams,
    InitWeightSyncRequest,
    PauseRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    request_seed,
    union_error,
)
from .runner import EngineRunner

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BearerAuth:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <api_key>`` (401 otherwise).
    Pure ASGI (not ``BaseHTTPMiddleware``) so streamed responses still see client disconnects."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                what = "missing" if not got else "wrong"
                err = APIError(
                    401,
                    f"Incorrect API key provided ({what} Authorization header); send 'Authorization: Bearer <key>'",
                    None,
                    code="invalid_api_key",
                )
                return await JSONResponse(err.body(), 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def server_error(exc: Exception) -> APIError:
    """An unexpected exception out of a route (not an :class:`APIError`): a 500 ``server_error``
    with the exception's message (its type's name when it has none), ``param`` and ``code`` None."""
    return APIError(500, str(exc) or type(exc).__name__, None, type="server_error")


def encode_routed_experts(arr: np.ndarray) -> dict:
    """Routing record as JSON: {"shape": [L, n_moe_layers, top_k], "dtype": "int16", "data": base64 of
    the C-order bytes, little endian}."""
    a = np.ascontiguousarray(arr, dtype="<i2")
    return {"shape": list(a.shape), "dtype": "int16", "data": base64.b64encode(a.tobytes()).decode()}


def encode_block_selections(outs: list[SampleOutput]) -> tuple[list[str], list[list[int] | None]]:
    """Block-selection records of a response's samples as JSON: (table: base64 of each distinct
    coded segment, ``m3_rollout.model.selection_record`` format; per sample the indices of its
    segments in position order, or None). Equal segments (a group's prompt) are sent once."""
    table: list[str] = []
    at: dict[tuple[int, bytes], int] = {}
    per = []
    for o in outs:
        rec = o.block_selection
        if rec is None:
            per.append(None)
            continue
        idx = []
        for seg in rec.segments:
            key = (seg.start, seg.to_bytes())
            if key not in at:
                at[key] = len(table)
                table.append(base64.b64encode(key[1]).decode())
            idx.append(at[key])
        per.append(idx)
    return table, per


def encode_top_logprobs(tops: list[list[tuple[int, float]]] | None) -> list[list[list]] | None:
    """The sampler's top lists (``SampleOutput.top_logprobs`` / ``StreamDelta.top_logprobs``) as
    JSON: per generated token [[token id, logprob], ...], most likely first; None when not asked."""
    return None if tops is None else [[[t, v] for t, v in row] for row in tops]


def encode_prefill_prompt_logprobs(entries: list) -> list:
    """The prefill's prompt scores (``SampleOutput.prompt_logprobs``: [P'] entries, None first,
    then ``PositionLogprobs``) as JSON, with every bit kept: [null, [logprob, rank, [[token id,
    logprob], ...]], ...], a -inf logprob (a token the filters removed) as null, as JSON has no
    -inf. The client rebuilds them (``client.decode_prefill_prompt_logprobs``); the vLLM-shaped
    ``prompt_logprobs`` beside them cannot carry that (a floor for -inf, the own token's entry in
    place of its top one)."""
    return [
        None if e is None else [None if e.logprob == float("-inf") else e.logprob, e.rank, [[t, v] for t, v in e.top]]
        for e in entries
    ]


def _sample_dict(out: SampleOutput, routed: bool) -> dict:
    d = {
        "sample_index": out.sample_index,
        "output_ids": out.output_ids,
        "logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
        "weight_version": out.weight_version,
        "token_weight_versions": out.token_weight_versions,
        "token_weight_writes": list(out.token_weight_writes),
        "error": out.error,
        "top_logprobs": encode_top_logprobs(out.top_logprobs),
    }
    if out.prompt_logprobs is not None:  # the engine's prefill scored the prompt (prompt_logprobs asked)
        d["prefill_prompt_logprobs"] = encode_prefill_prompt_logprobs(out.prompt_logprobs)
        d["prompt_weight_writes"] = list(out.prompt_weight_writes)
    if routed:
        d["routed_experts"] = None if out.routed_experts is None else encode_routed_experts(out.routed_experts)
    return d


async def _until_disconnect(request: Request, coro):
    """Await ``coro``; if the client disconnects first, cancel it (the request is aborted on the
    engine) and return None."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def build_app(served: ServedModel, runner: EngineRunner, api_key: str | None = None) -> FastAPI:
    """The server application for ``served`` over ``runner``. The runner is shut down with the app."""
    app = FastAPI(title="m3-rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    ctl = Controller(runner)
    oai = OpenAIServing(served, ctl)
    app.state.controller, app.state.served = ctl, served
    app.router.add_event_handler("shutdown", runner.shutdown)

    # ---- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "body"]
        if err["type"] == "json_invalid":
            return JSONResponse(APIError(400, f"Invalid JSON in the request body: {err['ctx']['error']}").body(), 400)
        if not loc and err["type"] in ("model_attributes_type", "dict_type", "missing"):
            return JSONResponse(
                APIError(400, "The request body must be a JSON object (Content-Type: application/json)").body(), 400
            )
        body_field = getattr(request.scope.get("route"), "body_field", None)  # the route's request model
        model = getattr(getattr(body_field, "field_info", None), "annotation", None)
        errors = [{**e, "loc": [p for p in e["loc"] if p != "body"]} for e in exc.errors()]
        union = union_error(errors, model if isinstance(model, type) else None)
        if union is not None:
            return JSONResponse(APIError(400, union[1], union[0]).body(), 400)
        param = ".".join(loc) or None
        msg = f"{param}: {err['msg']}" if param else err["msg"]
        if err["type"] == "extra_forbidden" and loc[:1] == ["sampling_params"]:
            msg = f"{param}: unknown field; sampling_params takes {', '.join(GenerateSamplingParams.model_fields)}"
        elif "input" in err and param and err["type"] != "missing":
            msg += f" (got {json.dumps(err['input'], default=str)[:100]})"
        return JSONResponse(APIError(400, msg, param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail), None).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception):
        # Starlette raises the exception on after this answer, so the ASGI server logs it with its
        # traceback (uvicorn: "Exception in ASGI application") and closes the connection
        return JSONResponse(server_error(exc).body(), 500)

    # ---- OpenAI --------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        card = {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "m3-rollout",
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        prompt, greq = oai.prepare_chat(body)
        if body.stream:
            return StreamingResponse(
                oai.chat_stream(body, prompt, greq), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await _until_disconnect(request, oai.chat(body, prompt, greq))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        reqs = oai.prepare_completion(body)
        if body.stream:
            return StreamingResponse(
                oai.completion_stream(body, reqs), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await _until_disconnect(request, oai.completion(body, reqs))

    # ---- RL extensions -------------------------------------------------------------------------
    def generate_request(body: GenerateRequest) -> GenerationRequest:
        check_token_ids(served, body.input_ids, "input_ids")
        check_prompt_length(served, len(body.input_ids), "input_ids")
        sp = body.sampling_params
        if sp.top_k not in (-1, 0) and sp.top_k < 1:
            raise APIError(
                400, f"sampling_params.top_k={sp.top_k}: must be -1 or 0 (off) or >= 1", "sampling_params.top_k"
            )
        if sp.stop_token_ids:
            check_token_ids(served, sp.stop_token_ids, "sampling_params.stop_token_ids")
        if any(not s for s in sp.stop):
            raise APIError(400, "sampling_params.stop: stop strings must be non-empty", "sampling_params.stop")
        if body.return_routed_experts and not runner.records_routing:
            raise APIError(
                400, "return_routed_experts: start the server with --record-routing", "return_routed_experts"
            )
        if body.return_block_selection and not runner.records_block_selection:
            raise APIError(
                400,
                "return_block_selection: start the server with --record-block-selection",
                "return_block_selection",
            )
        check_prompt_logprobs(sp.prompt_logprobs, "sampling_params.prompt_logprobs")
        if body.block_selection_from > len(body.input_ids):
            raise APIError(
                400,
                f"block_selection_from={body.block_selection_from}: past the {len(body.input_ids)} input ids",
                "block_selection_from",
            )
        params = SamplingParams(  # temperature 0 (greedy), top_k 0 (off): the engine's rules, vLLM's
            n=sp.n,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_new_tokens=sp.max_new_tokens,
            stop_token_ids=tuple(sp.stop_token_ids),
            seed=request_seed(sp.seed),
            logprobs_mode=sp.logprobs_mode,
            stop_strings=tuple(sp.stop),
            top_logprobs=sp.top_logprobs,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=logit_bias_pairs(served, sp.logit_bias, "sampling_params.logit_bias"),
            prompt_logprobs=sp.prompt_logprobs,
            ignore_eos=sp.ignore_eos,
        )
        return GenerationRequest(
            body.rid or f"gen-{uuid.uuid4().hex}", body.input_ids, params, body.sample_index, body.block_selection_from
        )

    def add_prompt_logprobs(k: int, prompt: list[int], scored: tuple, outs, dicts) -> None:
        """``sampling_params.prompt_logprobs=k``: each sample dict of ``dicts`` (for ``outs``) gets
        its ``prompt_logprobs`` (vLLM's shape) and, when its prompt ran with weights written over
        since, a ``prompt_logprobs_note`` (``OpenAIServing.sample_prompt_logprobs``: the engine's
        prefill scores); ``scored``: the request's ``OpenAIServing.prompt_scores`` (the scoring
        forward, for outputs that carry none)."""
        for d, out in zip(dicts, outs):
            d["prompt_logprobs"], note = oai.sample_prompt_logprobs(prompt, scored, out, k)
            if note:
                d["prompt_logprobs_note"] = note

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        greq = generate_request(body)
        routed, selections = body.return_routed_experts, body.return_block_selection
        prompt_k, prompt = body.sampling_params.prompt_logprobs, list(greq.prompt_ids)
        if body.stream:

            async def events():
                scored = None  # the request's prompt scores, once its first sample is out
                try:
                    async for item in ctl.stream(greq, stream=True):
                        if isinstance(item, StreamDelta):
                            d = {
                                "rid": greq.request_id,
                                "sample_index": item.sample_index,
                                "token_ids": item.token_ids,
                                "logprobs": item.logprobs,
                                "weight_versions": item.weight_versions,
                                "weight_writes": list(item.weight_writes),
                                "top_logprobs": encode_top_logprobs(item.top_logprobs),
                            }
                        else:
                            d = {"rid": greq.request_id, **_sample_dict(item, routed)}
                            if selections:
                                table, (idx,) = encode_block_selections([item])
                                d.update(block_selection_segments=table, block_selection=idx)
                            if prompt_k is not None and item.finish_reason != FINISH_ERROR:
                                if scored is None:
                                    scored = await oai.prompt_scores(prompt, prompt_k, greq.params, outs=[item])
                                add_prompt_logprobs(prompt_k, prompt, scored, [item], [d])
                        yield f"data: {json.dumps(d)}\n\n"
                except APIError as exc:
                    yield f"data: {json.dumps(exc.body())}\n\n"
                except Exception as exc:  # noqa: BLE001 - reported in the stream, which has begun
                    yield f"data: {json.dumps(server_error(exc).body())}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

        async def run():
            outs = [o async for o in ctl.stream(greq, stream=False) if isinstance(o, SampleOutput)]
            errors = [o.error for o in outs if o.finish_reason == FINISH_ERROR]
            if errors:
                raise engine_error(errors[0], GENERATE_FIELDS)
            outs.sort(key=lambda o: o.sample_index)
            reply = {
                "rid": greq.request_id,
                "prompt_tokens": len(greq.prompt_ids),
                "outputs": [_sample_dict(o, routed) for o in outs],
                "weight_version": max(o.weight_version for o in outs),
            }
            if selections:
                table, per = encode_block_selections(outs)
                reply["block_selection_segments"] = table
                for d, idx in zip(reply["outputs"], per):
                    d["block_selection"] = idx
            if prompt_k is not None:
                scored = await oai.prompt_scores(prompt, prompt_k, greq.params, outs=outs)
                add_prompt_logprobs(prompt_k, prompt, scored, outs, reply["outputs"])
            return reply

        return await _until_disconnect(request, run())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            oai.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", "prompt")
        if body.prompt is not None:
            ids = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            mode = thinking_mode_of(served.template_kwargs(body.chat_template_kwargs))
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            try:
                text = render(served.chat_template, messages, tools, body.add_generation_prompt, mode)
            except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages
                raise APIError(400, f"messages: the chat template cannot render them: {exc}", "messages") from exc
            ids = served.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            oai.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < served.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} outside the vocabulary [0, {served.vocab_size})", "tokens")
        return {"prompt": served.decode(body.tokens)}

    # ---- control plane -------------------------------------------------------------------------
    @app.post("/init_weight_sync")
    async def init_weight_sync(body: InitWeightSyncRequest):
        return await ctl.init_weight_sync(body)

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        rec = await ctl.update_weights(body)
        return {
            "success": True,
            "weight_version": rec.version,
            "seconds": rec.seconds,
            "paused_seconds": rec.paused_seconds,
        }

    @app.post("/pause")
    async def pause(body: PauseRequest | None = None):
        return await ctl.pause((body or PauseRequest()).mode)

    @app.post("/resume")
    async def resume():
        return await ctl.resume()

    @app.post("/abort")
    async def abort(body: AbortRequest):
        return await ctl.abort(body.rid, body.abort_all)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return await ctl.reset_prefix_cache()

    @app.get("/weight_version")
    async def weight_version():
        return {"weight_version": runner.weight_version}

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "weight_version": runner.weight_version,
            # a boolean, as /pause and /resume answer it (and vLLM's /is_paused); the mode beside it
            "paused": ctl.pause_mode is not None,
            "pause_mode": ctl.pause_mode,  # "abort" | "drain" | "keep" while paused, else null
            "updating": ctl.updating,
            "running": sum(ctl.live.values()),
            "weight_sync_ranks": runner.weight_sync_ranks,
            "weight_sync_joined": runner.weight_sync_ready,
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(ctl, served.name), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app

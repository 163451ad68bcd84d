"""The expert-parallel server (``python -m m3_rollout.serve --expert-parallel-size 2``: two EP worker
processes over gloo) does what the in-process one does: streamed tokens equal /generate's, /abort and
a disconnecting client end the request and free its KV pages (seen on /metrics), /pause in each mode
and /resume, top logprobs (streamed and not) equal to the in-process engine's, and a trainer's
weight update over HTTP after which the server's logprobs are the trainer's, with concurrent
streams carrying both versions across the update. Over a fake EP group (no processes): a failed
group's non-streamed requests are resubmitted and answered as without the failure, streamed ones
end with error records; after a restart that lost the weights the trainer sent, requests are 503s
until the trainer joins again and sends an update."""

import asyncio
import json
import time

import httpx
import pytest
import torch
from fake_ep import fake_http_trainer, fake_service  # tests/ on sys.path
from server_util import (
    LiveServer,
    free_port,
    save_tiny_checkpoint,
    serve_subprocess,
    served_model,
    tiny_model,
    tiny_tokenizer,
)
from transformers import AutoTokenizer

from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import load_checkpoint
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.server.client import HTTPBackend, RolloutServerClient, ServerError, rejoin_needed
from m3_rollout.weight_sync import BroadcastChannel, WeightSender, WeightSyncGroup, WeightUpdateError
from m3_trainers.policy import token_logprobs

MAX_LEN = 256
EP = 2
PROMPT = list(range(20, 52))  # two KV pages


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = tiny_tokenizer()
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), tok, tiny_model(len(tok), max_len=MAX_LEN))
    args = ["--expert-parallel-size", str(EP), "--max-num-seqs", "16", "--served-model-name", "tiny-m3"]
    with serve_subprocess(path, args, startup_timeout_s=240, stop_timeout_s=60) as (url, client):
        yield url, client, path


def _body(seed: int, new: int, stream: bool = True, rid: str | None = None) -> dict:
    body = {"input_ids": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": new, "seed": seed}}
    return {**body, "rid": rid} if rid else body


def _events(resp):
    """The JSON events of an SSE /generate stream, up to [DONE]."""
    for line in resp.iter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])


def _wait_freed(client) -> dict:
    deadline = time.monotonic() + 60
    while True:
        m = client.metrics()
        if m["m3:num_requests_running"] == 0 and m["m3:kv_cache_pages_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def _stream_until(http, url, body, n_events: int):
    """Open a stream, read ``n_events`` token events; returns (response context, events iterator, ids)."""
    ctx = http.stream("POST", url + "/generate", json=body)
    resp = ctx.__enter__()
    assert resp.status_code == 200
    events = _events(resp)
    ids = []
    for _ in range(n_events):
        ids += next(events)["token_ids"]
    return ctx, events, ids


def _rest(events, ids: list) -> dict:
    """Read a stream to its final record; ``ids`` collects the streamed tokens."""
    for e in events:
        if "finish_reason" in e:
            return e
        ids += e["token_ids"]
    raise AssertionError("stream ended without a final record")


def test_ep_stream_equals_generate_and_abort_frees_pages(server):
    url, client, _ = server
    ref = httpx.post(url + "/generate", json=_body(3, 24, stream=False), timeout=120).json()["outputs"][0]
    assert len(ref["output_ids"]) == 24 and ref["finish_reason"] == "length"
    with httpx.Client(timeout=120) as http:
        # Streamed = non-streamed (same seed; keyed sampler), token by token.
        ctx, events, ids = _stream_until(http, url, _body(3, 24), 1)
        final = _rest(events, ids)
        ctx.__exit__(None, None, None)
        assert ids == final["output_ids"] == ref["output_ids"] and final["logprobs"] == pytest.approx(ref["logprobs"])
        # /abort by request id: the stream ends with "abort" and the output so far.
        ctx, events, ids = _stream_until(http, url, _body(4, 200, rid="ep-abort"), 2)
        m = client.metrics()
        assert m["m3:num_requests_running"] == 1 and m["m3:kv_cache_pages_used"] > 0
        assert client.abort("ep-abort") == {"aborted": 1}
        final = _rest(events, ids)
        ctx.__exit__(None, None, None)
        assert final["finish_reason"] == "abort" and final["output_ids"][: len(ids)] == ids and len(ids) < 200
        _wait_freed(client)
        # A client that goes away: its request is aborted on the EP ranks and its pages freed.
        ctx, events, _ = _stream_until(http, url, _body(5, 200), 2)
        assert client.metrics()["m3:kv_cache_pages_used"] > 0
        ctx.__exit__(None, None, None)
    _wait_freed(client)
    assert client.health()["running"] == 0


def test_ep_pause_modes_and_resume(server):
    url, client, _ = server
    ref = httpx.post(url + "/generate", json=_body(7, 30, stream=False), timeout=120).json()["outputs"][0]
    with httpx.Client(timeout=120) as http:
        # keep: the request stays in the engine (KV kept) and continues at /resume, tokens unchanged.
        ctx, events, ids = _stream_until(http, url, _body(7, 30), 1)
        assert client.pause("keep")["mode"] == "keep"
        assert client.metrics()["m3:kv_cache_pages_used"] > 0 and client.health()["pause_mode"] == "keep"
        assert client.resume() == {"paused": False}
        final = _rest(events, ids)
        ctx.__exit__(None, None, None)
        assert final["finish_reason"] == "length" and ids == final["output_ids"] == ref["output_ids"]
        # abort: the running request ends now.
        ctx, events, ids = _stream_until(http, url, _body(8, 200), 1)
        assert client.pause("abort")["aborted"] == 1
        assert _rest(events, ids)["finish_reason"] == "abort"
        ctx.__exit__(None, None, None)
        client.resume()
        # drain: /pause returns once the running request finished.
        ctx, events, ids = _stream_until(http, url, _body(9, 20), 1)
        assert client.pause("drain")["running"] == 0
        assert _rest(events, ids)["finish_reason"] == "length" and len(ids) == 20
        ctx.__exit__(None, None, None)
        client.resume()
    _wait_freed(client)


def test_ep_server_resubmits_the_non_streamed_requests_a_failed_group_lost():
    """A worker group that fails while requests run (the fake EP group of tests/fake_ep.py: no
    processes, tokens keyed like the real sampler's). A non-streamed request used to answer 503
    generation_failed (the step API ended every live request); now it is resubmitted on the
    restarted group and answers 200 with the outputs of a run without the failure. A streamed
    request, whose tokens have gone out, still ends with error records naming the failure."""
    tok = tiny_tokenizer()
    svc, log = fake_service(run_failures=0, start_failures=0)
    srv = LiveServer(served_model(tok, len(tok), MAX_LEN), svc)
    params = {"n": 3, "max_new_tokens": 16, "seed": 46, "stop_token_ids": [3]}  # samples of 6, 16, 16 tokens
    body = {"input_ids": [5, 6, 7], "sampling_params": params}
    keys = ("sample_index", "output_ids", "logprobs", "finish_reason")
    try:
        clean = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert clean.status_code == 200, clean.text
        want = [{k: o[k] for k in keys} for o in clean.json()["outputs"]]
        assert [len(o["output_ids"]) for o in want] == [6, 16, 16]
        log["fail_runs"].add(log["runs"] + 2)  # the request's second run call, after its first step
        resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert [{k: o[k] for k in keys} for o in resp.json()["outputs"]] == want  # bitwise, as without failure
        assert svc.restarts == 1
        log["fail_runs"].add(log["runs"] + 2)
        with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=60) as stream:
            events = list(_events(stream))
        tokens = [e for e in events if "token_ids" in e and "finish_reason" not in e]
        finals = sorted((e for e in events if "finish_reason" in e), key=lambda e: e["sample_index"])
        assert len(tokens) == 3  # each sample's first token went out before the failure
        assert [(e["sample_index"], e["finish_reason"]) for e in finals] == [(0, "error"), (1, "error"), (2, "error")]
        assert all("peer died" in e["error"] and "the request was lost" in e["error"] for e in finals)
        assert svc.restarts == 2
    finally:
        srv.stop()


def test_ep_server_refuses_requests_after_a_restart_lost_the_weights_received_from_the_trainer():
    """Weights a trainer sent over /init_weight_sync + /update_weights reach the EP workers only; a
    restarted group holds the checkpoint's (the fake's version 0). A non-streamed request the
    failure lost used to be resubmitted and answered 200 from those weights (stamped 0 while the
    server reported 1), and the next /update_weights failed on the workers and restarted the group
    again. Now the request is a 503 generation_failed naming the cause and the remedy, and so is
    a new one; /update_weights is a 400 asking for /init_weight_sync (no restart); after joining
    again and an accepted update the server answers from the new weights."""
    tok = tiny_tokenizer()
    svc, log = fake_service(run_failures=0, start_failures=0)
    srv = LiveServer(served_model(tok, len(tok), MAX_LEN), svc)
    client = RolloutServerClient(srv.url)
    params = {"n": 3, "max_new_tokens": 16, "seed": 46, "stop_token_ids": [3]}
    body = {"input_ids": [5, 6, 7], "sampling_params": params}
    try:
        client.init_weight_sync("127.0.0.1", free_port(), 3)
        assert client.update_weights()["weight_version"] == 1
        ok = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["weight_version"] == 1, ok.text
        log["fail_runs"].add(log["runs"] + 2)  # the request's second run call, after its first step
        for _ in range(2):  # the request the failure lost, then a new one
            resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert error["code"] == "generation_failed" and "not the served version 1" in error["message"]
            assert "/init_weight_sync" in error["message"]
        assert svc.restarts == 1 and client.weight_version() == 1
        with pytest.raises(ServerError, match="call /init_weight_sync"):
            client.update_weights()
        assert svc.restarts == 1
        client.init_weight_sync("127.0.0.1", free_port(), 3)
        log["trainer_version"] = 2
        assert client.update_weights()["weight_version"] == 2
        resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["weight_version"] == 2, resp.text
        assert [o["output_ids"] for o in resp.json()["outputs"]] == [o["output_ids"] for o in ok.json()["outputs"]]
    finally:
        client.close()
        srv.stop()


def test_http_backend_joins_again_after_the_servers_ep_group_restarted(monkeypatch):
    """A restarted EP group's workers are not in the trainer's weight-sync group: HTTPBackend kept
    sending over its old group and the server answered every /update_weights with a 400 asking for
    /init_weight_sync. Now the backend sees it (/health's weight_sync_joined) and has the server join
    a new group first; when the restart comes after that check, the 400's code
    (weight_sync_not_joined) makes it join again and resend once. Each new group's first update
    carries the frozen tensors."""
    tok = tiny_tokenizer()
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_http_trainer(monkeypatch, log)
    srv = LiveServer(served_model(tok, len(tok), MAX_LEN), svc)
    backend = HTTPBackend(srv.url)
    params = {"n": 3, "max_new_tokens": 16, "seed": 46, "stop_token_ids": [3]}
    body = {"input_ids": [5, 6, 7], "sampling_params": params}
    weights = [("w", torch.zeros(2))]

    def restart():  # a failed run: the group restarts and leaves the trainer's group
        log["fail_runs"].add(log["runs"] + 1)
        resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert resp.status_code == 503 and not svc.weight_sync_joined, resp.text

    try:
        backend.update_weights(1, weights)
        backend.update_weights(2, weights)
        assert backend.weight_version == 2 and log["received"] == [(1, True, False, "ok"), (2, False, False, "ok")]
        restart()
        backend.update_weights(3, weights)  # was a 400 asking for /init_weight_sync
        assert backend.weight_version == 3 and log["received"][2:] == [(3, True, False, "ok")]
        resp = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["weight_version"] == 3, resp.text
        restart()
        health = backend.client.health
        monkeypatch.setattr(backend.client, "health", lambda: {**health(), "weight_sync_joined": True})  # stale
        backend.update_weights(4, weights)  # the 400's code: joined again, resent once
        assert backend.weight_version == 4 and log["received"][3:] == [(4, True, False, "ok")]
        assert svc.restarts == 2
    finally:
        backend.shutdown()
        srv.stop()
    refused = ServerError(400, {"message": "no weight-sync group: call /init_weight_sync first", "code": None})
    rejected = ServerError(400, {"message": "weight update rejected", "code": "weight_update_rejected"})
    assert rejoin_needed(ServerError(400, {"code": "weight_sync_not_joined"}))
    assert not rejoin_needed(refused) and not rejoin_needed(rejected) and not rejoin_needed(ValueError())


def test_http_backend_learns_of_a_restart_during_its_update_from_the_answer_not_the_send_timeout(monkeypatch):
    """An EP rank dies during an update and the trainer's send does not see it (an NCCL send waits
    for dead peers until the collective timeout, weight_sync_timeout_s: 120 s). The server answers
    /update_weights as soon as its group restarted (400 weight_sync_not_joined), but HTTPBackend
    read that answer only after its send ended, so it learned of the restart at the timeout. Now
    the answer ends the wait: the group hosted here is closed (which stops the send), and the
    backend joins again and resends at once. The fake send reports what ended it."""
    tok = tiny_tokenizer()
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_http_trainer(monkeypatch, log)
    log["send_timeout_s"] = 30.0  # the collective timeout of the fake send
    srv = LiveServer(served_model(tok, len(tok), MAX_LEN), svc)
    backend = HTTPBackend(srv.url)
    weights = [("w", torch.zeros(2))]
    try:
        backend.update_weights(1, weights)
        log["send_outcomes"].append("dies_unseen")
        backend.update_weights(2, weights)
        assert log["send_ends"].get(timeout=60) == "closed"  # was "timed out"
        assert log["received"] == [(1, True, False, "ok"), (2, False, False, "dies_unseen"), (2, True, False, "ok")]
        assert backend.weight_version == 2 and svc.restarts == 1 and svc.weight_sync_joined
    finally:
        backend.shutdown()
        srv.stop()


def _chat_top_logprobs(url: str, stream: bool) -> tuple[list[int], list[int], list[dict]]:
    """A chat completion with ``top_logprobs=3`` (streamed or not): (prompt ids, output ids, the
    logprobs.content entries)."""
    body = {
        "model": "tiny-m3",
        "messages": [{"role": "user", "content": "What is 12 * 34?"}],
        "max_tokens": 8,
        "seed": 6,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text  # was 501 under EP
        r = r.json()
        choice = r["choices"][0]
        return r["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["content"]
    prompt, out, entries = None, [], []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for e in _events(resp):
            assert "error" not in e, e
            for c in e["choices"]:
                prompt = prompt or c.get("prompt_token_ids")
                out += c.get("token_ids") or []
                entries += (c.get("logprobs") or {}).get("content") or []
    return prompt, out, entries


def test_ep_serves_top_logprobs_equal_to_ep1(server):
    url, _, path = server
    prompt, out, entries = _chat_top_logprobs(url, stream=False)
    assert len(out) == len(entries) == 8
    tok = AutoTokenizer.from_pretrained(str(path))
    engine = NativeBackend(load_checkpoint(path), [tok.eos_token_id], max_model_len=MAX_LEN).engine
    want = engine.top_logprobs(prompt + out, len(prompt), 3)  # EP=1: the in-process engine
    decode = lambda i: tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    for entry, row in zip(entries, want):
        assert [t["token"] for t in entry["top_logprobs"]] == [decode(i) for i, _ in row]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([v for _, v in row], abs=1e-4)
    # streamed: each delta's top logprobs computed on the EP ranks between two engine steps
    s_prompt, s_out, s_entries = _chat_top_logprobs(url, stream=True)
    assert (s_prompt, s_out) == (prompt, out) and len(s_entries) == 8
    for a, b in zip(s_entries, entries):
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in b["top_logprobs"]], abs=1e-4
        )


def test_ep_prompt_logprobs_come_through_the_workers(server):
    """/generate's ``prompt_logprobs`` on the EP server: scored by the worker's prefill and carried
    on its outputs across the process boundary, equal to the in-process engine's scoring."""
    url, _, path = server
    sp = {"max_new_tokens": 2, "seed": 3, "n": 2, "prompt_logprobs": 2}
    r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp}, timeout=120)
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    tok = AutoTokenizer.from_pretrained(str(path))
    engine = NativeBackend(load_checkpoint(path), [tok.eos_token_id], max_model_len=MAX_LEN).engine
    want = engine.top_logprobs(PROMPT, 1, 2, with_tokens=True)
    assert outs[0]["prompt_logprobs"] == outs[1]["prompt_logprobs"] and outs[0]["prompt_logprobs"][0] is None
    for entry, t, w in zip(outs[0]["prompt_logprobs"][1:], PROMPT[1:], want, strict=True):
        assert entry[str(t)]["logprob"] == pytest.approx(w.logprob, abs=1e-4) and entry[str(t)]["rank"] == w.rank
        assert [int(i) for i in entry if int(i) != t] == [i for i, _ in w.top if i != t]


def test_ep_streamed_completion_logprobs_equal_the_non_streamed(server):
    """Streamed /v1/completions carry each chunk's logprobs on the EP server too (each chunk's top
    lists one forward on both ranks between two steps): concatenated, the non-streamed answer's."""
    url, _, _ = server
    body = {"model": "tiny-m3", "prompt": PROMPT, "max_tokens": 8, "seed": 6, "logprobs": 3, "n": 2}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"]
    got = {0: [], 1: []}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    got[ch["index"]].append(ch["logprobs"])
    for ch in whole:
        chunks = [lp for lp in got[ch["index"]] if lp is not None]
        want = ch["logprobs"]
        assert [t for lp in chunks for t in lp["tokens"]] == want["tokens"] and len(want["tokens"]) == 8
        assert [o for lp in chunks for o in lp["text_offset"]] == want["text_offset"]
        assert [v for lp in chunks for v in lp["token_logprobs"]] == pytest.approx(want["token_logprobs"], abs=1e-5)
        rows = [row for lp in chunks for row in lp["top_logprobs"]]
        assert [list(r) for r in rows] == [list(r) for r in want["top_logprobs"]]
        for row, want_row in zip(rows, want["top_logprobs"], strict=True):
            assert list(row.values()) == pytest.approx(list(want_row.values()), abs=1e-4)


@pytest.fixture(scope="module")
def trainer(server):
    """The trainer's model (the checkpoint after a fake training step) and its weight sender, rank 0
    of a group with the server's two EP ranks (ranks 1 and 2)."""
    _, client, path = server
    torch.manual_seed(123)
    model = load_checkpoint(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    port = free_port()
    world = 1 + client.health()["weight_sync_ranks"]
    assert world == 1 + EP
    joined = client.start_init_weight_sync("127.0.0.1", port, world, 1, "gloo", 60.0, bucket_size_mb=0.25)
    group = WeightSyncGroup("127.0.0.1", port, 0, world, "gloo", 60.0)
    sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), bucket_size_mb=0.25)
    sender.handshake()
    assert joined.result(timeout=120)["rank"] == 1
    yield model, sender
    group.close()


def _update(client, sender, version: int, first: bool = False) -> dict:
    fut = client.start_update_weights(version)
    sender.update(version, include_frozen=first)
    return fut.result(timeout=120)


def _max_diff(model, prompt, outs) -> float:
    worst = 0.0
    for o in outs:
        with torch.no_grad():
            ref = token_logprobs(model, torch.tensor([prompt + o["output_ids"]]))[0, len(prompt) :]
        worst = max(worst, float((ref - torch.tensor(o["logprobs"])).abs().max()))
    return worst


def test_ep_weight_update_over_http_gives_the_trainers_logits(server, trainer):
    url, client, _ = server
    model, sender = trainer
    body = {"input_ids": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 10, "seed": 4}}
    before = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert before["weight_version"] == 0 and _max_diff(model, PROMPT, before["outputs"]) > 1e-2
    assert _update(client, sender, 1, first=True)["weight_version"] == 1 and client.weight_version() == 1
    after = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert all(o["token_weight_versions"] == [1] * 10 for o in after["outputs"])
    assert _max_diff(model, PROMPT, after["outputs"]) < 1e-4  # both EP ranks serve the trainer's weights
    assert client.metrics()["m3:refits_total"] == 1
    # announced 5, sent 2: every rank refuses before writing; version 1 stays served
    fut = client.start_update_weights(5)
    with pytest.raises(WeightUpdateError, match="expected version 5"):
        sender.update(2)
    with pytest.raises(ServerError, match="update version 2 refused: the receiving side expected version 5"):
        fut.result(timeout=120)
    assert client.weight_version() == 1
    again = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert [o["output_ids"] for o in again["outputs"]] == [o["output_ids"] for o in after["outputs"]]


def test_ep_concurrent_streams_across_a_weight_update(server, trainer):
    url, client, _ = server
    _, sender = trainer
    v0 = client.weight_version()
    records = [{"ids": [], "versions": [], "final": None} for _ in range(6)]

    async def one(http, i, r):
        body = {"input_ids": PROMPT[i:], "stream": True, "sampling_params": {"max_new_tokens": 60, "seed": i}}
        async with http.stream("POST", url + "/generate", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    e = json.loads(line[6:])
                    if "finish_reason" in e:
                        r["final"] = e
                    else:
                        r["ids"] += e["token_ids"]
                        r["versions"] += e["weight_versions"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.ensure_future(one(http, i, r)) for i, r in enumerate(records)]
            while not all(r["ids"] for r in records):
                await asyncio.sleep(0.01)
            # Freeze them (KV kept), update under them, let them continue: every stream has
            # tokens of both versions whatever the machine's speed.
            await asyncio.to_thread(client.pause, "keep")
            running = sum(r["final"] is None for r in records)
            reply = await asyncio.to_thread(_update, client, sender, v0 + 1)
            await asyncio.to_thread(client.resume)
            await asyncio.gather(*tasks)
            return reply, running

    reply, running = asyncio.run(asyncio.wait_for(main(), 300))
    assert reply["weight_version"] == v0 + 1 and running > 0
    both = 0
    for r in records:
        final = r["final"]
        assert final is not None and final["finish_reason"] in ("stop", "length")  # none lost
        assert r["ids"] == final["output_ids"] and r["versions"] == final["token_weight_versions"]
        assert set(r["versions"]) <= {v0, v0 + 1} and r["versions"] == sorted(r["versions"])
        both += len(set(r["versions"])) == 2
    assert both > 0  # requests running at the update continued on the new version


def _prompt_scores(final: dict) -> list[float]:
    return [e[str(t)]["logprob"] for e, t in zip(final["prompt_logprobs"][1:], final["prompt"][1:])]


def test_ep_same_version_update_under_paused_requests_keeps_their_prefill_prompt_logprobs(server, trainer):
    """Weights written under two requests frozen by pause(keep) (one per EP rank) with the version
    number kept (replace=True): their prompts were prefilled, and so scored, with the old weights,
    and their prompt logprobs are those weights' (a scoring forward after generation would have run
    the new ones: they used to come back empty). Requests admitted after it, on both ranks at once,
    get the new weights' scores: every rank stamps the service's weight-write count. Its own setup
    first: the server serves the trainer's weights (sent here, a version up), whatever tests ran
    before it."""
    url, client, _ = server
    model, sender = trainer
    v = client.weight_version() + 1
    assert _update(client, sender, v, first=True)["weight_version"] == v
    prompts = [list(range(60, 90)), list(range(90, 120))]  # new prompts: placed by load, one per rank

    def run_two(update=None) -> list[dict]:
        with httpx.Client(timeout=120) as http:
            streams = []
            for i, prompt in enumerate(prompts):
                sp = {"max_new_tokens": 40, "seed": i, "prompt_logprobs": 2}
                streams.append(
                    _stream_until(http, url, {"input_ids": prompt, "stream": True, "sampling_params": sp}, 1)
                )
            if update is not None:
                assert client.pause("keep")["running"] == 2
                update()
                client.resume()
            finals = []
            for (ctx, events, ids), prompt in zip(streams, prompts):
                finals.append({**_rest(events, ids), "prompt": prompt})
                ctx.__exit__(None, None, None)
        return finals

    def same_version_update():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        fut = client.start_update_weights(v)
        sender.update(v, include_frozen=True, replace=True)
        assert fut.result(timeout=120)["weight_version"] == v

    with torch.no_grad():  # the weights served now: the trainer's, sent above
        old = [token_logprobs(model, torch.tensor([p]))[0, 1:].tolist() for p in prompts]
    for final, want in zip(run_two(same_version_update), old, strict=True):
        assert final["finish_reason"] == "length" and set(final["token_weight_versions"]) == {v}
        assert "prompt_logprobs_note" not in final and _prompt_scores(final) == pytest.approx(want, abs=1e-4)
    for final in run_two():
        assert "prompt_logprobs_note" not in final
        with torch.no_grad():
            want = token_logprobs(model, torch.tensor([final["prompt"]]))[0, 1:]
        assert _prompt_scores(final) == pytest.approx(want.tolist(), abs=1e-4)


def test_ep_non_atomic_update_that_left_a_rank_invalid_stops_serving_until_a_good_update(server, trainer):
    """atomic=false: EP rank 1 refuses a NaN in one of its experts after the ranks wrote part of
    the update, so they are invalid. The ranks' forwards read each other's experts:
    the running request used to go on (through the half-written experts of the invalid ranks)
    and new ones were served. Now the running one ends with an error record, new ones get 503
    generation_failed, and an accepted update brings serving back."""
    url, client, _ = server
    model, _ = trainer
    port = free_port()
    world = 1 + client.health()["weight_sync_ranks"]
    joined = client.start_init_weight_sync("127.0.0.1", port, world, 1, "gloo", 60.0, bucket_size_mb=0.25, atomic=False)
    group = WeightSyncGroup("127.0.0.1", port, 0, world, "gloo", 60.0)
    try:
        sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), bucket_size_mb=0.25)
        sender.handshake()
        joined.result(timeout=120)
        v = client.weight_version()
        assert _update(client, sender, v + 1, first=True)["weight_version"] == v + 1
        experts = next(m.block_sparse_moe.experts for m in model.model.layers if hasattr(m, "block_sparse_moe"))
        with httpx.Client(timeout=120) as http:
            ctx, events, ids = _stream_until(http, url, _body(11, 60), 1)
            client.pause("keep")
            with torch.no_grad():
                saved = experts.w2[-1, 0, 0].item()
                experts.w2[-1, 0, 0] = float("nan")  # the last expert: EP rank 1's
            fut = client.start_update_weights(v + 2)
            with pytest.raises(WeightUpdateError, match="non-finite"):
                sender.update(v + 2)
            with pytest.raises(ServerError, match="weight update rejected"):
                fut.result(timeout=120)
            client.resume()
            final = _rest(events, ids)
            ctx.__exit__(None, None, None)
        assert final["finish_reason"] == "error" and "invalid: wrote bytes of a rejected" in final["error"]
        resp = httpx.post(url + "/generate", json=_body(12, 4, stream=False), timeout=120)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "generation_failed"
        assert "invalid: wrote bytes of a rejected" in resp.json()["error"]["message"]
        with torch.no_grad():
            experts.w2[-1, 0, 0] = saved
        assert _update(client, sender, v + 2)["weight_version"] == v + 2
        out = httpx.post(url + "/generate", json=_body(12, 4, stream=False), timeout=120).json()["outputs"][0]
        assert out["finish_reason"] == "length" and out["token_weight_versions"] == [v + 2] * 4
    finally:
        group.close()
    _wait_freed(client)

"""The server as its own process (``python -m m3_rollout.serve``), driven by a trainer in this process:
weight sync over gloo through /init_weight_sync + /update_weights (the server's logprobs then equal
the trainer's), 409 for control calls during an update, 64 concurrent streams across an update, and
a disconnecting client whose request is aborted and whose KV pages are freed (seen on /metrics)."""

import asyncio
import json
import time

import httpx
import pytest
import torch
from server_util import (  # tests/ on sys.path
    free_port,
    save_tiny_checkpoint,
    serve_subprocess,
    tiny_model,
    tiny_tokenizer,
)

from m3_rollout.model import load_checkpoint
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.server.client import ServerError
from m3_rollout.weight_sync import BroadcastChannel, WeightSender, WeightSyncGroup, WeightUpdateError
from m3_trainers.policy import token_logprobs

MAX_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = tiny_tokenizer()
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), tok, tiny_model(len(tok), max_len=MAX_LEN))
    args = ["--served-model-name", "tiny-m3", "--max-num-seqs", "64"]
    with serve_subprocess(path, args, startup_timeout_s=180, stop_timeout_s=30) as (url, client):
        yield url, client, path, tok


@pytest.fixture(scope="module")
def trainer(server):
    """The trainer's model (the checkpoint after a fake training step) and its weight sender, joined
    to the server's group (rank 0 here, the server rank 1)."""
    _, client, path, _ = server
    torch.manual_seed(123)
    model = load_checkpoint(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    port = free_port()
    joined = client.start_init_weight_sync("127.0.0.1", port, 2, 1, "gloo", 60.0, bucket_size_mb=0.25)
    group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", 60.0)
    sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), bucket_size_mb=0.25)
    sender.handshake()
    assert joined.result(timeout=120)["rank"] == 1
    yield model, sender
    group.close()


def _update(client, sender, version: int, first: bool = False) -> dict:
    fut = client.start_update_weights(version)
    sender.update(version, include_frozen=first)
    return fut.result(timeout=120)


def _generate(client, url, prompt, seed, n=2):
    body = {"input_ids": prompt, "sampling_params": {"n": n, "max_new_tokens": 12, "seed": seed}}
    return httpx.post(url + "/generate", json=body, timeout=120).json()


def _max_diff(model, prompt, outs) -> float:
    worst = 0.0
    for o in outs:
        ids = torch.tensor([prompt + o["output_ids"]])
        with torch.no_grad():
            ref = token_logprobs(model, ids)[0, len(prompt) :]
        worst = max(worst, float((ref - torch.tensor(o["logprobs"])).abs().max()))
    return worst


def test_trainer_updates_the_servers_weights(server, trainer):
    url, client, _, _ = server
    model, sender = trainer
    prompt = list(range(10, 30))
    before = _generate(client, url, prompt, seed=4)
    assert before["weight_version"] == 0
    assert _max_diff(model, prompt, before["outputs"]) > 1e-2  # the trainer's weights differ
    reply = _update(client, sender, 1, first=True)
    assert reply["weight_version"] == 1 and client.weight_version() == 1
    after = _generate(client, url, prompt, seed=4)
    assert all(o["token_weight_versions"] == [1] * len(o["output_ids"]) for o in after["outputs"])
    assert _max_diff(model, prompt, after["outputs"]) < 1e-4  # the server's logits are the trainer's
    # Top logprobs (five logits per position) agree too.
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "tiny-m3",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "seed": 2,
            "logprobs": True,
            "top_logprobs": 5,
            "return_token_ids": True,
        },
    ).json()
    ids = r["prompt_token_ids"] + r["choices"][0]["token_ids"]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), -1)[len(r["prompt_token_ids"]) - 1 :]
    tok = server[3]
    for pos, entry in enumerate(r["choices"][0]["logprobs"]["content"]):
        for top in entry["top_logprobs"]:
            tid = tok.encode(top["token"], add_special_tokens=False)
            if len(tid) == 1:
                assert top["logprob"] == pytest.approx(float(full[pos, tid[0]]), abs=1e-4)
    assert "m3:refit_seconds_last" in httpx.get(url + "/metrics").text
    # An update announced as version 5 that the trainer sends as 2 is refused before it is
    # committed (it was a 400 after the weights and version had changed): version 1 stays served.
    fut = client.start_update_weights(5)
    with pytest.raises(WeightUpdateError, match="expected version 5"):
        sender.update(2)
    with pytest.raises(ServerError, match="update version 2 refused: the receiving side expected version 5") as e:
        fut.result(timeout=120)
    assert e.value.status == 400 and e.value.error["code"] == "weight_update_rejected"
    assert client.weight_version() == 1
    assert _max_diff(model, prompt, _generate(client, url, prompt, seed=4)["outputs"]) < 1e-4


def test_control_calls_while_an_update_runs_get_409(server, trainer):
    url, client, _, _ = server
    _, sender = trainer
    fut = client.start_update_weights(2)  # the server now waits for the trainer's broadcast
    deadline = time.monotonic() + 60
    while not client.health()["updating"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for path, body in [
        ("/pause", {"mode": "keep"}),
        ("/resume", {}),
        ("/update_weights", {}),
        ("/reset_prefix_cache", {}),
        ("/init_weight_sync", {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}),
    ]:
        resp = httpx.post(url + path, json=body, timeout=30)
        assert resp.status_code == 409, (path, resp.text)
        assert resp.json()["error"]["code"] == "update_in_progress"
    assert client.health()["status"] == "ok"  # serving goes on
    sender.update(2)
    assert fut.result(timeout=120)["weight_version"] == 2
    assert client.pause("keep")["paused"] and not client.resume()["paused"]


def test_drain_update_while_a_keep_pause_freezes_a_request_is_refused_not_stuck(server, trainer):
    """pause(keep) then update(in_flight=drain) waited forever for the frozen request; /resume got
    409 (an update ran) and only abort_all got out, losing the request."""
    url, client, _, _ = server
    _, sender = trainer
    version = client.weight_version()
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 60, "seed": 1}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert "output_ids" in first or "token_ids" in first
        assert client.pause("keep")["running"] == 1
        with pytest.raises(ServerError, match=r"in_flight='drain' refused: /pause mode=keep holds 1 running") as e:
            client.update_weights(version + 1, in_flight="drain")
        assert e.value.status == 409 and e.value.error["code"] == "paused_keep"
        assert not client.health()["updating"]
        fut = client.start_update_weights(version + 1, in_flight="continue")  # what the message offers
        sender.update(version + 1)
        assert fut.result(timeout=120)["weight_version"] == version + 1
        assert client.resume() == {"paused": False}
        items = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    final = [i for i in items if "finish_reason" in i][-1]
    assert final["finish_reason"] == "length" and len(final["output_ids"]) == 60
    assert final["token_weight_versions"][-1] == version + 1  # it went on with the new weights


def test_an_update_the_trainer_refuses_itself_is_withdrawn_at_once_and_the_next_lands(server, trainer):
    """The sender refused an int tensor (or one outside the handshake) before sending anything,
    while the server waited for a header: serving stalled for the group's whole timeout, then the
    next good update failed on both sides (the receivers rebuilt the group, the sender did not).
    Now the sender sends a withdrawn header: the server answers at once and stays in step."""
    url, client, _, _ = server
    model, sender = trainer
    good = sender.named_tensors
    prompt = list(range(10, 30))

    def int_tensor():
        for i, (name, t) in enumerate(good()):
            yield name, (t.to(torch.int32) if i == 3 else t)

    def extra_tensor():
        yield from good()
        yield "language_model.model.bogus.weight", torch.zeros(2)

    for bad, why in ((int_tensor, "not a real floating-point dtype"), (extra_tensor, "not in the handshake list")):
        v = client.weight_version()
        sender.named_tensors = bad
        try:
            fut = client.start_update_weights(v + 1)
            with pytest.raises(WeightUpdateError, match=why):
                sender.update(v + 1)
        finally:
            sender.named_tensors = good
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=f"update {v + 1} withdrawn by the trainer before sending") as e:
            fut.result(timeout=120)
        assert time.monotonic() - t0 < 30  # not the group's 60-s timeout
        assert e.value.status == 400 and client.weight_version() == v
        assert _update(client, sender, v + 1, first=True)["weight_version"] == v + 1  # the group is in step
        assert _max_diff(model, prompt, _generate(client, url, prompt, seed=3)["outputs"]) < 1e-4


async def _stream(http, url, prompt, seed, record):
    body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 40, "seed": seed}}
    async with http.stream("POST", url + "/generate", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            item = json.loads(line[6:])
            if "finish_reason" in item:
                record["final"] = item
            else:
                record["ids"] += item["token_ids"]
                record["versions"] += item["weight_versions"]


def test_64_concurrent_streams_across_a_weight_update(server, trainer):
    url, client, _, _ = server
    _, sender = trainer
    v0 = client.weight_version()
    records = [{"ids": [], "versions": [], "final": None} for _ in range(64)]

    async def main():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            prompts = [[5 + (7 * i + j) % 400 for j in range(8 + i % 5)] for i in range(64)]
            tasks = [
                asyncio.ensure_future(_stream(http, url, p, i, r)) for i, (p, r) in enumerate(zip(prompts, records))
            ]
            while sum(len(r["ids"]) for r in records) < 64 * 3:
                await asyncio.sleep(0.01)
            # Freeze the running requests (KV kept), update under them, let them continue: those
            # still running have tokens of both versions whatever the machine's speed.
            await asyncio.to_thread(client.pause, "keep")
            running = sum(r["final"] is None for r in records)
            reply = await asyncio.to_thread(_update, client, sender, v0 + 1)
            health = client.health()
            assert health["paused"] is True and health["pause_mode"] == "keep"  # the update kept the pause
            await asyncio.to_thread(client.resume)
            await asyncio.gather(*tasks)
            return reply, running

    reply, running = asyncio.run(asyncio.wait_for(main(), 600))
    assert reply["weight_version"] == v0 + 1
    both = 0
    for r in records:
        final = r["final"]
        assert final is not None and final["finish_reason"] in ("stop", "length")  # none lost
        assert r["ids"] == final["output_ids"] and r["versions"] == final["token_weight_versions"]
        assert set(r["versions"]) <= {v0, v0 + 1} and r["versions"] == sorted(r["versions"])
        both += len(set(r["versions"])) == 2
    assert running > 0 and both > 0  # requests running at the update continued on the new version


def test_a_same_version_update_under_a_paused_request_keeps_its_sampler_and_prefill_scores(server, trainer):
    """Weights written under a request frozen by pause(keep), with the version number kept
    (replace=True), the request going on with its KV of the old weights. The generated tokens' top
    lists come from the sampler (the distribution each token was sampled from, as its logprob) and
    its prompt logprobs from its prefill (whole before the update, one model's), so both stay,
    before and after the update; a request admitted after the update is scored by the new weights."""
    url, client, _, _ = server
    model, sender = trainer
    v = client.weight_version()
    chat = {
        "model": "tiny-m3",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "seed": 3,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    gen = {"input_ids": list(range(10, 30)), "stream": True, "sampling_params": {"max_new_tokens": 40, "seed": 1}}
    gen["sampling_params"]["prompt_logprobs"] = 2
    with httpx.Client(timeout=120) as http:
        with (
            http.stream("POST", url + "/v1/chat/completions", json=chat) as c,
            http.stream("POST", url + "/generate", json=gen) as g,
        ):
            chunks = (json.loads(line[6:]) for line in c.iter_lines() if line.startswith("data: {"))
            events = (json.loads(line[6:]) for line in g.iter_lines() if line.startswith("data: {"))
            first = next(ch for e in chunks for ch in e["choices"] if ch.get("logprobs"))
            next(events)
            assert client.pause("keep")["running"] == 2  # both are frozen mid-way, their KV kept
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            fut = client.start_update_weights(v)
            sender.update(v, include_frozen=True, replace=True)  # every tensor changed: send them all
            assert fut.result(timeout=120)["weight_version"] == v
            assert client.resume() == {"paused": False}
            rest = [ch for e in chunks for ch in e["choices"] if ch.get("logprobs")]
            final = next(e for e in events if "finish_reason" in e)
    assert all(len(t["top_logprobs"]) == 2 for t in first["logprobs"]["content"]) and "top_logprobs_note" not in first
    last = rest[-1]  # sampled after the update, on KV of the old weights
    assert set(last["token_weight_versions"]) == {v}  # the version cannot tell
    # its top lists are the sampler's, from the distribution it was sampled from (as its logprob):
    # kept; only scores computed after generation (prompt logprobs, below) are withheld
    assert all(len(t["top_logprobs"]) == 2 for t in last["logprobs"]["content"])
    assert "top_logprobs_note" not in last
    assert final["finish_reason"] == "length" and set(final["token_weight_versions"]) == {v}
    # its prompt logprobs come from its prefill, which ran whole before the update under one set of
    # weights: kept, as its sampled tokens' logprobs are (only a prefill across a write is emptied)
    assert final["prompt_logprobs"][0] is None and all(len(e) >= 2 for e in final["prompt_logprobs"][1:])
    assert len(final["prompt_logprobs"]) == 20 and "prompt_logprobs_note" not in final
    # a request admitted after the update: its prompt ran with the weights served, its scores are theirs
    again = httpx.post(url + "/generate", json={**gen, "stream": False}, timeout=120).json()["outputs"][0]
    assert "prompt_logprobs_note" not in again
    prompt = gen["input_ids"]
    with torch.no_grad():
        want = token_logprobs(model, torch.tensor([prompt]))[0]
    got = [e[str(t)]["logprob"] for e, t in zip(again["prompt_logprobs"][1:], prompt[1:])]
    assert got == pytest.approx(want[1:].tolist(), abs=1e-4)


def _aborted(url: str) -> float:
    """m3:request_finished_total{..., finished_reason="abort"} on /metrics (0 before the first)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith("m3:request_finished_total") and '"abort"' in ln)


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_pages(server):
    url, client, _, _ = server
    aborted = _aborted(url)
    body = {"input_ids": list(range(20, 60)), "stream": True, "sampling_params": {"max_new_tokens": 200, "seed": 1}}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/generate", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
            m = client.metrics()
            assert m["m3:num_requests_running"] == 1 and m["m3:kv_cache_pages_used"] > 0
    deadline = time.monotonic() + 60
    while True:
        m = client.metrics()
        if m["m3:num_requests_running"] == 0 and m["m3:kv_cache_pages_used"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert client.health()["running"] == 0
    assert _aborted(url) == aborted + 1  # counted as an abort (it was counted nowhere)


def test_failed_join_is_a_400_and_unknown_update_without_group(server):
    url, client, _, _ = server
    with pytest.raises(ServerError) as e:
        client.init_weight_sync("127.0.0.1", free_port(), 2, 1, "gloo", timeout_s=1.0)
    assert e.value.status == 400 and e.value.error["code"] == "weight_sync_failed"
    with pytest.raises(ServerError) as e:
        client.init_weight_sync("127.0.0.1", 1234, 2, 2, "gloo")
    assert e.value.status == 400 and e.value.error["param"] == "rank_offset"

"""The control plane's admission gate and pause modes (``m3_rollout/server/control.py``), driven
in process on one event loop so the order of control calls and waiting requests is exact: a
request held at the gate never starts while the server is paused, /abort ends one held there, and
a pause that a /resume lifted says so (a drain one stops waiting)."""

import asyncio

from server_util import ScriptedBackend  # tests/ on sys.path

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.server.control import Controller
from m3_rollout.server.runner import EngineRunner

STOP = 9


def _run(body) -> object:
    """``body(ctl)`` on a fresh event loop over a scripted backend's runner."""
    runner = EngineRunner(ScriptedBackend([[7, 8, STOP]], STOP))
    try:
        return asyncio.run(body(Controller(runner)))
    finally:
        runner.shutdown()


def _request(rid: str, n: int = 1) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6], SamplingParams(n=n, max_new_tokens=3))


def _ends(outs) -> list:
    return [(o.sample_index, o.output_ids, o.finish_reason) for o in outs if isinstance(o, SampleOutput)]


async def _until(predicate) -> None:
    """Yield to the loop until ``predicate()`` holds (an acknowledgement, not a timing)."""
    while not predicate():
        await asyncio.sleep(0)


def test_a_request_waiting_at_the_gate_does_not_start_when_a_pause_follows_a_resume_at_once():
    """Breaker finding: /resume then /pause before the held request ran (two control calls in one
    loop iteration): the request woke from the gate and ran while the server was paused."""

    async def body(ctl: Controller):
        await ctl.pause("abort")

        async def client():
            return [item async for item in ctl.stream(_request("held"), stream=False)]

        task = asyncio.ensure_future(client())
        await _until(lambda: ctl.waiting == 1)
        await ctl.resume()
        await ctl.pause("abort")  # before the held request ran
        for _ in range(20):  # let every ready callback run
            await asyncio.sleep(0)
        held = (ctl.waiting, dict(ctl.live), task.done())
        await ctl.resume()
        return held, await asyncio.wait_for(task, 60)

    held, outs = _run(body)
    assert held == (1, {}, False)  # still at the gate, not live
    assert [(o.output_ids, o.finish_reason) for o in outs if isinstance(o, SampleOutput)] == [([7, 8, STOP], "stop")]


def test_a_drain_pause_that_a_resume_lifted_returns_not_paused_instead_of_waiting_on():
    """Breaker finding: /pause mode=drain kept waiting for the running requests after a /resume
    had lifted it (with traffic it never returned), then answered paused=true on a server that
    was not paused."""

    async def body(ctl: Controller):
        stream = ctl.stream(_request("running"), stream=True)
        first = await stream.__anext__()  # live until its iteration ends: held open here
        draining = asyncio.ensure_future(ctl.pause("drain"))
        await _until(lambda: ctl.pause_mode == "drain")
        assert not draining.done() and dict(ctl.live) == {"running": 1}
        await ctl.resume()
        reply = await asyncio.wait_for(draining, 60)  # hung before
        rest = [item async for item in stream]
        return first, reply, rest, ctl.pause_mode

    first, reply, rest, mode = _run(body)
    assert reply == {"paused": False, "mode": "drain", "aborted": 0, "running": 1} and mode is None
    deltas = [first] + rest[:-1]  # a handler that fell behind gets merged deltas: their tokens in order
    assert [t for d in deltas for t in d.token_ids] == [7, 8, STOP] and rest[-1].finish_reason == "stop"


def test_abort_by_id_ends_a_request_held_at_the_gate():
    """Breaker finding: /abort of a request held at the admission gate (server paused) answered
    aborted=0 and the request ran after /resume. It now ends there, as an aborted request that
    had not sampled yet: one "abort" record per sample, no tokens, never sent to the backend."""

    async def body(ctl: Controller):
        await ctl.pause("abort")
        held = asyncio.ensure_future(_collect(ctl.stream(_request("held", n=2), stream=True)))
        other = asyncio.ensure_future(_collect(ctl.stream(_request("other"), stream=False)))
        await _until(lambda: ctl.waiting == 2)
        replies = [await ctl.abort("held", False), await ctl.abort("unknown", False)]
        outs = await asyncio.wait_for(held, 60)  # ended while the server is still paused
        state = (ctl.waiting, dict(ctl.live), other.done())
        await ctl.resume()
        return replies, outs, state, await asyncio.wait_for(other, 60), ctl.runner

    replies, outs, state, other, runner = _run(body)
    assert replies == [{"aborted": 1}, {"aborted": 0}]
    assert _ends(outs) == [(0, [], "abort"), (1, [], "abort")] and len(outs) == 2  # no deltas
    assert state == (1, {}, False)  # the other one still waits at the gate
    assert _ends(other) == [(0, [7, 8, STOP], "stop")]
    assert [r.request_id.split(":", 1)[1] for r in runner.backend.requests] == ["other"]
    assert runner.requests_finished == {"abort": 2, "stop": 1}


def test_abort_all_ends_requests_held_at_the_gate_and_counts_them():
    """Breaker finding: abort_all reached only running requests; those held at the gate ran after
    /resume and were not counted."""

    async def body(ctl: Controller):
        await ctl.pause("abort")
        tasks = [asyncio.ensure_future(_collect(ctl.stream(_request(rid), stream=False))) for rid in "ab"]
        await _until(lambda: ctl.waiting == 2)
        reply = await ctl.abort(None, True)
        outs = [await asyncio.wait_for(t, 60) for t in tasks]
        await ctl.resume()
        return reply, outs, ctl.runner.backend.requests

    reply, outs, sent = _run(body)
    assert reply == {"aborted": 2}
    assert [_ends(o) for o in outs] == [[(0, [], "abort")]] * 2 and sent == []


def test_an_abort_pause_that_a_resume_lifted_while_it_aborted_returns_not_paused():
    """Breaker finding: /pause mode=abort answered paused=true when a /resume landed while it was
    still aborting the running requests (the server then admitted requests again)."""

    async def body(ctl: Controller):
        stream = ctl.stream(_request("running"), stream=True)
        await stream.__anext__()  # live until its iteration ends: held open here
        pausing = asyncio.ensure_future(ctl.pause("abort"))
        await _until(lambda: ctl.pause_mode == "abort")  # it awaits the engine loop's abort now
        assert not pausing.done()
        await ctl.resume()
        reply = await asyncio.wait_for(pausing, 60)
        await _collect(stream)  # (the scripted backend may have finished it before the abort)
        return reply, ctl.pause_mode

    reply, mode = _run(body)
    assert reply == {"paused": False, "mode": "abort", "aborted": 1, "running": 1} and mode is None


async def _collect(stream) -> list:
    return [item async for item in stream]
